"""The recurrent-layer rule (``layer_rules.recurrent``) against the float64 per-class reference.

Each case builds an ``nn.LSTM``/``nn.GRU``/``nn.RNN``, calls it on a run of classes (sizes with an
empty class and unequal classes, so the grid is padded), and checks that (a) the rule's forward,
run again, is torch's own output, and (b) every parameter's per-class gradient is within 1e-5
relative of ``torch.autograd.grad`` through a float64 copy of the module, class by class.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

from classgrad.workers.engines.layer_rules import ClassGrid
from classgrad.workers.engines.layer_rules.recurrent import recurrent_class_grads, recurrent_refusal, rerun
from tests.support.engine_cases import max_relative_error

SIZES = [2, 0, 3, 1]  # an empty class, and classes of unequal sizes (padding in the grid)
T, IN, HID = 5, 4, 6
# fp32 against float64, sums over a few samples and steps: the engine tests' row tolerance
TOL = 1e-5


def grid_for(sizes: list[int], dtype: torch.dtype = torch.float32) -> ClassGrid:
    return ClassGrid.of_counts(torch.tensor(sizes), dtype)


def build(mode: str, **options) -> nn.RNNBase:
    torch.manual_seed(0)
    if mode == "LSTM":
        module: nn.RNNBase = nn.LSTM(IN, HID, **options)
    elif mode == "GRU":
        module = nn.GRU(IN, HID, **options)
    else:
        module = nn.RNN(IN, HID, nonlinearity=mode, **options)
    with torch.no_grad():  # biases away from zero, so every gate's bias term matters
        for name, p in module.named_parameters():
            if name.startswith("bias"):
                p.uniform_(-1.0, 1.0)
    return module.eval()


def make_call(module: nn.RNNBase, n: int, packed: str | None, h0: bool, seed: int = 1):
    """``(args, kwargs, sample ids in the output's structure)`` for ``n`` samples."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, T, IN, generator=gen)
    ids = torch.arange(n, dtype=torch.float32)[:, None, None].expand(n, T, 1)
    if packed is not None:
        lengths = torch.randint(1, T + 1, (n,), generator=gen)
        lengths[0] = T
        if packed == "sorted":
            lengths = lengths.sort(descending=True).values
        inp = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=packed == "sorted")
        ids = pack_padded_sequence(ids, lengths, batch_first=True, enforce_sorted=packed == "sorted")
    elif module.batch_first:
        inp = x
    else:
        inp, ids = x.transpose(0, 1), ids.transpose(0, 1)
    kwargs = {}
    if h0:
        D = 2 if module.bidirectional else 1
        h = torch.randn(module.num_layers * D, n, module.proj_size or HID, generator=gen)
        c = torch.randn(module.num_layers * D, n, HID, generator=gen)
        kwargs["hx"] = (h, c) if module.mode == "LSTM" else h
    return (inp,), kwargs, ids


def output_grads(out, hidden, gen: torch.Generator, which: str = "all"):
    """Random gradients with the output's structure; ``which`` keeps only "output" or "hidden"."""
    data = out.data if isinstance(out, PackedSequence) else out
    g_out = torch.randn(data.shape, generator=gen) if which in ("all", "output") else None

    def like(t):
        return torch.randn(t.shape, generator=gen) if which in ("all", "hidden") else None

    g_hidden = tuple(like(t) for t in hidden) if isinstance(hidden, tuple) else like(hidden)
    return g_out, g_hidden


