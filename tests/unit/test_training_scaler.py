"""PerClassGradScaler (workers/training): rows against a float64 per-class loop and the seed's
retain_graph loop, the GradScaler contract (skipped steps, scale, state_dict), both routes of
step_batch in eval and train mode, and one-line refusals of bad input."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from classgrad import PerClassGradScaler
from classgrad.errors import InputError
from classgrad.workers.training import scaler as scaler_module
from classgrad.workers.training.scaler import is_freed_graph
from tests.support.devices import DEVICES
from tests.support.docs import python_blocks

REPO = Path(__file__).resolve().parents[2]
C = 6


def mlp(seed: int = 0, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 12), nn.Tanh(), nn.Dropout(dropout), nn.Linear(12, C))


def cnn(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, C),
    )


def batch(seed: int = 1, n: int = 20, image: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, 4, 4, generator=g) if image else torch.randn(n, 5, generator=g)
    y = torch.randint(0, C, (n,), generator=g)
    return x, y


def class_losses(logits: torch.Tensor, y: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of each class in ``classes`` (the loss vector of the tests)."""
    per = F.cross_entropy(logits.float() if logits.dtype != torch.float64 else logits, y, reduction="none")
    return torch.stack([per[y == c].mean() for c in classes.tolist()])


def loop_rows(model: nn.Module, loss: torch.Tensor) -> torch.Tensor:
    """The seed's loop: one backward(retain_graph=True) per class, .grad copied and zeroed."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for c in range(len(loss)):
        for p in params:
            p.grad = None
        loss[c].backward(retain_graph=True)
        rows.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]))
    for p in params:
        p.grad = None
    return torch.stack(rows)


def reference64(model: nn.Module, x: torch.Tensor, y: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
    """Rows in float64 from a copy of the model (its current mode), a fresh forward per class."""
    m = copy.deepcopy(model).double()
    params = [p for p in m.parameters() if p.requires_grad]
    rows = []
    for c in classes.tolist():
        loss = class_losses(m(x.double()), y, torch.tensor([c]))[0]
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
    return torch.stack(rows)


def close(a: torch.Tensor, b: torch.Tensor, rel: float) -> bool:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max()) <= rel * float(b.abs().max())


# --- rows -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_rows", [None, 4, 1])
def test_call_rows_equal_the_float64_reference(block_rows):
    model = mlp()
    x, y = batch()
    classes = torch.arange(C)
    scaler = PerClassGradScaler(block_rows=block_rows)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rows = scaler(class_losses(model(x), y, classes), opt, model=model, update_grad=False)
    assert rows.shape == (C, sum(p.numel() for p in model.parameters())) and rows.dtype == torch.float32
    # fp32 rows against float64: a few roundings of float32 sums, far below 1e-5 of the largest entry.
    assert close(rows, reference64(model, x, y, classes), 1e-5)
    assert all(p.grad is None for p in model.parameters())  # update_grad=False only returns rows


def test_call_without_batching_rule_falls_back_to_one_backward_per_row():
    model = mlp()
    x, y = batch()
    scaler = PerClassGradScaler(block_rows=4)
    scaler._rows.batched = False  # as after a graph refused is_grads_batched
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = torch.empty(C, sum(p.numel() for p in model.parameters()))
    rows = scaler(class_losses(model(x), y, torch.arange(C)), opt, model=model, update_grad=False, out=out)
    assert rows is out
    assert close(rows, reference64(model, x, y, torch.arange(C)), 1e-5)  # fp32 vs float64, as above


def test_the_graph_is_freed_after_the_last_block():
    model = mlp()
    x, y = batch()
    scaler = PerClassGradScaler(block_rows=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler(class_losses(model(x), y, torch.arange(C)), opt, model=model, update_grad=False)  # batched known to work
    loss = class_losses(model(x), y, torch.arange(C))
    scaler(loss, opt, model=model, update_grad=False)
    with pytest.raises(RuntimeError, match="second time"):
        loss.sum().backward()


def test_a_loss_whose_graph_was_freed_is_one_line():
    model = mlp()
    x, y = batch()
    loss = class_losses(model(x), y, torch.arange(C))
    loss.sum().backward()
    with pytest.raises(InputError, match="its graph was already freed"):
        PerClassGradScaler()(loss, torch.optim.SGD(model.parameters(), lr=0.1), model=model, update_grad=False)
    with pytest.raises(RuntimeError) as raised:
        loss.sum().backward()  # autograd's own refusal, the error the helper reads
    assert is_freed_graph(raised.value)
    assert not is_freed_graph(RuntimeError("element 0 of tensors does not require grad and does not have a grad_fn"))
    assert not is_freed_graph(ValueError(str(raised.value)))


@pytest.mark.parametrize("image", [False, True])
def test_step_batch_fast_route_rows_equal_the_reference(image):
    model = cnn() if image else mlp()
    model.eval()
    x, y = batch(image=image)
    scaler = PerClassGradScaler(num_classes=C)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rows, ids = scaler.step_batch(model, x, y, opt, update_grad=False)
    assert ids.dtype == torch.int64 and ids.tolist() == sorted(set(y.tolist()))
    assert close(rows, reference64(model, x, y, ids), 1e-5)  # fp32 vs float64, as above
    general, ids2 = scaler.step_batch(model, x, y, opt, update_grad=False, route="general")
    assert torch.equal(ids, ids2) and close(general, rows, 1e-5)  # two fp32 routes, same rows


def test_rows_alone_need_no_optimizer_and_a_step_still_does():
    """``update_grad=False`` only returns rows, so ``None`` stands for the optimizer there (the
    README's promise); with ``update_grad`` the missing optimizer is one line."""
    model = mlp()
    model.eval()
    x, y = batch()
    scaler = PerClassGradScaler(num_classes=C)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for route in ("fast", "general"):
        with_opt, ids = scaler.step_batch(model, x, y, opt, update_grad=False, route=route)
        without, ids2 = scaler.step_batch(model, x, y, None, update_grad=False, route=route)
        assert torch.equal(ids, ids2) and torch.equal(with_opt, without), route  # same inputs, same kernels

    def rows(optimizer):  # each call frees its loss's graph: a fresh forward each
        return scaler(class_losses(model(x), y, torch.arange(C)), optimizer, model=model, update_grad=False)

    assert torch.equal(rows(None), rows(opt))
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(InputError, match="optimizer must be a torch.optim.Optimizer, got NoneType"):
        scaler.step_batch(model, x, y, None)
    with pytest.raises(InputError, match="optimizer must be a torch.optim.Optimizer, got NoneType"):
        scaler(class_losses(model(x), y, torch.arange(C)), None, update_grad=False)  # no model: no columns


def test_step_batch_bf16_rows_within_the_engines_bf16_tolerance():
    model = mlp()
    x, y = batch()
    scaler = PerClassGradScaler(num_classes=C)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rows, ids = scaler.step_batch(model, x, y, opt, update_grad=False)
    # bf16 keeps 8 bits of mantissa: the engine tests allow 5e-2 of the largest entry.
    assert close(rows, reference64(model, x, y, ids), 5e-2)
    assert not scaler.scaler.is_enabled()  # bf16: no loss scaling


def test_train_mode_dropout_and_batchnorm_rows_follow_the_batch_as_given():
    # The general route (BatchNorm's own under auto; dropout's when asked: auto takes the fast
    # route, whose masks are drawn as its run forwards the samples).
    for model, route in ((mlp(dropout=0.5).train(), "general"), (cnn().train(), "auto")):
        x, y = batch(image=isinstance(model[0], nn.Conv2d))
        scaler = PerClassGradScaler(num_classes=C)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        twin = copy.deepcopy(model)
        torch.manual_seed(7)
        rows, ids = scaler.step_batch(model, x, y, opt, update_grad=False, route=route)
        torch.manual_seed(7)  # the same dropout masks, the same batch statistics
        want = loop_rows(twin, class_losses(twin(x), y, ids))
        assert close(rows, want, 1e-5)  # two fp32 computations of the same gradients
        for a, b in zip(model.buffers(), twin.buffers()):  # BatchNorm statistics moved once, as in a step
            assert torch.equal(a, b)


class SignDropout(nn.Dropout):
    """A dropout whose mask is a function of each sample's own values (its positive entries kept):
    a stand-in for the generator's draws that any arrangement of the batch reproduces, so the
    fast route's rows under it have a plain reference."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (x.detach() > 0).to(x.dtype) / (1 - self.p) if self.training else x


def test_train_mode_dropout_takes_the_fast_route_each_row_its_classs_gradient_under_its_masks(monkeypatch):
    general = []
    route = scaler_module.batch_loss_vector
    monkeypatch.setattr(scaler_module, "batch_loss_vector", lambda *a, **k: general.append(1) or route(*a, **k))
    model = nn.Sequential(nn.Linear(5, 12), nn.Tanh(), SignDropout(0.5), nn.Linear(12, C)).train()
    x, y = batch()
    twin, opt = copy.deepcopy(model), torch.optim.SGD(model.parameters(), lr=0.1)
    rows, ids = PerClassGradScaler(num_classes=C).step_batch(model, x, y, opt)
    assert general == []  # one forward and one backward, through the hook path
    # Two fp32 computations of the same gradients (the masks are each sample's own).
    assert close(rows, loop_rows(twin, class_losses(twin(x), y, ids)), 1e-5)


def test_train_mode_dropouts_masks_come_from_the_callers_generator(monkeypatch):
    model, (x, y) = mlp(dropout=0.5).train(), batch()
    scaler, opt = PerClassGradScaler(num_classes=C), torch.optim.SGD(model.parameters(), lr=0.1)
    found = []
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        found.append(scaler.step_batch(model, x, y, opt, update_grad=False)[0])
    assert torch.equal(found[0], found[1])  # the caller's seed, the same masks
    assert not torch.equal(found[0], found[2])  # not a seed of the engine's own
    # Where the hook path cannot run (a forward hook on every module): the general route, whose
    # masks a plain forward of the batch under the same seed draws.
    general = []
    route = scaler_module.batch_loss_vector
    monkeypatch.setattr(scaler_module, "batch_loss_vector", lambda *a, **k: general.append(1) or route(*a, **k))
    twin = copy.deepcopy(model)
    hook = nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    try:
        torch.manual_seed(5)
        rows, ids = scaler.step_batch(model, x, y, opt, update_grad=False)
        torch.manual_seed(5)
        assert general == [1] and close(rows, loop_rows(twin, class_losses(twin(x), y, ids)), 1e-5)
        with pytest.raises(InputError, match="dropout draws need"):
            scaler.step_batch(model, x, y, opt, update_grad=False, route="fast")
    finally:
        hook.remove()
    # Refused once, the model's later batches go straight to the general route (no failed
    # attempt every step), also once the hook path could take them again.
    tried = []
    fast = scaler_module.fast_rows
    monkeypatch.setattr(scaler_module, "fast_rows", lambda *a, **k: tried.append(1) or fast(*a, **k))
    scaler.step_batch(model, x, y, opt, update_grad=False)
    assert tried == [] and general == [1, 1]


class FunctionalDropoutMLP(nn.Module):
    """Dropout by the module's own mode, no dropout layer (as an attention's functional dropout)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(5, 12), nn.Linear(12, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.dropout(torch.tanh(self.a(x)), 0.5, self.training))


