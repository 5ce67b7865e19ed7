"""Build a job's model, probe set, loss and engine from its config, the same way everywhere.

Holds ``build_model`` (factory by import path, checkpoint loaded without pickle, mode),
``build_probe`` (each factory runs from a fresh random seed, so that one that is not seeded
builds differently in every process, which the run's identity check refuses), and
``build_job_engine``, which the Ray actor, the driver's preflight check, ``classgrad estimate``
and the benchmarks all use, so they can never disagree on what a config means; it builds on
``engine_from_parts`` (a config's engine over a given model, probe set and loss), which the
query side of ``classgrad score`` uses too.
"""

from __future__ import annotations

import logging
import os
import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from classgrad.errors import ClassgradError, InputError, NonFiniteError, first_line
from classgrad.workers.amp import PrecisionPolicy
from classgrad.workers.devices import check_device
from classgrad.workers.engines import GradientEngine
from classgrad.workers.gradients import create_engine, projection_options
from classgrad.workers.imports import import_object
from classgrad.workers.layout import ParamLayout
from classgrad.workers.losses import LossKind, create_loss
from classgrad.workers.model_io import input_pad_values
from classgrad.workers.probe import ProbeSet

if TYPE_CHECKING:
    from classgrad.config import JobConfig

log = logging.getLogger(__name__)


def load_checkpoint(model: nn.Module, path: str) -> None:
    """Load weights into ``model``: safetensors, or ``torch.load(weights_only=True)``.

    ``weights_only`` refuses pickles that would run code; a file holding ``{"state_dict": ...}``
    or ``{"model": ...}`` is unwrapped. Missing or unexpected keys are errors.
    """
    file = Path(path)
    if not file.is_file():
        raise InputError(f"model.checkpoint {path!r}: no such file")
    state: object  # a state dict, or a checkpoint holding one (checked below)
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            state = load_file(str(file))
        except Exception as exc:  # noqa: BLE001 - a damaged file is the user's to fix
            raise InputError(f"model.checkpoint {path!r}: not a readable safetensors file ({exc})") from exc
    else:
        try:
            state = torch.load(file, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, AttributeError) as exc:
            raise InputError(
                f"model.checkpoint {path!r}: refused, not a plain weights file "
                f"(torch.load weights_only=True: {first_line(exc)})"
            ) from exc
    for key in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict):
        raise InputError(f"model.checkpoint {path!r}: expected a state dict, got {type(state).__name__}")
    _check_shapes(model, state, path)
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise InputError(
            f"model.checkpoint {path!r} does not fit the model: missing {result.missing_keys[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}"
        )


def _check_shapes(model: nn.Module, state: dict, path: str) -> None:
    """Refuse a checkpoint whose tensors have other shapes than the model's (the right keys for
    another width or class count): one line naming the first few, not torch's multi-line error."""
    expected = model.state_dict()
    wrong = [
        f"{name} is {tuple(value.shape)} in the checkpoint, {tuple(expected[name].shape)} in the model"
        for name, value in state.items()
        if name in expected and isinstance(value, torch.Tensor) and value.shape != expected[name].shape
    ]
    if wrong:
        more = f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""
        raise InputError(f"model.checkpoint {path!r} does not fit the model: {'; '.join(wrong[:3])}{more}")


def call_factory(path: str, kwargs: dict, what: str) -> Any:
    factory = import_object(path, what=what)
    # A factory must not depend on its process's random state (the same in every fresh process, so
    # an unseeded factory would agree with itself until some process drew a number first): it
    # starts from a fresh seed, and the caller's random state is left as it was.
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(int.from_bytes(os.urandom(8), "little"))
        return _called(factory, path, kwargs, what)


def _called(factory: Any, path: str, kwargs: dict, what: str) -> Any:
    try:
        return factory(**kwargs)
    except Exception as exc:  # noqa: BLE001 - the user's factory failed: report it in one line
        raise InputError(f"{what} {path!r} raised {type(exc).__name__}: {exc}") from exc


def build_model(
    factory: str, kwargs: dict | None = None, checkpoint: str | None = None, mode: str = "eval"
) -> nn.Module:
    model = call_factory(factory, dict(kwargs or {}), "model.factory")
    if not isinstance(model, nn.Module):
        raise InputError(f"model.factory {factory!r} returned {type(model).__name__}, not an nn.Module")
    if checkpoint:
        load_checkpoint(model, checkpoint)
    return model.train(mode == "train")


