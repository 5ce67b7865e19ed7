"""A run's identity: what its rows were actually computed from, beyond the config's text.

Holds ``RunIdentity`` (the digest of the model's parameters and buffers as built, after the
checkpoint; the digest of the probe set as built, labels and inputs; the model's outputs on the
first ``PROBE_SAMPLES`` probe samples), ``model_digest``, ``engine_identity`` (an engine's
identity, after checking that its data and forward give the same answer when asked twice),
``identity_changes`` (what differs between a recorded identity and a new one, in words) and
``check_same_build`` (an actor's build against the driver's).

A store records its identity when it is created; the driver compares it before trusting done
shards, and each actor compares its own build with the driver's before it writes. The config's
fingerprint cannot see a checkpoint replaced at the same path, data files changed in place, or
factory code that changes the forward without changing a weight: these catch all three.

Outputs are compared normwise per sample, ||a - b|| <= rtol * max(||a||, ||b||), with rtol
``OUTPUT_RTOL`` (1e-2 for float32/float64 outputs, 5e-2 for 16-bit ones): the driver computes
them on the CPU, an actor may on a GPU (TF32 convolutions differ by about 1e-3 relative, a
half-precision model by about 1e-2), while a changed forward moves them by far more. Outputs
wider than ``SKETCH_WIDTH`` values per sample are recorded as a fixed count sketch of that
width (value i goes, with a fixed sign, to bucket i mod width), which keeps norms on average.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from classgrad.errors import InputError
from classgrad.workers.engines import GradientEngine
from classgrad.workers.model_io import ModelIO
from classgrad.workers.probe import digest_into

__all__ = [
    "IDENTITY_VERSION",
    "OUTPUT_RTOL",
    "PROBE_SAMPLES",
    "SKETCH_WIDTH",
    "RunIdentity",
    "check_same_build",
    "engine_identity",
    "identity_changes",
    "listed",
    "model_digest",
]

IDENTITY_VERSION = 1
PROBE_SAMPLES = 4  # the first probe samples, as the driver's preflight uses
SKETCH_WIDTH = 64
OUTPUT_RTOL = {"float64": 1e-2, "float32": 1e-2, "float16": 5e-2, "bfloat16": 5e-2}

PARAMS = "the model's parameters/buffers"
OUTPUTS = "the model's outputs on the first probe samples"
PROBE = "the probe data (labels and inputs)"

SEED_HINT = (
    "seed it (torch.manual_seed or a torch.Generator inside the factory, no random transforms), "
    "or load every weight from model.checkpoint"
)


@dataclass(frozen=True)
class RunIdentity:
    """What a run computed from; ``to_dict`` is the JSON a store records."""

    params: str  # sha256 hex of names, dtypes, shapes and bytes of parameters and buffers
    probe: str  # sha256 hex of the probe set as built (ProbeSet.digest)
    outputs: tuple[tuple[float, ...], ...]  # per probe sample: its outputs, or their sketch
    outputs_dtype: str
    sketched: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": IDENTITY_VERSION,
            "params": self.params,
            "probe": self.probe,
            "outputs": [list(o) for o in self.outputs],
            "outputs_dtype": self.outputs_dtype,
            "outputs_sketch": f"count sketch, width {SKETCH_WIDTH}" if self.sketched else None,
        }

    @classmethod
    def from_dict(cls, record: Any) -> RunIdentity | None:
        """The identity a store recorded, or None when it is not one this code can read."""
        try:
            if record["version"] != IDENTITY_VERSION:
                return None
            return cls(
                params=str(record["params"]),
                probe=str(record["probe"]),
                outputs=tuple(tuple(float(v) for v in o) for o in record["outputs"]),
                outputs_dtype=str(record["outputs_dtype"]),
                sketched=record["outputs_sketch"] is not None,
            )
        except (KeyError, TypeError, ValueError):
            return None


def model_digest(model: nn.Module) -> str:
    """sha256 hex over the names, dtypes, shapes and bytes (on the CPU) of the model's parameters,
    then its buffers, in module order."""
    h = hashlib.sha256(b"classgrad model v1")
    for kind, named in (("param", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, tensor in named:
            h.update(f"{kind}:{name}".encode())
            digest_into(h, tensor)
    return h.hexdigest()


def _outputs(io: ModelIO, inputs: Any, samples: int) -> torch.Tensor:
    """The model's outputs (its logits, as the engine takes them) on ``inputs``, one float64 row per
    sample on the CPU, computed in eval mode (no dropout, no batch statistics, no running-statistics
    updates) and without autocast; every module's mode is restored after."""
    modes = [(m, m.training) for m in io.model.modules()]
    io.model.eval()
    try:
        with torch.no_grad():
            out = io(inputs)
    finally:
        for m, training in modes:
            m.training = training
    rows = out.detach().reshape(samples, -1).to("cpu", torch.float64)
    return torch.nan_to_num(rows)  # JSON holds no NaN; a non-finite output is refused elsewhere