def reference(module, args, kwargs, ids, grads, sizes) -> dict[str, torch.Tensor]:
    """Per class: ``torch.autograd.grad`` of ``sum <g, output>`` over its samples, float64 copy."""
    ref = copy.deepcopy(module).double()
    inp = args[0]
    if isinstance(inp, PackedSequence):
        inp = PackedSequence(inp.data.double(), inp.batch_sizes, inp.sorted_indices, inp.unsorted_indices)
        ids = ids.data
    else:
        inp = inp.double()
    kw = {k: (tuple(s.double() for s in v) if isinstance(v, tuple) else v.double()) for k, v in kwargs.items()}
    out, hidden = ref(inp, **kw)
    out = out.data if isinstance(out, PackedSequence) else out
    states = list(hidden) if isinstance(hidden, tuple) else [hidden]
    g_out, g_hidden = grads
    g_states = list(g_hidden) if isinstance(g_hidden, tuple) else [g_hidden]
    names = [n for n, _ in ref.named_parameters()]
    rows: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    start = 0
    for size in sizes:
        sample_ids = torch.arange(start, start + size)
        outs, gs = [], []
        if g_out is not None:
            mine = torch.isin(ids[..., 0].long(), sample_ids)
            outs.append(out)
            gs.append(g_out.double() * mine[..., None])
        for s, g in zip(states, g_states):
            if g is not None:
                mine = torch.isin(torch.arange(s.shape[1]), sample_ids)
                outs.append(s)
                gs.append(g.double() * mine[None, :, None])
        found = torch.autograd.grad(outs, list(ref.parameters()), gs, retain_graph=True, allow_unused=True)
        for n, p, g in zip(names, ref.parameters(), found):
            rows[n].append(torch.zeros_like(p) if g is None else g)
        start += size
    return {n: torch.stack(v) for n, v in rows.items()}


def check(module, sizes=SIZES, packed=None, h0=False, method="native", which="all", seed=1):
    args, kwargs, ids = make_call(module, sum(sizes), packed, h0, seed)
    out, hidden = module(*args, **kwargs)
    # the rule's forward is torch's: same output and final states, up to float32 roundoff
    # (other summation orders and, for the native path, an identity product instead of W_ih x)
    re_out, re_h, re_c = rerun(module, args, kwargs, method=method)
    if isinstance(out, PackedSequence):
        padded, _ = torch.nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=T)
    else:
        padded = out if module.batch_first else out.transpose(0, 1)
    torch.testing.assert_close(re_out, padded, rtol=1e-5, atol=1e-6)
    h_n, c_n = hidden if isinstance(hidden, tuple) else (hidden, None)
    torch.testing.assert_close(re_h, h_n, rtol=1e-5, atol=1e-6)
    if c_n is not None:
        torch.testing.assert_close(re_c, c_n, rtol=1e-5, atol=1e-6)
    grads = output_grads(out, hidden, torch.Generator().manual_seed(seed + 1), which)
    ref = reference(module, args, kwargs, ids, grads, sizes)
    kinds = [n for n, _ in module.named_parameters()]
    got = recurrent_class_grads(module, args, kwargs, grads, grid_for(sizes), kinds, method=method)
    assert set(got) == set(kinds)
    for name in kinds:
        assert got[name].shape == ref[name].shape and got[name].dtype == torch.float32
        rows, want = got[name].reshape(len(sizes), -1), ref[name].reshape(len(sizes), -1)
        assert max_relative_error(rows, want) <= TOL, name
        for i, size in enumerate(sizes):
            if size == 0:
                assert (rows[i] == 0).all(), f"{name}: empty class {i} has a non-zero row"
    return got, ref


MODES = ["LSTM", "GRU", "tanh", "relu"]
CONFIGS = {
    "1layer": ({}, None, False),
    "2layers-bidir-batchfirst-h0": ({"num_layers": 2, "bidirectional": True, "batch_first": True}, None, True),
    "2layers-nobias": ({"num_layers": 2, "bias": False}, None, False),
    "packed-unsorted-bidir-h0": ({"bidirectional": True}, "unsorted", True),
    "packed-sorted-2layers-batchfirst-h0": ({"num_layers": 2, "batch_first": True}, "sorted", True),
}


