"""The gradient engine interface shared by every engine, and what they all need.

Holds:
- ``RowBlock``: a block of finished rows with their class ids, losses, counts and fp16 loss
  scales: what every engine yields and what the row writer consumes.
- ``EngineStats``: counters (forward passes, backward/VJP calls, recomputed rows) that tests
  and reports read.
- ``GradientEngine``: the one constructor signature and the one method, ``iter_blocks``, plus
  the helpers every engine shares: the forward pass under autocast with buffers left untouched
  and a seeded RNG per micro-batch, parameter selection, and loss checks.
- ``samples_independent``: whether a model in its current mode treats samples independently;
  ``draws_only``: whether only its dropout layers' random draws keep it from it.
- ``choice_clock``: the clock engines time their own choices (the dense engine's block size) with.
- ``NormInFloat32``: batch norm on half inputs computed in float32, so vmap can batch it.
- ``parameters_kept``: a model's own parameters back in place after ``functional_call``.
- ``on_device``: the model moved to the engine's device, or one line saying why it cannot be.
- ``reaches_any``: whether an autograd graph uses given tensors (a walk, no computation).

Engines never keep a graph beyond the rows they are computing, and never hold more than one
group of rows, so memory does not grow with the number of classes. (The dense engine's basis for
rows through the head, F x D floats, is kept across calls: it does not grow with C either.)
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from classgrad.errors import InputError, NonFiniteError, first_line
from classgrad.workers.amp import PrecisionPolicy
from classgrad.workers.layout import ParamLayout
from classgrad.workers.losses import LossKind
from classgrad.workers.model_io import ModelIO
from classgrad.workers.probe import MicroBatch, ProbeSet

# Layers whose train-mode output for one sample depends on the other samples in the batch, or
# on random draws: with any of them in train mode, a class's row is not the gradient of its own
# samples alone, so the partitioned shortcut does not apply.
BATCH_COUPLED_TYPES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._BatchNorm,
    nn.modules.dropout._DropoutNd,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)

DROPOUT_TYPES: tuple[type[nn.Module], ...] = (nn.modules.dropout._DropoutNd,)  # AlphaDropout's too

# Each micro-batch's forward draws its random numbers (dropout in train mode) from this seed
# plus its index, so every engine sees the same masks and reruns give the same rows.
FORWARD_SEED = 0x5EED


def choice_clock(device: torch.device) -> Callable[[], float]:
    """The clock engines time their own alternatives with (the dense engine's block size; never
    a choice that changes a row's rounding).

    On a CPU with one intra-op thread (how each Ray actor runs), the CPU time of this thread:
    other processes taking the cores do not distort it, so a busy machine does not make the
    engine pick a slow option. Otherwise (several threads, or a GPU) wall time; GPU callers
    synchronise before reading it.
    """
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


def samples_independent(model: nn.Module) -> bool:
    """True when each sample's output depends only on that sample (and no randomness).

    A module can declare itself with an attribute ``samples_independent = True/False``.
    """
    declared = getattr(model, "samples_independent", None)
    if declared is not None:
        return bool(declared)
    return not any(couples_samples(m) for m in model.modules())


def draws_only(model: nn.Module) -> bool:
    """True when every module that couples samples (``couples_samples``) is a dropout layer: each
    sample's output then depends on that sample and its own random draws only, so a run that
    forwards every sample once, drawing from the caller's generator, gives each class the exact
    gradient of its samples under those draws (``PartitionedEngine(draws_from_caller=True)``)."""
    if getattr(model, "samples_independent", None) is not None:
        return False  # a model that declares itself is taken at its word
    coupled = [m for m in model.modules() if couples_samples(m)]
    return bool(coupled) and all(isinstance(m, DROPOUT_TYPES) for m in coupled)


def couples_samples(module: nn.Module) -> bool:
    """Whether this one module, in its current mode, mixes samples or draws random numbers."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not module.track_running_stats:
        return True  # no running statistics: batch statistics even in eval mode
    if not module.training or not isinstance(module, BATCH_COUPLED_TYPES):
        return False
    # Dropout with p=0 (common in transformer layers) draws nothing and changes nothing.
    return not (isinstance(module, nn.modules.dropout._DropoutNd) and module.p == 0)


@dataclass
class RowBlock:
    """Finished rows for ``classes`` (in the order asked for)."""

    classes: torch.Tensor  # int64 [b], CPU
    rows: torch.Tensor  # [b, D] true gradient values, on the engine's device
    loss: torch.Tensor  # [b] L_c, CPU
    count: torch.Tensor  # int64 [b] probe samples contributing to L_c, CPU
    loss_scale: torch.Tensor  # float32 [b] fp16 loss scale each row was computed with (1.0 otherwise), CPU
    recomputed: torch.Tensor  # bool [b] rows that overflowed and were recomputed, CPU

    def __len__(self) -> int:
        return len(self.classes)

    @staticmethod
    def concat(blocks: Sequence[RowBlock], rows: torch.Tensor | None = None) -> RowBlock:
        """The blocks as one; ``rows``: their rows already side by side (a view of a caller's
        buffer), taken as they are instead of concatenated."""
        joined = {f: torch.cat([getattr(b, f) for b in blocks]) for f in RowBlock.__dataclass_fields__ if f != "rows"}
        return RowBlock(rows=torch.cat([b.rows for b in blocks]) if rows is None else rows, **joined)


@dataclass
class StepGrads:
    """A training step served by the backward of its rows (the partitioned engine's hook path):
    its objective ``sum_c weights[c] * L_c`` over the run's classes (host ``weights``, by class
    id: a batch's mean loss is ``n_c / N``; the rows stay each class's own), and its gradient
    ``[D]`` over the engine's whole layout, which each run's rules form from the same captures
    and add up over the runs (``grads``: None until a run of the hook path gave its part)."""

    weights: dict[int, float]
    grads: torch.Tensor | None = None


@dataclass
class EngineStats:
    """Work counters, for tests and reports."""

    forwards: int = 0  # forward passes over a micro-batch (or part of one)
    backwards: int = 0  # calls into autograd (one batched VJP counts once)
    rows: int = 0
    recomputed_rows: int = 0
    # rows whose run bounded every entry below ``rule_io.FINITE_BOUND`` (the hook path's evidence):
    # a sum of them is finite without a read (``PerClassGradScaler.step_batch``)
    bounded_rows: int = 0
    notes: list[str] = field(default_factory=list)


@contextlib.contextmanager
def without_draws(model: nn.Module) -> Iterator[None]:
    """The model in eval mode for the block, each module's mode back as it was after: the spot
    check of a training batch's hook path, which forwards its classes twice. The whole model, not
    its dropout layers alone: a layer may draw by its own mode (an attention's functional
    dropout). For a model whose only coupling is dropout (``draws_only``) eval mode changes
    nothing else: its BatchNorm layers, if any, already run on their running statistics."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


@contextlib.contextmanager
def rnns_ready_for_backward(model: nn.Module) -> Iterator[None]:
    """The model's recurrent modules in eval mode, run so that a backward through them works on
    a GPU, with the values of eval mode. cuDNN's RNN kernels keep what their backward needs only
    in train mode ("cudnn RNN backward can only be called in training mode"): an RNN whose
    dropout does nothing (0, or one layer) runs in train mode, which then computes the same; one
    with a dropout that eval mode turns off runs with cuDNN off (the native kernels). On a CPU
    the same, where it changes nothing."""
    idle = [m for m in model.modules() if isinstance(m, nn.RNNBase) and not m.training]
    flipped = [m for m in idle if m.dropout == 0 or m.num_layers == 1]
    cudnn = torch.backends.cudnn
    enabled = cudnn.enabled  # the switch alone: cudnn.flags() would read the TF32 settings too
    for m in flipped:
        m.training = True
    if len(flipped) < len(idle):
        cudnn.enabled = False
    try:
        yield
    finally:
        cudnn.enabled = enabled
        for m in flipped:
            m.training = False


def seed_forward(device: torch.device, seed: int) -> None:
    """Seed the generators a forward on ``device`` draws from (the CPU's and, on CUDA, that
    device's), the ones ``fork_rng`` restores. Not ``torch.manual_seed``: on a machine whose CUDA,
    XPU and MTIA are not initialised it queues a seed for each with the caller's formatted stack
    (0.06 ms a call from a shallow stack, 0.28 ms from 40 frames deep: a tenth of a 3 ms training
    step), and it moves the other devices' generators, which ``fork_rng`` does not give back."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)
    elif device.type != "cpu":  # another accelerator: its generator as torch.manual_seed seeds it
        torch.manual_seed(seed)


class GradientEngine(ABC):
    """Computes rows of the per-class gradient matrix for any list of class ids."""

    name: ClassVar[str] = ""
    # A training step whose gradient a run's backward also computes (only the partitioned
    # engine's hook path serves one; ``classgrad.workers.training``'s logged step sets it).
    step: StepGrads | None = None
    # A training batch's forward draws dropout masks from the caller's generator, as the plain
    # step would; False: each micro-batch's draws are seeded (reruns give the same rows).
    draws_from_caller: bool = False

    def __init__(
        self,
        model: nn.Module,
        probe: ProbeSet,
        loss: LossKind,
        layout: ParamLayout,
        *,
        precision: PrecisionPolicy = PrecisionPolicy(),  # noqa: B008 - a frozen value object
        device: torch.device | str = "cpu",
        block_rows: int | None = None,
        group_rows: int = 256,
        output: str | int | None = None,
    ):
        self.device = torch.device(device)
        self.model = on_device(model, self.device)
        # Every call of the model goes through this: dict batches as keyword arguments, the logits
        # taken out of a ModelOutput, dict or tuple (``output`` chooses another entry).
        self.io = ModelIO(self.model, output, self.device)
        self.probe = probe
        self.loss = loss
        self.layout = layout
        self.precision = precision
        self.block_rows = block_rows
        if block_rows is not None and block_rows <= 0:
            raise InputError(f"engine.block_rows must be > 0, got {block_rows}")
        if group_rows <= 0:
            raise InputError(f"engine.group_rows must be > 0, got {group_rows}")
        self.group_rows = group_rows
        self.stats = EngineStats()
        loss.validate_targets(probe.targets)
        self.norm = loss.norm(probe.targets).to(self.device)
        self.counts = self.norm.counts.cpu()
        self.params = layout.parameters(self.model)
        # Inputs follow the model's floating dtype (a float64 model gets float64 inputs).
        self.compute_dtype = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float32)
        # Rows and losses are kept in at least float32 (half-precision models included).
        self.row_dtype = torch.promote_types(self.compute_dtype, torch.float32)

    @abstractmethod
    def iter_blocks(self, classes: Sequence[int]) -> Iterator[RowBlock]:
        """Yield rows for ``classes`` in that order, a block at a time."""

    def compute(self, classes: Sequence[int]) -> RowBlock:
        """All rows for ``classes`` at once (convenience for tests and small jobs)."""
        return RowBlock.concat(list(self.iter_blocks(classes)))

    # --- helpers shared by the engines ------------------------------------------------------

    def _check_classes(self, classes: Sequence[int]) -> torch.Tensor:
        ids = torch.as_tensor(list(classes), dtype=torch.int64)
        bad = (ids < 0) | (ids >= self.loss.num_classes)
        if bool(bad.any()):
            raise InputError(f"class id {int(ids[bad][0])} outside [0, {self.loss.num_classes})")
        return ids

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        """Around a computation of rows: only the selected parameters require grad
        (``selected_grads``), and float32 is float32 (``PrecisionPolicy.float32_arithmetic``)."""
        with self.selected_grads(), self.precision.float32_arithmetic(self.device):
            yield

    def computed(self, blocks: Iterator[RowBlock]) -> Iterator[RowBlock]:
        """``blocks`` (an engine's row generator) stepped inside ``computing``, which is left at
        each yield: the caller's code between two blocks runs with its own settings (its
        ``requires_grad`` flags, its TF32), also when it raises or stops early."""
        try:
            while True:
                with self.computing():
                    try:
                        block = next(blocks)
                    except StopIteration:
                        return
                yield block
        finally:
            close = getattr(blocks, "close", None)
            if close is not None:  # an abandoned generator's own clean-up runs now, not at collection
                with self.computing():
                    close()

    @contextlib.contextmanager
    def selected_grads(self) -> Iterator[None]:
        """Only the selected parameters require grad while rows are computed.

        Autograd then skips weight gradients of every other parameter, and a selected frozen
        parameter (chosen by an explicit include pattern) still gets its gradient.
        """
        selected = {id(p) for p in self.params}
        saved = [(p, p.requires_grad) for p in self.model.parameters()]
        try:
            for p, _ in saved:
                p.requires_grad_(id(p) in selected)
            yield
        finally:
            for p, flag in saved:
                p.requires_grad_(flag)

    @contextlib.contextmanager
    def forward_context(self, micro_batch: int) -> Iterator[None]:
        """Autocast and RNNs ready for a backward (``rnns_ready_for_backward``); in train mode,
        buffers restored afterwards and a seeded RNG per micro-batch (the caller's generator with
        ``draws_from_caller``)."""
        if not self.model.training:
            with self.precision.autocast(self.device), rnns_ready_for_backward(self.model):
                yield
            return
        # Computing gradients must not move BatchNorm running statistics: the forward updates
        # throw-away copies, and the originals go back untouched. (Copying the old values back
        # in place instead would bump versions of tensors the graph saved, breaking backward.)
        originals = [(m, name, b) for m in self.model.modules() for name, b in m._buffers.items() if b is not None]
        for m, name, b in originals:
            m._buffers[name] = b.clone()
        devices = [self.device] if self.device.type == "cuda" else []
        seeded = not self.draws_from_caller
        try:
            with torch.random.fork_rng(devices=devices) if seeded else contextlib.nullcontext():
                if seeded:
                    seed_forward(self.device, FORWARD_SEED + micro_batch)
                with self.precision.autocast(self.device), rnns_ready_for_backward(self.model):
                    yield
        finally:
            for m, name, b in originals:
                m._buffers[name] = b

    def forward(self, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Model outputs of a micro-batch and its contribution to L (``[C]``), with the graph."""
        x, y = self.probe.batch(mb.indices, self.device, self.compute_dtype)
        with self.forward_context(mb.index):
            outputs = self.io(x)
        self.stats.forwards += 1
        self.loss.check_outputs(outputs)
        contrib = self.loss.batch_losses(outputs, y, self.norm)
        return outputs, contrib

    def check_finite_loss(self, values: torch.Tensor, class_ids: torch.Tensor) -> None:
        bad = ~torch.isfinite(values)
        if bool(bad.any()):
            where = bad.nonzero().squeeze(1).cpu()
            raise NonFiniteError(
                f"non-finite loss for class(es) {class_ids[where][:10].tolist()} "
                f"(NaN/Inf in the inputs, or overflow in the {self.precision.dtype} forward)"
            )

    def grads_to_rows(self, grads: Sequence[torch.Tensor | None], batch_dims: int) -> torch.Tensor:
        return self.layout.flatten(grads, batch_dims=batch_dims)


def on_device(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` with its parameters and buffers moved to ``device``; one ``InputError`` line when
    some cannot be (tensors on the ``meta`` device hold no values)."""
    try:
        moved = model.to(device)
    except (NotImplementedError, RuntimeError) as exc:
        raise InputError(f"model: cannot be moved to engine.device {str(device)!r} ({first_line(exc)})") from None
    elsewhere = sorted({str(t.device) for t in (*moved.parameters(), *moved.buffers()) if t.device.type != device.type})
    if elsewhere:
        raise InputError(
            f"model: has tensors on {', '.join(elsewhere)} after moving it to engine.device {str(device)!r} "
            "(a model split over devices is not supported: build it on one device)"
        )
    return moved


def reaches_any(fn, leaf_ids: set[int]) -> bool:
    """Whether the autograd graph below ``fn`` accumulates into any tensor in ``leaf_ids``
    (a walk over the graph's nodes, no computation)."""
    stack, seen = [fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf tensor
        if leaf is not None and id(leaf) in leaf_ids:
            return True
        stack.extend(n for n, _ in node.next_functions)
    return False


@contextlib.contextmanager
def parameters_kept(model: nn.Module) -> Iterator[None]:
    """Every module holds its own parameter objects again when the block ends.

    ``torch.func.functional_call`` swaps parameters in and out; a module registered under two
    names gets the swap twice and is left holding functorch tensors (a PyTorch quirk), which
    corrupts the model for everything after. This puts the real parameters back regardless.
    """
    registered = [(m, name, p) for m in model.modules() for name, p in m._parameters.items()]
    try:
        yield
    finally:
        for m, name, p in registered:
            if m._parameters.get(name) is not p:
                m._parameters[name] = p


class NormInFloat32(TorchFunctionMode):
    """Runs batch norm on half-precision inputs in float32 and casts the result back.

    Under vmap, autocast hands batch norm a half input with float32 statistics, which the CPU
    kernel rejects; outside vmap the kernel computes in float32 internally anyway, so this
    gives the same numbers while letting vmap batch BatchNorm models in fp16/bf16.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is F.batch_norm or func is torch.batch_norm) and args[0].dtype in (torch.float16, torch.bfloat16):
            return func(args[0].float(), *args[1:], **kwargs).to(args[0].dtype)
        return func(*args, **kwargs)