def test_a_layers_own_dropout_draws_from_the_callers_generator_too():
    torch.manual_seed(0)
    model, (x, y) = FunctionalDropoutMLP().train(), batch()
    scaler, opt = PerClassGradScaler(num_classes=C), torch.optim.SGD(model.parameters(), lr=0.1)
    found = []
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        found.append(scaler.step_batch(model, x, y, opt, update_grad=False)[0])
    assert torch.equal(found[0], found[1]) and not torch.equal(found[0], found[2])


# --- the training loop ----------------------------------------------------------------------------


def seed_step(model, opt, x, y):
    """The seed's step: rows by the retain_graph loop, their mean into .grad, then the step."""
    opt.zero_grad()
    loss = class_losses(model(x), y, torch.unique(y))
    rows = loop_rows(model, loss)
    mean, offset = rows.mean(0), 0
    for p in model.parameters():
        p.grad = mean[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    opt.step()


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("how", ["call", "batch"])
def test_twenty_steps_give_the_seed_loops_parameters(optim, how):
    make = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    }[optim]
    ours, seed = mlp(), mlp()
    opt_ours, opt_seed = make(ours.parameters()), make(seed.parameters())
    scaler = PerClassGradScaler(num_classes=C)
    for step in range(20):
        x, y = batch(seed=step)
        seed_step(seed, opt_seed, x, y)
        opt_ours.zero_grad()
        if how == "call":
            scaler(class_losses(ours(x), y, torch.unique(y)), opt_ours, model=ours)
        else:
            scaler.step_batch(ours, x, y, opt_ours)
    for a, b in zip(ours.parameters(), seed.parameters()):
        # fp32 rows summed in another order over 20 steps (Adam divides by sqrt(v): roundings grow
        # a little): well within 1e-5 of the parameters' size.
        assert close(a, b, 1e-5)


