"""``classgrad.service.driver_runtime.actor_deaths`` without a Ray cluster: an actor killed by Ray's memory monitor
is told apart from other deaths and said in one line, from Ray 2.60's message and an older one
(the kill itself, by Ray's monitor on a real local Ray, is in tests/integration/test_out_of_memory.py)."""

from __future__ import annotations

from ray.exceptions import OutOfMemoryError

from classgrad.service.driver_runtime.actor_deaths import is_out_of_memory, out_of_memory_failure, out_of_memory_line
from tests.support.ray_errors import actor_died, creation_failed

# Shaped as Ray 2.60's message (format strings of its raylet), shortened: some 40 lines in all.
RAY_260 = """Task was killed due to the node running low on memory.
Memory on the node (IP: 10.0.0.3, ID: 5f2c9a) was 29.80GB used / 31.30GB limit (0.952087)
OOM kill reason: memory usage above the threshold
Ray killed 1 worker(s) based on the killing policy
Considered workers: [(Worker with no lease granted: job ID=01000000, pid=4242, actual memory used=12.1GB)]
To see more information about memory usage on this node, use `ray logs raylet.out -ip 10.0.0.3`
Top 10 memory users:
PID	MEM(GB)	COMMAND
4242	12.10	ray::GradientWorker.compute_shard
Refer to the documentation on how to address the out of memory issue: https://docs.ray.io/..."""
OLDER = (
    "Task was killed due to the node running low on memory.\nMemory on the node (IP: 10.0.0.4, ID: ab12) "
    "where the task (actor ID: 9f, name=GradientWorker.__init__, pid=77, memory used=3.1GB) was running was "
    "7.60GB / 8.00GB (0.950123), which exceeds the memory usage threshold of 0.95.\nTop 10 memory users: ..."
)


def test_an_out_of_memory_kill_is_one_line_with_the_node_and_its_memory():
    line = out_of_memory_line(OutOfMemoryError(RAY_260))
    assert line == (
        "out of memory: Ray's memory monitor killed the actor (node 10.0.0.3: 29.80 GiB used of 31.30 GiB, 95%)"
    )
    assert out_of_memory_line(OutOfMemoryError(OLDER)) == (
        "out of memory: Ray's memory monitor killed the actor (node 10.0.0.4: 7.60 GiB used of 8.00 GiB, 95%)"
    )
    # The actor's death as later calls see it (an ActorDiedError quoting the OOM exit), and text
    # that names no node: still out of memory, still one line.
    died = actor_died("The actor is dead because its worker process has died. Worker exit type: NODE_OUT_OF_MEMORY")
    assert (
        out_of_memory_line(died) == "out of memory: Ray's memory monitor killed the actor (its node ran low on memory)"
    )
    assert out_of_memory_line(OutOfMemoryError("")).startswith("out of memory: ")


def test_other_deaths_are_not_out_of_memory():
    for text in (
        "The actor died unexpectedly before finishing this task.\n\tclass_name: GradientWorker\n\tpid: 12",
        "The actor is dead because it was killed by `ray.kill`.",
        "The actor died because of an error raised in its creation task, torch.OutOfMemoryError: CUDA out of memory",
    ):
        assert out_of_memory_line(RuntimeError(text)) is None, text


def test_out_of_memory_is_rays_type_or_the_text_of_the_death_that_later_calls_see():
    assert is_out_of_memory(OutOfMemoryError(""))  # the type alone says it
    detail = (
        "Worker exit type: NODE_OUT_OF_MEMORY Worker exit detail: "
        "Task was killed due to the node running low on memory."
    )
    assert is_out_of_memory(actor_died(f"The actor is dead because its worker process has died. {detail}"))
    assert not is_out_of_memory(actor_died("The actor is dead because it was killed by `ray.kill`."))
    assert not is_out_of_memory(actor_died("The actor is dead because its node has died. Node Id: abcd"))
    # A constructor that ran out of GPU memory is the user's model, not Ray's monitor.
    assert not is_out_of_memory(creation_failed(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")))


def test_memory_that_stays_short_is_said_in_one_line_with_what_to_do():
    line = out_of_memory_failure(5, "out of memory: Ray's memory monitor killed the actor (node x)", 7, 12)
    assert "\n" not in line and "Ray killed 5 actors" in line and "7 of 12 shards are saved" in line
    assert "cluster.num_workers" in line and "rerun to resume" in line
