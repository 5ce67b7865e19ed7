"""Fault injection for integration tests: a loss that fails or sleeps on cue, and helpers.

The cue is a directory named by the environment variable ``CLASSGRAD_FAULTS``. A job sets it on
its actors only, through ``cluster.runtime_env.env_vars``, which is not part of a store's
fingerprint: a faulty run and a clean run of the same job compute the same rows, and the driver
(which has no such variable) never sees a fault in its preflight check. The directory holds
``plan.json``::

    {"fail_class": 9, "fail_times": 2, "delay_s": 0.1, "hold_file": null,
     "oom_class": null, "oom_times": 0, "oom_max_bytes": 0}

- ``flaky_cross_entropy`` (``loss.kind: tests.support.faulty:flaky_cross_entropy``): the
  per-sample cross-entropy of ``loss.kind: cross_entropy`` (the same rows, bit for bit), which
  first sleeps ``delay_s`` per call and raises ``InjectedFault`` whenever it is handed a sample
  of ``fail_class`` while fewer than ``fail_times`` faults have been raised, and waits while
  ``hold_file`` exists (a gate the test opens with ``release``). Every fault leaves
  a file ``raised-<n>`` in the directory (created with O_EXCL, so two actors cannot both count
  as fault n); a raise aborts the shard attempt that computes that class, so the count of those
  files is the number of failed attempts of that shard. Likewise, handed a sample of
  ``oom_class`` (-1: any) while fewer than ``oom_times`` such faults have been claimed (files
  ``oom-<n>``), it takes memory, 64 MiB at a time up to ``oom_max_bytes``, until Ray's memory
  monitor kills its process (a test cluster started with a ``memory_usage_threshold`` that this
  crosses: ``oom_threshold``); not killed by then, it raises ``InjectedFault``.
- ``unhooked_mlp``: ``classgrad.workers.zoo.mlp`` with a no-op forward pre-hook on its first layer
  and on the model itself. The partitioned engine retries anything that fails in its fast paths
  (per-class sums from hooks, then vmap) with a slower one that gives the same rows, so an error
  raised there is swallowed instead of failing the shard. A layer with a forward hook hands its
  parameters to its parent, and a hooked model has none to hand them to: no hook path
  (``partitioned/hook_plan.py``, ``HookPlan.plan``), and ``engine.block_rows: 1`` makes
  every class go alone (no vmap packs): the loss is then always called on plain tensors, once
  per class, and a fault fails the shard attempt, as a real error in user code would.
- ``nan_dataset``: a probe set served as a ``Dataset`` with NaN in one sample's input, which
  only the actor that computes that sample's class sees (the driver's preflight cannot check a
  Dataset's inputs up front).
- ``nan_probe`` (tensors with NaN in one sample: the driver's preflight catches it),
  ``raising_dataset`` (a Dataset whose ``__getitem__`` raises on one item),
  ``other_model_checkpoint`` (weights that do not fit the job's model) and
  ``resized_checkpoint`` (the job's model's keys, other shapes), for bad-input tests;
  ``authenticated_probe`` (a probe set whose factory takes a credential), for redaction tests.
- ``unseeded_mlp`` (initialised from its process's random state), ``noisy_dataset`` (a random
  transform on every read) and ``scaled_mlp`` (``zoo.mlp``'s weights, another forward), for the
  run-identity tests.
- ``write_plan``, ``release``/``hold`` (the gate), ``faults_raised``, ``memory_faults`` and
  ``oom_threshold`` for the tests.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from classgrad.workers import zoo
from classgrad.workers.losses import partitioned_loss

ENV = "CLASSGRAD_FAULTS"
PLAN = "plan.json"
HOLD_MAX_S = 120.0


class InjectedFault(RuntimeError):
    """The error the fault plan raises (an ordinary exception, as a bug in user code would be)."""


def write_plan(
    directory: str | Path,
    *,
    fail_class: int | None = None,
    fail_times: int = 0,
    delay_s: float = 0.0,
    hold: bool = False,
    oom_class: int | None = None,
    oom_times: int = 0,
    oom_max_bytes: int = 0,
) -> str:
    """Write a fault plan into ``directory`` (created); returns the directory as a string.
    ``hold``: the loss waits while ``<directory>/hold`` exists (``release`` removes it), after
    leaving ``<directory>/started``: a job that is surely running while a test looks at it."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    hold_file = path / "hold"
    if hold:
        hold_file.touch()
    (path / PLAN).write_text(
        json.dumps(
            {
                "fail_class": fail_class,
                "fail_times": fail_times,
                "delay_s": delay_s,
                "hold_file": str(hold_file) if hold else None,
                "oom_class": oom_class,
                "oom_times": oom_times,
                "oom_max_bytes": oom_max_bytes,
            }
        )
    )
    return str(path)


