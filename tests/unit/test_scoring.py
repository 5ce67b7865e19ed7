"""``classgrad.service.analysis.scoring`` / ``score_driver`` / ``score_precondition`` and the store's
``preconditioner`` and score output, in this process (no Ray), on synthetic rows: scores equal a
float64 brute force for each method and form, over several query blocks, class blocks and column
bands; several checkpoints add up with their weights and stores of other rows are refused; the
preconditioner is saved once, reused, and refused once the rows change or its bytes do; every
score goes to a chunked, xarray-readable output; a run killed part-way resumes; and bad inputs
end in one line with nothing written."""

from __future__ import annotations

import numpy as np
import pytest
import zarr

import classgrad.service.analysis.score_precondition as precondition
from classgrad.errors import ConfigError, InputError, StoreMismatchError
from classgrad.service.analysis import scoring
from classgrad.service.analysis.score_driver import score_rows
from classgrad.service.commands.cli import main as cli_main
from classgrad.store import open_store
from tests.support.docs import python_blocks
from tests.support.stores import synthetic_store, write_all


def _store(path, num_classes=200, dim=24, seed=0, **spec):
    store, rows = synthetic_store(path, num_classes=num_classes, dim=dim, projected=True, seed=seed, **spec)
    return open_store(str(path), mode="r+"), rows.astype(np.float64)


def _queries(n, dim, seed=1):
    return np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)


def brute_force(q, phi, method, lam=None, fraction=0.1):
    q = q.astype(np.float64)
    if method == "dot":
        return q @ phi.T
    if method == "cosine":
        pn = np.linalg.norm(phi, axis=1)[:, None]
        return (q / np.linalg.norm(q, axis=1)[:, None]) @ np.divide(phi, pn, out=np.zeros_like(phi), where=pn > 0).T
    C, D = phi.shape
    gram = phi.T @ phi
    lam = fraction * np.trace(gram) / min(C, D) if lam is None else lam
    return q @ np.linalg.solve(gram + lam * np.eye(D), phi.T)


def _check_topk(result, full, k):
    want = -np.sort(-full, axis=1)[:, :k]
    # float32 products over D <= 24 terms (trak: float64 inverse, float32 transformed rows):
    # within 1e-5 of the largest score, and the rows picked carry the brute force's best scores.
    atol = 1e-5 * np.abs(full).max()
    np.testing.assert_allclose(result.scores.double().numpy(), want, rtol=0, atol=atol)
    np.testing.assert_allclose(np.take_along_axis(full, result.rows.numpy(), axis=1), want, rtol=0, atol=atol)


def _banded_task_mb(store, num_queries: int) -> float:
    """A task budget just too small for full rows beside 32 queries: the plan reads column bands."""
    base = scoring._SLACK_BYTES
    for extra in range(500, 200_000, 250):
        config = scoring.ScoreConfig(task_mb=(base + extra) / (1 << 20), block_rows=32, method="dot", top_k=7)
        try:
            plan = scoring.plan_scores(num_queries, store, config, num_stores=1, form=None)
        except ConfigError:
            continue
        if plan.band_cols < store.dim:
            return config.task_mb
    raise AssertionError("no budget gives column bands")


