"""``classgrad.service.analysis.similarity`` without Ray (the in-process executor runs the very task
function Ray runs): the stored matrix and top-k table equal a dense numpy computation on a
500-class store, for every store dtype, projected stores, cosine and dot, column bands; reruns
replace the result; incomplete stores and bad options are refused with one clear line."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from classgrad.errors import ConfigError, StoreError, StoreIncompleteError
from classgrad.service.analysis.similarity import (
    SimilarityConfig,
    compute_similarity,
    plan_similarity,
    top_k_rows,
)
from classgrad.service.commands.cli import main as cli_main
from classgrad.store import open_store
from tests.support.stores import ZERO_ROW, dense_similarity, synthetic_store

U = 2.0**-24  # float32 unit roundoff


def float32_bound(rows: np.ndarray, metric: str, terms: int) -> np.ndarray:
    """Entrywise error bound of a float32 dot product of ``terms`` terms: |fl(x.y) - x.y| <=
    ~terms * u * |x| |y| (Higham, Thm 3.1; BLAS may sum in any order); divided by |x| |y| for
    cosine (the norms themselves are summed in float64 and scale by one more rounding). Four
    extra roundings cover the normalisation and the final cast to float32."""
    gamma = (terms + 4) * U
    if metric == "cosine":
        return np.full((rows.shape[0],) * 2, gamma)
    n = np.linalg.norm(rows.astype(np.float64), axis=1)
    return gamma * n[:, None] * n[None, :]


def check_result(store, rows: np.ndarray, metric: str, top_k: int, bound: np.ndarray) -> None:
    ref = dense_similarity(rows, metric)
    got = store.similarity()
    assert got.dtype == np.float32 and got.shape == ref.shape
    assert (np.abs(got - ref) <= bound).all()  # bound: see float32_bound
    assert np.array_equal(got, got.T)  # symmetric by construction, bit for bit
    index, value = store.similarity_neighbours()
    C = rows.shape[0]
    assert index.shape == (C, top_k) and value.shape == (C, top_k)
    assert not (index == np.arange(C)[:, None]).any()  # self excluded
    assert np.array_equal(value, np.take_along_axis(got, index, axis=1))  # table matches matrix
    assert (np.diff(value, axis=1) <= 0).all()  # best first
    masked = ref.copy()
    np.fill_diagonal(masked, -np.inf)
    ref_top = -np.sort(-masked, axis=1)[:, : top_k + 1]
    # The k values are the k largest, up to the same error bound (robust to near-ties).
    assert (np.abs(value - ref_top[:, :top_k]) <= bound.max(axis=1, keepdims=True)).all()
    # Where the reference has a clear gap after the k-th value, the index sets agree exactly.
    ref_idx = np.argsort(-masked, axis=1, kind="stable")[:, :top_k]
    clear = ref_top[:, top_k - 1] - ref_top[:, top_k] > 2 * bound.max(axis=1)
    assert clear.mean() > 0.9
    for r in np.flatnonzero(clear):
        assert set(index[r]) == set(ref_idx[r])


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_cosine_matches_dense_numpy_for_every_dtype(tmp_path, dtype):
    store, rows = synthetic_store(tmp_path / "s", dtype=dtype)
    summary = compute_similarity(str(tmp_path / "s"), executor="local", top_k=10, block_rows=128)
    assert summary["tasks"] == 4 and summary["block_rows"] == 128
    reader = open_store(str(tmp_path / "s"))
    # Low-precision stores are compared on what the reader returns (true float32 values).
    check_result(reader, rows, "cosine", 10, float32_bound(rows, "cosine", rows.shape[1]))
    info = reader.similarity_info()
    assert info["state"] == "ready" and info["metric"] == "cosine" and info["top_k"] == 10
    # A class without samples (zero row) is similar to nothing: 0 in its row and column, and
    # its neighbours are the lowest row indices (ties go to the lower index).
    S = reader.similarity()
    assert not S[ZERO_ROW].any() and not S[:, ZERO_ROW].any()
    nearest = reader.similarity_neighbours([ZERO_ROW])[0][0]
    assert nearest.tolist() == [0, 1, 2, 3, 4, 5, 6, 8, 9, 10]


def test_dot_with_column_bands_and_projected_store(tmp_path):
    store, rows = synthetic_store(tmp_path / "s", projected=True, dim=72, col_chunk=16)
    summary = compute_similarity(
        str(tmp_path / "s"), executor="local", metric="dot", top_k=5, block_rows=96, band_cols=32
    )
    assert summary["band_cols"] == 32 and summary["tasks"] == 6  # 500 rows / 96, 3 bands
    # Three bands summed in float32: two more roundings on top of the per-band products.
    check_result(open_store(str(tmp_path / "s")), rows, "dot", 5, float32_bound(rows, "dot", rows.shape[1] + 2))


def test_float64_precision(tmp_path):
    store, rows = synthetic_store(tmp_path / "s", num_classes=200)
    compute_similarity(str(tmp_path / "s"), executor="local", metric="dot", top_k=3, precision="float64", block_rows=64)
    got = open_store(str(tmp_path / "s")).similarity()
    ref = dense_similarity(rows, "dot")
    # float64 products, then one rounding to float32: half a float32 ulp of each value, plus
    # float64 roundoff (D * 2^-53 * |x||y|, far below it).
    assert (np.abs(got - ref) <= U * np.abs(ref) + 1e-12).all()


def test_rerun_replaces_the_result_and_stale_writers_are_refused(tmp_path):
    store, rows = synthetic_store(tmp_path / "s", num_classes=100)
    url = str(tmp_path / "s")
    first = compute_similarity(url, executor="local", top_k=4)
    compute_similarity(url, executor="local", metric="dot", top_k=2)
    reader = open_store(url)
    info = reader.similarity_info()
    assert info["metric"] == "dot" and info["top_k"] == 2 and info["run_id"] != first["run_id"]
    assert reader.similarity_neighbours()[0].shape == (100, 2)
    assert (
        np.abs(reader.similarity() - dense_similarity(rows, "dot")) <= float32_bound(rows, "dot", rows.shape[1])
    ).all()  # see float32_bound
    # A run that dies after starting leaves a result readers refuse, and a task of an older
    # run can no longer write into the new arrays.
    store.similarity_arrays.begin(metric="cosine", top_k=3, chunk_rows=16, run_id="crashed")
    with pytest.raises(StoreError, match="unfinished"):
        reader.similarity([0])
    with pytest.raises(StoreError, match="no longer owns"):
        store.similarity_arrays.write_rows(0, np.zeros((16, 100)), run_id=first["run_id"])
    with pytest.raises(StoreError, match="misaligned"):
        store.similarity_arrays.write_rows(8, np.zeros((16, 100)), run_id="crashed")


def test_incomplete_store_is_refused_naming_the_missing_rows(tmp_path):
    synthetic_store(tmp_path / "s", shards=[0, 1, 2, 5])
    with pytest.raises(StoreIncompleteError, match=r"rows \[192, 320\), \[384, 500\)"):
        compute_similarity(str(tmp_path / "s"), executor="local")
    assert open_store(str(tmp_path / "s")).similarity_info() is None  # nothing was written


def test_options_are_checked_before_any_work(tmp_path):
    synthetic_store(tmp_path / "s", num_classes=64)
    url = str(tmp_path / "s")
    with pytest.raises(
        ConfigError,
        match=r"--block-rows must be a positive multiple of the "
        r"store's row_chunk \(16\), got 20",
    ):
        compute_similarity(url, executor="local", block_rows=20)
    with pytest.raises(ConfigError, match="--block-rows"):
        compute_similarity(url, executor="ray", block_rows=20)  # refused before Ray starts
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()
    with pytest.raises(ConfigError, match=r"top_k \(--top-k\).*greater than or equal to 0"):
        compute_similarity(url, executor="local", top_k=-1)
    with pytest.raises(ConfigError, match=r"metric \(--metric\)"):
        compute_similarity(url, executor="local", metric="euclid")


def test_plan_sizes_and_memory_bound(tmp_path):
    store, _ = synthetic_store(tmp_path / "s", num_classes=500, dim=4096, col_chunk=512)
    # Automatic: strips within the budget, >= 2 tasks per CPU, whole row chunks.
    plan = plan_similarity(store, SimilarityConfig(block_mb=1.0), workers=4)
    assert plan.block_rows % 16 == 0 and plan.block_rows * 500 * 4 <= 1 << 20
    assert len(plan.blocks()) >= 8
    # A block of full rows above the budget is read in bands of whole column chunks.
    assert plan.band_cols % 512 == 0 and plan.block_rows * plan.band_cols * 4 <= 1 << 20
    bound = plan.memory_bound()
    assert bound["total"] == sum(v for k, v in bound.items() if k != "total")
    assert plan.top_k == 10 and plan.chunk_rows == 16
    small = plan_similarity(store, SimilarityConfig(top_k=10**6), workers=1)
    assert small.top_k == 499  # clamped to C - 1


def test_task_reports_memory_within_the_bound(tmp_path):
    synthetic_store(tmp_path / "s", num_classes=256)
    summary = compute_similarity(str(tmp_path / "s"), executor="local", block_rows=64)
    for report in summary["task_reports"]:
        assert 0 <= report["rss_added"] <= summary["memory_bound_bytes"]
        assert (
            report["read_bytes"]
            == (report["stop"] - report["start"] + 256) * 96 * 4 - (report["stop"] - report["start"]) * 96 * 4
        )  # own block once, every block once


def test_top_k_ties_go_to_the_lower_index():
    strip = np.array([[0.0, 5.0, 1.0, 1.0, 1.0, 1.0], [2.0, 9.0, 2.0, 2.0, 3.0, 2.0]], dtype=np.float32)
    index, value = top_k_rows(strip, 0, 3)
    # Row 0 excludes column 0; row 1 excludes column 1 (its own).
    assert index.tolist() == [[1, 2, 3], [4, 0, 2]]
    assert value.tolist() == [[5.0, 1.0, 1.0], [3.0, 2.0, 2.0]]


def test_cli(tmp_path, capsys):
    synthetic_store(tmp_path / "s", num_classes=64)
    assert cli_main(["similarity", str(tmp_path / "s"), "--local", "--top-k", "3"]) == 0
    out = capsys.readouterr().out
    assert "cosine of 64 classes x 96" in out and "top-3" in out and "bound" in out
    synthetic_store(tmp_path / "t", num_classes=200, shards=[0])
    assert cli_main(["similarity", str(tmp_path / "t"), "--local"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("classgrad: error: store") and "rows [64, 200)" in err
    assert "\n" not in err  # one line, no traceback


def test_help_states_the_config_defaults():
    """Defaults live in the configs; the commands' --help repeats them, so check they agree."""
    import argparse
    import re

    from classgrad.service.analysis.aggregate import AggregateConfig
    from classgrad.service.analysis.plot import PlotConfig
    from classgrad.service.commands import aggregate, plot, similarity

    cases = [
        (
            similarity,
            SimilarityConfig,
            {
                "--top-k": "top_k",
                "--metric": "metric",
                "--block-mb": "block_mb",
                "--task-mb": "task_mb",
                "--precision": "precision",
                "--num-cpus": "num_cpus",
            },
        ),
        (plot, PlotConfig, {"--top-n": "top_n", "--dpi": "dpi"}),
        (aggregate, AggregateConfig, {"--weights": "weights"}),
    ]
    checked = 0
    for module, config, flags in cases:
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        for action in parser._actions:
            for flag in set(action.option_strings) & set(flags):
                assert action.default is None, flag  # not given -> the config's default
                match = re.search(r"\(default ([^;)]+)[;)]", action.help) or re.search(
                    r"'(\w+)' \(default\)", action.help
                )
                stated, default = match.group(1), config.model_fields[flags[flag]].default
                assert stated == str(default) or float(stated) == default, flag
                checked += 1
    assert checked == 9
