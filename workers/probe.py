"""The probe set: the samples whose losses define the per-class gradient rows.

Holds ``ProbeSet``: the probe data as given (a ``Dataset`` of ``(input, target)`` or of dicts of
inputs with a label key, a Hugging Face ``datasets.Dataset`` (duck-typed: ``len`` and ``[i]``), a
``DataLoader`` (its dataset and collate_fn), a dict of batched tensors with a label key, or a pair
of tensors), its targets gathered once on the CPU, the micro-batches every engine walks in the
same order, and the digest of the probe set as built (``digest``; a Dataset's is taken while its
targets are gathered, the one pass over it) with the check that its first samples read the same
twice (``reads_repeat``); and ``tree_map_tensors``, which maps a function over the tensors of a
batch (inputs may be nests of tuples, lists and dicts), ``digest_into``, which hashes such a
nest, and ``has_image`` / ``in_memory_format`` (its 4-D floating tensors, found and put in a
memory format).

Inputs stay where the user put them and are fetched per batch; only targets (small) are held
whole. Tensor pairs are indexed directly; other datasets go through ``__getitem__`` and the
collate setting (``classgrad.workers.collate``: stacked, padded per batch, or the user's function).
Image batches can be asked for channels-last (the partitioned engine's measured choice).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate, default_convert

from classgrad.errors import InputError, first_line
from classgrad.workers.collate import DEFAULT_LABEL_KEYS, Samples, resolve_collate, stack

log = logging.getLogger(__name__)

# Samples of a Dataset whose digests are kept from the first read, to check that a second read
# gives the same inputs (``reads_repeat``: random transforms make a probe set differ per read).
HEAD_SAMPLES = 4


def tree_map_tensors(fn: Any, tree: Any) -> Any:
    """Apply ``fn`` to every tensor in a nest of tuples, lists and dicts (a batch of inputs);
    anything else is kept as it is."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, (tuple, list)):
        return type(tree)(tree_map_tensors(fn, t) for t in tree)
    if isinstance(tree, dict):
        return {k: tree_map_tensors(fn, v) for k, v in tree.items()}
    return tree


def digest_into(h: Any, tree: Any) -> None:
    """Feed a nest of tensors (tuples, lists, dicts; numbers and arrays as tensors) into the hash
    ``h``: structure, dtypes, shapes and the bytes of each tensor on the CPU."""
    if isinstance(tree, (tuple, list)):
        h.update(f"{type(tree).__name__}[{len(tree)}]".encode())
        for t in tree:
            digest_into(h, t)
    elif isinstance(tree, dict):
        h.update(f"dict[{len(tree)}]".encode())
        for k, v in tree.items():
            h.update(repr(k).encode())
            digest_into(h, v)
    elif isinstance(tree, str):
        h.update(f"str:{tree!r}".encode())
    else:
        t = tree if isinstance(tree, torch.Tensor) else torch.as_tensor(tree)
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())


def _sample_digest(inputs: Any) -> str:
    h = hashlib.sha256()
    digest_into(h, inputs)
    return h.hexdigest()


def in_memory_format(batch: Any, memory_format: torch.memory_format) -> Any:
    """4-D floating tensors of ``batch`` in ``memory_format``; everything else as it is."""
    return tree_map_tensors(lambda t: t.contiguous(memory_format=memory_format) if is_image(t) else t, batch)


def has_image(batch: Any) -> bool:
    """Whether ``batch`` (a tensor, or a nest of tuples, lists and dicts) holds a 4-D floating tensor."""
    if isinstance(batch, (tuple, list)):
        return any(has_image(t) for t in batch)
    if isinstance(batch, dict):
        return any(has_image(t) for t in batch.values())
    return is_image(batch)


def _to_device(batch: Any, device: torch.device, dtype: torch.dtype | None = None) -> Any:
    def move(t: torch.Tensor) -> torch.Tensor:
        t = t.to(device, non_blocking=True)
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t

    return tree_map_tensors(move, batch)


