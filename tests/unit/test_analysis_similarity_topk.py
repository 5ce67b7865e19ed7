"""``classgrad.service.analysis.similarity_topk`` without Ray: the block merge against a full
sort (ties to the lower index, self excluded, any block sizes), the streamed top-k against a
dense float64 reference (cosine and dot, column bands, float64 arithmetic), the top-k-only run
in this process (no C x C array written, the dense path's neighbours, verify clean), the choice
between dense and top-k only with its one-line refusals, the plan's memory bound, and the
command line (sample with class names, exit codes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from classgrad.errors import ConfigError, StoreError
from classgrad.service.analysis import similarity as sim_module
from classgrad.service.analysis.similarity import SimilarityConfig, compute_similarity, wants_dense
from classgrad.service.analysis.similarity_topk import merge_topk, streamed_topk
from classgrad.service.analysis.topk_plan import TopKPlan, plan_topk
from classgrad.service.analysis.verify import verify_store
from classgrad.service.commands.cli import main as cli_main
from classgrad.store import open_store
from tests.support.stores import ZERO_ROW, dense_similarity, synthetic_store

U = 2.0**-24  # float32 unit roundoff


def reference_topk(S: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's k best of S, self excluded, best first, equal values by lower index."""
    S = S.astype(np.float64, copy=True)
    np.fill_diagonal(S, -np.inf)
    cols = np.broadcast_to(np.arange(S.shape[1]), S.shape)
    order = np.lexsort((cols, -S), axis=1)[:, :k]
    return order, np.take_along_axis(S, order, axis=1)