def _sketch(rows: torch.Tensor) -> torch.Tensor:
    """A count sketch of each row: value i, with a fixed sign, added into bucket i mod width."""
    index = torch.arange(rows.shape[1], dtype=torch.int64)
    sign = 1.0 - 2.0 * (((index * 2654435761) >> 16) & 1).to(torch.float64)
    return torch.zeros(rows.shape[0], SKETCH_WIDTH, dtype=torch.float64).index_add_(
        1, index % SKETCH_WIDTH, rows * sign
    )


def _outputs_close(a: torch.Tensor, b: torch.Tensor, rtol: float) -> bool:
    if a.shape != b.shape:
        return False
    diff = torch.linalg.vector_norm(a - b, dim=1)
    scale = torch.maximum(torch.linalg.vector_norm(a, dim=1), torch.linalg.vector_norm(b, dim=1))
    return bool((diff <= rtol * scale).all())


def _rtol(*dtypes: str) -> float:
    return max(OUTPUT_RTOL.get(d, OUTPUT_RTOL["float16"]) for d in dtypes)


def engine_identity(engine: GradientEngine) -> RunIdentity:
    """The identity of an engine's model and probe set. Refuses (``InputError``, one line saying
    to seed it) a probe set whose first samples read differently twice, and a forward that gives
    other outputs twice on the same samples."""
    probe = engine.probe
    if not probe.reads_repeat():
        raise InputError(
            "data: the first probe samples give other inputs each time they are read (random transforms?): "
            "the probe set must be the same on every read: seed them (a torch.Generator with a fixed seed) or drop them"
        )
    samples = min(len(probe), PROBE_SAMPLES)
    inputs, _ = probe.batch(torch.arange(samples), engine.device, engine.compute_dtype)
    dtype = str(next((p.dtype for p in engine.model.parameters() if p.is_floating_point()), torch.float32))
    dtype = dtype.removeprefix("torch.")
    first, second = (_outputs(engine.io, inputs, samples) for _ in range(2))
    if not _outputs_close(first, second, _rtol(dtype)):
        raise InputError(
            f"model: the forward gives other outputs each time on the same probe samples (random layers?): {SEED_HINT}"
        )
    sketched = first.shape[1] > SKETCH_WIDTH
    record = _sketch(first) if sketched else first
    return RunIdentity(
        params=model_digest(engine.model),
        probe=probe.digest,
        outputs=tuple(tuple(float(v) for v in row) for row in record.tolist()),
        outputs_dtype=dtype,
        sketched=sketched,
    )


def identity_changes(recorded: Any, current: RunIdentity) -> list[str]:
    """What differs between a recorded identity (a store's JSON) and ``current``, in words; empty
    when they are the same run's inputs (outputs within the stated tolerance)."""
    old = RunIdentity.from_dict(recorded)
    if old is None:
        return ["the record of its inputs (unreadable by this classgrad)"]
    changed = []
    if old.params != current.params:
        changed.append(PARAMS)
    a, b = (torch.tensor(i.outputs, dtype=torch.float64) for i in (old, current))
    if old.sketched != current.sketched or not _outputs_close(a, b, _rtol(old.outputs_dtype, current.outputs_dtype)):
        changed.append(OUTPUTS)
    if old.probe != current.probe:
        changed.append(PROBE)
    return changed


def check_same_build(driver: Mapping[str, Any], mine: RunIdentity) -> None:
    """Refuse (``InputError``, one line) an actor whose build differs from the driver's: a
    factory that is not deterministic (the job's factories run from a fresh random seed in each
    process, so unseeded initialisation always shows here)."""
    changed = identity_changes(driver, mine)
    if changed:
        raise InputError(
            f"this actor built the job differently from the driver ({listed(changed)} differ): model.factory "
            f"or data.factory is not deterministic (unseeded initialisation, random transforms?): {SEED_HINT}"
        )


def listed(items: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]
