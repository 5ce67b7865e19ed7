"""The one place that calls the user's model: how a batch goes in, how the logits come out.

Holds:
- ``ModelIO``: a model with its way of being called. A batch that is a dict (a tokenizer's
  output, a Hugging Face dataset's row) is passed as keyword arguments, only the keys the
  model's ``forward`` names, and when it also takes ``**kwargs`` (as Hugging Face models do)
  every other key holding a tensor; other keys (raw text, ids) are dropped with one note per
  process. Anything else, and a dict none of whose keys ``forward`` names (a model that takes
  the dict itself), is passed as the one positional argument, as before. A model whose
  ``forward`` takes ``use_cache`` (Hugging Face decoders) is called with ``use_cache=False``
  unless the batch sets it. The output becomes the logits tensor: a tensor as it is; a
  ``ModelOutput``, dict or tuple gives ``.logits`` / ``["logits"]`` when present, else its first
  tensor; ``output`` (a key, or an index into a tuple) chooses another. ``functional`` does the
  same through ``torch.func.functional_call``.
- ``logits_of``: that choice of tensor, for any output.
- ``class_names_of``: the class names a model's config holds (``config.id2label``, a Hugging
  Face model's), unless they are the ``LABEL_i`` placeholders filled in by default.
- ``call_errors``: the model's own failures that are user input problems (tensors on another
  device than the engine's, a GPT-2-style model without a pad token given several samples),
  turned into one-line ``InputError``s; ``is_device_mismatch`` and ``is_missing_pad_token`` tell
  those two failures apart (by their text: PyTorch and transformers raise no type of their own).
- ``input_pad_values``: the pad values of ``data.collate: pad`` for this model: ``input_ids`` by
  default padded with the tokenizer's pad id (when one is given) or the model's
  ``config.pad_token_id``, and any other pad id of ``input_ids`` refused in one line (a
  GPT-2-style model takes each sample's last token that is not its pad id: pads of another id
  would be read as tokens, and the rows would be silently wrong).

The label key of a dict dataset never reaches the model: the probe set takes it out of the
inputs (Hugging Face models compute their own loss when given ``labels``).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from classgrad.errors import InputError, first_line

log = logging.getLogger(__name__)

__all__ = [
    "ModelIO",
    "call_errors",
    "class_names_of",
    "input_pad_values",
    "is_device_mismatch",
    "is_missing_pad_token",
    "logits_of",
    "pad_token_id_of",
]

# Fragments of PyTorch's messages for tensors of one operation on different devices.
_DEVICE_ERRORS = ("same device", "expected device", "meta tensor", "Expected object of device type")
# Hugging Face fills id2label with these when a config names no labels.
_PLACEHOLDER = re.compile(r"LABEL_\d+")

# (model class, dropped keys) already noted in this process: the note is said once, not per batch.
_NOTED: set[tuple[str, tuple[str, ...]]] = set()
# Hugging Face decoders' switch for their key/value cache, set off: rows need no cache, and a
# cache is state that a layer's units would change when they run the layer again (OPT's
# decoder layers gave other outputs on their second run, so every path but the loop failed).
NO_CACHE = "use_cache"


def _tensors(seq: Any) -> Iterator[tuple[Any, torch.Tensor]]:
    items = seq.items() if isinstance(seq, Mapping) else enumerate(seq)
    for key, value in items:
        if isinstance(value, torch.Tensor):
            yield key, value


def logits_of(out: Any, output: str | int | None = None) -> torch.Tensor:
    """The logits tensor of a model's output ``out`` (see the module docstring); ``InputError``
    when there is no tensor to take."""
    if isinstance(out, torch.Tensor):
        return out
    kind = type(out).__name__
    if output is not None:
        try:
            if isinstance(output, int) and isinstance(out, Mapping):
                picked = list(out.values())[output]
            elif isinstance(output, int):
                picked = out[output]
            elif isinstance(out, Mapping):
                picked = out[output]
            else:
                picked = getattr(out, output)
        except (KeyError, IndexError, TypeError, AttributeError):
            raise InputError(f"model.output {output!r}: the model's output ({kind}) has no such entry") from None
        if not isinstance(picked, torch.Tensor):
            raise InputError(
                f"model.output {output!r}: that entry of the model's output is {type(picked).__name__}, not a tensor"
            )
        return picked
    logits = out.get("logits") if isinstance(out, Mapping) else getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, (Mapping, tuple, list)):
        for _, t in _tensors(out):
            return t
    raise InputError(
        f"model output: a {kind} with no tensor to take as the logits "
        "(return a tensor, a ModelOutput/dict with 'logits', or a tuple whose first tensor is the logits; "
        "model.output names another entry)"
    )


def is_device_mismatch(exc: BaseException) -> bool:
    """Whether ``exc`` is PyTorch refusing an operation on tensors of different devices. PyTorch
    raises a plain ``RuntimeError`` (no subclass, no attribute naming the devices) for it, so its
    text is the only signal: the fragments in ``_DEVICE_ERRORS``."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(s in text for s in _DEVICE_ERRORS)