def _item(dataset: Any, index: int) -> Any:
    """``dataset[index]``; the user's ``__getitem__`` failing is one ``InputError`` naming the item."""
    try:
        return dataset[index]
    except Exception as exc:  # noqa: BLE001 - the user's dataset failed: report it in one line
        raise InputError(f"data: item {index} of the probe set raised {first_line(exc, with_type=True)}") from exc


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of the probe set: sample indices in probe order."""

    index: int
    indices: torch.Tensor  # int64, CPU


class ProbeSet:
    """The probe samples, their targets, and the order engines visit them in."""

    def __init__(
        self,
        data: Dataset | tuple[Any, torch.Tensor] | list | Mapping | DataLoader,
        batch_size: int = 256,
        *,
        label_field: str | None = None,
        collate: str | Callable[[list[Any]], Any] | None = None,
        pad_values: Mapping[str, float] | None = None,
        digest_now: bool = True,
        driver_targets: torch.Tensor | None = None,
        digest: str | None = None,
    ):
        """``digest_now``: hash a Dataset's inputs in the one pass that reads its targets (a job
        records the digest); False leaves it to a second read if ``digest`` is ever asked for.

        ``driver_targets`` and ``digest``: the probe set's targets and digest as the driver gathered
        and hashed them, for an actor: a Dataset is then not read whole (only its first samples,
        and later the samples a shard needs, each checked against its target here), and nothing
        is hashed; a probe set of another length, or a sample whose label differs, is refused."""
        if batch_size <= 0:
            raise InputError(f"data.batch_size must be > 0, got {batch_size}")
        self.batch_size = int(batch_size)
        collate_fn = resolve_collate(collate, pad_values)
        self._samples: Samples | None = None
        self._known_digest = digest
        self._given = driver_targets is not None  # the driver's targets: labels are checked as samples are read
        if isinstance(data, DataLoader):
            data, collate_fn = _from_loader(data, collate, collate_fn)
        if isinstance(data, Mapping) and all(isinstance(v, torch.Tensor) for v in data.values()):
            data = _split_columns(data, label_field)  # a batch of named columns (a tokenizer's output + labels)
        if isinstance(data, (tuple, list)) and len(data) == 2 and isinstance(data[1], torch.Tensor):
            inputs, targets = data
            if isinstance(inputs, torch.Tensor) and len(inputs) != len(targets):
                raise InputError(f"data: {len(inputs)} inputs but {len(targets)} targets")
            self._inputs: Any = inputs
            self._dataset: Dataset | Sequence[Any] | None = None
            self.targets = targets.detach().cpu()
            self._inputs_digest: str | None = None  # taken when first asked for (``digest``)
            self._head: list[str] = []
        elif isinstance(data, Dataset) or hasattr(data, "__getitem__"):
            self._inputs = None
            self._dataset = data  # type: ignore[assignment] # anything with len and [i]
            n = len(data)  # type: ignore[arg-type]
            if n == 0:
                raise InputError("data: the probe set is empty")
            if driver_targets is not None:  # gathered once, by the driver
                self._adopt(data, driver_targets, label_field, collate_fn)
                return
            # The one pass that reads every sample (for its target) also hashes its inputs.
            h = hashlib.sha256()
            gathered: list[torch.Tensor] = []
            self._head = []
            samples = None
            for i in range(n):
                item = _item(data, i)
                if samples is None:
                    samples = self._samples = Samples(item, label_field, collate_fn)
                inputs = samples.inputs_of(item)
                if digest_now:
                    digest_into(h, inputs)
                if i < HEAD_SAMPLES:
                    self._head.append(_sample_digest(inputs))
                gathered.append(torch.as_tensor(samples.label_of(item, i)))
            self.targets = stack(gathered)
            self._inputs_digest = h.hexdigest() if digest_now else None
        else:
            raise InputError(
                f"data: expected a Dataset of (input, target) or of dicts, a DataLoader, or a pair (inputs, targets), "
                f"got {type(data).__name__}"
            )
        if driver_targets is not None and not _same_targets(self.targets, driver_targets):
            raise InputError(_DIFFERENT_DATA + ": their targets differ")
        self._clamp_batch()

    def _adopt(self, data: Any, targets: torch.Tensor, label_field: str | None, collate_fn: Any) -> None:
        """Take the driver's targets for a Dataset: read only its first samples (the collate and
        label settings, and the digests ``reads_repeat`` compares)."""
        if len(data) != len(targets):
            raise InputError(f"{_DIFFERENT_DATA}: {len(data)} samples here, {len(targets)} on the driver")
        self.targets = targets.detach().cpu()
        self._inputs_digest = None
        self._head = []
        for i in range(min(HEAD_SAMPLES, len(data))):
            item = _item(data, i)
            if self._samples is None:
                self._samples = Samples(item, label_field, collate_fn)
            self._check_label(i, item)
            self._head.append(_sample_digest(self._samples.inputs_of(item)))
        self._clamp_batch()

    def _check_label(self, index: int, item: Any) -> None:
        assert self._samples is not None
        label = torch.as_tensor(self._samples.label_of(item, index))
        if not _same_targets(label, self.targets[index]):
            raise InputError(
                f"{_DIFFERENT_DATA}: sample {index} has label {label.tolist()} here, {self.targets[index].tolist()} "
                "on the driver"
            )

    def _clamp_batch(self) -> None:
        if len(self.targets) == 0:
            raise InputError("data: the probe set is empty")
        if self.batch_size > len(self.targets):
            # A batch larger than the probe set is the probe set: said once by the driver's preflight,
            # and no absurd batch size reaches an allocation or a C long (2^63 and up overflow one).
            log.debug("data.batch_size %d clamped to the probe set's %d samples", self.batch_size, len(self.targets))
            self.batch_size = len(self.targets)

    def __len__(self) -> int:
        return len(self.targets)

    def inputs(self, indices: torch.Tensor, memory_format: torch.memory_format | None = None) -> Any:
        """Inputs of the given samples, batched, where they are held. ``memory_format``
        (``torch.channels_last``) lays 4-D floating tensors out that way, gathered in the same
        pass where the inputs are held as tensors."""
        if self._dataset is None:
            return _index(self._inputs, indices, memory_format)
        assert self._samples is not None  # set while the targets were gathered
        samples = self._samples
        items = [_item(self._dataset, int(i)) for i in indices]
        if self._given:  # each sample as read here: its label must be the driver's
            for i, item in zip(indices.tolist(), items, strict=True):
                self._check_label(i, item)
        batch = samples.inputs_of_batch(samples.collate(items))
        return batch if memory_format is None else in_memory_format(batch, memory_format)

    def batch(
        self,
        indices: torch.Tensor,
        device: torch.device,
        dtype: torch.dtype | None = None,
        memory_format: torch.memory_format | None = None,
    ) -> tuple[Any, torch.Tensor]:
        """(inputs, targets) of the given samples on ``device``; floating inputs cast to ``dtype``,
        4-D floating inputs in ``memory_format`` if given."""
        x = _to_device(self.inputs(indices, memory_format), device, dtype)
        y = self.targets[indices].to(device, non_blocking=True)
        return x, y

    def check_finite(self) -> None:
        """Raise ``InputError`` naming the first sample whose floating inputs hold NaN/Inf.

        Only checks inputs held as tensors (a Dataset is checked as its batches are used)."""

        def first_bad(t: Any) -> int | None:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                bad = ~torch.isfinite(t.reshape(len(t), -1)).all(dim=1)
                return int(bad.nonzero()[0]) if bool(bad.any()) else None
            if isinstance(t, (tuple, list)):
                found = [i for i in (first_bad(x) for x in t) if i is not None]
                return min(found) if found else None
            if isinstance(t, dict):
                return first_bad(list(t.values()))
            return None

        if self._inputs is not None and (i := first_bad(self._inputs)) is not None:
            raise InputError(f"data: NaN/Inf in the inputs of probe sample {i}")

    @property
    def digest(self) -> str:
        """sha256 hex of the probe set as built: its inputs (a Dataset's as read when the probe set
        was built) and its targets; the driver's when it gave it (``digest=``)."""
        if self._known_digest is not None:
            return self._known_digest
        if self._inputs_digest is None:
            h = hashlib.sha256()
            if self._dataset is not None:  # not hashed when first read (``digest_now``): read again
                assert self._samples is not None
                for i in range(len(self.targets)):
                    digest_into(h, self._samples.inputs_of(_item(self._dataset, i)))
            else:
                digest_into(h, self._inputs)
            self._inputs_digest = h.hexdigest()
        h = hashlib.sha256(b"classgrad probe set v1")
        h.update(self._inputs_digest.encode())
        digest_into(h, self.targets)
        return h.hexdigest()

    def reads_repeat(self) -> bool:
        """Whether the first samples of a Dataset give the same inputs when read again (random
        transforms do not); always true for inputs held as tensors."""
        if self._dataset is None:
            return True
        assert self._samples is not None
        return all(
            _sample_digest(self._samples.inputs_of(_item(self._dataset, i))) == d for i, d in enumerate(self._head)
        )

    def micro_batches(self) -> Iterator[MicroBatch]:
        """The probe set in order, ``batch_size`` samples at a time (the same for every engine)."""
        n = len(self)
        for i, start in enumerate(range(0, n, self.batch_size)):
            yield MicroBatch(i, torch.arange(start, min(start + self.batch_size, n)))

    @property
    def num_micro_batches(self) -> int:
        return -(-len(self) // self.batch_size)


_DIFFERENT_DATA = (
    "data: the data factory gives another probe set here than on the driver (it must give the same "
    "samples in the same order on every node)"
)


def _same_targets(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.equal(a.to(b.dtype), b))


def _from_loader(loader: DataLoader, setting: Any, collate_fn: Any) -> tuple[Any, Any]:
    """A DataLoader's dataset, and its collate_fn unless it is torch's default (then the configured
    one); its sampler, shuffling and batch size are not used (the probe set has its own order)."""
    if isinstance(loader.dataset, IterableDataset):
        raise InputError(
            "data: a DataLoader over an IterableDataset: the probe set needs a map-style dataset (len, [i])"
        )
    own = loader.collate_fn
    default = own in (default_collate, default_convert)
    if not default and setting not in (None, "stack"):
        raise InputError(f"data.collate {setting!r}: the DataLoader has its own collate_fn; give one or the other")
    log.info("data: a DataLoader: its dataset and collate_fn are used, its sampler, shuffling and batch size are not")
    return loader.dataset, collate_fn if default else own


def _split_columns(columns: Mapping[str, torch.Tensor], label_field: str | None) -> tuple[dict, torch.Tensor]:
    """A dict of batched columns holding the labels -> (inputs dict, labels)."""
    key = label_field or next((k for k in DEFAULT_LABEL_KEYS if k in columns), None)
    if key is None or key not in columns:
        raise InputError(
            f"data: a dict of tensors without the label key {key or ' or '.join(DEFAULT_LABEL_KEYS)!r} "
            f"(keys: {', '.join(map(str, columns))}): set data.label_field"
        )
    return {k: v for k, v in columns.items() if k != key}, columns[key]


def is_image(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == 4 and t.is_floating_point()


def _index(inputs: Any, indices: torch.Tensor, memory_format: torch.memory_format | None = None) -> Any:
    if isinstance(inputs, torch.Tensor):
        if memory_format == torch.channels_last and is_image(inputs):
            # Gathering from an NHWC view writes the batch channels-last in one pass; indexing
            # and then converting reads and writes it twice.
            picked = torch.index_select(inputs.permute(0, 2, 3, 1), 0, indices.to(inputs.device))
            return picked.permute(0, 3, 1, 2)
        return in_memory_format(inputs[indices], memory_format) if memory_format is not None else inputs[indices]
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(_index(x, indices, memory_format) for x in inputs)
    if isinstance(inputs, dict):
        return {k: _index(v, indices, memory_format) for k, v in inputs.items()}
    raise InputError(f"data: unsupported input type {type(inputs).__name__}")