def build_probe(
    factory: str,
    kwargs: dict | None = None,
    batch_size: int = 256,
    *,
    label_field: str | None = None,
    collate: str = "stack",
    pad_values: dict[str, float] | None = None,
    driver_probe: tuple[torch.Tensor, str] | None = None,
) -> ProbeSet:
    """The probe set of a data factory; ``driver_probe``: the (targets, digest) the driver took,
    so that an actor neither reads every sample nor hashes them (``ProbeSet``)."""
    data = call_factory(factory, dict(kwargs or {}), "data.factory")
    targets, digest = driver_probe if driver_probe is not None else (None, None)
    return ProbeSet(
        data,
        batch_size=batch_size,
        label_field=label_field,
        collate=collate,
        pad_values=pad_values,
        driver_targets=targets,
        digest=digest,
    )


def build_job_engine(
    config: JobConfig,
    device: str | None = None,
    record: dict | None = None,
    driver_probe: tuple[torch.Tensor, str] | None = None,
) -> GradientEngine:
    """Model, probe set, loss, parameter layout and engine for a job config (the device checked first).

    ``record``: the store's ``projection`` attribute: the structure an unset
    ``projection.structure`` resumes with, and the map a worker reuses (a Kronecker split, measured
    by the driver, see ``structures.kronecker``; a TensorSketch map, checked). ``driver_probe``:
    the probe set's targets and digest as the driver took them (``build_probe``)."""
    device = device or config.resolved_device()
    check_device(device)
    model = build_model(config.model.factory, config.model.kwargs, config.model.checkpoint, config.model.mode)
    data = config.data
    probe = build_probe(
        data.factory,
        data.kwargs,
        data.batch_size,
        label_field=data.label_field,
        collate=data.collate,
        pad_values=input_pad_values(model, data.collate, data.pad_values),  # input_ids: the model's pad id
        driver_probe=driver_probe,
    )
    loss = create_loss(config.loss.kind, config.loss.num_classes)
    return engine_from_parts(config, model, probe, loss, device=device, record=record)


def engine_from_parts(
    config: JobConfig,
    model: nn.Module,
    probe: ProbeSet,
    loss: LossKind,
    *,
    device: str,
    record: dict | None = None,
    kind: str | None = None,
) -> GradientEngine:
    """The engine a job's config defines (its parameters, precision, projection, engine options)
    over a given model, probe set and loss: ``build_job_engine``'s, and the query side's
    (``classgrad score``: the store's row definition over query examples). ``kind`` replaces
    ``engine.kind``."""
    layout = ParamLayout.from_model(model, include=config.params.include, exclude=config.params.exclude)
    policy = PrecisionPolicy(config.precision.dtype, config.precision.init_scale, config.precision.min_scale)
    return create_engine(
        kind or config.engine.kind,
        model,
        probe,
        loss,
        layout,
        projection_options(config.projection, record),
        precision=policy,
        device=device,
        block_rows=config.engine.block_rows,
        group_rows=config.engine.group_rows,
        output=config.model.output,
    )


def preflight(engine: GradientEngine) -> None:
    """Catch user errors before any store exists: non-finite probe inputs, and one forward on a
    few samples to check the model's output width and that the loss is finite."""
    engine.probe.check_finite()
    idx = torch.arange(min(len(engine.probe), 4))
    # A train-mode BatchNorm updates its running statistics in this forward: put them back, or
    # the driver's build (whose buffers the run's identity digests) differs from every actor's.
    buffers = [(b, b.detach().clone()) for b in engine.model.buffers()]
    with torch.no_grad():
        x, y = engine.probe.batch(idx, engine.device, engine.compute_dtype)
        try:
            with engine.precision.autocast(engine.device):
                out = engine.io(x)
        except ClassgradError:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's model cannot take the user's data
            raise InputError(f"the model's forward failed on the probe data: {type(exc).__name__}: {exc}") from exc
        finally:
            for buffer, saved in buffers:
                buffer.copy_(saved)
        engine.loss.check_outputs(out)
        values = engine.loss.batch_losses(out, y, engine.norm)
    if not bool(torch.isfinite(values).all()):
        raise NonFiniteError("non-finite loss on the first probe samples (NaN/Inf inputs or weights?)")
