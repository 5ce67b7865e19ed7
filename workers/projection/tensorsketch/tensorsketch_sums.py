"""Per-class TensorSketches of outer-product layers: the default projection inside the backward.

Holds ``sketched_outer_sums`` (``outer.class_outer_sums`` calls it for a layer whose rows are
TensorSketch-projected: ``LayerRows.projection`` a unit of ``classgrad.workers.projection``'s
``ChunkedSketchUnit`` or, for stores made before it, ``SketchUnit``), ``sketched_embedding_sums``
(the embedding rules call it instead of forming the table) and ``ROUTE_COST`` (the cost model that
picks a route per call). The units say how their map is applied; this module picks the route.

Class i's part of the row is the unit's sketch of ``M_i = sum_t u_t v_t^T`` (``u`` the first
token factor, ``v`` the second, the bias a constant-1 feature on the input's side). Two routes
give the same numbers up to float32 rounding (both are the map ``unit.sketch``):

- ``fft``: per token, each factor placed and transformed, the two multiplied
  (``unit.token_spectra``: rffts per chunk of ``dim`` coordinates, the chunks' filters applied),
  summed over the class's tokens in the frequency domain, one ``irfft`` per class
  (``from_spectra``). ``M_i`` never exists: for a C-wide classifier head (``rows = C``) its
  cost is ``C / dim`` FFTs and ``C`` additions per sample, not ``C x hidden`` per class.
- ``form``: ``M_i`` formed exactly (the layer's own product per class, or a convolution's
  grouped backward), then sketched (``rows x cols_in`` additions per class, and an FFT per
  chunk pair when there are several). Cheaper where a class has many tokens and the layer is
  small (convolutions, attention on sequences).

The route is the cheaper by ``ROUTE_COST`` for this call's token and class counts: a pure
function of the shapes, never a timing, so every worker and every run takes the same one.
Embedding tables (one-hot inputs) take a third, ``direct``: each looked-up entry added at its
column (``H`` additions per token, the columns gathered from ``unit.entry_index`` where the
table is small enough to keep them), then each chunk pair filtered (``unit.combine``), never a
``[V, H]`` table of gradients.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from classgrad.workers.engines.layer_rules import rule_io
from classgrad.workers.engines.layer_rules.rule_io import LayerRows

# Seconds per unit of work, by device type, measured on a 2-core CPU (torch 2.13, float32):
# ``fft_column``: one rfft/irfft column of a 1k-4k-wide block (log factor included);
# ``scatter``: one signed addition of a sparse sign sketch; ``mac``: one multiply-add of a
# batched product. Only their ratios matter (they choose a route, never change a row).
# Any other device type takes ``cuda``'s, from first principles until a GPU run measures them
# (an H200-class part: about 50 TFLOP/s of float32 products, 4.8 TB/s of memory): a product's
# multiply-add 2e-14 s; an FFT column streams about 16 bytes per pass over some 12 passes,
# 4e-14 s; a scattered signed add is an atomic read-modify-write of a random word, 5e-13 s.
ROUTE_COST = {
    "cpu": {"fft_column": 4e-9, "scatter": 2.2e-9, "mac": 1.5e-11},
    "cuda": {"fft_column": 4e-14, "scatter": 5e-13, "mac": 2e-14},
}
FORCED_ROUTE: str | None = None  # tests: "fft" or "form" for every layer


def _costs(device: torch.device) -> dict[str, float]:
    return ROUTE_COST.get(rule_io.route_kind(device), ROUTE_COST["cuda"])


def route_for(unit: Any, tokens: int, classes: int, device: torch.device) -> str:
    """``fft`` or ``form``: the cheaper for ``tokens`` tokens of ``classes`` classes."""
    if FORCED_ROUTE is not None:
        return FORCED_ROUTE
    c = _costs(device)
    s, dim = unit.nonzeros, unit.dim
    # fft: per token both factors placed; an rfft per row chunk of the first and, for each row
    # chunk, one per column chunk of the second (placed anew for each: ``token_spectra``), their
    # product; per class an irfft.
    ffts = unit.row_chunks * (1 + unit.col_chunks) + 1
    fft = tokens * ((unit.rows + unit.cols_in) * s * c["scatter"] + ffts * dim * c["fft_column"])
    fft += classes * dim * c["fft_column"]
    # form: per class its matrix's entries added at their places, then each chunk pair filtered.
    filtered = unit.chunk_pairs + 1 if unit.chunk_pairs > 1 else 0
    form = tokens * unit.full * c["mac"] + classes * (unit.full * s * c["scatter"] + filtered * dim * c["fft_column"])
    return "fft" if fft < form else "form"


def _with_bias(first: torch.Tensor, second: torch.Tensor, unit: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The token factors with the bias's constant-1 feature on the input's side: the second
    factor's (Linear, Conv), or the first's when the matrix's first axis is the input (Conv1D)."""
    if unit.bias is None:
        return first, second
    if unit.input_first:
        return torch.cat([first, first.new_ones(*first.shape[:-1], 1)], dim=-1), second
    return first, torch.cat([second, second.new_ones(*second.shape[:-1], 1)], dim=-1)


