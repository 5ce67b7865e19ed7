"""The engines' process-wide speed choices: what was measured or found once, kept for later engines.

Holds every cache the engines keep across engine objects, in one place, and ``clear()`` (for
tests). None of them changes a row: they only decide how fast rows come, or skip a check that
already passed on the same model. They are process-wide because an actor (or a script calling
``per_class_gradients`` repeatedly) builds many engines on one model and one probe shape, and
each measurement costs real runs; keys hold everything the choice depends on. What could change
a row's rounding is not chosen by timing: the memory format of image inputs on the hook path and
the kernel of a convolution's per-class sums are fixed rules (``partitioned.input_format`` and
``layer_rules.conv.conv_route``), so that every actor of a job, every resume and
``per_class_gradients`` compute a row alike.

- ``HOOKS_CHECKED``: models whose per-class sums from hooks passed the spot check against the
  plain single-class path, with the ``(selected parameters, precision, device, layer rules)``
  they passed for. The check is of the model's structure, so later engines on the same model
  object skip it. Weak keys: an entry goes with its model.
- ``BLOCK_ROWS``: the dense engine's measured block size; key ``(id(model), classes, graph kind,
  batch size, probe size, D, device, precision, loss, threads)``.
- ``VMAP_REFUSED``: module-VJP units (``layer_rules.module_vjp``) ``torch.func.vmap`` could not
  batch, with the first line of why; they are done class by class from then on. Weak keys.
- ``PER_SAMPLE_LEAVES``: module-VJP units whose wanted parameters are all broadcast over the
  samples (``[1, ...]``: class tokens, position embeddings), with whether giving each sample its
  own copy as a leaf (one VJP over the run, summed by class) matched the vmapped VJP on the
  module's first run. Weak keys.
- ``DRAWS_REFUSED``: models whose training batches the hook path could not take with the
  caller's draws (``PartitionedEngine(draws_from_caller=True)``), with the first line of why:
  the training routes send their batches to the general route from then on, without a failed
  attempt every step. Weak keys.
- ``NO_HEAD``: why dense rows cannot go through the model's final Linear layer, per model
  (weak keys) and ``(path, loss, classes, parameters, precision, device)``: found once (it may
  take a forward pass), not once per engine.
"""

from __future__ import annotations

import weakref

from torch import nn

HOOKS_CHECKED: weakref.WeakKeyDictionary[nn.Module, set[tuple]] = weakref.WeakKeyDictionary()
BLOCK_ROWS: dict[tuple, int] = {}
NO_HEAD: weakref.WeakKeyDictionary[nn.Module, dict[tuple, str]] = weakref.WeakKeyDictionary()
VMAP_REFUSED: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
DRAWS_REFUSED: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
PER_SAMPLE_LEAVES: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()
UNIT_LAYOUTS: weakref.WeakKeyDictionary[nn.Module, dict[str, list[int | None]]] = weakref.WeakKeyDictionary()


def clear() -> None:
    """Forget every choice (tests: the next engine measures and checks again)."""
    for cache in (
        HOOKS_CHECKED,
        BLOCK_ROWS,
        NO_HEAD,
        VMAP_REFUSED,
        DRAWS_REFUSED,
        UNIT_LAYOUTS,
        PER_SAMPLE_LEAVES,
    ):
        cache.clear()
