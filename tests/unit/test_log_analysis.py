"""``classgrad score | similarity | plot`` on a training log (issue 48): a real log of
``tests/support/grad_log_run.py`` (a seeded MLP, 5 steps, windows of 2 steps, rows sketched to
32 columns; a checkpoint at step 4). TracIn scores equal a float64 computation from independent
float64 query rows and the log's ``lr_grads`` (sketched and whole-row logs, any windows); a
window's similarity equals numpy's cosine of its rows; the plot writes its PNGs; the CLI runs
all three; a window out of range or not done, a path that is not a log and options that do not
apply end in one line."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
import zarr

from classgrad import GradLog
from classgrad.errors import InputError, StoreError, StoreIncompleteError
from classgrad.service.analysis.log_plot import plot_log
from classgrad.service.analysis.log_score import score_log
from classgrad.service.analysis.log_similarity import window_similarity
from classgrad.service.analysis.verify import verify_store
from classgrad.service.commands.cli import main as cli_main
from classgrad.store import open_store
from classgrad.store.training_log.log_store import SPEC_ATTR, is_log, read_log
from tests.support import grad_log_run as run
from tests.support.harness import error_lines
from tests.support.log_analysis import MODEL_KWARGS, query_rows64, whole_row_log
from tests.support.png import check_png
from tests.support.stores import dense_similarity, synthetic_store

U = 2.0**-24  # float32 unit roundoff
MODEL = "classgrad.workers.zoo:mlp"


class Renamed(torch.nn.Sequential):
    """The logged model's parameters under another class."""


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """The log (windows 0, 1 and a last one of one step), its checkpoint at step 4, a query file."""
    tmp = tmp_path_factory.mktemp("log")
    url, ckpt = str(tmp / "log.zarr"), str(tmp / "ckpt.pt")
    run.train(url, ckpt, 0, 5)
    queries = tmp / "queries.yaml"
    queries.write_text(
        "data:\n  factory: classgrad.workers.zoo:synthetic_probe\n"
        f"  kwargs: {{num_classes: {run.C}, samples_per_class: 2, kind: vector, input_shape: [8], seed: 5}}\n"
    )
    return {"url": url, "ckpt": ckpt, "queries": str(queries), "tmp": tmp}


def _model_at(ckpt: str) -> torch.nn.Module:
    model, _ = run.fresh()
    model.load_state_dict(torch.load(ckpt, weights_only=True)["model"])
    return model


def _check_scores(result, ref: np.ndarray, q: np.ndarray, sums: np.ndarray) -> None:
    got = np.full_like(ref, np.nan)
    np.put_along_axis(got, result.class_ids.numpy(), result.scores.numpy().astype(np.float64), axis=1)
    # Query rows of the fp32 engine (about 1e-6 relative to |q|), sums stored in float32, products
    # of 32 float32 terms ((32 + 4) u): 1e-5 of |q| |S_c| bounds the three with room.
    bound = 1e-5 * np.linalg.norm(q, axis=1)[:, None] * np.linalg.norm(sums, axis=1)[None, :]
    assert (np.abs(got - ref) <= bound).all(), np.abs(got - ref).max()
    assert (np.diff(result.scores.numpy(), axis=1) <= 0).all()  # best first


@pytest.mark.parametrize("windows,chosen", [(None, [0, 1, 2]), ("0,2", [0, 2]), ([1], [1])])
def test_tracin_scores_equal_float64_query_rows_dotted_with_the_windows_lr_sums(logged, windows, chosen, tmp_path):
    model = _model_at(logged["ckpt"])
    x, y = run.batch(99)
    result = score_log(logged["url"], model, (x, y), windows=windows, top_k=run.C)
    record = zarr.open_group(logged["url"], mode="r").attrs[SPEC_ATTR]["projection"]
    q = query_rows64(model, x, y, record, str(tmp_path / "scratch.zarr"))
    stored = read_log(logged["url"])
    sums = stored["lr_grads"][chosen].astype(np.float64).sum(axis=0)  # windows 0-2 are done: index = window
    _check_scores(result, q @ sums.T, q, sums)
    assert result.info["windows"] == chosen and result.method == "tracin"
    assert result.info["steps"] == [chosen[0] * run.WINDOW, min(5, (chosen[-1] + 1) * run.WINDOW)]


def test_a_whole_row_log_is_scored_without_a_sketch(tmp_path):
    url = str(tmp_path / "whole.zarr")
    whole_row_log(url, 3)
    model, _ = run.fresh()
    x, y = run.batch(50)
    result = score_log(url, model, (x, y), top_k=run.C)
    q = query_rows64(model, x, y, None, "")
    sums = read_log(url)["lr_grads"].astype(np.float64).sum(axis=0)
    assert sums.shape == (run.C, 518)
    # As above, with 518 columns: (518 + 4) u = 3e-5 of |q| |S_c| for the products.
    got = np.full((len(y), run.C), np.nan)
    np.put_along_axis(got, result.class_ids.numpy(), result.scores.numpy().astype(np.float64), axis=1)
    bound = 5e-5 * np.linalg.norm(q, axis=1)[:, None] * np.linalg.norm(sums, axis=1)[None, :]
    assert (np.abs(got - q @ sums.T) <= bound).all()


