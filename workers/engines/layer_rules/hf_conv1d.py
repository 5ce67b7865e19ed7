"""The layer rule for ``transformers``' ``Conv1D`` (GPT-2's projections): a Linear whose weight is
stored transposed, ``[in, out]``, with the forward ``addmm(bias, x, weight)``.

Holds ``TransposedLinearFactors`` (the outer-product factors with the roles of the stored
matrix's axes: its first axis is the input's), ``hf_conv1d_sums`` and ``register_hf_conv1d``
(registers the rule when ``transformers`` imports; classgrad works without it).

Class i's stored weight gradient is ``sum_t x_t g_t^T`` ([in, out]), the transpose of a Linear's:
``outer.class_outer_sums`` forms ``grad_tokens^T @ input_tokens`` per class, so these factors
hand it the inputs as the first factor and the output gradients as the second (a projection of
the stored matrix's rows then applies to the inputs, as it should). The bias gradient, the sum of
``g`` per class, is formed here, except with Kronecker-projected rows: the unit's matrix is then
``[W; b^T]`` (``(in + 1) x out``, the bias a constant-1 input feature, ``KroneckerUnit.input_first``)
and ``class_outer_sums`` forms both at once.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from classgrad.workers.engines.layer_rules.linear import LinearFactors
from classgrad.workers.engines.layer_rules.outer import class_outer_sums
from classgrad.workers.engines.layer_rules.registry import RULES, register_rule
from classgrad.workers.engines.layer_rules.rule_io import LayerCapture, LayerRows

log = logging.getLogger(__name__)


class TransposedLinearFactors(LinearFactors):
    """``[k, tokens, in]`` inputs as the first factor, ``[k, tokens, out]`` gradients as the second."""

    def _pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.seen.inputs, self.seen.grads

    def grad_tokens(self) -> torch.Tensor:
        return self._tokens(self.seen.inputs)

    def input_tokens(self) -> torch.Tensor:
        return self._tokens(self.seen.grads)


def hf_conv1d_sums(module: nn.Module, seen: LayerCapture, out: LayerRows) -> None:
    if out.projection is not None:  # projected (any structure): weight and bias at once (rows of [W; b^T])
        class_outer_sums(TransposedLinearFactors(seen), out)
        return
    if out.wants("weight"):
        # Only the weight through class_outer_sums: its bias sums would be of the inputs here.
        class_outer_sums(TransposedLinearFactors(seen), LayerRows(out.run, {"weight": out.slots["weight"]}))
    if out.wants("bias"):
        g = seen.grads.to(seen.grid.dtype)  # summed in the rows' dtype, as the other rules do
        gb = seen.by_class(g.reshape(seen.total, -1, g.shape[-1]).sum(dim=1)).sum(dim=1)
        out.bound_by_values(gb)
        out.put("bias", gb)


def register_hf_conv1d() -> bool:
    """Register the rule for ``transformers.pytorch_utils.Conv1D`` if transformers imports."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # transformers is optional: GPT-2-style models then take another path
        log.debug("transformers does not import: no layer rule for its Conv1D")
        return False
    if Conv1D not in RULES:
        register_rule(Conv1D, live_tokens=True)(hf_conv1d_sums)
    return True