def merged(S: np.ndarray, k: int, widths: list[int], row0: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Rows of S (query rows row0.. of a C-column matrix) merged block by block."""
    B, C = S.shape
    val = torch.full((B, k), float("-inf"), dtype=torch.float64)
    idx = torch.full((B, k), C, dtype=torch.int64)
    col = 0
    for w in widths:
        block = torch.from_numpy(S[:, col : col + w].copy())
        val, idx = merge_topk(val, idx, block, col, row0, k)
        col += w
    assert col == C
    return idx.numpy(), val.numpy()


@pytest.mark.parametrize("widths", [[50], [7, 13, 30], [1] * 50, [3, 47]])
def test_merge_equals_a_full_sort_whatever_the_blocks(widths):
    rng = np.random.default_rng(3)
    S = rng.permutation(50 * 50).reshape(50, 50).astype(np.float64)  # distinct scores
    index, value = merged(S, 6, widths)
    ref_index, ref_value = reference_topk(S, 6)
    assert np.array_equal(index, ref_index) and np.array_equal(value, ref_value)


def test_merge_breaks_ties_by_the_lower_index_across_and_within_blocks():
    rng = np.random.default_rng(4)
    S = rng.integers(0, 4, size=(40, 40)).astype(np.float64)  # many equal scores
    for widths in ([40], [5, 11, 24], [16, 16, 8]):
        index, value = merged(S, 7, widths)
        ref_index, ref_value = reference_topk(S, 7)
        assert np.array_equal(index, ref_index) and np.array_equal(value, ref_value), widths
    # Query rows 20..39 of the same matrix: self is the column row0 + r.
    index, _ = merged(S[20:], 7, [9, 31], row0=20)
    assert np.array_equal(index, reference_topk(np.vstack([S[:20], S[20:]]), 7)[0][20:])


def plan_for(
    C: int,
    D: int,
    *,
    block: int,
    stream: int,
    band: int | None = None,
    metric="cosine",
    k=5,
    precision="float32",
    window: int = 0,
):
    return TopKPlan(
        window_rows=window,
        num_classes=C,
        dim=D,
        block_rows=block,
        stream_rows=stream,
        band_cols=band or D,
        chunk_rows=16,
        metric=metric,
        top_k=k,
        precision=precision,
    )


def check_against_dense(rows: np.ndarray, index: np.ndarray, value: np.ndarray, metric: str, k: int, tol: np.ndarray):
    """The streamed table against the float64 reference: its values are the k best values, the
    reference's score at each chosen index is the value stored, and where the reference has no
    near-tie (a gap of more than 2 tol between consecutive candidates up to the k+1-th) the
    indices are the reference's exactly."""
    S = dense_similarity(rows, metric)
    ref_index, ref_value = reference_topk(S, k + 1)
    C = rows.shape[0]
    t = tol if np.ndim(tol) == 0 else np.take_along_axis(tol, ref_index, axis=1)[:, :k]
    assert (np.abs(value - ref_value[:, :k]) <= t).all()  # tol: float32 products, see callers
    chosen = np.take_along_axis(S, index, axis=1)
    assert (np.abs(chosen - value) <= t).all()
    assert not (index == np.arange(C)[:, None]).any()
    gaps = np.diff(-ref_value, axis=1)  # >= 0
    tol_row = tol if np.ndim(tol) == 0 else tol.max(axis=1, keepdims=True)
    clear = (gaps > 2 * tol_row).all(axis=1)
    clear[ZERO_ROW] = True  # its row is exactly 0 in both: ties by lower index, checked exactly
    assert clear.mean() > 0.9  # the check below covers nearly every row
    assert np.array_equal(index[clear], ref_index[clear, :k])


@pytest.mark.parametrize(
    "metric, block, stream, band, precision, window",
    [
        ("cosine", 64, 48, None, "float32", 0),
        ("cosine", 128, 16, 40, "float32", 0),  # column bands: D = 96 in three
        ("dot", 32, 100, None, "float32", 0),
        ("dot", 64, 64, 32, "float64", 0),
        ("cosine", 64, 16, 40, "float32", 48),  # windows of 48 score columns, read 16 rows at a time
        ("dot", 32, 16, None, "float32", 80),
    ],
)
def test_streamed_topk_equals_the_dense_reference(metric, block, stream, band, precision, window):
    from tests.support.stores import synthetic_rows

    rows = synthetic_rows(300, 96, seed=2)
    plan = plan_for(
        300, 96, block=block, stream=stream, band=band, metric=metric, k=8, precision=precision, window=window
    )

    def read(a: int, b: int, cols: tuple[int, int]) -> np.ndarray:
        return rows[a:b, cols[0] : cols[1]].copy()

    parts = [streamed_topk(read, plan, a, b) for a, b in plan.blocks()]
    index = np.concatenate([p[0] for p in parts])
    value = np.concatenate([p[1] for p in parts])
    assert index.dtype == np.int64 and value.dtype == np.float32 and index.shape == (300, 8)
    # float32: D + a few roundings per product (Higham 3.1), relative to |x||y| (1 for cosine);
    # float64: the final rounding to float32 dominates.
    terms = 96 + 8 if precision == "float32" else 1
    n = np.linalg.norm(rows.astype(np.float64), axis=1)
    tol = terms * U * (np.ones((300, 300)) if metric == "cosine" else np.outer(n, n))
    check_against_dense(rows, index, value, metric, 8, tol)
    # Each task reads every row once, and its own block once (once per window when banded).
    query_reads = len(plan.windows()) if band else 1
    assert all(
        p[2] == query_reads * (b - a) * 96 * 4 + 300 * 96 * 4 for p, (a, b) in zip(parts, plan.blocks(), strict=True)
    )
    assert sum(p[2] for p in parts) == plan.passes() * 300 * 96 * 4


@pytest.mark.parametrize("band, window", [(None, 0), (40, 0), (None, 48), (40, 48)])
def test_candidate_parts_merged_give_the_table_of_one_part(band, window):
    """A query block's neighbours from candidate parts, merged, equal those of every row at
    once: integer rows, so that every product is exact whatever the tiles, and many ties."""
    from classgrad.service.analysis.similarity_topk import PartMerger

    rows = np.random.default_rng(5).integers(-2, 3, size=(300, 96)).astype(np.float32)
    base = plan_for(300, 96, block=64, stream=16, band=band, metric="dot", k=8, window=window)

    def read(a: int, b: int, cols: tuple[int, int]) -> np.ndarray:
        return rows[a:b, cols[0] : cols[1]].copy()

    whole = [streamed_topk(read, base, a, b)[:2] for a, b in base.blocks()]
    parted = TopKPlan(**{**base.__dict__, "part_rows": 80})
    assert parted.parts() == [(0, 80), (80, 160), (160, 240), (240, 300)]
    merger = PartMerger(parted)
    merged = {}
    for a, b, c0, c1 in reversed(parted.tasks()):  # in any order
        index, value, read_bytes = streamed_topk(read, parted, a, b, (c0, c1))
        query_reads = len(parted.windows(c0, c1)) if band else 1
        assert read_bytes == (query_reads * (b - a) + (c1 - c0)) * 96 * 4
        block = merger.add({"start": a, "index": index, "value": value, "candidates": (c0, c1)})
        if block is not None:
            merged[block[0]] = block[1:]
    assert sorted(merged) == [a for a, _ in base.blocks()]
    ref_index, ref_value = reference_topk(rows.astype(np.float64) @ rows.T.astype(np.float64), 8)
    for (a, b), (index, value) in zip(base.blocks(), whole, strict=True):
        assert np.array_equal(merged[a][0], index) and np.array_equal(merged[a][1], value)
        assert np.array_equal(index, ref_index[a:b]) and np.array_equal(value, ref_value[a:b])


def test_a_top_k_run_in_parts_writes_the_table_of_one_part(tmp_path, monkeypatch):
    from classgrad.service.analysis.topk_plan import plan_topk as real_plan

    store, rows = synthetic_store(tmp_path / "s", num_classes=300)
    url = str(tmp_path / "s")
    compute_similarity(url, executor="local", top_k=6, dense=False, metric="dot")
    one = open_store(url).similarity_neighbours()
    # As on a cluster of 4 CPUs (8 tasks): 3 query blocks x 3 candidate parts, merged by the driver.
    monkeypatch.setattr(sim_module, "plan_topk", lambda store, config, workers=1: real_plan(store, config, 4))
    summary = compute_similarity(url, executor="local", top_k=6, dense=False, metric="dot")
    assert summary["tasks"] == 9 and summary["part_rows"] == 112 and summary["passes"] == 3 + 3
    assert summary["read_bytes"] == summary["passes"] * 300 * 96 * 4
    assert "index" not in summary["task_reports"][0]  # the partial tables stay with the driver
    index, value = open_store(url).similarity_neighbours()
    # The same products in other tiles: float32 sums over D = 96 terms, (D + 8) u |x||y| each.
    n = np.linalg.norm(rows.astype(np.float64), axis=1)
    assert (np.abs(value - one[1]) <= 2 * (96 + 8) * U * n[:, None] * n[one[0]]).all()
    assert (index == one[0]).mean() > 0.95
    assert verify_store(url).code == 0


def test_the_plan_at_a_million_classes_reads_the_store_blocks_plus_parts_times():
    """1,000,000 x 4,096 float32 rows (15.3 GiB) on 1,000 CPUs at the default 512 MiB per task:
    before, 62,500 query blocks of 16 rows (one window of every row's scores left room for no
    more), each streaming the whole store; now query blocks as large as the budget holds, and
    candidate parts for the rest of the 2,000 tasks."""
    from types import SimpleNamespace

    store = SimpleNamespace(num_classes=1_000_000, dim=4096, row_chunk=16, col_chunk=4096)
    plan = plan_topk(store, SimilarityConfig(), workers=1000)
    assert len(plan.tasks()) >= 2000 and plan.memory_bound()["total"] <= 512 << 20
    assert plan.block_rows >= 10_000 and plan.window_rows > 0  # 93 blocks, windows of scores
    assert plan.passes() == len(plan.blocks()) + len(plan.parts()) <= 120, plan  # 62,501 before
    # A budget that holds more rows than sqrt(tasks) blocks need: sqrt(2,000) blocks and parts.
    large = plan_topk(store, SimilarityConfig(task_mb=4096), workers=1000)
    assert large.memory_bound()["total"] <= 4096 << 20
    assert len(large.blocks()) == 45 and len(large.parts()) == 45 and large.passes() == 90


def test_top_k_only_run_writes_no_matrix_and_equals_the_dense_run(tmp_path):
    store, rows = synthetic_store(tmp_path / "s", num_classes=500)
    url = str(tmp_path / "s")
    dense = compute_similarity(url, executor="local", top_k=10, dense=True)
    reader = open_store(url)
    dense_index, dense_value = reader.similarity_neighbours()
    S = reader.similarity()
    summary = compute_similarity(url, executor="local", top_k=10, dense=False, block_rows=128)
    assert summary["dense"] is False and dense["dense"] is True and summary["tasks"] == 4
    assert not (tmp_path / "s" / "similarity").exists()  # no C x C array, not even its metadata
    info = reader.similarity_info()
    assert info["dense"] is False and info["state"] == "ready" and info["top_k"] == 10
    index, value = reader.similarity_neighbours()
    # Both are float32 products over D = 96 terms, summed in other orders: (D + 8) u each.
    tol = 2 * (96 + 8) * U
    assert (np.abs(value - dense_value) <= tol).all()
    ordered = -np.sort(-np.where(np.eye(500, dtype=bool), -np.inf, S), axis=1)[:, :11]
    clear = (np.diff(-ordered, axis=1) > 2 * tol).all(axis=1)
    clear[ZERO_ROW] = True  # exactly 0 in both
    assert clear.mean() > 0.9 and np.array_equal(index[clear], dense_index[clear])
    assert index[ZERO_ROW].tolist() == [0, 1, 2, 3, 4, 5, 6, 8, 9, 10]  # ties to the lower index
    with pytest.raises(StoreError, match=r"top-10 neighbour table only .*--dense"):
        reader.similarity([0])
    assert verify_store(url).code == 0
    for report in summary["task_reports"]:
        assert 0 <= report["rss_added"] <= summary["memory_bound_bytes"]
        assert report["read_bytes"] == (report["stop"] - report["start"] + 500) * 96 * 4  # own block + every row


def test_dense_or_top_k_only_and_the_one_line_refusals(tmp_path, monkeypatch):
    config = SimilarityConfig()
    assert wants_dense(config, 16_384) and not wants_dense(config, 16_385)  # 1 GiB of float32
    assert wants_dense(SimilarityConfig(dense=True), 60_000)
    with pytest.raises(ConfigError, match=r"100,000 x 100,000 float32 matrix would take 37\.3 GiB.*drop --dense"):
        wants_dense(SimilarityConfig(dense=True), 100_000)
    with pytest.raises(ConfigError, match=r"--top-k.*0 stores nothing.*--top-k-only"):
        wants_dense(SimilarityConfig(dense=False, top_k=0), 100)
    # Above the (lowered) automatic threshold, a run is top-k only unless asked.
    synthetic_store(tmp_path / "s", num_classes=64)
    monkeypatch.setattr(sim_module, "DENSE_AUTO_BYTES", 64 * 64 * 4 - 1)
    assert compute_similarity(str(tmp_path / "s"), executor="local", top_k=3)["dense"] is False
    assert compute_similarity(str(tmp_path / "s"), executor="local", top_k=3, dense=True)["dense"] is True
    assert (tmp_path / "s" / "similarity").exists()


def test_plan_stays_within_the_budget_and_bands_wide_rows(tmp_path):
    store, _ = synthetic_store(tmp_path / "s", num_classes=500, dim=4096, col_chunk=512)
    plan = plan_topk(store, SimilarityConfig(task_mb=60), workers=1)
    bound = plan.memory_bound()
    assert bound["total"] <= 60 << 20 and bound["total"] == sum(v for k, v in bound.items() if k != "total")
    assert plan.block_rows % 16 == 0 and plan.stream_rows % 16 == 0 and plan.band_cols == 4096
    # One block may hold every row (the table is then one chunk of all 500 rows).
    assert plan.chunk_rows == 500 if len(plan.blocks()) == 1 else plan.chunk_rows % 16 == 0
    assert len(plan.blocks()) == 1 or plan.block_rows % plan.chunk_rows == 0
    # Two workers: at least two tasks each, as 2 query blocks x 2 candidate parts (the store is
    # read 4 times: each block streams it once, each task reads its block once), not 4 blocks.
    two = plan_topk(store, SimilarityConfig(task_mb=512), workers=2)
    assert len(two.tasks()) >= 4 and len(two.blocks()) == len(two.parts()) == 2 and two.passes() == 4
    # A budget too small for full stream rows beside the query block: bands of column chunks.
    tight = plan_topk(store, SimilarityConfig(task_mb=30, block_rows=96), workers=1)
    assert tight.band_cols < 4096 and tight.band_cols % 512 == 0
    assert tight.memory_bound()["total"] <= 30 << 20
    with pytest.raises(ConfigError, match=r"--task-mb 29 cannot hold .* raise --task-mb to at least \d+"):
        plan_topk(store, SimilarityConfig(task_mb=29, block_rows=496), workers=1)
    # With a budget too small for every row's full rows, it bands them so that one task holds
    # every query row (two passes over the store instead of three).
    banded = plan_topk(store, SimilarityConfig(task_mb=44), workers=1)
    assert banded.band_cols < 4096 and len(banded.blocks()) == 1 and banded.passes() == 2


def test_cli_prints_a_sample_with_class_names_and_writes_no_matrix(tmp_path, capsys):
    names = tuple(f"c{i}" for i in range(64))
    synthetic_store(tmp_path / "s", num_classes=64, class_ids=tuple(range(100, 164)), class_names=names)
    url = str(tmp_path / "s")
    assert cli_main(["similarity", url, "--local", "--top-k", "7", "--top-k-only"]) == 0
    out = capsys.readouterr().out
    assert "top-7 neighbours per class (top-k only: no 64 x 64 matrix)" in out and "bound" in out
    sample = out.split("first 5 classes:\n")[1].splitlines()
    assert len(sample) == 5 and sample[0].startswith("  100 (c0): ") and sample[0].endswith(", +2 more")
    index, value = open_store(url).similarity_neighbours([0])
    first = f"{100 + index[0, 0]} (c{index[0, 0]}) {value[0, 0]:.3g}"
    assert sample[0].split(": ", 1)[1].startswith(first)
    assert not (tmp_path / "s" / "similarity").exists()
    assert cli_main(["similarity", url, "--local", "--top-k", "3", "--dense"]) == 0
    assert "the 64 x 64 matrix and the top-3" in capsys.readouterr().out
    assert open_store(url).similarity([0]).shape == (1, 64)
    # One line and exit 2: no neighbours without the matrix; both modes at once.
    assert cli_main(["similarity", url, "--local", "--top-k", "0", "--top-k-only"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("classgrad: error: similarity option top_k") and "\n" not in err
    with pytest.raises(SystemExit) as exc:
        cli_main(["similarity", url, "--dense", "--top-k-only"])
    assert exc.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_cli_refuses_a_dense_matrix_beyond_the_limit(tmp_path, capsys, monkeypatch):
    synthetic_store(tmp_path / "s", num_classes=64)
    monkeypatch.setattr(sim_module, "DENSE_MAX_BYTES", 64 * 64 * 4 - 1)
    assert cli_main(["similarity", str(tmp_path / "s"), "--local", "--dense"]) == 2
    err = capsys.readouterr().err.strip()
    assert "64 x 64 float32 matrix would take 16.0 KiB, above the limit" in err and "\n" not in err
    assert open_store(str(tmp_path / "s")).similarity_info() is None  # refused before any write


def test_plot_computes_the_heatmap_after_a_top_k_only_run(tmp_path):
    from classgrad.service.analysis.plot import plot_store

    synthetic_store(tmp_path / "s", num_classes=120)
    compute_similarity(str(tmp_path / "s"), executor="local", metric="dot", dense=False)
    result = plot_store(str(tmp_path / "s"), str(tmp_path / "png"), top_n=10)
    assert result["similarity_source"] == "computed"  # no matrix to read: from the rows


def test_inspect_and_verify_see_a_top_k_only_result(tmp_path, capsys):
    import shutil

    from classgrad.service.analysis.verify import METADATA

    synthetic_store(tmp_path / "s", num_classes=64)
    url = str(tmp_path / "s")
    compute_similarity(url, executor="local", top_k=4, dense=False)
    assert cli_main(["inspect", url]) == 0
    assert "similarity  cosine, top-4 only (no matrix), ready" in capsys.readouterr().out
    shutil.rmtree(tmp_path / "s" / "similarity_topk_value")  # a damaged result
    report = verify_store(url)
    assert report.code & METADATA
    assert any("similarity_topk_value is missing, expected [64, 4]" in p for p in report.problems["metadata"])


def test_the_benchmarks_numpy_baseline_finds_the_same_neighbours(tmp_path):
    """benchmarks/similarity.py compares the top-k route with numpy: like with like."""
    from benchmarks.similarity import numpy_topk

    _, rows = synthetic_store(tmp_path / "s", num_classes=300, seed=3)
    compute_similarity(str(tmp_path / "s"), executor="local", top_k=5, dense=False)
    ours = open_store(str(tmp_path / "s")).similarity_neighbours()[0]
    theirs = numpy_topk(str(tmp_path / "s"), 5, block=64)["index"]
    S = dense_similarity(rows, "cosine")
    best = -np.sort(-np.where(np.eye(300, dtype=bool), -np.inf, S), axis=1)[:, :6]
    # Rows whose 6 best are more than 2 x (D + 8) u apart (float32 products over D = 96 terms,
    # summed in different orders by the two) must agree exactly; the zero row ties everywhere.
    distinct = (np.diff(-best, axis=1) > 2 * (96 + 8) * U).all(axis=1)
    distinct[ZERO_ROW] = False
    assert distinct.mean() > 0.9 and np.array_equal(ours[distinct], theirs[distinct])


@pytest.mark.parametrize("option", ["--task-mb", "--block-mb"])
def test_a_memory_budget_beyond_a_pebibyte_is_refused_in_one_line(tmp_path, capsys, option):
    """Before: ``--task-mb 1e308`` was an internal error (OverflowError: its byte count is inf;
    issue 56, item 3)."""
    synthetic_store(tmp_path / "s", num_classes=64)
    assert cli_main(["similarity", str(tmp_path / "s"), "--local", option, "1e308"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"({option}): Input should be less than or equal to 1073741824, got 1e+308" in err and "\n" not in err


@pytest.mark.parametrize("dense", [False, True])
def test_a_result_chunk_copied_over_another_is_refused_and_verify_reports_it(tmp_path, dense):
    """Before: a chunk of ``similarity_topk_index`` (or ``similarity``) copied over another gave
    wrong neighbours and ``verify`` exited 0 (issue 60, item 6): every result chunk now has a
    digest in the result's records, checked on read and by verify."""
    import shutil

    from classgrad.errors import CorruptChunkError
    from classgrad.service.analysis.verify import CORRUPT

    synthetic_store(tmp_path / "s", num_classes=64)
    url = str(tmp_path / "s")
    compute_similarity(url, executor="local", top_k=4, dense=dense, block_rows=16)
    assert verify_store(url).code == 0
    reader = open_store(url)
    from classgrad.store.store_keys import list_keys

    keys = list_keys(reader._loc)  # the records are the store's own keys (deleted with it)
    assert not keys.others and any(k.startswith("similarity_records/") for k in keys.store)
    rc = int(reader.similarity_info()["chunk_rows"])
    assert rc < 64  # two chunks at least: one copied over the other
    name = "similarity" if dense else "similarity_topk_index"
    shutil.copyfile(tmp_path / "s" / name / "c" / "0" / "0", tmp_path / "s" / name / "c" / "1" / "0")
    read = (
        (lambda: open_store(url).similarity([rc])) if dense else (lambda: open_store(url).similarity_neighbours([rc]))
    )
    with pytest.raises(CorruptChunkError, match=rf"{name} rows {rc}-{2 * rc - 1} do not match their record"):
        read()
    assert open_store(url).similarity_neighbours([0])[0].shape == (1, 4)  # the other chunk reads
    report = verify_store(url)
    assert report.code & CORRUPT and any(f"{name} rows {rc}-" in p for p in report.problems["corrupt"])