@pytest.mark.parametrize("method", ["native", "unrolled"])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("mode", MODES)
def test_layer_against_reference(mode, config, method):
    options, packed, h0 = CONFIGS[config]
    check(build(mode, **options), packed=packed, h0=h0, method=method)


@pytest.mark.parametrize(
    "options,packed,h0",
    [
        ({"proj_size": 3}, None, True),
        ({"proj_size": 3, "num_layers": 2, "bidirectional": True}, "unsorted", True),
        ({"proj_size": 4, "num_layers": 2, "bias": False, "batch_first": True}, "sorted", False),
    ],
)
def test_lstm_projection(options, packed, h0):
    check(build("LSTM", **options), packed=packed, h0=h0)


@pytest.mark.parametrize("which", ["output", "hidden"])
@pytest.mark.parametrize("mode", ["LSTM", "GRU"])
def test_gradient_at_one_output_only(mode, which):
    """``grad_outputs`` with None where an output got no gradient."""
    check(build(mode, num_layers=2, bidirectional=True), packed="unsorted", h0=True, which=which)


def test_equal_classes_and_a_single_class():
    module = build("LSTM", num_layers=2)
    check(module, sizes=[2, 2, 2])
    check(module, sizes=[3])


def test_gru_hidden_bias_is_inside_the_reset_gate():
    """The new gate's ``b_hn`` is scaled by the reset gate: its gradient is not ``bias_ih``'s."""
    module = build("GRU")
    with torch.no_grad():
        module.bias_ih_l0[:HID].fill_(-2.0)  # reset gates near 0.1, far from 1
    got, ref = check(module)
    new_ih, new_hh = got["bias_ih_l0"][:, 2 * HID :], got["bias_hh_l0"][:, 2 * HID :]
    assert (new_hh - new_ih).norm() > 0.5 * new_ih.norm()
    # the reset and update parts are plain sums of the same pre-activations
    torch.testing.assert_close(got["bias_hh_l0"][:, : 2 * HID], got["bias_ih_l0"][:, : 2 * HID])


def test_only_some_parameters_and_zero_when_unreached():
    module = build("GRU", num_layers=2, bidirectional=True)
    args, kwargs, _ = make_call(module, sum(SIZES), None, False)
    out, hidden = module(*args, **kwargs)
    grads = output_grads(out, hidden, torch.Generator().manual_seed(3))
    all_kinds = [n for n, _ in module.named_parameters()]
    full = recurrent_class_grads(module, args, kwargs, grads, grid_for(SIZES), all_kinds)
    some = recurrent_class_grads(module, args, kwargs, grads, grid_for(SIZES), ["weight_hh_l1_reverse"])
    assert list(some) == ["weight_hh_l1_reverse"]
    torch.testing.assert_close(some["weight_hh_l1_reverse"], full["weight_hh_l1_reverse"])
    # only the top layer's final states get a gradient: the first layer is not reached
    D = 2
    g_h = torch.zeros_like(hidden)
    g_h[D:] = 1.0
    top = recurrent_class_grads(module, args, kwargs, (None, g_h), grid_for(SIZES), ["weight_ih_l0", "bias_hh_l1"])
    assert top["weight_ih_l0"].abs().sum() > 0  # the top layer's states read the first layer's output
    none = recurrent_class_grads(module, args, kwargs, (None, None), grid_for(SIZES), all_kinds)
    assert all((v == 0).all() for v in none.values())


def test_unbatched_input():
    module = build("LSTM", num_layers=2)
    x = torch.randn(T, IN)
    out, (h, c) = module(x)
    g = (torch.randn_like(out), (torch.randn_like(h), torch.randn_like(c)))
    got = recurrent_class_grads(module, (x,), {}, g, grid_for([1]), ["weight_hh_l1", "bias_ih_l0"])
    batched = recurrent_class_grads(
        module,
        (x[:, None],),
        {},
        (g[0][:, None], (g[1][0][:, None], g[1][1][:, None])),
        grid_for([1]),
        ["weight_hh_l1", "bias_ih_l0"],
    )
    for name in got:
        torch.testing.assert_close(got[name], batched[name])