def is_missing_pad_token(exc: BaseException) -> bool:
    """Whether ``exc`` is a transformers sequence classifier (GPT-2-style, which reads each sample's
    last non-pad token) refusing several samples because ``config.pad_token_id`` is unset.
    transformers raises a plain ``ValueError`` for it, so its text is the only signal."""
    return isinstance(exc, ValueError) and "no padding token" in str(exc)


@contextlib.contextmanager
def call_errors(device: torch.device | str | None = None) -> Iterator[None]:
    """Turn the model's failures that are the user's inputs into one-line ``InputError``s."""
    try:
        yield
    except RuntimeError as exc:
        if is_device_mismatch(exc):
            where = f" than engine.device {str(device)!r}" if device is not None else ""
            raise InputError(
                f"model: its forward uses tensors on another device{where} ({first_line(exc)}): keep every "
                "tensor it uses as a parameter or buffer (model.to moves those), or build it on that device"
            ) from None
        raise
    except ValueError as exc:
        if is_missing_pad_token(exc):
            raise InputError(
                "model: config.pad_token_id is not set, so it cannot find the last token of each of several "
                "samples (a GPT-2-style model): set model.config.pad_token_id in the factory "
                "(for example to the tokenizer's eos id), or use data.batch_size=1"
            ) from None
        raise


