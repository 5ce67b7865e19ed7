"""``per_class_gradients``: the one-call Python API (no Ray) from DESIGN.md, and what it builds on.

Holds ``per_class_gradients`` (with an optional progress bar, terminal or notebook, counting rows
as blocks finish), ``build_engine`` (everything it needs, as an engine that can be asked again)
and the job's ``projection``: ``projection_options`` (a mapping or a ``ProjectionConfig``, with a
store's record, to a ``projection.ResolvedProjection``), ``finished_projector`` (the projector of an
engine's finished rows, when its structure does not project inside the backward) and
``stored_width`` (the columns of a stored row).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

# ``torch.autograd.grad`` with tensor ``grad_outputs`` (the recurrent and module-VJP rules, the
# dense engine) imports torch.fx's symbolic shapes, sympy with it, on its first call: 0.7-1.1 s
# on a 2-core CPU that a process's first ``per_class_gradients`` paid (an LSTM at C = 1,000:
# first call 2.1 s, second 0.6 s). Taken with the engines' other imports instead.
import torch.fx.experimental.symbolic_shapes  # noqa: F401
from torch import nn

from classgrad.config import ProjectionConfig
from classgrad.errors import ConfigError, InputError
from classgrad.progress_bar import progress_bar
from classgrad.workers.allocator import keep_freed_memory
from classgrad.workers.amp import PrecisionPolicy
from classgrad.workers.devices import check_device
from classgrad.workers.engines.base import GradientEngine
from classgrad.workers.engines.partitioned import PartitionedEngine
from classgrad.workers.engines.partitioned.projected_engine import ProjectedEngine
from classgrad.workers.gradients.engine_registry import create_engine
from classgrad.workers.layout import ParamLayout
from classgrad.workers.losses import LossKind, create_loss
from classgrad.workers.model_io import input_pad_values
from classgrad.workers.probe import ProbeSet
from classgrad.workers.projection.base import ResolvedProjection, RowProjector, resolve_projection

log = logging.getLogger(__name__)


def build_engine(
    model: nn.Module,
    data: Any,
    *,
    num_classes: int,
    loss: str | Callable | LossKind = "cross_entropy",
    precision: str | PrecisionPolicy = "fp32",
    params: Sequence[str] | None = None,
    exclude: Sequence[str] = (),
    engine: str = "auto",
    batch_size: int = 256,
    device: str | torch.device = "cpu",
    block_rows: int | None = None,
    group_rows: int = 256,
    output: str | int | None = None,
    label_field: str | None = None,
    collate: str | Callable[[list[Any]], Any] | None = None,
    pad_values: Mapping[str, float] | None = None,
    projection: ResolvedProjection[Any] | None = None,
    tokenizer: Any = None,
) -> GradientEngine:
    """Everything ``per_class_gradients`` needs, as an engine that can be asked for rows again.

    ``projection``: ``projection_options``; a structure that projects inside the backward gives a
    ``ProjectedEngine``, any other the plain engine (its rows then go to ``finished_projector``)."""
    keep_freed_memory()  # before the probe set's allocations too
    check_device(device)  # before the probe set is read: a missing GPU is named in one line
    loss_kind = create_loss(loss, num_classes)
    policy = precision if isinstance(precision, PrecisionPolicy) else PrecisionPolicy(precision)
    layout = ParamLayout.from_model(model, include=list(params or ()), exclude=list(exclude))
    probe = (
        data
        if isinstance(data, ProbeSet)
        else ProbeSet(
            data,
            batch_size=batch_size,
            label_field=label_field,
            collate=collate,
            pad_values=input_pad_values(model, collate, pad_values, tokenizer),  # input_ids: the model's pad id
            digest_now=False,  # nothing records the digest here
        )
    )
    return create_engine(
        engine,
        model,
        probe,
        loss_kind,
        layout,
        projection,
        precision=policy,
        device=device,
        block_rows=block_rows,
        group_rows=group_rows,
        output=output,
    )


def projection_options(
    projection: ProjectionConfig | Mapping[str, Any] | None, record: Mapping[str, Any] | None = None
) -> ResolvedProjection[Any] | None:
    """The options of ``per_class_gradients``' or a job's ``projection`` (a mapping, a
    ``ProjectionConfig`` or None), resolved against ``record`` (a store's ``projection``
    attribute: an unset structure resumes with the store's); None: full rows."""
    if projection is not None and not isinstance(projection, ProjectionConfig):
        if not isinstance(projection, Mapping):
            raise InputError(f"projection must be a mapping like {{'dim': 1024}}, got {type(projection).__name__}")
        try:
            projection = ProjectionConfig.model_validate(dict(projection))
        except ValueError as exc:
            raise ConfigError(f"projection: {exc}".splitlines()[0] + f" ({projection!r})") from None
    return resolve_projection(projection, record)


def finished_projector(options: ResolvedProjection[Any] | None, engine: GradientEngine) -> RowProjector | None:
    """The projector of ``engine``'s finished rows (None: stored whole, or projected by the engine)."""
    if options is None or isinstance(engine, ProjectedEngine):
        return None
    return options.finished_projector(engine.layout.slots, engine.layout.dim)


def stored_width(engine: GradientEngine, projector: RowProjector | None) -> int:
    """Columns of a stored row."""
    if projector is not None:
        return projector.out_dim
    return engine.stored_dim if isinstance(engine, ProjectedEngine) else engine.layout.dim


def per_class_gradients(
    model: nn.Module,
    data: Any,
    *,
    num_classes: int,
    classes: Sequence[int] | None = None,
    loss: str | Callable | LossKind = "cross_entropy",
    precision: str | PrecisionPolicy = "fp32",
    params: Sequence[str] | None = None,
    engine: str = "auto",
    batch_size: int = 256,
    device: str | torch.device = "cpu",
    mode: str = "eval",
    progress: bool | None = None,
    output: str | int | None = None,
    label_field: str | None = None,
    collate: str | Callable[[list[Any]], Any] | None = None,
    pad_values: Mapping[str, float] | None = None,
    projection: ProjectionConfig | Mapping[str, Any] | None = None,
    tokenizer: Any = None,
) -> torch.Tensor:
    """Rows ``dL_c/dtheta`` for ``classes`` (default: all), as float32 ``[len(classes), D]``.

    ``data`` is a Dataset of ``(input, target)`` or of dicts (inputs and the label, under
    ``label_field``: default the first of ``labels``, ``label``), a Hugging Face ``datasets.Dataset``,
    a ``DataLoader`` (its dataset and collate_fn; not its sampler or shuffling), or a pair of
    tensors; ``collate`` is ``"stack"`` (default), ``"pad"`` (variable-length fields padded per
    batch with ``pad_values``, default 0; ``input_ids`` by default with the pad id of ``tokenizer``
    when given, else of ``model.config``, and another pad id of ``input_ids`` than the model's is
    refused) or a function of a list of samples. A dict batch goes to
    the model as keyword arguments (the keys its ``forward`` takes; never the label); of a
    ``ModelOutput``, dict or tuple output the logits are ``.logits`` or the first tensor, unless
    ``output`` (a key or an index) says otherwise. ``params`` are name
    patterns (default: every parameter with ``requires_grad``), flattened and concatenated in
    ``model.named_parameters()`` order. ``mode`` is the module mode the rows are computed in,
    ``"eval"`` as in a job's config (a model fresh from a factory is often in train mode, where
    dropout and batch statistics change the rows); every module's own mode is put back afterwards.
    ``progress`` shows a bar counting rows (a terminal bar, or in a notebook a widget, or a text bar
    without ipywidgets):
    ``None`` only when the call lasts over ``PROGRESS_DELAY_S`` and stderr is a terminal (or in a
    notebook), ``True`` always, ``False`` never. ``projection``: the keys of a job's
    ``projection`` section (``{"dim": 4096, "structure": "kronecker", "seed": 0}``): rows come
    back ``[len(classes), dim]``, the same numbers a job with that section stores.
    """
    options = projection_options(projection)
    with _in_mode(model, mode):
        eng = build_engine(
            model,
            data,
            num_classes=num_classes,
            loss=loss,
            precision=precision,
            params=params,
            engine=engine,
            batch_size=batch_size,
            device=device,
            output=output,
            label_field=label_field,
            collate=collate,
            pad_values=pad_values,
            projection=options,
            tokenizer=tokenizer,
        )
        finished = finished_projector(options, eng)  # of finished rows: dense or a sketch
        width = stored_width(eng, finished)
        wanted = list(range(num_classes)) if classes is None else list(classes)
        if not wanted:
            return torch.zeros(0, width)
        with _row_bar(len(wanted), progress) as advance:
            on_cpu = eng.row_dtype == torch.float32 and eng.device.type == "cpu"
            if finished is None and on_cpu and isinstance(eng, PartitionedEngine):
                # Rows written straight into the result: no second pass over C x D floats. (On a
                # GPU blocks go to the host one at a time instead: C x D need not fit the device.)
                out = torch.empty(len(wanted), width)
                for b in eng.iter_blocks(wanted, out=out):
                    advance(len(b))  # once per block, not per row: the bar costs nothing on the hot path
                return out
            blocks = []
            for b in eng.iter_blocks(wanted):
                blocks.append((finished.project(b.rows) if finished else b.rows).float().cpu())
                advance(len(b))
        return torch.cat(blocks)


PROGRESS_DELAY_S = 2.0  # progress=None: a call shorter than this never shows a bar


@contextlib.contextmanager
def _row_bar(total: int, progress: bool | None) -> Iterator[Callable[[int], object]]:
    """``advance(rows)`` for the block: a bar of ``total`` rows (``progress_bar``: a terminal's, a
    notebook's widget or text bar), or a no-op when off."""
    if progress is False:
        yield lambda rows: None
        return
    bar = progress_bar(
        total,
        desc="per_class_gradients",
        unit="rows",
        show=progress,
        delay=PROGRESS_DELAY_S if progress is None else 0.0,
    )
    try:
        yield bar.update
    finally:
        bar.close()


@contextlib.contextmanager
def _in_mode(model: nn.Module, mode: str) -> Iterator[None]:
    """``model`` in ``mode`` ("eval" or "train") for the block; each module's flag restored after."""
    if mode not in ("eval", "train"):
        raise InputError(f"mode {mode!r} is unknown (choices: eval, train)")
    before = [(m, m.training) for m in model.modules()]
    model.train(mode == "train")
    if mode == "train" and any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        log.warning("train mode: the model's dropout is active, so rows depend on the random seed")
    try:
        yield
    finally:
        for module, training in before:
            module.training = training
