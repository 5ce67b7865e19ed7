"""Counts, on a CPU, the reads a host would make from an accelerator.

Holds ``HostReads``: a ``TorchDispatchMode`` that tells device data from host data by where it
came from, and counts each op that makes the host wait for device data (on a GPU: for the whole
queue of launched work to drain).

- Device data: the model's parameters and buffers, what the functions named by ``on_device``
  return (the loaded batch, tensors moved by the engine's ``to_device``), and every op's output
  with a device tensor among its inputs (an in-place op marks the tensor it writes: a row buffer
  becomes device data at its first write). Everything else is host data (labels, the host-made
  plan of a micro-batch): reading it costs nothing anywhere.
- A read: an op whose result the host must see (``.item()``, ``bool(t)``, ``int(t)``,
  ``nonzero``, ``unique``, ``bincount``, ``repeat_interleave`` without ``output_size``,
  ``masked_select``, an index by a bool mask, ``equal``) or ``Tensor.tolist``/``Tensor.numpy``
  (which never reach the dispatcher) of device data; and each call of a function named by
  ``read_point`` (the engine's sanctioned copy back, counted once, whatever it reads).
- ``within(owner, name)``: reads made inside that function are counted apart (the model's own
  forward: the floor makes them too).

A CPU cannot tell a copy to the host from no copy (``.cpu()`` of a CPU tensor is itself), so a
copy of device data made with ``.cpu()`` outside a ``read_point`` is not seen; a tensor made from
host data straight on the device and read back is not seen either (host data). Both are left to
review; the engine makes its one read through ``read_point``.
"""

from __future__ import annotations

import contextlib
import traceback
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten

# Ops whose every call makes the host wait for their device input.
_ALWAYS = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.bincount.default,
    aten.masked_select.default,
    aten._unique.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.equal.default,
    aten.is_nonzero.default,
}
_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


def _is_read(func: Any, args: tuple, kwargs: dict) -> bool:
    if func in _ALWAYS:
        return True
    if func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor):
        return kwargs.get("output_size") is None  # its length is the repeats' sum
    if func in _INDEXED:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)
    return False


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class HostReads(TorchDispatchMode):
    """``reads = HostReads(model)``, ``reads.on_device(...).read_point(...)...``, ``with reads:``;
    then ``reads.count`` (the engine's reads), ``reads.apart`` (those inside ``within``),
    ``reads.ops`` (ATen ops) and ``reads.where`` (the source line of each read, for a failing
    test's message)."""

    def __init__(self, model: nn.Module | None = None) -> None:
        super().__init__()
        self.count = 0
        self.apart = 0
        self.ops = 0
        self.calls = 0  # calls of the ``calls_of`` function (the engine's plan of a run: a run each)
        self.ops_in_scope = 0  # ATen ops inside the ``scope`` function (a run's own work)
        self._scope = 0
        self.where: Counter[str] = Counter()
        self._device: dict[int, weakref.ref] = {}  # id -> the device tensor (a tensor's == is elementwise)
        self._quiet = 0  # inside a read point: nothing more counted
        self._apart = 0  # inside a ``within`` function: counted apart
        self._patches = contextlib.ExitStack()
        if model is not None:
            self.mark(*model.parameters(), *model.buffers())

    def mark(self, *tensors: Any) -> None:
        for t in _tensors(tensors):
            while t is not None:  # a view written in place makes its base device data too
                self._device[id(t)] = weakref.ref(t)
                t = t._base

    def _on(self, t: Any) -> bool:
        ref = self._device.get(id(t))
        return ref is not None and ref() is t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._quiet:
            return out
        self.ops += 1
        self.ops_in_scope += bool(self._scope)
        if any(self._on(t) for t in _tensors((args, kwargs))):
            if _is_read(func, args, kwargs):
                self._note(str(func))
            self.mark(out)
        return out

    def _note(self, what: str) -> None:
        if self._apart:
            self.apart += 1
            return
        self.count += 1
        frames = [f for f in traceback.extract_stack()[:-3] if "/workers/" in f.filename or "classgrad" in f.filename]
        site = f"{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}" if frames else "?"
        self.where[f"{site} {what}"] += 1

    def __enter__(self) -> HostReads:
        self._patches.__enter__()
        self._patch_python_reads()
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._patches.__exit__(*exc)

    def _patch_python_reads(self) -> None:
        for name in ("tolist", "numpy"):
            original = getattr(torch.Tensor, name)

            def read(t: torch.Tensor, *args: Any, _name: str = name, _fn: Callable = original, **kwargs: Any) -> Any:
                if not self._quiet and self._on(t):
                    self._note(f"Tensor.{_name}")
                return _fn(t, *args, **kwargs)

            self._patch(torch.Tensor, name, read)

    def _patch(self, owner: Any, name: str, fn: Callable) -> Callable:
        """``owner.name = fn`` until the mode exits (an instance's own attribute removed again)."""
        original = getattr(owner, name)
        own = name in vars(owner)
        setattr(owner, name, fn)
        self._patches.callback(setattr, owner, name, original) if own else self._patches.callback(delattr, owner, name)
        return original

    def _wrap(self, owner: Any, name: str, around: Callable[[], Any], *, marks_output: bool = False) -> HostReads:
        """``owner.name`` run inside ``around()`` (a context manager) until the mode exits; its
        output marked as device data with ``marks_output``."""
        original = getattr(owner, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with around():
                out = original(*args, **kwargs)
            if marks_output:
                self.mark(out)
            return out

        self._patch(owner, name, wrapped)
        return self

    @contextlib.contextmanager
    def _deeper(self, depth: str) -> Iterator[None]:
        """One level deeper in the counter ``depth`` (``_quiet``, ``_scope``, ``_apart``) for the block."""
        setattr(self, depth, getattr(self, depth) + 1)
        try:
            yield
        finally:
            setattr(self, depth, getattr(self, depth) - 1)

    def on_device(self, owner: Any, name: str) -> HostReads:
        """``owner.name`` returns device data (call before entering)."""
        return self._wrap(owner, name, contextlib.nullcontext, marks_output=True)

    def read_point(self, owner: Any, name: str) -> HostReads:
        """Each call of ``owner.name`` is one read (of device data), whatever it does inside."""

        def one_read() -> Any:
            if not self._quiet:
                self._note(f"{name}()")
            return self._deeper("_quiet")

        return self._wrap(owner, name, one_read)

    def calls_of(self, owner: Any, name: str) -> HostReads:
        """Count the calls of ``owner.name`` (``calls``)."""

        def counted() -> Any:
            self.calls += 1
            return contextlib.nullcontext()

        return self._wrap(owner, name, counted)

    def scope(self, owner: Any, name: str) -> HostReads:
        """Count the ATen ops made inside ``owner.name`` apart (``ops_in_scope``)."""
        return self._wrap(owner, name, lambda: self._deeper("_scope"))

    def within(self, owner: Any, name: str) -> HostReads:
        """Reads inside ``owner.name`` are counted apart (``apart``), not in ``count``."""
        return self._wrap(owner, name, lambda: self._deeper("_apart"))