@pytest.mark.parametrize("method", ["dot", "cosine", "trak"])
def test_features_form_over_blocks_and_bands_equals_the_brute_force(tmp_path, method):
    store, phi = _store(tmp_path / "s", col_chunk=8)  # C = 200 > D = 24: trak in the features form
    q = _queries(70, 24)
    full = brute_force(q, phi, method)
    for options in ({"block_rows": 16}, {"block_rows": 70}, {"block_rows": 32, "task_mb": _banded_task_mb(store, 70)}):
        result = score_rows([store], [q], method=method, top_k=7, executor="local", **options)
        assert result.info["tasks"] == -(-70 // result.info["block_rows"])
        _check_topk(result, full, 7)
    assert result.info["band_cols"] < 24  # the last budget holds no full rows: column bands
    assert result.info["form"] == ("features" if method == "trak" else None)


def test_kernel_form_equals_the_brute_force_and_a_given_damping_is_used(tmp_path):
    store, phi = _store(tmp_path / "s", num_classes=40, dim=96, col_chunk=16, shard_rows=16)  # C < D: kernel
    q = _queries(30, 96)
    for damping, lam in ((None, None), (0.5, 0.5)):
        result = score_rows([store], [q], method="trak", top_k=5, damping=damping, block_rows=8, executor="local")
        assert result.info["form"] == "kernel"
        _check_topk(result, brute_force(q, phi, "trak", lam=lam), 5)
    assert result.info["damping"] == [0.5]


def test_fewer_classes_than_a_row_chunk_or_top_k(tmp_path):
    store, phi = _store(tmp_path / "s", num_classes=10, dim=16, row_chunk=16, shard_rows=16)
    q = _queries(3, 16)
    result = score_rows([store], [q], method="trak", top_k=20, executor="local")
    assert result.info["top_k"] == 10 and result.info["band_cols"] == 16  # k clamped to C; full rows read
    _check_topk(result, brute_force(q, phi, "trak"), 10)


def test_several_checkpoints_add_up_with_their_weights(tmp_path):
    a, phi_a = _store(tmp_path / "a", seed=0)
    b, phi_b = _store(tmp_path / "b", seed=4)
    qa, qb = _queries(20, 24, 1), _queries(20, 24, 2)
    result = score_rows([a, b], [qa, qb], method="trak", weights=[0.5, 2.0], top_k=6, block_rows=8, executor="local")
    full = 0.5 * brute_force(qa, phi_a, "trak") + 2.0 * brute_force(qb, phi_b, "trak")
    _check_topk(result, full, 6)


def test_stores_of_other_rows_are_refused(tmp_path):
    a, _ = _store(tmp_path / "a")
    other, _ = _store(tmp_path / "b", num_classes=100)
    q = _queries(4, 24)
    with pytest.raises(InputError, match="define their rows differently .*class_ids"):
        score_rows([a, other], [q, q], method="dot", executor="local")
    with pytest.raises(ConfigError, match="2 stores"):
        score_rows([a, a], [q, q], method="dot", weights=[1.0], executor="local")


def test_the_preconditioner_is_saved_once_and_refused_once_the_rows_change(tmp_path, monkeypatch):
    store, phi = _store(tmp_path / "s")
    q = _queries(10, 24)
    calls = []
    real = precondition.gram_matrix
    monkeypatch.setattr(precondition, "gram_matrix", lambda *a, **k: calls.append(1) or real(*a, **k))
    score_rows([store], [q], method="trak", executor="local")
    score_rows([store], [q], method="trak", damping_fraction=0.3, executor="local")
    assert len(calls) == 1  # computed once, reused with another damping
    info = store.preconditioner.info()
    assert info["state"] == "ready" and info["form"] == "features" and info["n"] == 24
    write_all(store, (phi * 2).astype(np.float32), shards=[0])  # shard 0 recomputed: other rows
    with pytest.raises(StoreMismatchError, match="changed since its preconditioner"):
        score_rows([store], [q], method="trak", executor="local")
    result = score_rows([store], [q], method="trak", recompute_preconditioner=True, executor="local")
    assert len(calls) == 2
    _check_topk(result, brute_force(q, store.rows(np.arange(200)).astype(np.float64), "trak"), 10)
    arr = zarr.open_array(str(tmp_path / "s" / "score_preconditioner"), mode="r+")
    arr[0, 0] = arr[0, 0] + 1.0  # damaged bytes
    with pytest.raises(StoreMismatchError, match="checksum"):
        score_rows([store], [q], method="trak", executor="local")


def test_verify_reads_the_preconditioner_and_a_damaged_one_names_its_fix(tmp_path):
    """Damaged bytes fail verify as corrupt; a chunk failing its crc32c is refused by score in one
    line naming --recompute-preconditioner, which replaces it; other rows give a note."""
    from classgrad.errors import StoreError
    from classgrad.service.analysis.verify import CORRUPT, verify_store

    store, phi = _store(tmp_path / "s")
    q = _queries(10, 24)
    score_rows([store], [q], method="trak", executor="local")
    assert verify_store(str(tmp_path / "s")).code == 0
    chunk = next(p for p in (tmp_path / "s" / "score_preconditioner").rglob("*") if p.is_file() and "c" in p.parts)
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    report = verify_store(str(tmp_path / "s"))
    assert report.code == CORRUPT and "--recompute-preconditioner` replaces it" in report.format(), report.format()
    with pytest.raises(StoreError, match="cannot read the preconditioner") as info:
        score_rows([store], [q], method="trak", executor="local")
    assert "--recompute-preconditioner" in str(info.value) and "\n" not in str(info.value)
    score_rows([store], [q], method="trak", recompute_preconditioner=True, executor="local")
    assert verify_store(str(tmp_path / "s")).code == 0
    arr = zarr.open_array(str(tmp_path / "s" / "score_preconditioner"), mode="r+")
    arr[0, 0] = arr[0, 0] + 1.0  # valid chunks, other bytes: the checksum tells
    report = verify_store(str(tmp_path / "s"))
    assert report.code == CORRUPT and "does not match its checksum" in report.format(), report.format()
    score_rows([store], [q], method="trak", recompute_preconditioner=True, executor="local")
    write_all(store, (phi * 2).astype(np.float32), shards=[0])  # other rows: stale, not damaged
    report = verify_store(str(tmp_path / "s"))
    assert report.code == 0 and any("computed from other rows" in n for n in report.notes), report.notes
    (tmp_path / "s" / "score_preconditioner" / "zarr.json").write_text("{garbled")  # reported, not raised
    report = verify_store(str(tmp_path / "s"))
    # CORRUPT from the preconditioner's check; the metadata check flags the same file (METADATA).
    assert report.code & CORRUPT and "cannot read the preconditioner" in report.format(), report.format()


def test_every_score_goes_to_a_chunked_xarray_readable_output(tmp_path):
    xr = pytest.importorskip("xarray")
    store, phi = _store(tmp_path / "s")
    q = _queries(40, 24)
    out = str(tmp_path / "scores.zarr")
    result = score_rows([store], [q], method="cosine", top_k=4, full=True, out=out, block_rows=16, executor="local")
    ds = xr.open_zarr(out)
    assert ds["scores"].dims == ("query", "class_id") and ds["scores"].shape == (40, 200)
    assert ds["scores"].data.chunksize[0] == 16
    full = brute_force(q, phi, "cosine")
    # float32 products of unit rows over 24 terms.
    np.testing.assert_allclose(ds["scores"].values, full, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(ds["topk_class_id"].values, result.class_ids.numpy())
    assert result.to_xarray()["topk_score"].dims == ("query", "rank")


def test_a_killed_run_resumes_and_another_request_is_refused(tmp_path, monkeypatch):
    store, phi = _store(tmp_path / "s")
    q = _queries(48, 24)
    out = str(tmp_path / "scores.zarr")
    real = scoring.score_task

    def dies_at_block_2(*args):
        if args[-1] == 2:
            raise KeyboardInterrupt  # a kill while block 2 is computed
        return real(*args)

    import classgrad.service.analysis.score_driver as driver

    monkeypatch.setattr(driver, "score_task", dies_at_block_2)
    with pytest.raises(KeyboardInterrupt):
        score_rows([store], [q], method="dot", out=out, block_rows=8, full=True, executor="local")
    monkeypatch.setattr(driver, "score_task", real)
    result = score_rows([store], [q], method="dot", out=out, block_rows=8, full=True, executor="local")
    assert result.info["blocks_skipped"] == 2 and result.info["tasks"] == 4
    _check_topk(result, brute_force(q, phi, "dot"), 10)
    with pytest.raises(StoreMismatchError, match="another request"):
        score_rows([store], [q], method="cosine", out=out, executor="local")


def test_bad_inputs_end_in_one_line_with_nothing_written(tmp_path, capsys):
    store, _ = _store(tmp_path / "s", num_classes=40, dim=96, col_chunk=16, shard_rows=16)
    q = _queries(5, 96)
    out = tmp_path / "scores.zarr"
    with pytest.raises(ConfigError, match="projection.dim"):
        score_rows([store], [q], method="trak", precond_mb=0.001, out=str(out), executor="local")
    with pytest.raises(InputError, match="query rows of shape"):
        score_rows([store], [q[:, :10]], method="dot", out=str(out), executor="local")
    assert not out.exists() and store.preconditioner.info() is None
    missing = tmp_path / "missing.yaml"
    assert cli_main(["score", str(tmp_path / "s"), "--queries", str(missing), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such file" in err[0]
    assert not out.exists()


@pytest.mark.parametrize(
    "option", [{"damping_fraction": float("inf")}, {"damping": float("nan")}, {"weights": [float("nan")]}]
)
def test_non_finite_damping_and_weights_are_refused(option, tmp_path):
    """Before: every score NaN and a top-k of 0, 1, 2, ... with exit code 0 (issue 45, item 4)."""
    store, _ = _store(tmp_path / "s", num_classes=40, dim=96, col_chunk=16, shard_rows=16)
    with pytest.raises(ConfigError, match="finite number"):
        score_rows([store], [_queries(3, 96)], method="trak", executor="local", **option)


def test_a_weight_beyond_float32_is_refused_in_one_line_naming_it(tmp_path, capsys):
    """Before: ``--weights 1e308`` ended in "internal error: RuntimeError: value cannot be
    converted to type float without overflow" (issue 56, item 3)."""
    store, _ = _store(tmp_path / "s", num_classes=40, dim=96, col_chunk=16, shard_rows=16)
    with pytest.raises(ConfigError, match=r"weights.*must be within float32's range"):
        score_rows([store], [_queries(3, 96)], method="dot", executor="local", weights=[1e308])
    # A binary file given as the query file (rows saved with numpy, say) is one line too, not an
    # internal error (found with this test: a UnicodeDecodeError).
    queries = tmp_path / "q.npy"
    np.save(queries, _queries(3, 96))
    code = cli_main(["score", str(tmp_path / "s"), "--queries", str(queries), "--weights=-1e308"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "not a text file" in err[0], err


@pytest.mark.parametrize(
    "option, name",
    [({"damping_fraction": 1e308}, "--damping-fraction 1e\\+308"), ({"damping": 1e308}, "--damping 1e\\+308")],
)
def test_a_damping_that_drowns_every_eigenvalue_is_refused_naming_it(option, name, tmp_path):
    """Before: ``--damping-fraction 1e308`` exited 0 with every score NaN, ``--damping 1e308``
    with every score 0.0 (issue 60, item 11)."""
    store, _ = _store(tmp_path / "s", num_classes=40, dim=96, col_chunk=16, shard_rows=16)
    with pytest.raises(ConfigError, match=rf"score option {name}: lambda .* more than 1e\+12 times"):
        score_rows([store], [_queries(3, 96)], method="trak", executor="local", **option)
    # The largest accepted still gives finite, ranked scores.
    result = score_rows([store], [_queries(3, 96)], method="trak", executor="local", damping_fraction=1e11)
    assert np.isfinite(result.scores.numpy()).all() and (result.scores.numpy() != 0).all()


def test_weights_whose_scores_overflow_float32_are_refused_before_any_score_is_written(tmp_path):
    """Weights within float32's range whose products with the scores leave it (issue 60, item 11):
    before, inf and NaN scores ranked as the best. The output is made before the tasks run (it
    is what a resume continues); no block of it is written or marked done."""
    from classgrad.store.analysis.score_output import ScoreOutput

    store, _ = _store(tmp_path / "s", num_classes=40, dim=96, col_chunk=16, shard_rows=16)
    out = tmp_path / "scores.zarr"
    with pytest.raises(InputError, match=r"scores overflow float32 .*lower --weights"):
        score_rows([store], [_queries(3, 96) * 1e3], method="dot", executor="local", weights=[3e38], out=str(out))
    assert not ScoreOutput.open(str(out)).block_done().any()


@pytest.mark.parametrize("option", [{"task_mb": 1e308}, {"precond_mb": 1e308}])
def test_a_memory_budget_beyond_a_pebibyte_is_refused_naming_it(option, tmp_path):
    """Issue 56, item 3: every number that becomes a byte count or a float32 is range-checked."""
    store, _ = _store(tmp_path / "s", num_classes=40, dim=96, col_chunk=16, shard_rows=16)
    with pytest.raises(ConfigError, match=rf"{next(iter(option))}.*less than or equal to 1073741824"):
        score_rows([store], [_queries(3, 96)], method="trak", executor="local", **option)


def test_a_changed_or_copied_chunk_of_a_score_output_is_refused(tmp_path):
    """Every output classgrad writes carries digests (issue 60, item 6): a top-k chunk of one
    query block copied over another's, or the query rows changed, are refused on the next read
    (a resume of the same request reads them), not returned as the scores."""
    import shutil

    from classgrad.errors import CorruptChunkError
    from classgrad.store.analysis.score_output import ScoreOutput

    store, _ = _store(tmp_path / "s", num_classes=40, dim=24, col_chunk=8, shard_rows=16)
    out = str(tmp_path / "scores.zarr")
    q = _queries(24, 24)
    first = score_rows([store], [q], method="dot", top_k=3, block_rows=8, executor="local", out=out)
    assert ScoreOutput.open(out).read_topk()[0].shape == (24, 3)
    shutil.copyfile(
        tmp_path / "scores.zarr" / "topk_row" / "c" / "0" / "0", tmp_path / "scores.zarr" / "topk_row" / "c" / "1" / "0"
    )
    with pytest.raises(
        CorruptChunkError, match=r"topk_row of query block 1 \(queries 8-15\) does not match its record"
    ):
        score_rows([store], [q], method="dot", top_k=3, block_rows=8, executor="local", out=out)  # a resume
    shutil.rmtree(out)  # what the refusal says to do
    score_rows([store], [q], method="dot", top_k=3, block_rows=8, executor="local", out=out)
    group = zarr.open_group(out, mode="r+")
    rows = group["query_rows"][...]
    rows[0, 3, 0] += 1.0
    group["query_rows"][...] = rows
    zarr.open_group(out, mode="r+")["block_done"][1] = 0  # a resume that must score block 1 again
    with pytest.raises(CorruptChunkError, match="its query rows do not match their digest"):
        score_rows([store], [q], method="dot", top_k=3, block_rows=8, executor="local", out=out)
    assert first.rows.shape == (24, 3)


def test_the_readme_score_snippet_runs(tmp_path):
    """The README's `classgrad score` Python snippet, as written, on a smaller store of the demo's job."""
    from pathlib import Path

    from classgrad.config import load_config
    from tests.support.jobs import run_without_ray

    repo = Path(__file__).resolve().parents[2]
    url = str(tmp_path / "demo.zarr")
    C = 200
    overrides = [f"model.kwargs.num_classes={C}", f"data.kwargs.num_classes={C}", f"loss.num_classes={C}"]
    run_without_ray(
        load_config(repo / "configs" / "demo.yaml", [*overrides, "sharding.shard_rows=64", f"store.url={url}"])
    )
    text = (repo / "README.md").read_text()
    block = python_blocks(text, "## Which classes a prediction leans on")[0]
    assert '"stores/demo.zarr"' in block
    namespace: dict = {}
    exec(compile(block.replace('"stores/demo.zarr"', repr(url)), "README.md", "exec"), namespace)  # noqa: S102
    result = namespace["result"]
    assert tuple(result.class_ids.shape) == (100, 5) and namespace["ds"]["topk_score"].shape == (100, 5)
