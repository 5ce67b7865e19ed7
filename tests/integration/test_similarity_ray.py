"""``classgrad similarity`` on a real local Ray: the tasks run in Ray worker processes, read
their blocks from the store and write their strips themselves; the result equals a dense numpy
computation and the in-process executor's; the top-k-only route's table equals the dense
route's (and the in-process executor's) and writes no matrix; a task that hits a corrupt chunk
fails the command with that chunk's one-line message; and every snippet of docs/reading.md runs
as written."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

from classgrad.errors import CorruptChunkError, StoreError
from classgrad.service.analysis.similarity import compute_similarity
from classgrad.service.commands.cli import main as cli_main
from classgrad.store import ParamSlot, StoreSpec, create_store, open_store
from tests.support.stores import dense_similarity, synthetic_store, write_all

REPO = Path(__file__).resolve().parents[2]
U = 2.0**-24


def test_ray_tasks_match_numpy_and_the_local_executor(ray_local, tmp_path):
    store, rows = synthetic_store(tmp_path / "s", num_classes=500)
    url = str(tmp_path / "s")
    summary = compute_similarity(url, top_k=8, block_rows=128)
    assert summary["executor"] == "ray" and summary["tasks"] == 4
    pids = {r["pid"] for r in summary["task_reports"]}
    assert os.getpid() not in pids  # computed in Ray workers, not here
    for r in summary["task_reports"]:
        assert 0 <= r["rss_added"] <= summary["memory_bound_bytes"]
    reader = open_store(url)
    on_ray = reader.similarity()
    index_ray = reader.similarity_neighbours()[0]
    # float32 products over D = 96 terms: error <= ~(D + 4) u for cosine (see the unit tests).
    bound = (rows.shape[1] + 4) * U
    assert np.abs(on_ray - dense_similarity(rows, "cosine")).max() <= bound
    assert np.array_equal(on_ray, on_ray.T)
    compute_similarity(url, top_k=8, block_rows=128, executor="local")
    local = reader.similarity()
    # Same algorithm; BLAS may split the sums differently with other thread counts: both are
    # within the bound of the exact value, so within twice of each other.
    assert np.abs(on_ray - local).max() <= 2 * bound
    assert (reader.similarity_neighbours()[0] == index_ray).mean() > 0.99  # near-ties may swap


def test_top_k_only_on_ray_equals_the_dense_route(ray_local, tmp_path):
    store, rows = synthetic_store(tmp_path / "s", num_classes=600, seed=5)
    url = str(tmp_path / "s")
    compute_similarity(url, top_k=6, dense=True)
    reader = open_store(url)
    S = reader.similarity()
    dense_index, dense_value = reader.similarity_neighbours()
    summary = compute_similarity(url, top_k=6, dense=False, block_rows=160)
    assert summary["dense"] is False and summary["tasks"] == 4 and summary["stream_rows"] >= 16
    assert os.getpid() not in {r["pid"] for r in summary["task_reports"]}  # in Ray workers
    for r in summary["task_reports"]:
        assert 0 <= r["rss_added"] <= summary["memory_bound_bytes"]
    assert not (tmp_path / "s" / "similarity").exists()
    index, value = reader.similarity_neighbours()
    # Both routes: float32 products over D = 96 terms in other orders, (D + 8) u each.
    tol = 2 * (rows.shape[1] + 8) * U
    assert (np.abs(value - dense_value) <= tol).all()
    # Distinct scores (no two of a row's 7 best within 2 tol of each other) give the same indices.
    best = -np.sort(-np.where(np.eye(600, dtype=bool), -np.inf, S), axis=1)[:, :7]
    distinct = (np.diff(-best, axis=1) > 2 * tol).all(axis=1)
    assert distinct.mean() > 0.9 and np.array_equal(index[distinct], dense_index[distinct])
    compute_similarity(url, top_k=6, dense=False, block_rows=160, executor="local")
    assert np.array_equal(reader.similarity_neighbours()[0][distinct], index[distinct])
    # More tasks than the budget's query blocks: candidate parts, whose partial tables come
    # back from the Ray workers and are merged by the driver.
    parted = compute_similarity(url, top_k=6, dense=False, tasks_per_cpu=8)
    assert parted["part_rows"] < 600 and parted["tasks"] > len(range(0, 600, parted["block_rows"]))
    assert parted["passes"] < parted["tasks"]  # not one pass over the store per task
    assert np.array_equal(reader.similarity_neighbours()[0][distinct], index[distinct])


def test_a_failing_task_fails_the_run_with_one_line(ray_local, tmp_path, capsys):
    synthetic_store(tmp_path / "s", num_classes=128)
    chunk = tmp_path / "s" / "grads" / "c" / "5" / "1"
    data = bytearray(chunk.read_bytes())
    data[12] ^= 0x04
    chunk.write_bytes(bytes(data))
    with pytest.raises(CorruptChunkError, match=r"grads chunk \(5, 1\)"):
        compute_similarity(str(tmp_path / "s"), block_rows=32)
    with pytest.raises(StoreError, match="unfinished"):
        open_store(str(tmp_path / "s")).similarity([0])
    assert open_store(str(tmp_path / "s")).lease.info() is None  # the lease was released
    assert cli_main(["similarity", str(tmp_path / "s"), "--block-rows", "32"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "grads chunk (5, 1)" in err


def test_ray_tasks_on_object_storage(ray_local, s3_bucket, s3_storage_options):
    """Tasks open the store on S3 themselves (storage options travel with them); a rerun
    replaces the previous arrays there too; verify sees the result."""
    url = f"s3://{s3_bucket}/store"
    spec = StoreSpec(num_classes=64, dim=48, shard_rows=32, row_chunk=16, col_chunk=24, fingerprint="s3")
    rows = np.random.default_rng(1).standard_normal((64, 48)).astype(np.float32)
    write_all(create_store(url, spec, storage_options=s3_storage_options), rows)
    compute_similarity(url, storage_options=s3_storage_options, top_k=3, block_rows=16)
    summary = compute_similarity(url, storage_options=s3_storage_options, metric="dot", top_k=2, block_rows=32)
    assert summary["tasks"] == 2
    reader = open_store(url, storage_options=s3_storage_options)
    ref = dense_similarity(rows, "dot")
    norms = np.linalg.norm(rows.astype(np.float64), axis=1)
    # float32 products over 48 terms: see the unit tests' float32_bound.
    assert (np.abs(reader.similarity() - ref) <= 52 * U * np.outer(norms, norms)).all()
    assert reader.similarity_neighbours()[0].shape == (64, 2)
    from classgrad.service.analysis.verify import verify_store

    assert verify_store(url, storage_options=s3_storage_options).code == 0


def demo_like_store(path: Path) -> None:
    """A store with the demo job's layout (its second hidden layer, "2.*") and 300 classes."""
    rng = np.random.default_rng(0)
    spec = StoreSpec(
        num_classes=300,
        dim=1056,
        shard_rows=64,
        row_chunk=32,
        layout=(ParamSlot("2.weight", (32, 32), 0, 1024), ParamSlot("2.bias", (32,), 1024, 32)),
        fingerprint="demo-like",
        loss_kind="cross_entropy",
    )
    write_all(create_store(str(path), spec), (0.01 * rng.standard_normal((300, 1056))).astype(np.float32))


