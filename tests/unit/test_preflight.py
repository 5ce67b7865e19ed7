"""The resource preflight of ``classgrad run`` (issue 25): a job that cannot fit is refused in one
line, exit code 2, naming the numbers and the key to change, before its store exists or any actor
starts; sizes refused where they are read; the estimate against measured peaks; the store's size.

The node's limits are injected (``preflight.node_limits`` replaced), so no case depends on this
machine's memory, GPU or disk.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import zarr

from classgrad.errors import ResourceError
from classgrad.service.commands.cli import main as cli_main
from classgrad.service.driver_runtime import preflight
from classgrad.service.driver_runtime.footprint import RAY_ACTOR_BYTES, Footprint, Part, job_footprint
from classgrad.service.driver_runtime.preflight import Limits, check_resources
from classgrad.service.driver_runtime.preparation import check_job
from tests.support.harness import error_lines, write_job
from tests.support.jobs import mlp_job, run_without_ray, small_job

GB = 2**30  # a GiB: sizes print in binary units (classgrad.units)
ROOMY = Limits(memory_available=64 * GB, memory_total=64 * GB, cpus=8, local_ray=True, disk_free=10**15)


def limit(monkeypatch, **changes) -> None:
    """This node, as the preflight sees it: ROOMY with ``changes``."""
    limits = Limits(**{**ROOMY.__dict__, **changes})
    monkeypatch.setattr(preflight, "node_limits", lambda config: limits)


def refused(tmp_path: Path, capsys, job: dict, *extra: str) -> str:
    """Run ``classgrad run`` on ``job``: it must end in one error line, exit 2, no store; the line."""
    path = write_job(tmp_path / "job.yaml", job)
    code = cli_main(["run", path, *extra])
    out, err = capsys.readouterr()
    assert code == 2, (out, err[-3000:])
    lines = error_lines(err)
    assert len(lines) == 1 and lines[0].startswith("classgrad: error: "), err[-3000:]
    assert "Traceback" not in out + err
    assert not os.path.exists(job["store"]["url"]), "the store must not exist"
    return lines[0]


@pytest.fixture(autouse=True)
def _local(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # a job without cluster.address starts a local Ray


@pytest.mark.parametrize("structure", ["dense", "sketch"])
def test_a_projection_wider_than_the_row_is_refused_for_every_structure(structure, tmp_path, capsys, monkeypatch):
    limit(monkeypatch)
    job = small_job(str(tmp_path / "s.zarr"), projection={"dim": 10**9, "structure": structure})
    line = refused(tmp_path, capsys, job)
    assert "projection.dim (1000000000) is larger than the row it projects" in line, line


def _big_probe_job(url: str) -> dict:
    """A job whose probe set dominates an actor's memory: 16 classes x 256 vectors of 2,048 (32 MiB)."""
    C = 16
    return small_job(
        url,
        model={"factory": "classgrad.workers.zoo:mlp", "kwargs": {"num_classes": C, "in_features": 2048, "hidden": 8}},
        data={
            "kwargs": {"num_classes": C, "samples_per_class": 256, "kind": "vector", "input_shape": [2048], "seed": 0},
            "batch_size": 64,
        },
        loss={"num_classes": C},
    )


def _sizes(job: dict) -> tuple[int, int]:
    """(one actor's, the driver's) estimated peak, as the preflight computes them."""
    from classgrad.config import JobConfig

    checked = check_job(JobConfig.model_validate(job), preflight=False)
    assert checked.footprint is not None
    return checked.footprint["actor_bytes"], checked.footprint["driver_bytes"]