def test_aggregate_sum_weights_function_and_clip():
    model = mlp()
    x, y = batch()
    ids = torch.unique(y)
    weights = torch.linspace(0.5, 2.0, C)
    seen = {}

    def surgery(rows, class_ids):
        seen["ids"] = class_ids
        return rows[0] * 3

    for aggregate, want in (
        ("sum", lambda r: r.sum(0)),
        (weights, lambda r: weights[ids] @ r),
        (surgery, lambda r: r[0] * 3),
    ):
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=1.0)
        before = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
        rows, got_ids = PerClassGradScaler(num_classes=C).step_batch(m, x, y, opt, aggregate=aggregate)
        after = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
        assert close(before - after, want(rows), 1e-5)  # lr=1: the step is the aggregate (fp32 roundings)
    assert torch.equal(seen["ids"], ids)
    m = copy.deepcopy(model)
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    rows, _ = PerClassGradScaler(num_classes=C).step_batch(m, x, y, opt, clip_grad=1e-3)
    total = float(torch.cat([p.grad.reshape(-1) for p in m.parameters()]).norm())
    assert abs(total - 1e-3) < 1e-7  # clipped to the total norm 1e-3 (float32 rounding of the norm)


@pytest.mark.parametrize("route", ["fast", "general", "call"])
@pytest.mark.parametrize("kind", ["weights", "function"])
def test_a_non_finite_aggregate_of_finite_rows_skips_the_step_with_a_warning(route, kind, caplog):
    """Before: NaN weights, or a function that returned NaN, took the step and left every
    parameter NaN with no warning (issue 60, item 13)."""
    model = mlp()
    x, y = batch()
    aggregate = torch.full((C,), float("nan")) if kind == "weights" else (lambda rows, ids: rows.sum(0) * float("nan"))
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = PerClassGradScaler(num_classes=C)
    if route == "call":
        ids = torch.unique(y)
        loss = class_losses(model(x), y, ids)
        scaler(loss, opt, model=model, aggregate=aggregate if kind == "function" else aggregate[ids], class_ids=ids)
    else:
        scaler.step_batch(model, x, y, opt, aggregate=aggregate, route=route)
    assert scaler.found_inf
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # no step
    assert "the aggregate of finite rows is not finite" in caplog.text