def doc_blocks(text: str) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in re.finditer(r"```(python|console)\n(.*?)```", text, flags=re.S)]


def test_docs_reading_snippets_run_as_written(ray_local, tmp_path, monkeypatch, capsys):
    demo_like_store(tmp_path / "stores" / "demo.zarr")
    monkeypatch.chdir(tmp_path)  # the snippets' relative paths: stores/, plots, grad.safetensors
    blocks = doc_blocks((REPO / "docs" / "reading.md").read_text())
    assert [kind for kind, _ in blocks].count("console") == 1 and len(blocks) == 6
    namespace: dict = {}
    commands = []
    for kind, body in blocks:
        if kind == "python":
            exec(compile(body, "docs/reading.md", "exec"), namespace)  # noqa: S102
            continue
        for line in body.splitlines():
            argv = shlex.split(line, comments=True)
            assert argv[:2][0] == "$" and argv[1] == "classgrad", line
            commands.append(argv[2])
            assert cli_main(argv[2:]) == 0, line
    assert commands == ["inspect", "verify", "similarity", "plot", "aggregate"]
    assert namespace["rows"].shape == (2, 1056) and namespace["weight"].shape == (2, 32, 32)
    assert namespace["S"].shape == (2, 300) and namespace["index"].shape == (1, 10)
    assert namespace["lazy"].dims == ("class_id", "other_class_id")
    assert namespace["row"].shape == (1056,) and namespace["cols"].shape == (300, 1024)
    assert namespace["by_name"].shape == (300, 1024) and namespace["shape"] == (32, 32)
    assert namespace["true"]["grads"].dtype == np.float32
    assert namespace["mean"] == pytest.approx(namespace["grads"].mean(axis=0).values)
    assert sorted(os.listdir(tmp_path / "plots")) == ["class_norms.png", "param_norms.png", "similarity_heatmap.png"]
    model = namespace["model"]
    assert model.get_parameter("2.bias").grad is not None  # loaded, then stepped
    assert model.get_parameter("0.bias").grad is None  # not in the store: left alone
    capsys.readouterr()