def test_the_factory_and_checkpoint_give_the_scores_of_the_model_at_that_checkpoint(logged):
    x, y = run.batch(99)
    by_module = score_log(logged["url"], _model_at(logged["ckpt"]), (x, y), top_k=3)
    by_factory = score_log(logged["url"], MODEL, (x, y), model_kwargs=MODEL_KWARGS, checkpoint=logged["ckpt"], top_k=3)
    assert torch.equal(by_module.class_ids, by_factory.class_ids)
    assert torch.equal(by_module.scores, by_factory.scores)  # the same weights, the same arithmetic


@pytest.mark.parametrize("metric", ["cosine", "dot"])
def test_a_window_s_similarity_is_numpy_s_of_its_rows(logged, metric, tmp_path):
    out = tmp_path / "sim.npy"
    result = window_similarity(logged["url"], 1, metric=metric, top_k=3, out=str(out))
    rows = read_log(logged["url"])["grads"][1]
    ref = dense_similarity(rows, metric)
    # float32 products of 32 terms, float64 norms: (32 + 4) u, times |x| |y| for dot (see
    # test_analysis_similarity.float32_bound).
    norms = np.linalg.norm(rows.astype(np.float64), axis=1)
    bound = (32 + 4) * U * (1.0 if metric == "cosine" else norms[:, None] * norms[None, :])
    assert result.matrix is not None and (np.abs(result.matrix - ref) <= bound).all()
    assert np.array_equal(np.load(out), result.matrix) and not (tmp_path / "sim.npy.partial").exists()
    assert not (result.index == np.arange(run.C)[:, None]).any()  # self excluded
    assert np.array_equal(result.value, np.take_along_axis(result.matrix, result.index, axis=1))
    assert result.summary["window"] == 1 and result.summary["steps"] == [2, 4]
    last = window_similarity(logged["url"], top_k=2, dense=False)  # the last done window, the table only
    assert last.window == 2 and last.matrix is None and last.index.shape == (run.C, 2)


def test_classes_without_samples_in_the_window_have_no_neighbours_and_are_none(tmp_path, capsys):
    # Classes 4 and 5 have no samples in window 0: their rows are zeros, with no similarity to
    # speak of. Each class present has 3 others, so with top-4 its last place is empty too.
    url = str(tmp_path / "log.zarr")
    model, opt = run.fresh()
    with GradLog(url, model, run.C, window=2, dim=run.DIM) as log:
        for step in range(2):
            x, y = run.batch(step)
            y = y % 4
            opt.zero_grad()
            log.step(step, model, x, y, opt)
    result = window_similarity(url, 0, top_k=4)
    assert result.summary["empty_classes"] == 2
    assert (result.index[4:] == -1).all() and np.isnan(result.value[4:]).all()
    assert (result.index[:4, :3] < 4).all() and (result.index[:4, :3] >= 0).all()
    assert (result.index[:4, 3] == -1).all() and np.isnan(result.value[:4, 3]).all()
    assert result.matrix is not None and not result.matrix[4:].any() and not result.matrix[:, 4:].any()
    assert cli_main(["similarity", url, "--window", "0", "--top-k", "4"]) == 0
    out = capsys.readouterr().out
    assert "4: none (no samples in this window)" in out and "2 classes had no samples in this window" in out


def test_the_plot_writes_its_pngs(logged, tmp_path):
    result = plot_log(logged["url"], str(tmp_path / "png"), windows="0-2", top_n=4, dpi=50)
    names = ["log_norms", "log_norm_lines", "log_similarity_w0", "log_similarity_w1", "log_similarity_w2"]
    assert list(result["files"]) == names
    assert result["sizes"]["log_norms"] == [450, 300] and result["sizes"]["log_similarity_w1"] == [450, 400]
    for name, path in result["files"].items():
        check_png(path, tuple(result["sizes"][name]))
    grads = read_log(logged["url"])["grads"].astype(np.float64)
    norms = np.linalg.norm(grads, axis=2)  # [window, class]
    assert result["top_rows"] == np.argsort(-norms.sum(axis=0), kind="stable")[:4].tolist()
    for w, drawn in result["similarity"].items():
        assert sorted(drawn["heatmap_rows"]) == sorted(np.argsort(-norms[w], kind="stable")[:4].tolist())
        assert drawn["similarity_source"] == "computed" and drawn["heatmap"]["dendrogram"]