def poisoned(step: int, x: torch.Tensor) -> torch.Tensor:
    """Inputs that overflow at steps 3, 4 and 11: the forced overflows."""
    return x * float("inf") if step in (3, 4, 11) else x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how", ["call", "batch"])
def test_fp16_forced_overflow_skips_the_same_steps_as_plain_gradscaler(how, device):
    ours, plain = mlp().to(device), mlp().to(device)
    opt_ours, opt_plain = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, plain))
    scaler = PerClassGradScaler(precision="fp16", num_classes=C, init_scale=2.0**10, growth_interval=3)
    gs = torch.amp.GradScaler(device, init_scale=2.0**10, growth_interval=3)
    skipped_ours, skipped_plain = [], []
    for step in range(16):
        x, y = (t.to(device) for t in batch(seed=step))
        x = poisoned(step, x)
        ids = torch.unique(y)
        before = [p.detach().clone() for p in plain.parameters()]
        opt_plain.zero_grad()
        with torch.autocast(device, dtype=torch.float16):
            loss = class_losses(plain(x), y, ids)
        gs.scale(loss.mean()).backward()
        gs.unscale_(opt_plain)  # timm's order: unscale, clip the total norm, step, update
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
        gs.step(opt_plain)
        gs.update()
        skipped_plain.append(all(torch.equal(a, b) for a, b in zip(before, plain.parameters())))
        opt_ours.zero_grad()
        with torch.autocast(device, dtype=torch.float16):
            if how == "call":
                loss = class_losses(ours(x), y, ids)
            else:
                scaler.step_batch(ours, x, y, opt_ours, clip_grad=0.5)
        if how == "call":
            scaler(loss, opt_ours, model=ours, clip_grad=0.5)
        skipped_ours.append(scaler.found_inf)
        assert scaler.get_scale() == gs.get_scale()
    assert skipped_ours == skipped_plain and sum(skipped_ours) == 3
    assert scaler.state_dict() == gs.state_dict()
    for a, b in zip(ours.parameters(), plain.parameters()):
        # fp16 forwards: per-class rows then their mean vs one backward of the mean loss differ by
        # fp16 roundings (the engine tests' fp16 tolerance, 5e-2 of the largest entry).
        assert close(a, b, 5e-2)


