"""``classgrad.service.analysis.aggregate``: weighted combinations of the rows of a real 500-class store
(an MLP's per-class gradients) equal numpy's; the file is state-dict shaped; loading it into
``.grad`` gives the same SGD-with-momentum steps as setting ``.grad`` by hand; projected and
incomplete stores and bad weight files are refused with one clear line."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from classgrad.errors import ConfigError, InputError, StoreError, StoreIncompleteError
from classgrad.service.analysis.aggregate import aggregate, load_into_grad, load_weights, weighted_sum
from classgrad.service.commands.cli import main as cli_main
from tests.support.stores import model_store, synthetic_store

U = 2.0**-24  # float32 unit roundoff
C = 500


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    path = tmp_path_factory.mktemp("agg") / "store.zarr"
    store, model, rows = model_store(path, num_classes=C)
    return str(path), store, model, rows


def error_bound(rows: np.ndarray, weights: np.ndarray, block_rows: int) -> np.ndarray:
    """Each block's weighted sum is a float32 dot product of <= block_rows terms (error <=
    ~block_rows * u * sum |w||x|, Higham Thm 3.1); blocks add up in float64 (negligible); the
    result is rounded to float32 once (u * |value|)."""
    x = rows.astype(np.float64)
    ref = weights @ x
    return (block_rows + 2) * U * (np.abs(weights) @ np.abs(x)) + U * np.abs(ref)


def flat(tensors: dict[str, np.ndarray], store) -> np.ndarray:
    return np.concatenate([tensors[e.name].reshape(-1) for e in store.layout])


@pytest.mark.parametrize("kind", ["mean", "npy", "txt", "csv"])
def test_weighted_sum_matches_numpy(real, tmp_path, kind):
    url, store, model, rows = real
    counts = store.count().astype(np.float64)
    balanced = np.where(counts > 0, 1.0 / np.maximum(counts, 1), 0.0)  # class-balanced
    balanced /= balanced.sum()
    if kind == "mean":
        spec, weights = "mean", np.full(C, 1.0 / C)
    elif kind == "npy":
        spec, weights = str(tmp_path / "w.npy"), balanced
        np.save(spec, weights)
    elif kind == "txt":
        spec, weights = str(tmp_path / "w.txt"), balanced
        np.savetxt(spec, weights, header="class-balanced weights, one per row")
    else:
        spec, weights = str(tmp_path / "w.csv"), balanced
        (tmp_path / "w.csv").write_text(",".join(repr(float(w)) for w in weights))
    summary = aggregate(url, str(tmp_path / "g.safetensors"), weights=spec, block_rows=64)
    tensors = load_file(str(tmp_path / "g.safetensors"))
    # One tensor per parameter, named and shaped like the model's parameters.
    assert {n: tuple(t.shape) for n, t in tensors.items()} == {n: tuple(p.shape) for n, p in model.named_parameters()}
    got = flat(tensors, store)
    ref = weights @ rows.astype(np.float64)
    assert (np.abs(got - ref) <= error_bound(rows, weights, 64)).all()  # see error_bound
    assert summary["scale"] == 1.0 and summary["norm"] == pytest.approx(np.linalg.norm(ref), rel=1e-6)  # float32 sums


def test_zero_weight_blocks_and_missing_rows(tmp_path):
    store, rows = synthetic_store(tmp_path / "s", num_classes=256, shards=[0, 1, 3])
    weights = np.zeros(256)
    weights[:128] = 1.0
    weights[200] = 0.0
    got = weighted_sum(store, weights, block_rows=32)
    ref = weights[:128] @ rows[:128].astype(np.float64)
    assert (np.abs(got - ref) <= error_bound(rows[:128], weights[:128], 32)).all()  # see there
    weights[130] = 0.5  # a row of shard 2, not written
    with pytest.raises(StoreIncompleteError, match=r"rows \[128, 192\) have non-zero weight"):
        weighted_sum(store, weights)


def test_same_optimizer_step_as_setting_grad_by_hand(real, tmp_path):
    url, store, model, rows = real
    path = tmp_path / "mean.safetensors"
    aggregate(url, str(path))
    mean = rows.astype(np.float64).mean(axis=0)
    by_file, by_hand = copy.deepcopy(model), copy.deepcopy(model)
    opt_file = torch.optim.SGD(by_file.parameters(), lr=0.5, momentum=0.9)
    opt_hand = torch.optim.SGD(by_hand.parameters(), lr=0.5, momentum=0.9)
    for _ in range(3):  # several steps, so the momentum buffers matter too
        opt_file.zero_grad()
        info = load_into_grad(by_file, path)
        opt_file.step()
        opt_hand.zero_grad()
        for entry in store.layout:
            param = dict(by_hand.named_parameters())[entry.name]
            part = mean[entry.offset : entry.offset + entry.size].reshape(entry.shape)
            param.grad = torch.from_numpy(part.astype(np.float32))
        opt_hand.step()
    assert info["loaded"] == [n for n, _ in model.named_parameters()] and not info["not_in_file"]
    # The two gradients differ by at most error_bound (block sums of the default 512-row
    # blocks); three momentum steps move parameters by lr * (1 + 1.9 + 2.71) gradients, plus
    # float32 rounding of each update (u * |param| per step).
    grad_err = error_bound(rows, np.full(C, 1.0 / C), 512).max()
    for (name, a), (_, b) in zip(by_file.named_parameters(), by_hand.named_parameters()):
        tol = 0.5 * 5.61 * grad_err + 3 * U * b.detach().abs()
        assert ((a - b).abs() <= tol).all(), name
    assert any((a != p).any() for a, p in zip(by_file.parameters(), model.parameters()))


def test_clip_norm_in_file_and_on_load(real, tmp_path):
    url, store, model, rows = real
    norm = np.linalg.norm(rows.astype(np.float64).mean(axis=0))
    summary = aggregate(url, str(tmp_path / "c.safetensors"), clip_norm=norm / 4)
    clipped = flat(load_file(str(tmp_path / "c.safetensors")), store)
    # Scaled once in float64 and rounded to float32: relative error ~u per entry.
    assert np.linalg.norm(clipped) == pytest.approx(norm / 4, rel=1e-6)
    assert summary["scale"] == pytest.approx(0.25, rel=1e-6)  # float32 sums, see error_bound
    aggregate(url, str(tmp_path / "m.safetensors"))
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    info = load_into_grad(a, tmp_path / "m.safetensors", clip_norm=norm / 4)
    load_into_grad(b, tmp_path / "m.safetensors")
    total = torch.nn.utils.clip_grad_norm_(list(b.parameters()), norm / 4)
    assert info["total_norm"] == pytest.approx(float(total), rel=1e-6)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p.grad, q.grad)  # the same torch function on the same tensors


def test_load_into_grad_refuses_mismatches(real, tmp_path):
    url, store, model, rows = real
    aggregate(url, str(tmp_path / "g.safetensors"))
    other = torch.nn.Sequential(torch.nn.Linear(8, 8))  # has "0.weight", "0.bias" only
    with pytest.raises(InputError, match="parameters the model does not have: 2.bias, 2.weight"):
        load_into_grad(other, tmp_path / "g.safetensors")
    info = load_into_grad(other, tmp_path / "g.safetensors", strict=False)
    assert info["loaded"] == ["0.weight", "0.bias"]
    wrong = torch.nn.Sequential(torch.nn.Linear(8, 9))
    with pytest.raises(
        InputError,
        match=r"'0.weight' has shape \[8, 8\], the model's "
        r"parameter \[9, 8\]",
    ):
        load_into_grad(wrong, tmp_path / "g.safetensors", strict=False)
    with pytest.raises(InputError, match="cannot load"):
        load_into_grad(other, tmp_path / "nothing.safetensors")


def test_refusals(tmp_path):
    synthetic_store(tmp_path / "p", num_classes=32, projected=True, dim=24)
    with pytest.raises(StoreError, match="projected rows .* cannot be mapped back"):
        aggregate(str(tmp_path / "p"), str(tmp_path / "g.safetensors"))
    assert not (tmp_path / "g.safetensors").exists()
    (tmp_path / "short.txt").write_text("1 2 3\n")
    with pytest.raises(ConfigError, match=r"expected 10 weights .* got shape \[3\]"):
        load_weights(str(tmp_path / "short.txt"), 10)
    (tmp_path / "nan.csv").write_text("1,2,nan\n")
    with pytest.raises(ConfigError, match="must be finite"):
        load_weights(str(tmp_path / "nan.csv"), 3)
    (tmp_path / "words.txt").write_text("one two\n")
    with pytest.raises(ConfigError, match="cannot read weights"):
        load_weights(str(tmp_path / "words.txt"), 2)
    with pytest.raises(ConfigError, match="no such file"):
        load_weights(str(tmp_path / "absent.npy"), 2)


def test_cli(real, tmp_path, capsys):
    url, store, model, rows = real
    out = tmp_path / "g.safetensors"
    assert cli_main(["aggregate", url, "--out", str(out), "--clip-norm", "1e-9"]) == 0
    text = capsys.readouterr().out
    assert "5 tensors" not in text and "4 tensors" in text and "clipped to 1e-09" in text
    synthetic_store(tmp_path / "p", num_classes=32, projected=True, dim=24)
    assert cli_main(["aggregate", str(tmp_path / "p"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "projected rows" in err


def test_the_out_suffix_says_the_format_and_the_summary_is_printed_once(real, tmp_path, capsys, caplog):
    """`--out g.pt` once got safetensors bytes that torch.load could not read, and the summary
    was printed twice (the CLI's line and the library's log line)."""
    url, store, model, rows = real
    with caplog.at_level("INFO"):
        assert cli_main(["aggregate", url, "--out", str(tmp_path / "g.pt")]) == 0
    printed = capsys.readouterr().out
    assert printed.count("wrote ") == 1 and not any("wrote " in r.getMessage() for r in caplog.records)
    state = torch.load(tmp_path / "g.pt", weights_only=True)
    assert list(state) == [e.name for e in store.layout]
    from_safetensors = aggregate(url, str(tmp_path / "g.safetensors"))
    assert from_safetensors["tensors"] == len(state)
    same = load_file(str(tmp_path / "g.safetensors"))
    for name, tensor in state.items():
        assert np.array_equal(tensor.numpy(), same[name])  # the same vector, written two ways
    assert cli_main(["aggregate", url, "--out", str(tmp_path / "g.npz")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "use .safetensors, .pt, .pth" in err
    assert not (tmp_path / "g.npz").exists()


def test_weights_whose_sum_overflows_float32_are_refused_in_one_line(tmp_path, capsys):
    """Before: ``aggregate --weights`` of 1e38 each wrote non-finite tensors, exit 0 (issue 60, item 12)."""
    store, _ = synthetic_store(tmp_path / "s", num_classes=64)
    url, out = str(tmp_path / "s"), tmp_path / "g.safetensors"
    for value, why in ((1e38, "the weighted sum of the rows overflows float32"), (1e39, "within float32's range")):
        np.savetxt(tmp_path / "w.txt", np.full(64, value))
        assert cli_main(["aggregate", url, "--weights", str(tmp_path / "w.txt"), "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert why in err and "\n" not in err, err
        assert not out.exists()