def test_the_cli_runs_the_three_commands_on_a_log(logged, tmp_path, capsys):
    url = logged["url"]
    args = ["score", url, "--queries", logged["queries"], "--model", MODEL, "--checkpoint", logged["ckpt"]]
    kwargs = ["--model-kwargs", "{num_classes: 6, in_features: 8, hidden: 16, seed: 3}"]
    assert cli_main([*args, *kwargs, "--windows", "0-1", "--top-k", "3"]) == 0
    out = capsys.readouterr().out
    assert "tracin of 12 queries x 6 classes x 32" in out and "windows 0-1 (steps 0-3)" in out and "query 4:" in out
    assert cli_main(["similarity", url, "--window", "1", "--top-k", "2", "--out", str(tmp_path / "s.npy")]) == 0
    out = capsys.readouterr().out
    assert "cosine of 6 classes x 32, window 1 (steps 2-3)" in out and "top-2" in out
    assert np.load(tmp_path / "s.npy").shape == (run.C, run.C)
    assert cli_main(["plot", url, "--out", str(tmp_path / "png"), "--dpi", "40"]) == 0
    out = capsys.readouterr().out
    assert "log_norms.png (360 x 240)" in out and "log_similarity_w2.png" in out and "window 2: 6 classes" in out


def test_is_log_tells_a_log_from_a_store_and_from_nothing(logged, tmp_path):
    synthetic_store(tmp_path / "store", num_classes=20)
    assert is_log(logged["url"])
    assert not is_log(str(tmp_path / "store")) and not is_log(str(tmp_path / "nothing"))
    with pytest.raises(StoreError, match="not a classgrad grad log"):
        window_similarity(str(tmp_path / "store"), 0)
    with pytest.raises(StoreError, match=r"is a training log \(GradLog\), not a job's store: read it with .*read_log"):
        open_store(logged["url"])
    with pytest.raises(StoreError, match=r"is a training log \(GradLog\)"):  # verify says so too, as status does
        verify_store(logged["url"])


def test_windows_out_of_range_or_not_done_and_another_model_are_refused(logged, tmp_path):
    url = str(tmp_path / "resumed.zarr")
    shutil.copytree(logged["url"], url)
    model, _ = run.fresh()
    GradLog(url, model, run.C, window=run.WINDOW, dim=run.DIM, start_step=2)  # a resume at step 2: window 0 only
    x, y = run.batch(99)
    with pytest.raises(StoreIncompleteError, match=r"window 1 is not done .*done windows: 0\)"):
        score_log(url, model, (x, y), windows="0-1")
    with pytest.raises(StoreError, match=r"window 3 is out of range \(the log holds windows 0-2"):
        window_similarity(url, 3)
    with pytest.raises(InputError, match="the query model is a Renamed, grad log .* a Sequential"):
        score_log(url, Renamed(*model), (x, y))


def _error(capsys) -> str:
    captured = capsys.readouterr()
    lines = error_lines(captured.err)
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


def test_the_commands_refuse_what_does_not_apply_in_one_line(logged, tmp_path, capsys):
    url, queries = logged["url"], logged["queries"]
    synthetic_store(tmp_path / "store", num_classes=20)
    store = str(tmp_path / "store")
    for argv, words in [
        (["similarity", url, "--window", "9"], "window 9 is out of range"),
        (["similarity", url, "--window", "0-1"], "one window at a time"),
        (["similarity", url, "--task-mb", "8"], "--task-mb is for a job's store"),
        (["score", url, "--queries", queries], "give --model module:function"),
        (["score", url, "--queries", queries, "--model", MODEL, "--out", "x.zarr"], "--out is for a job's store"),
        (["score", url, "--queries", queries, "--model", MODEL, "--windows", "2-1"], "ends before it starts"),
        (["score", url, "--queries", queries, "--model", MODEL, "--model-kwargs", "[1]"], "expected a YAML mapping"),
        (
            [
                "score",
                url,
                "--queries",
                queries,
                "--model",
                MODEL,
                "--model-kwargs",
                "{num_classes: 6, in_features: 8}",
            ],
            "does not match the layout",  # a Sequential too, 64 hidden units: other shapes
        ),
        (["score", store, "--queries", queries, "--windows", "0"], "--windows is for a training log"),
        (["similarity", store, "--window", "0"], "--window is for a training log"),
        (["plot", store, "--out", str(tmp_path / "png"), "--windows", "0"], "--windows is for a training log"),
        # A mistyped path with a log's option: named as a missing store, not as a store that is no log.
        (["similarity", f"{url}x", "--window", "0"], "no classgrad store at"),
        (["plot", f"{url}x", "--out", str(tmp_path / "png"), "--windows", "0"], "no classgrad store at"),
        (["score", store, f"{url}x", "--queries", queries, "--model", MODEL], "no classgrad store at"),
    ]:
        assert cli_main(argv) == 2, argv
        line = _error(capsys)
        assert line.startswith("classgrad: error: ") and words in line, (argv, line)
    assert not (tmp_path / "png").exists()