def _fft_sketch(
    first: torch.Tensor,
    second: torch.Tensor,
    owner: torch.Tensor | None,
    k: int,
    unit: Any,
    into: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[k, dim]`` (into ``into`` when given) from token factors ``[T, rows]``, ``[T, cols_in]``
    (``owner``: each token's class; None: ``T = k * tokens`` class-major, padding tokens zero)."""
    dtype = first.dtype if first.dtype in (torch.float32, torch.float64) else torch.float32
    prod = unit.token_spectra(first.to(dtype), second.to(dtype))
    if owner is None:
        sums = prod.view(k, -1, prod.shape[1]).sum(dim=1)
    else:
        real = torch.view_as_real(prod)
        sums = torch.view_as_complex(real.new_zeros(k, *real.shape[1:]).index_add_(0, owner, real))
    return unit.from_spectra(sums, into)


def sketched_outer_sums(factors: Any, out: LayerRows, unit: Any) -> None:
    """Class ``i``'s sketch of ``[dW_i | db_i]`` (``unit.dim`` columns) into ``out``'s weight columns."""
    conv = isinstance(getattr(factors, "module", None), (nn.Conv1d, nn.Conv2d, nn.Conv3d))
    device = out.run.rows.device
    on_cpu = rule_io.cpu_routes(device) and not conv
    ragged = factors.ragged(live=True, one_token=True) if on_cpu else None
    k = out.k
    if ragged is not None and ragged.per_sample == 1 and route_for(unit, ragged.grads.shape[0], k, device) != "fft":
        ragged = None  # one token a sample, formed: one product over the padded grid costs less
    target = out.fresh("weight")  # the rows' own columns, written straight (None: add by put)
    if ragged is not None:
        first, second = ragged.grads, ragged.inputs
        tokens = first.shape[0]
        owner = ragged.owner(device)
        if route_for(unit, tokens, k, device) == "fft":
            rows = _fft_sketch(*_with_bias(first, second, unit), owner, k, unit, target)
        else:
            f, s = _with_bias(first, second, unit)
            matrices = f.new_empty(k, unit.rows, unit.cols_in)
            ragged.per_class_mm(f, s, matrices)
            rows = unit.sketch(matrices, target)
    elif route_for(unit, factors.grid_tokens(), k, device) == "fft":
        # [k, T, rows]: one block (units are never grouped layers)
        f, s = _with_bias(factors.grad_tokens(), factors.input_tokens(), unit)
        rows = _fft_sketch(f.reshape(-1, f.shape[-1]), s.reshape(-1, s.shape[-1]), None, k, unit, target)
    else:
        matrices, channels = _formed(factors, k, unit)
        rows = unit.sketch(matrices, target, channels_inner=channels)
    out.bound_by_values(rows)
    if target is None:
        out.put("weight", rows)


def _formed(factors: Any, k: int, unit: Any) -> tuple[torch.Tensor, int | None]:
    """``[k, rows, cols_in]``: each class's ``M_i`` exactly (a convolution's grouped backward, or
    the batched product of the token factors), and the order of its columns (``channels_inner``
    of ``SketchUnit.sketch``: the patches' cheapest order, which the sketch's hash follows)."""
    if not unit.input_first:
        direct = factors.direct_sums(True, unit.bias is not None)
        if direct is not None:  # in the grid's dtype, as the tokens would be
            gw, gb = direct
            assert gw is not None
            m = gw.reshape(k, unit.a, unit.b)
            return (m if gb is None else torch.cat([m, gb.reshape(k, unit.a, 1)], dim=2)), None
    tokens, channels = factors.input_tokens_any_order()
    f, s = _with_bias(factors.grad_tokens(), tokens, unit)
    return torch.bmm(f.transpose(1, 2), s), channels


def sketch_entries(
    unit: Any,
    k: int,
    cls: torch.Tensor,
    i: torch.Tensor,
    j: torch.Tensor | None,
    values: torch.Tensor,
    into: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[k, dim]``: entries ``values`` (``[T, H]``) at ``(i, j)`` of class ``cls[t]``'s matrix, each
    added at its column (the ``direct`` route; equal to ``unit.sketch`` of the summed matrices).
    ``i``: ``[T]`` (a row per token) or ``[T, H]``; ``j``: None (column ``h``) or ``[T, H]``."""
    device = values.device
    width = unit.chunk_pairs * unit.dim  # the unit's columns before its chunk pairs are combined
    acc = values.new_zeros(k * 2 * width)
    base = (cls * (2 * width)).unsqueeze(1)  # [T, 1]
    flat = values.reshape(-1)
    whole_rows = j is None and i.dim() == 1 and values.shape[1] == unit.cols_in and k * 2 * width < 2**31
    table = unit.entry_index(device) if whole_rows else None
    if table is not None:  # every entry's folded column kept: one gather of a table row per token
        acc.index_add_(0, (table[0][i] + base.to(torch.int32)).reshape(-1), flat)
    else:
        rows = i if i.dim() == 2 else i.unsqueeze(1)
        cols = torch.arange(values.shape[1], device=device).unsqueeze(0) if j is None else j
        # [T, 1] + [1, H] (or [T, H]): one column and sign per entry, no per-entry gathers of rows
        col, neg = unit.entry_columns(rows, cols, device)
        acc.index_add_(0, (base + col + neg.long() * width).reshape(-1), flat)
    both = acc.view(k, 2, width)
    return unit.combine(torch.sub(both[:, 0], both[:, 1]), into)


def sketched_entry_sums(
    out: LayerRows, unit: Any, cls: torch.Tensor, i: torch.Tensor, j: torch.Tensor | None, values: torch.Tensor
) -> None:
    """A weight given as entries (``sketch_entries``: ``values[t]`` at ``(i, j)`` of class
    ``cls[t]``'s matrix; an ``nn.EmbeddingBag``'s), sketched into the layer's rows."""
    target = out.fresh("weight")
    rows = sketch_entries(unit, out.k, cls, i, j, values.to(out.run.rows.dtype), target)
    out.bound_by_values(rows)
    if target is None:
        out.put("weight", rows)


def sketched_embedding_sums(
    out: LayerRows, unit: Any, cls: torch.Tensor, ids: torch.Tensor, grads: torch.Tensor, weight: torch.Tensor | None
) -> None:
    """An embedding table's per-class sketch from its lookups: token ``t`` of class ``cls[t]``
    looked up row ``ids[t]`` with output gradient ``grads[t]`` (``[T, H]``), times ``weight[t]``
    (a bag's share; None: 1). Padding tokens must come with a zero weight."""
    if weight is not None:
        grads = grads * weight.unsqueeze(1)
    target = out.fresh("weight")
    rows = sketch_entries(unit, out.k, cls, ids, None, grads.to(out.run.rows.dtype), target)
    out.bound_by_values(rows)
    if target is None:
        out.put("weight", rows)


def sketched_table_sums(module: nn.Embedding, seen: rule_io.LayerCapture, out: LayerRows, unit: Any) -> None:
    """An ``nn.Embedding``'s per-class sketch: each lookup into its buckets, no table formed
    (tokens of ``padding_idx`` add nothing, as the exact rows leave that row zero)."""
    idx = seen.inputs
    grads = seen.grads.to(seen.grid.dtype).reshape(-1, module.weight.shape[1])
    classes = rule_io.sample_classes(seen).view(-1, *[1] * (idx.dim() - 1)).expand_as(idx).reshape(-1)
    ids = idx.reshape(-1)
    keep = None if module.padding_idx is None else (ids != module.padding_idx).to(grads.dtype)
    sketched_embedding_sums(out, unit, classes, ids, grads, keep)