def test_refusals():
    module = build("LSTM", num_layers=2, dropout=0.3)
    assert recurrent_refusal(module) is None  # eval mode: dropout is off
    module.train()
    assert "dropout" in (recurrent_refusal(module) or "")
    with pytest.raises(ValueError, match="dropout"):
        recurrent_class_grads(module, (torch.randn(T, 1, IN),), {}, (None, None), grid_for([1]), ["weight_ih_l0"])

    class MyLSTM(nn.LSTM):
        pass

    assert "exactly" in (recurrent_refusal(MyLSTM(IN, HID)) or "")
    with pytest.raises(ValueError, match="3 samples, the grid places 6"):
        recurrent_class_grads(build("GRU"), (torch.randn(T, 3, IN),), {}, (None, None), grid_for([1, 2, 3]), [])
    with pytest.raises(KeyError, match="weight_hr_l0"):
        recurrent_class_grads(build("GRU"), (torch.randn(T, 1, IN),), {}, (None, None), grid_for([1]), ["weight_hr_l0"])


def test_call_and_gradient_spellings():
    """Keyword arguments, a ``PackedSequence`` as the output's gradient, LSTM's gradients flat
    (``(output, h_n, c_n)``), and a call under ``no_grad`` give the same rows as the canonical
    spelling."""
    module = build("LSTM", num_layers=2, bidirectional=True)
    args, kwargs, _ = make_call(module, sum(SIZES), "unsorted", True)
    out, hidden = module(*args, **kwargs)
    g_out, (g_h, g_c) = output_grads(out, hidden, torch.Generator().manual_seed(5))
    kinds = [n for n, _ in module.named_parameters()]
    want = recurrent_class_grads(module, args, kwargs, (g_out, (g_h, g_c)), grid_for(SIZES), kinds)
    packed_g = PackedSequence(g_out, out.batch_sizes, out.sorted_indices, out.unsorted_indices)
    spellings = [
        ((), {"input": args[0], **kwargs}, (g_out, (g_h, g_c))),
        ((args[0], kwargs["hx"]), {}, (packed_g, (g_h, g_c))),
        (args, kwargs, (g_out, g_h, g_c)),
    ]
    for a, kw, g in spellings:
        got = recurrent_class_grads(module, a, kw, g, grid_for(SIZES), kinds)
        for name in kinds:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)
    with torch.no_grad():  # as a hook may call it
        got = recurrent_class_grads(module, args, kwargs, (g_out, (g_h, g_c)), grid_for(SIZES), kinds)
        for name in kinds:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_dtypes(dtype):
    """A float64 layer is run in float64 (float64 rows); a half-precision one in float32 (float32 rows)."""
    module = build("GRU", num_layers=2).to(dtype)
    args, kwargs, ids = make_call(module, sum(SIZES), None, False)
    args = (args[0].to(dtype),)
    out, hidden = module(*args, **kwargs)
    grads = tuple(g.to(dtype) for g in output_grads(out, hidden, torch.Generator().manual_seed(6)))
    kinds = [n for n, _ in module.named_parameters()]
    rows = torch.float64 if dtype == torch.float64 else torch.float32
    got = recurrent_class_grads(module, args, kwargs, grads, grid_for(SIZES, rows), kinds)
    ref = reference(module, args, kwargs, ids, grads, SIZES)
    # float64 throughout: float64 roundoff only; bf16 layer: its weights, inputs and gradients are
    # the same bf16 values in both, and the rule runs them in float32 against the float64 reference
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for name in kinds:
        assert got[name].dtype == rows
        assert max_relative_error(got[name].reshape(len(SIZES), -1), ref[name].reshape(len(SIZES), -1)) <= tol