@pytest.mark.parametrize("size", [1.0, 1e37])
def test_finite_rows_whose_sum_overflows_skip_the_fp32_step(size):
    """The fast route reads no sum of rows that its run bounded (every entry below
    ``rule_io.FINITE_BOUND``), and reads it when the run could not: here each row is finite
    (about ``size``) but their sum over 64 classes is not (a head sure of class 0 makes the rows
    of every other class push the same entry the same way), so the step is skipped."""
    torch.manual_seed(0)
    model = nn.Linear(1, 64)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.zero_()
        model.bias[0] = 50.0  # p(class 0) = 1: every other class's row holds +x at W[0]
    x, y = torch.full((128, 1), size), torch.arange(64).repeat(2)
    before = [p.detach().clone() for p in model.parameters()]
    scaler = PerClassGradScaler(num_classes=64)
    rows, _ = scaler.step_batch(model, x, y, torch.optim.SGD(model.parameters(), lr=1e-40), route="fast")
    assert bool(torch.isfinite(rows).all())
    overflows = not bool(torch.isfinite(rows.sum(0)).all())
    assert scaler.found_inf == overflows == (size > 1)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert unchanged == overflows


def test_state_dict_mid_run_resumes_the_same_trajectory():
    def run(steps, model, opt, scaler):
        for step in steps:
            x, y = batch(seed=step)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = class_losses(model(poisoned(step, x)), y, torch.unique(y))
            scaler(loss, opt, model=model)

    kw = {"precision": "fp16", "init_scale": 2.0**8, "growth_interval": 2}
    whole, opt_whole = mlp(), None
    opt_whole = torch.optim.AdamW(whole.parameters(), lr=1e-2)
    s_whole = PerClassGradScaler(**kw)
    run(range(12), whole, opt_whole, s_whole)

    first = mlp()
    opt_first = torch.optim.AdamW(first.parameters(), lr=1e-2)
    s_first = PerClassGradScaler(**kw)
    run(range(6), first, opt_first, s_first)
    state = {"model": first.state_dict(), "opt": opt_first.state_dict(), "scaler": s_first.state_dict()}
    assert state["scaler"]["scale"] != 2.0**8  # the scale moved: the round trip carries something

    second = mlp(seed=5)
    opt_second = torch.optim.AdamW(second.parameters(), lr=1e-2)
    s_second = PerClassGradScaler(**kw)
    s_second.load_state_dict(state["scaler"])  # before the first call: applied when it is made
    second.load_state_dict(state["model"])
    opt_second.load_state_dict(state["opt"])
    run(range(6, 12), second, opt_second, s_second)
    assert s_second.state_dict() == s_whole.state_dict()
    for a, b in zip(second.parameters(), whole.parameters()):
        assert torch.equal(a, b)  # the same computations in the same order: bit for bit