class ModelIO:
    """Calls ``model`` on a batch the way it takes it, and gives back the logits."""

    def __init__(self, model: nn.Module, output: str | int | None = None, device: torch.device | str | None = None):
        self.model = model
        self.output = output
        self.device = device
        try:
            sig = inspect.signature(model.forward)
        except (TypeError, ValueError):  # a forward without a signature (a C extension): pass everything
            sig = None
        params = [] if sig is None else list(sig.parameters.values())
        self.takes_any = sig is None or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
        self.names = frozenset(
            p.name
            for p in params
            if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        )

    def positional(self, x: Any) -> bool:
        """Whether the batch ``x`` goes in as the one positional argument: anything but a dict, and
        a dict none of whose keys its ``forward`` names (a model that takes the dict itself)."""
        return not isinstance(x, Mapping) or (not self.takes_any and not any(k in self.names for k in x))

    def select(self, x: Any) -> Any:
        """The batch ``x`` with only what the model takes: a dict of keyword arguments without the
        keys its ``forward`` has no argument for (noted once); anything else as it is. (The vmap
        path batches only what it passes: raw text cannot be vmapped.)"""
        if self.positional(x):
            return x
        kwargs = {k: v for k, v in x.items() if k in self.names or (self.takes_any and isinstance(v, torch.Tensor))}
        dropped = tuple(sorted(str(k) for k in x if k not in kwargs))
        if dropped:
            key = (type(self.model).__qualname__, dropped)
            if key not in _NOTED:
                _NOTED.add(key)
                log.info(
                    "data: input keys %s are not arguments of %s.forward and are not passed to it",
                    ", ".join(dropped),
                    type(self.model).__name__,
                )
        return kwargs

    def arguments(self, x: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """(args, kwargs) the model is called with for the batch ``x``; ``use_cache=False`` where
        its ``forward`` takes that argument and the batch does not set it (see ``NO_CACHE``)."""
        args, kwargs = ((x,), {}) if self.positional(x) else ((), self.select(x))
        if NO_CACHE in self.names and NO_CACHE not in kwargs:
            kwargs[NO_CACHE] = False
        return args, kwargs

    def __call__(self, x: Any) -> torch.Tensor:
        """The model's logits on the batch ``x`` (with the graph, under the caller's context)."""
        args, kwargs = self.arguments(x)
        with call_errors(self.device):
            out = self.model(*args, **kwargs)
        return logits_of(out, self.output)

    def functional(self, params: Mapping[str, torch.Tensor], x: Any) -> torch.Tensor:
        """The logits with ``params`` in place of the model's own (``torch.func.functional_call``)."""
        from torch.func import functional_call

        args, kwargs = self.arguments(x)
        with call_errors(self.device):
            out = functional_call(self.model, dict(params), args, kwargs)
        return logits_of(out, self.output)


def class_names_of(model: nn.Module, num_classes: int) -> tuple[str, ...] | None:
    """``model.config.id2label`` as names of classes 0..C-1, when it names every class and is not
    made of ``LABEL_i`` placeholders; None otherwise."""
    id2label = getattr(getattr(model, "config", None), "id2label", None)
    if not isinstance(id2label, Mapping) or len(id2label) != num_classes:
        return None
    try:
        by_id = {int(k): str(v) for k, v in id2label.items()}
    except (TypeError, ValueError):
        return None
    if sorted(by_id) != list(range(num_classes)):
        return None
    names = tuple(by_id[i] for i in range(num_classes))
    if all(_PLACEHOLDER.fullmatch(n) for n in names):
        return None
    return names


# The dict key of token ids, the one input whose pad value the model reads.
INPUT_IDS = "input_ids"


def pad_token_id_of(model: nn.Module) -> int | None:
    """``model.config.pad_token_id`` (a Hugging Face model's) when it is an integer; None otherwise."""
    pad = getattr(getattr(model, "config", None), "pad_token_id", None)
    return pad if isinstance(pad, int) and not isinstance(pad, bool) else None


def input_pad_values(
    model: nn.Module, collate: Any, pad_values: Mapping[str, float] | None = None, tokenizer: Any = None
) -> dict[str, float]:
    """The pad values ``collate: pad`` uses for ``model`` (see the module docstring); other collate
    settings get ``pad_values`` as they are (a collate function pads its own way)."""
    pads = dict(pad_values or {})
    if collate != "pad":
        return pads
    model_pad = pad_token_id_of(model)
    tokenizer_pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    if INPUT_IDS in pads:
        used, source = pads[INPUT_IDS], "data.pad_values.input_ids"
    elif isinstance(tokenizer_pad, int):
        used, source = tokenizer_pad, "the tokenizer's pad_token_id"
    elif model_pad is not None:
        return {**pads, INPUT_IDS: model_pad}
    else:
        return pads  # no pad id anywhere: 0, hidden by the attention mask (GPT-2 style: refused when called)
    if model_pad is not None and float(used) != float(model_pad):
        raise InputError(
            f"data: input_ids would be padded with {used:g} ({source}) but the model's config.pad_token_id is "
            f"{model_pad}: the model would read those pads as tokens; pad with the model's id (the default "
            "of collate=pad) or set model.config.pad_token_id to the pad id used"
        )
    return {**pads, INPUT_IDS: used}
