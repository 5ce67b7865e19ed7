"""``PerClassGradScaler``: the loss-scaler step of a training loop, with every class's gradient row.

Holds ``PerClassGradScaler``, a drop-in for the ``GradScaler`` step of a training loop (the
pattern of timm's ``NativeScaler``) whose loss is a vector of per-class losses:

- ``rows = scaler(loss, optimizer, model=model)``: the rows ``d loss[c] / d params`` of any loss
  vector with its graph (``classgrad.workers.training.loss_rows``: VJPs in blocks);
- ``rows, class_ids = scaler.step_batch(model, inputs, labels, optimizer)``: the rows of the
  classes present in a batch for the mean cross-entropy per class, by the partitioned engine's
  hook path when the model treats samples independently in its current mode (train-mode
  dropout included: its masks drawn as each sample is forwarded, once), else by one
  forward of the batch and the VJP blocks (``classgrad.workers.training.batch_rows``);

then, with ``update_grad=True``, the rows aggregated into ``.grad`` and the ``GradScaler``
contract kept: the aggregate goes in at the scaler's scale and ``GradScaler.unscale_`` /
``step`` / ``update`` do the rest, so a non-finite value in any row skips the step and lowers the
scale exactly as ``GradScaler.step`` would (with a disabled scaler the step is skipped the same
way and there is no scale to lower); ``clip_grad`` clips the total norm after unscaling.

Also holds ``is_freed_graph``: whether an error is autograd's refusal of a graph already freed.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from classgrad.errors import InputError
from classgrad.store.core.params import ParamSlot
from classgrad.workers.engines.base import draws_only, samples_independent
from classgrad.workers.engines.partitioned.engine import OneForwardRefused, draws_refused
from classgrad.workers.layout import ParamLayout
from classgrad.workers.training.batch_rows import (
    ambient_precision,
    batch_loss_vector,
    batch_size_of,
    check_forward,
    check_labels,
    fast_rows,
    fp16_graph,
    input_signature,
    parameters_of,
)
from classgrad.workers.training.loss_rows import LossRows, check_loss_vector

log = logging.getLogger(__name__)

Aggregate = str | torch.Tensor | Sequence[float] | Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

CREATE_GRAPH_REFUSAL = (
    "create_graph=True is not supported: rows are written block by block into one float32 buffer and the "
    "graph is freed after the last block, so they cannot be differentiated again (take "
    "torch.autograd.grad(loss[c], params, create_graph=True) per class for that)"
)


def is_freed_graph(exc: BaseException) -> bool:
    """Whether ``exc`` is autograd refusing a backward through a graph that an earlier backward
    freed ("Trying to backward through the graph a second time"). PyTorch raises a plain
    ``RuntimeError`` for it (no subclass, no attribute), so its text is the only signal."""
    return isinstance(exc, RuntimeError) and "backward through the graph a second time" in str(exc)


class PerClassGradScaler:
    """A ``torch.amp.GradScaler`` step that also gives every class's gradient row.

    ``scaler``: the ``GradScaler`` to wrap; by default one is made at the first call for the
    model's device, enabled only for fp16 (``precision="fp16"``, a first call made under an fp16
    autocast, or one made after it on a loss whose graph holds fp16 tensors), disabled for fp32 and
    bf16. With ``update_grad`` the aggregate is added into ``.grad``, as ``backward()`` adds: zero
    the gradients each step. ``scaler_kwargs`` (``init_scale``,
    ``growth_interval``, ...) go to that ``GradScaler``. ``block_rows``: rows per batched backward
    of the general route (default: 1, 4, 16 or 32, whichever the first calls measure fastest per
    row; fewer for rows over 256 MiB a block).
    """

    def __init__(
        self,
        scaler: torch.amp.GradScaler | None = None,
        *,
        precision: str | None = None,
        num_classes: int | None = None,
        block_rows: int | None = None,
        **scaler_kwargs: Any,
    ):
        if precision not in (None, "fp32", "fp16", "bf16"):
            raise InputError(f"precision must be fp32, fp16 or bf16, got {precision!r}")
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise InputError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        if scaler is not None and scaler_kwargs:
            raise InputError(f"scaler given: its options {sorted(scaler_kwargs)} belong to that GradScaler")
        _check_scaler_values(scaler_kwargs, "option")
        self._scaler = scaler
        self.precision = precision
        self.num_classes = num_classes
        self.scaler_kwargs = scaler_kwargs
        self._pending_state: dict[str, Any] | None = None
        self._rows = LossRows(block_rows)
        self._forward_checked: set[tuple] = set()  # input signatures the fast route checked a forward of
        # Whether the last call with update_grad found a non-finite row (and so skipped its step).
        self.found_inf = False

    # --- the wrapped GradScaler -----------------------------------------------------------------

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The wrapped ``GradScaler`` (None before the first call when none was given)."""
        return self._scaler

    def _scaler_for(self, device: torch.device, precision: str) -> torch.amp.GradScaler:
        if self._scaler is None:
            enabled = (self.precision or precision) == "fp16"
            if self._pending_state and not enabled:
                raise InputError(
                    "load_state_dict: the state is an fp16 (enabled) GradScaler's, but this scaler runs "
                    f"{self.precision or precision}, where it would be dropped: give precision='fp16'"
                )
            if self._pending_state == {} and enabled:
                raise InputError(
                    "load_state_dict: an empty state is a disabled GradScaler's (fp32 or bf16), but this scaler "
                    "runs fp16; give the state_dict() of an fp16 run"
                )
            self._scaler = torch.amp.GradScaler(device.type, enabled=enabled, **self.scaler_kwargs)
            if self._pending_state is not None:
                self._scaler.load_state_dict(self._pending_state)
                self._pending_state = None
        if self._scaler.is_enabled():
            # GradScaler makes its scale tensor at its first scale(): made here the same way, so
            # that unscale_/step/update find it (a multiply of one number).
            self._scaler.scale(torch.ones((), device=device))
        return self._scaler

    def get_scale(self) -> float:
        """The loss scale rows are computed at (1.0 when disabled or not yet made)."""
        return float(self._scaler.get_scale()) if self._scaler is not None else 1.0

    def state_dict(self) -> dict[str, Any]:
        """The wrapped scaler's state (``GradScaler.state_dict``), to checkpoint with the run."""
        if self._scaler is None:
            return dict(self._pending_state or {})
        return self._scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the scale and growth tracker of a checkpoint (applied at the first call when the
        scaler is made then)."""
        if not isinstance(state, dict):
            raise InputError(f"state must be a dict from state_dict(), got {type(state).__name__}")
        unknown = sorted(set(state) - set(STATE_KEYS))
        if unknown:
            raise InputError(
                f"load_state_dict: {unknown} are not a GradScaler's state (keys: {', '.join(STATE_KEYS)}); "
                "give this scaler's own state_dict()"
            )
        _check_scaler_values(state, "state")
        missing = [k for k in STATE_KEYS if k not in state]
        if state and missing:  # GradScaler.load_state_dict needs every one (a KeyError at the next step)
            raise InputError(f"load_state_dict: the state lacks {missing}; give this scaler's own state_dict()")
        enabled = self._scaler.is_enabled() if self._scaler is not None else self.precision == "fp16"
        if not state and enabled:
            raise InputError(
                "load_state_dict: an empty state is a disabled GradScaler's (fp32 or bf16), but this scaler runs "
                "fp16; give the state_dict() of an fp16 run"
            )
        if state and self._scaler is not None and not self._scaler.is_enabled():
            raise InputError(
                "load_state_dict: the state is an fp16 (enabled) GradScaler's, but this scaler is disabled "
                "(fp32 or bf16), where it would be dropped: make it with precision='fp16'"
            )
        if self._scaler is None:
            self._pending_state = dict(state)
        else:
            self._scaler.load_state_dict(state)

    # --- the general route ------------------------------------------------------------------------

    def __call__(
        self,
        loss: torch.Tensor,
        optimizer: torch.optim.Optimizer | None,
        model: nn.Module | None = None,
        clip_grad: float | None = None,
        update_grad: bool = True,
        aggregate: Aggregate = "mean",
        params: Sequence[str] | None = None,
        create_graph: bool = False,
        out: torch.Tensor | None = None,
        class_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rows ``[C, D]`` (float32, unscaled, or ``out``) of the per-class loss vector ``loss``;
        with ``update_grad`` also the optimizer step on their aggregate (without it, and with
        ``model``, ``optimizer`` may be None).

        Columns: ``params`` (name patterns of ``model``'s parameters) or every trainable
        parameter of ``model`` in ``named_parameters()`` order, or, without ``model``, the
        optimizer's parameters in its groups' order. ``aggregate``: ``"mean"`` over the loss's
        entries, ``"sum"``, weights ``[C]``, or ``fn(rows, class_ids) -> [D]``. ``class_ids``:
        what ``fn`` and weights see as each row's class (default ``0..C-1``).
        """
        if create_graph:
            raise InputError(CREATE_GRAPH_REFUSAL)
        _check_aggregate(aggregate)
        _check_clip(clip_grad)
        loss = check_loss_vector(loss)
        if class_ids is not None and (not isinstance(class_ids, torch.Tensor) or class_ids.shape != (loss.numel(),)):
            got = list(class_ids.shape) if isinstance(class_ids, torch.Tensor) else type(class_ids).__name__
            raise InputError(f"class_ids must be a tensor of one id per entry of loss ([{loss.numel()}]), got {got}")
        layout, tensors = _columns(model, params, optimizer)
        _check_optimizer(optimizer, tensors, layout, update_grad)
        device = tensors[0].device
        precision = ambient_precision(device)
        if self._scaler is None and self.precision is None and precision == "fp32" and fp16_graph(loss):
            # The README's loop: the forward under an fp16 autocast, this call after it. Unscaled, its
            # small gradients would underflow in fp16: the scaler is made enabled, as for fp16.
            log.info("training: the loss's graph holds fp16 tensors: loss scaling on (precision fp16)")
            precision = "fp16"
        scaler = self._scaler_for(device, precision)
        n = loss.numel()
        rows = _rows_buffer(out, n, layout.dim, device)
        scale = float(scaler.get_scale()) if scaler.is_enabled() else 1.0
        try:
            self._rows.rows(loss, tensors, layout, rows, scale)
        except RuntimeError as exc:
            if is_freed_graph(exc):
                raise InputError("loss: its graph was already freed (a backward ran on it before this call)") from None
            raise
        ids = torch.arange(n) if class_ids is None else class_ids
        self._finish(rows, ids, optimizer, tensors, aggregate, clip_grad, update_grad, None, scaler)
        return rows

    # --- the batch route --------------------------------------------------------------------------

    def step_batch(
        self,
        model: nn.Module,
        inputs: Any,
        labels: torch.Tensor,
        optimizer: torch.optim.Optimizer | None,
        *,
        num_classes: int | None = None,
        clip_grad: float | None = None,
        update_grad: bool = True,
        aggregate: Aggregate = "mean",
        params: Sequence[str] | None = None,
        route: str = "auto",
        output: str | int | None = None,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows, class_ids)``: rows of the mean cross-entropy of each class present in the batch
        (``class_ids``, ascending, int64), then, with ``update_grad``, the step on their aggregate
        (``"mean"`` over the classes present, ``"sum"``, weights ``[num_classes]`` indexed by class,
        or ``fn(rows, class_ids)``); without it ``optimizer`` may be None.

        Runs in the model's current mode and under the caller's autocast. ``route``: ``"fast"``
        (the partitioned engine's hook path: about one forward+backward; needs a model that treats
        samples independently in its current mode, train-mode dropout aside: each sample is
        forwarded once, its masks drawn from the caller's RNG as the run reaches it),
        ``"general"`` (one forward of the batch as
        given, then VJPs in blocks: dropout masks from the caller's RNG, train-mode BatchNorm with
        the batch's statistics, running statistics updated once) or ``"auto"`` (fast when it
        applies). ``inputs``: a tensor, or a dict of tensors passed as keyword arguments (a
        tokenizer's output); ``output`` picks the logits of a ``ModelOutput``/dict/tuple.
        ``out``: a float32 buffer of at least ``[classes present, D]`` rows (one of the batch's
        size takes every step's), whose first rows are returned: a loop reusing it holds one set
        of rows, not two.
        """
        if route not in ("auto", "fast", "general"):
            raise InputError(f"route {route!r} is unknown (choices: auto, fast, general)")
        if not isinstance(model, nn.Module):
            raise InputError(f"model must be an nn.Module, got {type(model).__name__}")
        _check_aggregate(aggregate)
        _check_clip(clip_grad)
        classes = _num_classes(self.num_classes if num_classes is None else num_classes, model)
        labels = check_labels(labels, classes, batch_size_of(inputs))
        layout, tensors = parameters_of(model, params)
        _check_optimizer(optimizer, tensors, layout, update_grad)
        device = tensors[0].device
        precision = ambient_precision(device)
        scaler = self._scaler_for(device, precision)
        scale = float(scaler.get_scale()) if scaler.is_enabled() else 1.0
        # Train-mode dropout alone couples nothing (it draws masks): the fast route draws them.
        independent = samples_independent(model) or draws_only(model)
        if route == "fast" and not independent:
            raise InputError(
                "route='fast' needs a model that treats samples independently in its current mode "
                "(BatchNorm in train mode couples them): use route='general' or 'auto'"
            )
        if route != "general" and independent and not (route == "auto" and draws_refused(model)):
            signature = input_signature(inputs)
            if signature not in self._forward_checked:  # once per input shape: a forward of two samples
                check_forward(model, inputs, num_classes=classes, output=output)
                self._forward_checked.add(signature)
            k = int(torch.unique(labels).numel())
            buf = None if out is None else _rows_buffer(out, k, layout.dim, device)
            try:
                rows, class_ids, found = fast_rows(
                    model,
                    inputs,
                    labels,
                    num_classes=classes,
                    layout=layout,
                    precision=precision,
                    scale=scale,
                    output=output,
                    out=buf,
                )
            except OneForwardRefused:  # dropout whose hook path failed (said once): nothing touched yet
                if route == "fast":
                    raise
            else:
                weights = _class_weights(aggregate, class_ids)
                self._finish(rows, class_ids, optimizer, tensors, weights, clip_grad, update_grad, found, scaler)
                return rows, class_ids
        loss, class_ids = batch_loss_vector(model, inputs, labels, num_classes=classes, output=output)
        weights = _class_weights(aggregate, class_ids)
        rows = self(
            loss,
            optimizer,
            model=model,
            clip_grad=clip_grad,
            update_grad=update_grad,
            aggregate=weights,
            params=params,
            out=out,
            class_ids=class_ids,
        )
        return rows, class_ids

    # --- the step ---------------------------------------------------------------------------------

    def _finish(
        self,
        rows: torch.Tensor,
        class_ids: torch.Tensor,
        optimizer: torch.optim.Optimizer | None,
        params: Sequence[torch.Tensor],
        aggregate: Aggregate,
        clip_grad: float | None,
        update_grad: bool,
        found: bool | None,
        scaler: torch.amp.GradScaler,
    ) -> None:
        """The step on the rows' ``aggregate``. ``found``: True (the rows overflowed: skip), None
        (finite rows whose sum is unknown: read it) or False (their sum is finite for sure)."""
        self.found_inf = bool(found)
        if not update_grad or optimizer is None:  # None only without update_grad (_check_optimizer)
            return
        # ``found`` None: one read of the rows' sum, non-finite wherever a row is (inf + x = inf,
        # inf - inf = NaN), so it is both the check and, for "mean" and "sum", the aggregate; and
        # with it in .grad the scaler finds what is in the rows even when a weighting or a surgery
        # function would have hidden it. False (the fast route bounded every entry): no read.
        named = aggregate if isinstance(aggregate, str) else None
        if found is False and named is None:
            agg = _aggregate(rows, class_ids, aggregate)
        else:
            total = rows.sum(0)
            if found is None:
                found = self.found_inf = not bool(torch.isfinite(total).all())
            if found or named == "sum":
                agg = total
            elif named == "mean":
                agg = total.div_(rows.shape[0])
            else:
                agg = _aggregate(rows, class_ids, aggregate)
        layout = ParamLayout(_slots(params))
        enabled = scaler.is_enabled()
        scale = float(scaler.get_scale()) if enabled else 1.0
        for p, g in zip(params, layout.unflatten(agg).values()):
            # At the scaler's scale, as a scaled backward leaves it: GradScaler unscales it below.
            g = (g * scale if enabled else g.clone()).to(p.dtype)
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)
        if not enabled:
            if found:
                log.warning("training: a non-finite gradient row: optimizer step skipped")
                return
            if named is None and not bool(torch.isfinite(agg).all()):
                # Finite rows, but weights or a function that gave NaN or inf: no step on it (one
                # read, only for aggregates other than "mean" and "sum"; a GradScaler finds it itself).
                self.found_inf = True
                log.warning(
                    "training: the aggregate of finite rows is not finite (the aggregate's weights or "
                    "function gave NaN or inf): optimizer step skipped"
                )
                return
            if clip_grad is not None:
                torch.nn.utils.clip_grad_norm_(params, clip_grad)
            optimizer.step()
            return
        if clip_grad is not None:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, clip_grad)
        scaler.step(optimizer)
        scaler.update()


# --- helpers ----------------------------------------------------------------------------------------

# What a GradScaler's state_dict holds (an enabled one's; a disabled one's is empty), and the
# options PerClassGradScaler passes to the GradScaler it makes: each value's check.
STATE_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
FLOAT32_MAX = float(torch.finfo(torch.float32).max)
OPTION_KEYS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")
_VALUE_CHECKS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    # GradScaler keeps its scale in float32: beyond its range the first scaled loss is inf.
    "scale": ("a number > 0 within float32's range", lambda v: _finite(v) and 0 < v <= FLOAT32_MAX),
    "init_scale": ("a number > 0 within float32's range", lambda v: _finite(v) and 0 < v <= FLOAT32_MAX),
    "growth_factor": ("a finite number > 1", lambda v: _finite(v) and v > 1),
    "backoff_factor": ("a number in (0, 1)", lambda v: _finite(v) and 0 < v < 1),
    "growth_interval": ("an integer >= 1", lambda v: _integer(v) and v >= 1),
    "_growth_tracker": ("an integer >= 0", lambda v: _integer(v) and v >= 0),
}


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_scaler_values(values: dict[str, Any], what: str) -> None:
    """``GradScaler`` options (``what="option"``) or state entries: known names, sane values."""
    for name, value in values.items():
        if what == "option" and name not in OPTION_KEYS:
            raise InputError(f"PerClassGradScaler: unknown option {name!r} (GradScaler's: {', '.join(OPTION_KEYS)})")
        rule = _VALUE_CHECKS.get(name)
        if rule is not None and not rule[1](value):
            where = "PerClassGradScaler" if what == "option" else "load_state_dict"
            raise InputError(f"{where}: {name} must be {rule[0]}, got {value!r}")


def _check_clip(clip_grad: float | None) -> None:
    if clip_grad is not None and not (_finite(clip_grad) and clip_grad > 0):
        raise InputError(f"clip_grad must be a finite number > 0 (a maximum gradient norm), got {clip_grad!r}")


def _slots(params: Sequence[torch.Tensor]) -> list[ParamSlot]:
    slots, offset = [], 0
    for i, p in enumerate(params):
        slots.append(ParamSlot(f"param{i}", tuple(p.shape), offset, p.numel()))
        offset += p.numel()
    return slots


def _columns(
    model: nn.Module | None, params: Sequence[str] | None, optimizer: torch.optim.Optimizer | None
) -> tuple[ParamLayout, list[torch.Tensor]]:
    """The rows' parameters and their layout: of ``model`` (all trainable, or ``params``
    patterns), or, without a model, the optimizer's trainable parameters."""
    if model is not None:
        if not isinstance(model, nn.Module):
            raise InputError(f"model must be an nn.Module, got {type(model).__name__}")
        layout, chosen = parameters_of(model, params)
        return layout, list(chosen)
    if params:
        raise InputError("params (name patterns) need model=")
    tensors = _unique(p for g in _groups(optimizer) for p in g["params"] if p.requires_grad)
    if not tensors:
        raise InputError("optimizer holds no parameter that requires grad: no rows to compute")
    return ParamLayout(_slots(tensors)), tensors


def _groups(optimizer: Any) -> list[dict]:
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(optimizer, torch.optim.Optimizer) or groups is None:
        raise InputError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    return groups


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _check_optimizer(
    optimizer: torch.optim.Optimizer | None, tensors: Sequence[torch.Tensor], layout: ParamLayout, update_grad: bool
) -> None:
    if not update_grad:  # rows alone: the optimizer is never read, and may be None
        return
    held = {id(p) for g in _groups(optimizer) for p in g["params"]}
    missing = [s.name for s, p in zip(layout.slots, tensors) if id(p) not in held]
    if missing:
        raise InputError(
            f"optimizer: does not hold {len(missing)} of the rows' {len(tensors)} parameters "
            f"(e.g. {missing[0]!r}): build it over the same parameters, or pass update_grad=False"
        )


def _num_classes(given: int | None, model: nn.Module) -> int:
    if given is None:
        given = getattr(getattr(model, "config", None), "num_labels", None)
    if not isinstance(given, int) or isinstance(given, bool) or given <= 0:
        raise InputError(
            f"num_classes must be a positive int (give num_classes= to step_batch or the scaler), got {given!r}"
        )
    return given


def _rows_buffer(out: torch.Tensor | None, n: int, dim: int, device: torch.device) -> torch.Tensor:
    """``out[:n]`` (its first ``n`` rows: a buffer of the batch's size takes any step's classes,
    whose count varies), or a new ``[n, dim]``."""
    if out is None:
        return torch.empty(n, dim, device=device)
    if not isinstance(out, torch.Tensor) or out.ndim != 2 or out.shape[0] < n or out.shape[1] != dim:
        shown = f"{list(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise InputError(f"out must be a float32 tensor of at least [{n}, {dim}], got {shown}")
    if out.dtype != torch.float32 or not out.is_contiguous():
        raise InputError(f"out must be a contiguous float32 tensor, got {out.dtype}")
    if out.device != device:
        raise InputError(f"out is on {out.device}, the rows' parameters on {device}")
    return out if out.shape[0] == n else out[:n]


def _class_weights(aggregate: Aggregate, class_ids: torch.Tensor) -> Aggregate:
    """For the batch route: weights given per class (``[num_classes]``) picked for the classes present."""
    if isinstance(aggregate, str) or callable(aggregate):
        return aggregate
    weights = torch.as_tensor(aggregate)
    if weights.ndim != 1 or int(class_ids.max()) >= len(weights):
        raise InputError(f"aggregate weights must be [num_classes], got shape {list(weights.shape)}")
    return weights[class_ids.to(weights.device)]


def _check_aggregate(aggregate: Aggregate) -> None:
    if isinstance(aggregate, str) and aggregate not in ("mean", "sum"):
        raise InputError(
            f"aggregate {aggregate!r} is unknown (choices: mean, sum, weights [C], or fn(rows, class_ids))"
        )


def _aggregate(rows: torch.Tensor, class_ids: torch.Tensor, aggregate: Aggregate) -> torch.Tensor:
    """The ``[D]`` gradient the optimizer steps on."""
    if isinstance(aggregate, str):
        if aggregate == "mean":
            return rows.mean(0)
        if aggregate == "sum":
            return rows.sum(0)
        raise InputError(
            f"aggregate {aggregate!r} is unknown (choices: mean, sum, weights [C], or fn(rows, class_ids))"
        )
    if callable(aggregate) and not isinstance(aggregate, torch.Tensor):
        agg = aggregate(rows, class_ids)
        if not isinstance(agg, torch.Tensor) or tuple(agg.shape) != (rows.shape[1],):
            shown = list(agg.shape) if isinstance(agg, torch.Tensor) else type(agg).__name__
            raise InputError(f"aggregate function must return a [D={rows.shape[1]}] tensor, got {shown}")
        return agg.to(rows.dtype)
    weights = torch.as_tensor(aggregate, dtype=rows.dtype, device=rows.device)
    if tuple(weights.shape) != (rows.shape[0],):
        raise InputError(f"aggregate weights must be [{rows.shape[0]}] (one per row), got {list(weights.shape)}")
    return weights @ rows