def release(directory: str | Path) -> None:
    (Path(directory) / "hold").unlink(missing_ok=True)


def hold(directory: str | Path) -> None:
    """Close the gate of a plan written with ``hold`` again: every loss call waits from now on
    (a running job's shards stay in flight until ``release``)."""
    (Path(directory) / "hold").touch()


def started(directory: str | Path) -> bool:
    return (Path(directory) / "started").exists()


def faults_raised(directory: str | Path) -> int:
    return len(list(Path(directory).glob("raised-*")))


def memory_faults(directory: str | Path) -> int:
    """Out-of-memory faults claimed so far (each one an actor that took memory until killed)."""
    return len(list(Path(directory).glob("oom-*")))


def oom_threshold(margin_bytes: int) -> float:
    """A ``memory_usage_threshold`` for a Ray started now that ``margin_bytes`` more memory in
    use on this machine crosses: its used fraction now (as Ray's memory monitor counts it,
    total minus available) plus the margin."""
    import psutil

    vm = psutil.virtual_memory()
    return min(0.99, (vm.total - vm.available + margin_bytes) / vm.total)


def _hog_memory(max_bytes: int) -> None:
    """Take memory (touched, so resident) until this process is killed, or give up."""
    import numpy as np

    held = []
    step = 64 << 20
    while len(held) * step < max_bytes:
        held.append(np.ones(step // 8))
        time.sleep(0.05)  # the monitor samples every memory_monitor_refresh_ms
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        time.sleep(0.1)
    raise InjectedFault(f"took {max_bytes >> 20} MiB and Ray's memory monitor did not kill pid {os.getpid()}")


def _plan() -> tuple[Path, dict] | None:
    directory = os.environ.get(ENV)
    if not directory:
        return None
    try:
        return Path(directory), json.loads((Path(directory) / PLAN).read_text())
    except FileNotFoundError:
        return None


def _count_fault(directory: Path, fail_times: int, label: int, prefix: str = "raised") -> bool:
    """Claim the next fault number below ``fail_times``; False when the budget is spent."""
    for n in range(fail_times):
        try:
            fd = os.open(directory / f"{prefix}-{n}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            continue
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps({"pid": os.getpid(), "label": label, "time": time.time()}))
        return True
    return False


@partitioned_loss
def flaky_cross_entropy(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    found = _plan()
    if found is not None:
        directory, plan = found
        if plan.get("delay_s"):
            time.sleep(float(plan["delay_s"]))
        hold = plan.get("hold_file")
        if hold:  # a gate: wait (at most HOLD_MAX_S) while the test keeps the file
            (directory / "started").touch()
            deadline = time.monotonic() + HOLD_MAX_S
            while os.path.exists(hold) and time.monotonic() < deadline:
                time.sleep(0.05)
        hog = plan.get("oom_class")  # -1: any class
        if hog is not None and (hog == -1 or bool((labels == hog).any())):
            if _count_fault(directory, int(plan.get("oom_times", 0)), int(hog), prefix="oom"):
                _hog_memory(int(plan.get("oom_max_bytes", 0)))
        target = plan.get("fail_class")
        if target is not None and bool((labels == target).any()):
            if _count_fault(directory, int(plan.get("fail_times", 0)), int(target)):
                raise InjectedFault(f"injected fault while computing class {target} (pid {os.getpid()})")
    # Exactly what loss.kind=cross_entropy computes (workers/losses.py), so rows are identical.
    return F.cross_entropy(
        outputs.float() if outputs.dtype in (torch.float16, torch.bfloat16) else outputs, labels, reduction="none"
    )


def _no_op(module: nn.Module, args: tuple) -> None:
    return None


def unhooked_mlp(num_classes: int = 10, **mlp_kwargs) -> nn.Module:
    model = zoo.mlp(num_classes, **mlp_kwargs)
    model[0].register_forward_pre_hook(_no_op)
    model.register_forward_pre_hook(_no_op)
    return model


def nan_dataset(nan_sample: int, **probe_kwargs) -> Dataset:
    """``nan_probe(nan_sample, **probe_kwargs)`` served as a Dataset."""
    return TensorDataset(*nan_probe(nan_sample, **probe_kwargs))


def nan_probe(nan_sample: int, **probe_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """``classgrad.workers.zoo.synthetic_probe(**probe_kwargs)`` (tensors) with NaN in sample ``nan_sample``."""
    inputs, targets = zoo.synthetic_probe(**probe_kwargs)
    inputs = inputs.clone()
    inputs[nan_sample] = float("nan")
    return inputs, targets


def other_model_checkpoint(path: str) -> str:
    """Save the state dict of a model that is not ``small_cnn`` (keys that do not fit it)."""
    torch.save(zoo.mlp(4, in_features=3, hidden=5).state_dict(), path)
    return path


class _RaisingDataset(Dataset):
    def __init__(self, bad_item: int, inputs: torch.Tensor, targets: torch.Tensor):
        self.bad_item, self.inputs, self.targets = bad_item, inputs, targets

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index == self.bad_item:
            raise OSError(f"image file {index}.png is truncated")
        return self.inputs[index], self.targets[index]


def raising_dataset(bad_item: int, **probe_kwargs) -> Dataset:
    """``classgrad.workers.zoo.synthetic_probe(**probe_kwargs)`` as a Dataset whose ``__getitem__``
    raises ``OSError`` on item ``bad_item`` (as a corrupt file would)."""
    return _RaisingDataset(bad_item, *zoo.synthetic_probe(**probe_kwargs))


def resized_checkpoint(path: str, **small_cnn_kwargs) -> str:
    """Save the state dict of ``small_cnn(**small_cnn_kwargs)``: the keys of the job's small CNN,
    other shapes when the kwargs differ (another width or class count)."""
    torch.save(zoo.small_cnn(**small_cnn_kwargs).state_dict(), path)
    return path


def authenticated_probe(source: dict, **probe_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """``synthetic_probe(**probe_kwargs)``, from a factory that takes a credential, as one that
    downloads its data would (``source: {url: ..., api_token: ...}``); the credential is unused."""
    assert isinstance(source.get("api_token"), str)
    return zoo.synthetic_probe(**probe_kwargs)


def unseeded_mlp(num_classes: int = 10, in_features: int = 8, hidden: int = 16) -> nn.Module:
    """An MLP initialised from whatever random state its process has: not deterministic."""
    return nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))


class _NoisyDataset(Dataset):
    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor):
        self.inputs, self.targets = inputs, targets

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[i] + 0.01 * torch.randn_like(self.inputs[i]), self.targets[i]


def noisy_dataset(**probe_kwargs) -> Dataset:
    """``synthetic_probe(**probe_kwargs)`` served with a random transform (unseeded noise per read)."""
    return _NoisyDataset(*zoo.synthetic_probe(**probe_kwargs))


def scaled_mlp(scale: float = 1.0, **mlp_kwargs) -> nn.Module:
    """``zoo.mlp`` whose forward multiplies the outputs by ``scale``: the same weights as
    ``zoo.mlp``, another forward (factory code changed without changing a weight)."""
    model = zoo.mlp(**mlp_kwargs)
    model.append(_Scale(scale))  # no parameters: the parameters' names and values stay zoo.mlp's
    return model


class _Scale(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


# Token shapes an exception's text may carry (none is real): the data factory below raises them.
PLANTED_TOKENS = {
    "bearer": "Bearer Zm9vYmFyYmF6cXV4MTIzNDU2Nzg5",
    "hf": "hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345",
    "jwt": "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJjbGFzc2dyYWQifQ.c2lnbmF0dXJlLXBsYW50ZWQ",
    "github": "ghp_PlantedPlantedPlantedPlanted012345",
    "aws": "AKIAPLANTEDEXAMPLE12",
    "openai": "sk-plantedplantedplantedplanted",
}


def leaky_dataset(**probe_kwargs) -> Dataset:
    """A data factory that fails the way a download does, its exception quoting credentials."""
    headers = {"Authorization": PLANTED_TOKENS["bearer"], "X-Api": PLANTED_TOKENS["openai"]}
    raise ConnectionError(
        f"download failed for {{'url': 'https://hub.example/data', 'headers': {headers}, "
        f"'token': '{PLANTED_TOKENS['hf']}'}} after auth {PLANTED_TOKENS['jwt']} "
        f"(keys {PLANTED_TOKENS['github']} {PLANTED_TOKENS['aws']})"
    )


def leaky_on_actors(**probe_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """``synthetic_probe``'s data on the driver; inside a Ray actor, ``leaky_dataset``'s failure
    (a node whose download fails, quoting its credentials): what reaches Ray's own logs."""
    import ray

    if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
        leaky_dataset()
    return zoo.synthetic_probe(**probe_kwargs)