# --- bad input --------------------------------------------------------------------------------------


def test_bad_input_is_one_line():
    model = mlp()
    x, y = batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = PerClassGradScaler(num_classes=C)
    loss = class_losses(model(x), y, torch.unique(y))
    cases = [
        (lambda: scaler(loss.sum(), opt, model=model), "vector"),
        (lambda: scaler(loss.detach(), opt, model=model), "no graph"),
        (lambda: scaler(loss, opt, model=model, create_graph=True), "create_graph=True is not supported"),
        (lambda: scaler(loss, torch.optim.SGD(mlp().parameters(), lr=1), model=model), "optimizer: does not hold"),
        (lambda: scaler.step_batch(model, x, y + C, opt), "labels outside"),
        (lambda: scaler.step_batch(model, x, y[:3], opt), "20 samples but labels 3"),
        (lambda: scaler.step_batch(model, x, y, opt, num_classes=0), "num_classes"),
        (lambda: scaler.step_batch(model, x, y, opt, aggregate="median"), "aggregate"),
        (
            lambda: scaler.step_batch(cnn().train(), *batch(image=True), opt, update_grad=False, route="fast"),
            "route='fast'",
        ),
    ]
    frozen = mlp()
    frozen.requires_grad_(False)
    cases.append((lambda: scaler.step_batch(frozen, x, y, opt), "select no parameters"))
    for call, words in cases:
        with pytest.raises(InputError) as info:
            call()
        assert words in str(info.value) and "\n" not in str(info.value)


def test_inputs_that_gave_a_wrong_step_are_refused_before_any_step():
    """Issue 45, items 5 and 6: each of these stepped (or failed later with a raw error) before."""
    model = mlp()
    x, y = batch()
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.1)
    classes = torch.unique(y)
    other = mlp(seed=3)  # its loss does not reach model's parameters
    cases = [
        (lambda: PerClassGradScaler()(class_losses(other(x), y, classes), opt, model=model), "reaches none"),
        (lambda: PerClassGradScaler()(class_losses(model(x), y, classes), opt, model=model, clip_grad=-1), "clip_grad"),
        (lambda: PerClassGradScaler().step_batch(model, x, y, opt, num_classes=C, clip_grad=float("nan")), "clip_grad"),
        (
            lambda: PerClassGradScaler()(class_losses(model(x), y, classes), opt, model=model, class_ids=classes[:2]),
            "class_ids",
        ),
        (lambda: PerClassGradScaler(init_scale=-3), "init_scale must be a number > 0 within float32's range"),
        # Issue 60, item 14: each of these was a raw error at the next step, or at once.
        (lambda: PerClassGradScaler(init_scale=1e308), "init_scale must be a number > 0 within float32's range"),
        (lambda: PerClassGradScaler(block_rows="x"), "block_rows must be an integer > 0, got 'x'"),
        (lambda: PerClassGradScaler(precision="fp16").load_state_dict({}), "an empty state is a disabled"),
        (lambda: PerClassGradScaler().load_state_dict({"scale": 2.0}), "the state lacks ['growth_factor'"),
        (lambda: PerClassGradScaler(bogus=1), "unknown option 'bogus'"),
        (lambda: PerClassGradScaler().load_state_dict({"scale": -5.0}), "scale must be"),
        (lambda: PerClassGradScaler().load_state_dict({"scale": "abc"}), "scale must be"),
        (lambda: PerClassGradScaler().load_state_dict({"foo": 1}), "not a GradScaler's state"),
        (lambda: PerClassGradScaler().load_state_dict(opt.state_dict()), "not a GradScaler's state"),
    ]
    for call, words in cases:
        with pytest.raises(InputError) as info:
            call()
        assert words in str(info.value) and "\n" not in str(info.value)
    wide = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 10 * C)).eval()
    with pytest.raises(InputError, match=rf"not \[batch, num_classes={C}\]: give num_classes="):
        PerClassGradScaler().step_batch(wide, x, y, torch.optim.SGD(wide.parameters(), lr=0.1), num_classes=C)
    # Inputs the model cannot take: one line, before the fast route's slower paths were tried
    # and said so (two "fallback" warnings, then the model's raw error).
    with pytest.raises(InputError, match="step_batch: the model's forward failed on the inputs: RuntimeError"):
        PerClassGradScaler().step_batch(model, torch.randn(20, 7), y, opt, num_classes=C)
    # An enabled scaler's state into one that runs fp32: refused, not dropped (get_scale() was 1.0).
    state = torch.amp.GradScaler("cpu", init_scale=1024.0).state_dict()
    disabled = PerClassGradScaler(num_classes=C)
    disabled.load_state_dict(state)
    with pytest.raises(InputError, match="precision='fp16'"):
        disabled.step_batch(model, x, y, opt)
    enabled = PerClassGradScaler(precision="fp16", num_classes=C)
    enabled.load_state_dict(state)
    enabled.step_batch(model, x, y, opt, update_grad=False)
    assert enabled.get_scale() == 1024.0
    for name, value in model.state_dict().items():  # nothing above took a step
        assert torch.equal(value, before[name]), name