def test_an_actor_twice_the_nodes_memory_is_refused_naming_the_numbers_and_the_key(tmp_path, capsys, monkeypatch):
    job = _big_probe_job(str(tmp_path / "s.zarr"))
    actor, _ = _sizes(job)
    limit(monkeypatch, memory_available=actor // 2, memory_total=actor // 2)
    line = refused(tmp_path, capsys, job)
    assert "preflight: one actor (with the driver) needs ~" in line and "probe set" in line, line
    assert "available" in line and "data.kwargs" in line, line  # the numbers, and the key to change
    assert re.search(r"~[\d,.]+ (MiB|GiB)", line), line  # binary units, as every command prints (units.py)


def test_a_batch_whose_activations_do_not_fit_names_the_batch_size(tmp_path, capsys, monkeypatch):
    sections = {
        "model": {"kwargs": {"num_classes": 48, "width": 32}},
        "data": {"kwargs": {"num_classes": 48, "samples_per_class": 3, "input_shape": [3, 32, 32]}, "batch_size": 144},
    }
    job = small_job(str(tmp_path / "s.zarr"), **sections)  # 144 images of 32 x 32 through 32 channels at once
    actor, driver = _sizes(job)
    limit(monkeypatch, memory_available=driver + actor // 2)
    line = refused(tmp_path, capsys, job)
    assert "activations" in line and "lower data.batch_size" in line, line


def test_too_many_actors_for_the_node_name_num_workers(tmp_path, capsys, monkeypatch):
    job = small_job(str(tmp_path / "s.zarr"), cluster={"num_workers": 64})
    actor, driver = _sizes(job)
    limit(monkeypatch, memory_available=driver + 3 * actor)
    line = refused(tmp_path, capsys, job)
    # 64 asked for, 12 started: the driver starts no more actors than the job has shards.
    assert "12 actors of ~" in line and "lower cluster.num_workers (at most 3 fit)" in line, line


def test_a_cluster_node_with_too_many_actors_names_num_cpus_per_worker(tmp_path, capsys, monkeypatch):
    job = small_job(str(tmp_path / "s.zarr"), cluster={"address": "10.0.0.1:6379", "num_workers": 8})
    actor, _ = _sizes(job)
    limit(monkeypatch, local_ray=False, cpus=8, memory_total=2 * actor, memory_available=2 * actor)
    line = refused(tmp_path, capsys, job)
    assert "8 actors of ~" in line and "raise cluster.num_cpus_per_worker" in line and "--no-preflight" in line, line


def test_a_store_larger_than_the_free_disk_is_refused(tmp_path, capsys, monkeypatch):
    limit(monkeypatch, disk_free=1000)
    line = refused(tmp_path, capsys, small_job(str(tmp_path / "s.zarr")))
    assert "the store (48 x " in line and "more on disk" in line and "1,000" not in line, line
    assert "free: put store.url on a filesystem with more space" in line, line


def test_an_absurd_row_chunk_is_refused_before_it_reaches_an_allocation(tmp_path, capsys, monkeypatch):
    limit(monkeypatch)
    job = small_job(str(tmp_path / "s.zarr"), store={"row_chunk": 2**62}, sharding={"shard_rows": 2**62})
    line = refused(tmp_path, capsys, job)
    assert "writer" in line and "lower store.row_chunk" in line, line


def test_no_preflight_skips_the_resource_checks_but_not_the_sizes(tmp_path, monkeypatch):
    limit(monkeypatch, memory_available=1, memory_total=1, disk_free=1)
    config = mlp_job(tmp_path)
    with pytest.raises(ResourceError):
        check_job(config)
    assert check_job(config, preflight=False).footprint is not None  # --no-preflight
    with pytest.raises(Exception, match="larger than the row"):
        check_job(mlp_job(tmp_path, projection={"dim": 10**6}), preflight=False)


def test_no_preflight_is_an_option_of_run_and_submit():
    from classgrad.service.commands.cli import build_parser
    from classgrad.service.driver_runtime.submit import prepare_submission

    parser = build_parser()
    assert parser.parse_args(["run", "job.yaml", "--no-preflight"]).no_preflight
    assert parser.parse_args(["submit", "job.yaml", "--no-preflight"]).no_preflight
    demo = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"
    overrides = ["store.url=s3://bucket/demo.zarr"]  # a store every node reaches
    entry = prepare_submission(demo, overrides, working_dir=demo.parents[1], preflight=False).entrypoint
    assert "classgrad run configs/demo.yaml --no-preflight" in entry, entry


def test_near_the_limit_is_one_warning(tmp_path, monkeypatch, caplog):
    config = mlp_job(tmp_path)
    actor, driver = _sizes(config.model_dump(mode="json"))
    limit(monkeypatch, memory_available=int((2 * actor + driver) / 0.9))  # 90% used: above NEAR (80%)
    checked = check_job(config)
    near = [n for n in checked.preflight_notes if "%" in n]
    assert len(near) == 1 and "90%" in near[0] and "cluster.num_workers" in near[0], checked.preflight_notes


def test_the_gpu_share_of_an_actor_is_checked():
    fp = Footprint(
        num_classes=10,
        dim_in=10,
        dim=10,
        store_dtype="float32",
        store_bytes=0,
        store_disk_bytes=0,
        device="cuda",
        actor=[Part("process", 10**8, None)],
        device_parts=[Part("model", 3 * GB, "model.factory"), Part("activations", 9 * GB, "data.batch_size")],
        driver=[Part("process", 10**8, None)],
    )
    gpu = Limits(**{**ROOMY.__dict__, "gpu_memory": 16 * GB})
    from classgrad.config import JobConfig

    job = small_job("s.zarr", cluster={"num_gpus_per_worker": 0.5, "num_workers": 2})
    needs = r"GPU memory needs ~12.0 GiB .* 8.0 GiB .*raise cluster.num_gpus_per_worker"
    with pytest.raises(ResourceError, match=needs):
        check_resources(JobConfig.model_validate(job), fp, gpu)
    whole = small_job("s.zarr", cluster={"num_gpus_per_worker": 1, "num_workers": 2})
    small = Limits(**{**gpu.__dict__, "gpu_memory": 10 * GB})
    with pytest.raises(ResourceError, match="lower data.batch_size"):
        check_resources(JobConfig.model_validate(whole), fp, small)


def test_an_absurd_batch_size_is_clamped_with_a_note_and_the_hooks_keep_their_path(tmp_path):
    config = mlp_job(tmp_path, data={"batch_size": 10**19})  # 2^63 and up overflow a C long
    checked = check_job(config, preflight=False)
    assert any(
        "data.batch_size 10000000000000000000 is more than the probe set's 72" in n for n in checked.preflight_notes
    )
    store = run_without_ray(config)
    assert store.is_complete
    from classgrad.workers.actor_runtime.factory import build_job_engine

    engine = build_job_engine(config)
    assert engine.probe.batch_size == 72
    list(engine.iter_blocks(list(range(8))))
    assert not any("abandoned" in n for n in engine.stats.notes), engine.stats.notes  # no fallback to vmap


def test_the_store_size_is_exact(tmp_path):
    config = mlp_job(tmp_path, store={"dtype": "float16", "row_chunk": 4, "col_chunk": 100})
    store = run_without_ray(config)
    from classgrad.workers.actor_runtime.stored_rows import checked_engine

    engine, projector, dim = checked_engine(config, device="cpu")
    fp = job_footprint(config, engine, projector, dim, build_bytes=0)
    group = zarr.open_group(config.store.url, mode="r")
    arrays = [group[name] for name in ("grads", "row_scale", "loss", "count")]
    assert fp.store_bytes == sum(a.nbytes for a in arrays)  # shapes x item sizes: exact
    on_disk = 0
    for name in ("grads", "row_scale", "loss", "count"):
        for dirpath, _, files in os.walk(Path(config.store.url) / name / "c"):
            on_disk += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files)
    assert fp.store_disk_bytes == on_disk  # whole chunks with their crc32c, uncompressed: exact
    assert store.num_classes == fp.num_classes


# --- the estimate against measured peaks ---------------------------------------------------------

ZOO_JOBS = {
    "mlp": ("classgrad.workers.zoo:mlp", {"in_features": 8, "hidden": 16}, {"kind": "vector", "input_shape": [8]}),
    "small_cnn": (
        "classgrad.workers.zoo:small_cnn",
        {"width": 32},
        {"input_shape": [3, 32, 32], "samples_per_class": 8},
    ),
    "bn_cnn": ("classgrad.workers.zoo:bn_cnn", {"width": 16}, {"input_shape": [3, 16, 16]}),
    "tiny_transformer": ("classgrad.workers.zoo:tiny_transformer", {}, {"kind": "tokens", "vocab": 64}),
    "resnet18": ("classgrad.workers.zoo:resnet18", {}, {"input_shape": [3, 8, 8], "samples_per_class": 1}),  # D = 11M
}


def _zoo_job(tmp: Path, name: str) -> dict:
    factory, kwargs, probe = ZOO_JOBS[name]
    C = 4 if name == "resnet18" else 8
    data = {"num_classes": C, "samples_per_class": 2, "seed": 0, **probe}
    return {
        "model": {"factory": factory, "kwargs": {"num_classes": C, **kwargs}},
        "data": {"factory": "classgrad.workers.zoo:synthetic_probe", "kwargs": data, "batch_size": 64},
        "loss": {"num_classes": C},
        "sharding": {"shard_rows": 4},
        "store": {"url": str(tmp / f"{name}.zarr"), "row_chunk": 4},
        "cluster": {"num_workers": 1},
    }


def _hf_job(tmp: Path) -> dict:
    C = 6
    return {
        "model": {"factory": "tests.support.hf_jobs:job_bert", "kwargs": {"num_classes": C}},
        "data": {"factory": "tests.support.hf_jobs:job_text_rows", "kwargs": {"num_classes": C}, "collate": "pad"},
        "loss": {"num_classes": C},
        "sharding": {"shard_rows": 6},
        "store": {"url": str(tmp / "bert.zarr"), "row_chunk": 2},
        "cluster": {"num_workers": 1},
    }


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and /proc/self/status (VmHWM)")
def test_the_estimate_is_within_1_5x_of_the_measured_peak_rss(tmp_path):
    from tests.support.peak_memory import estimate_and_measure

    jobs = [_zoo_job(tmp_path, name) for name in ZOO_JOBS] + [_hf_job(tmp_path)]
    results = estimate_and_measure(jobs)
    assert len(results) == len(jobs)
    for job, result in zip(jobs, results):
        # The estimate counts Ray's core worker in each actor (RAY_ACTOR_BYTES); the actor measured
        # here runs without Ray, so that allowance is taken off. Every child here starts with
        # transformers imported (preloaded_bytes, see tests/support/peak_memory.py), which a fresh
        # driver's measured build would have counted: it is added back.
        estimate = result["estimate"]["actor_bytes"] - RAY_ACTOR_BYTES + result["preloaded_bytes"]
        measured = result["peak_rss_bytes"]
        # 1.5x either way: the bound for a model of memory built from sizes (parameters,
        # probe set, row groups, saved activations per sample) and allowances measured once
        # (a process with torch imported), not from this run.
        assert measured / 1.5 <= estimate <= 1.5 * measured, (job["model"]["factory"], estimate, measured, result)


def test_the_run_summary_says_each_fallback_once_and_the_estimate_beside_the_peaks():
    from classgrad.service.driver_runtime.driver import RunSummary
    from classgrad.service.driver_runtime.run_record import estimate_record, record_peak

    summary = RunSummary(run_id="r")
    why = "fallback: hooks abandoned: ValueError: Overflow when unpacking long long"
    summary.add_engine_notes(
        ["partitioned: vmap for all 6 params; hooks abandoned (...)", f"{why}; the vmap path, 2.5x"]
    )
    summary.add_engine_notes([f"{why}; the vmap path, 2.5x"])  # a second actor says the same
    summary.memory = {"estimate": estimate_record({"actor_bytes": 300 * 2**20, "actor": []}), "peak_rss_per_actor": {}}
    record_peak(summary.memory, {"host": "h", "pid": 1, "peak_rss_bytes": 200 * 2**20})
    record_peak(summary.memory, {"host": "h", "pid": 1, "peak_rss_bytes": 10**8})  # a later, lower report
    text = "\n".join(summary.lines())
    assert summary.fallbacks == [f"{why}; the vmap path, 2.5x"] and text.count("Overflow when unpacking") == 1
    assert "  fallback    hooks abandoned: ValueError" in text
    assert "estimate ~300 MiB per actor; measured peak RSS 200 MiB (highest of 1 actors)" in text
    assert summary.to_dict()["memory"]["peak_rss_per_actor"] == {"h:1": 200 * 2**20}


def test_a_real_fallback_reaches_the_run_summary_once(tmp_path):
    from torch import nn

    from classgrad.service.driver_runtime.driver import RunSummary
    from classgrad.workers.actor_runtime.factory import build_job_engine

    config = mlp_job(tmp_path)
    handle = nn.modules.module.register_module_forward_hook(lambda m, args, out: None)  # rules the hooks out
    try:
        engines = [build_job_engine(config) for _ in range(2)]  # two actors
        for engine in engines:
            list(engine.iter_blocks(list(range(8))))
    finally:
        handle.remove()
    summary = RunSummary(run_id="r")
    for engine in engines:
        summary.add_engine_notes(engine.stats.notes)
    text = "\n".join(summary.lines())
    line = "  fallback    hooks abandoned: forward hooks on every module, or on the model; the vmap path, about 2.5x"
    assert text.count("  fallback    ") == 1 and line in text, text


def test_estimate_and_the_preflight_are_one_model_and_refuse_alike(tmp_path, monkeypatch):
    from classgrad.service.driver_runtime.estimate import estimate_job

    config = mlp_job(tmp_path, store={"dtype": "float16"})
    result = estimate_job(config, sample_rows=8)
    checked = check_job(config)
    assert checked.footprint is not None
    assert result.footprint["store_bytes"] == checked.footprint["store_bytes"] == result.store_bytes

    def parts(fp: dict) -> dict:  # all but the measured build, which a second build in one process shrinks
        return {p["name"]: p["bytes"] for p in fp["actor"] if p["name"] != "build"}

    assert parts(result.footprint) == parts(checked.footprint)
    assert result.peak_memory_bytes == result.footprint["actor_bytes"]
    limit(monkeypatch, memory_available=10**6, memory_total=10**6)
    with pytest.raises(ResourceError, match="preflight: one actor"):
        estimate_job(config, sample_rows=8)
    assert estimate_job(config, sample_rows=8, preflight=False).store_bytes == result.store_bytes  # --no-preflight


def test_measuring_the_saved_bytes_leaves_the_model_as_built(tmp_path):
    from classgrad.service.driver_runtime.footprint import saved_bytes
    from classgrad.workers.actor_runtime.factory import build_job_engine
    from classgrad.workers.actor_runtime.identity import model_digest

    job = small_job(str(tmp_path / "s.zarr"), model={"factory": "classgrad.workers.zoo:bn_cnn", "mode": "train"})
    from classgrad.config import JobConfig

    engine = build_job_engine(JobConfig.model_validate({**job, "loss": {"kind": "logit", "num_classes": 48}}))
    before = model_digest(engine.model)
    assert saved_bytes(engine)[0] > 0  # per sample
    assert model_digest(engine.model) == before  # train-mode BatchNorm's running statistics put back


def test_autocast_copies_of_the_weights_count_once_a_forward_not_per_sample(tmp_path):
    """Under a bf16 autocast a forward saves a bf16 copy of each weight it casts: once a forward,
    whatever the batch. Counted per sample (the saved bytes over four samples), a 10,000-class
    ResNet-18's head made a batch of 1,024 need 9 GiB more than it does."""
    from classgrad.config import JobConfig
    from classgrad.service.driver_runtime.footprint import saved_bytes
    from classgrad.workers.actor_runtime.factory import build_job_engine

    C, hidden = 2000, 64
    job = small_job(
        str(tmp_path / "s.zarr"),
        model={
            "factory": "classgrad.workers.zoo:mlp",
            "kwargs": {"num_classes": C, "in_features": 8, "hidden": hidden},
        },
        data={"kwargs": {"num_classes": C, "samples_per_class": 1, "kind": "vector", "input_shape": [8]}},
        loss={"num_classes": C},
        precision={"dtype": "bf16"},
    )
    engine = build_job_engine(JobConfig.model_validate(job))
    per_sample, per_forward = saved_bytes(engine)
    head_bf16 = C * hidden * 2
    assert per_forward >= head_bf16  # the head's copy, once
    # What grows with the batch: a sample's bf16 hidden units and logits and its float32 logits,
    # a few tensors of C or fewer each (well under the head's 250 KiB over four samples, 62.5 KiB).
    assert 0 < per_sample <= 4 * C * 4, per_sample
