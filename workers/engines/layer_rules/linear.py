"""The layer rule for ``nn.Linear``: per-class sums of ``g x^T`` over samples and positions.

Holds ``LinearFactors`` (the layer's token factors: every sample, and every position of a
sequence input, is a token) and ``linear_sums``, registered for ``nn.Linear``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from classgrad.workers.engines.layer_rules.outer import OuterFactors, class_outer_sums
from classgrad.workers.engines.layer_rules.registry import register_rule
from classgrad.workers.engines.layer_rules.rule_io import LayerCapture, LayerRows, Ragged

# Dead tokens (an output gradient of zeros) are dropped when at most this fraction of a run's
# tokens is live: a decoder's classifier head, which scores every position and keeps one
# (GPT-2 at C = 10,000, 16 positions: the head's sketch 24.1 -> 2.7 s, the call 48 -> 28 s;
# benchmarks/history/RESULTS-until-2026-12-04.md, sixth pass). Not a sequence's padding: with
# 10 of 16 positions live, dropping them made GPT-2's attention layers 1.5-2x slower (classes
# of many different token counts take one product each; scratch timing).
DROP_BELOW = 0.5


class LinearFactors(OuterFactors):
    """``[total, ..., features]`` input and output gradient as ``[k, tokens, features]``."""

    def __init__(self, seen: LayerCapture):
        self.seen = seen

    def _tokens(self, t: torch.Tensor) -> torch.Tensor:
        seen = self.seen
        return seen.by_class(t.reshape(seen.total, -1, t.shape[-1])).reshape(seen.k, -1, t.shape[-1])

    def ragged(self, live: bool = False, one_token: bool = False) -> Ragged | None:
        seen = self.seen
        if seen.total == 0 or (seen.grid.spots is None and not live):
            return None  # classes of equal size: the grid is a view already
        first, second = self._pair()
        per_sample = first[0].numel() // first.shape[-1]  # tokens of a sample
        if per_sample == 1 and not one_token:
            # Products of a few tokens: a loop over classes costs more in calls than the padding
            # saves (an MLP of classes of 1 to 4 samples: 5-10% slower than the padded grid).
            return None
        alive = seen.live if live else None  # read by the hook path, with every layer's
        if alive is not None and not 0 < int(alive.sum()) <= DROP_BELOW * alive.numel():
            # A sequence's padding (the classes' varied token counts cost more calls), or nothing
            # live at all (the sums are zero either way; the rules read at least one token).
            alive = None
        if alive is None and seen.grid.spots is None:
            return None
        tokens = [n * per_sample for n in seen.grid.sizes]
        dtype = seen.grid.dtype
        found = Ragged(
            first.reshape(-1, first.shape[-1]).to(dtype),
            second.reshape(-1, second.shape[-1]).to(dtype),
            tokens,
            per_sample,
        )
        return found if alive is None else found.keeping(alive)

    def _pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The first and second factor as captured (``[total, ..., features]``)."""
        return self.seen.grads, self.seen.inputs

    def grid_tokens(self) -> int:
        seen = self.seen  # each sample's tokens: the dimensions between the batch and the features
        return seen.k * seen.grid.width * math.prod(seen.grads.shape[1:-1])

    def grad_tokens(self) -> torch.Tensor:
        return self._tokens(self.seen.grads)

    def input_tokens(self) -> torch.Tensor:
        return self._tokens(self.seen.inputs)


@register_rule(nn.Linear, live_tokens=True)
def linear_sums(module: nn.Linear, seen: LayerCapture, out: LayerRows) -> None:
    class_outer_sums(LinearFactors(seen), out)