def test_a_call_after_an_fp16_autocast_block_scales_the_loss():
    """The README's call pattern with fp16: the forward under the autocast, the call after it.
    Before, the scaler was made disabled (no loss scaling) unless precision="fp16" was given
    (issue 45, item 9)."""
    model = mlp()
    x, y = batch()
    classes = torch.unique(y)
    scaler = PerClassGradScaler(num_classes=C)
    with torch.autocast("cpu", dtype=torch.float16):
        logits = model(x)
    rows = scaler(class_losses(logits.float(), y, classes), torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    assert scaler.scaler is not None and scaler.scaler.is_enabled() and scaler.get_scale() > 1
    # fp16 products against the float64 reference: fp16's rounding of the forward.
    assert close(rows, reference64(mlp(), x, y, classes), 2e-2)
    plain, other = PerClassGradScaler(num_classes=C), mlp()
    plain(class_losses(other(x), y, classes), torch.optim.SGD(other.parameters(), lr=0.1), model=other)
    assert plain.scaler is not None and not plain.scaler.is_enabled()


def test_step_batch_fills_the_first_rows_of_a_buffer_of_the_batchs_size():
    """One buffer serves every step, whatever the classes present (issue 45, item 9)."""
    model = mlp()
    x, y = batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dim = sum(p.numel() for p in model.parameters())
    buf = torch.full((len(y), dim), float("nan"))
    scaler = PerClassGradScaler(num_classes=C)
    rows, ids = scaler.step_batch(model, x, y, opt, out=buf, update_grad=False)
    assert rows.data_ptr() == buf.data_ptr() and rows.shape == (len(ids), dim)
    assert torch.isnan(buf[len(ids) :]).all()  # the rest untouched
    want, _ = PerClassGradScaler(num_classes=C).step_batch(model, x, y, opt, update_grad=False)
    torch.testing.assert_close(rows, want, rtol=0, atol=0)  # the same engine on the same batch
    with pytest.raises(InputError, match="at least"):
        scaler.step_batch(model, x, y, opt, out=buf[:2], update_grad=False)


def test_the_readme_training_loop_runs():
    """The README's "In a training loop" snippet, as written."""
    text = (REPO / "README.md").read_text()
    blocks = python_blocks(text, "## In a training loop")
    assert blocks
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - our own docs
    assert namespace["class_ids"].tolist() == sorted(set(namespace["y"].tolist()))  # the first snippet's last batch
    assert namespace["rows"].shape[0] == 100 and bool(torch.isfinite(namespace["rows"]).all())  # the second's
