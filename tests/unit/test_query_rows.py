"""``classgrad.workers.actor_runtime.query``: query rows in a store's space. Rows of the store's own
probe examples (one per class) come out as the store's rows under every projection structure,
and as ``per_class_gradients``' rows of one-example classes; groups are their examples' mean;
the margin is the gradient of TRAK's margin; ``classgrad.score`` over each structure's store
equals a float64 brute force (dot, trak); a model of another layout, a store without its
projection record and an unknown query function are refused in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from classgrad.errors import InputError, StoreError
from classgrad.service.analysis.score_api import score
from classgrad.workers.actor_runtime.query import query_rows
from classgrad.workers.gradients import per_class_gradients
from classgrad.workers.zoo import mlp, synthetic_probe
from tests.support.jobs import MLP_JOB_CLASSES, mlp_job, run_without_ray

C = MLP_JOB_CLASSES
ONE_PER_CLASS = {"num_classes": C, "samples_per_class": 1, "kind": "vector", "input_shape": [8]}
STRUCTURES = {
    "full": None,
    "default": {"dim": 16},  # the default structure, recorded as such (tensorsketch)
    "dense": {"dim": 16, "structure": "dense"},
    "sketch": {"dim": 16, "structure": "sketch"},
    "kronecker": {"dim": 16, "structure": "kronecker"},
}


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """One store per projection structure, each of the same one-example-per-class probe set."""
    out = {}
    for name, projection in STRUCTURES.items():
        path = tmp_path_factory.mktemp(name)
        sections = {"data": {"kwargs": ONE_PER_CLASS}}
        if projection is not None:
            sections["projection"] = projection
        out[name] = run_without_ray(mlp_job(path, **sections))
    return out


def _probe():
    return synthetic_probe(**ONE_PER_CLASS)


@pytest.mark.parametrize("name", list(STRUCTURES))
def test_query_rows_of_the_probe_examples_are_the_store_rows(stores, name):
    store = stores[name]
    x, y = _probe()
    q = query_rows(store, (x, y))
    want = store.rows(np.searchsorted(store.class_ids, y.numpy()))
    # The same engine and projection code over the same examples; only the grouping of classes
    # into blocks differs, which may reorder float32 sums: a few ulps of the largest entry.
    assert q.rows.shape == want.shape
    np.testing.assert_allclose(q.rows.numpy(), want, rtol=0, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("name", ["full", "dense", "sketch"])
def test_query_rows_equal_per_class_gradients_of_one_example_classes(stores, name):
    store = stores[name]
    data = synthetic_probe(**{**ONE_PER_CLASS, "seed": 7})  # other examples than the store's
    q = query_rows(store, data)
    model = mlp(num_classes=C, in_features=8, hidden=16)
    want = per_class_gradients(model, data, num_classes=C, classes=data[1].tolist(), projection=STRUCTURES[name])
    # Same arithmetic per example (one class each); block boundaries may reorder float32 sums.
    np.testing.assert_allclose(q.rows.numpy(), want.numpy(), rtol=0, atol=1e-6 * float(want.abs().max()))


def test_group_rows_are_the_mean_of_their_examples(stores):
    store = stores["dense"]
    data = _probe()
    single = query_rows(store, data).rows
    groups = np.arange(C) // 3 * 10  # eight groups of three examples
    grouped = query_rows(store, data, groups=groups)
    assert grouped.rows.shape == (C // 3, 16) and grouped.groups.tolist() == list(range(0, 80, 10))
    want = single.reshape(C // 3, 3, 16).double().mean(dim=1)
    # A float64 mean of float32 rows, rounded once to float32.
    np.testing.assert_allclose(grouped.rows.numpy(), want.numpy(), rtol=1e-6, atol=1e-7)


def test_scores_of_groups_carry_their_group_ids(stores, tmp_path):
    xr = pytest.importorskip("xarray")
    groups = [f"g{i // 6}" for i in range(C)]  # four groups of six examples
    out = str(tmp_path / "scores.zarr")
    result = score(stores["dense"], None, _probe(), method="dot", top_k=3, groups=groups, out=out, executor="local")
    assert result.groups == ["g0", "g1", "g2", "g3"] and tuple(result.scores.shape) == (4, 3)
    assert xr.open_zarr(out)["group"].values.tolist() == ["g0", "g1", "g2", "g3"]
    assert result.to_xarray()["group"].values.tolist() == ["g0", "g1", "g2", "g3"]


def test_the_margin_is_the_gradient_of_the_negated_logit_margin(stores):
    store = stores["full"]
    x, y = _probe()
    q = query_rows(store, (x[:3], y[:3]), fn="margin").rows
    model = mlp(num_classes=C, in_features=8, hidden=16).eval()
    for i in range(3):
        z = model(x[i : i + 1])[0]
        others = torch.cat([z[: y[i]], z[y[i] + 1 :]])
        margin = torch.logsumexp(others, 0) - z[y[i]]
        grads = torch.autograd.grad(margin, list(model.parameters()))
        want = torch.cat([g.reshape(-1) for g in grads])
        # One example, the same float32 forward and backward: rounding differences only.
        torch.testing.assert_close(q[i], want, rtol=1e-5, atol=1e-6)


def test_a_model_of_another_layout_is_refused(stores):
    wider = mlp(num_classes=C, in_features=8, hidden=12)
    for name in ("full", "dense"):
        with pytest.raises(InputError, match="does not match"):
            query_rows(stores[name], _probe(), model=wider)


def test_query_data_the_model_cannot_take_is_refused_in_one_line(stores):
    x, y = _probe()
    with pytest.raises(InputError, match="forward failed") as info:
        query_rows(stores["full"], (x[:, :5], y))  # 5 features for a model of 8
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("fn", ["loss", "margin"])
def test_query_labels_outside_the_stores_classes_are_refused_in_one_line(stores, fn):
    """Before: the default store's hook path failed on the label and its refusal advised a dense
    projection (issue 45, item 8)."""
    x, y = _probe()
    y = y.clone()
    y[3] = C
    with pytest.raises(InputError, match=rf"query labels outside the store's classes \[0, {C}\): example 3") as info:
        query_rows(stores["default"], (x, y), fn=fn)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("fn", ["loss", "margin"])
def test_float_query_labels_are_refused_in_one_line(stores, fn):
    """Before: an internal error with fn loss, and accepted with fn margin (issue 60, item 14)."""
    x, y = _probe()
    with pytest.raises(InputError, match=r"query labels are float32: give the store's integer class ids") as info:
        query_rows(stores["default"], (x, y.float()), fn=fn)
    assert "\n" not in str(info.value)


class _WithoutRecord:
    """A projected store whose ``projection`` attribute is gone."""

    def __init__(self, store):
        self._store = store

    def __getattr__(self, name):
        return getattr(self._store, name)

    @property
    def attrs(self):
        return {k: v for k, v in self._store.attrs.items() if k != "projection"}


def test_a_store_without_its_projection_record_is_refused(stores):
    with pytest.raises(StoreError, match="no record of its rows' projection"):
        query_rows(_WithoutRecord(stores["kronecker"]), _probe())


def test_an_unknown_query_function_is_refused(stores):
    with pytest.raises(InputError, match="unknown"):
        query_rows(stores["full"], _probe(), fn="hinge")


def _brute_force(q: np.ndarray, phi: np.ndarray, method: str, fraction: float = 0.1) -> np.ndarray:
    """Every query x class score in float64, all at once."""
    if method == "dot":
        return q @ phi.T
    if method == "cosine":
        qn = np.linalg.norm(q, axis=1)[:, None]
        pn = np.linalg.norm(phi, axis=1)[:, None]
        return (q / qn) @ np.divide(phi, pn, out=np.zeros_like(phi), where=pn > 0).T
    C, D = phi.shape
    gram = phi.T @ phi
    lam = fraction * np.trace(gram) / min(C, D)
    return q @ np.linalg.solve(gram + lam * np.eye(D), phi.T)


@pytest.mark.parametrize("method", ["dot", "trak"])  # cosine's arithmetic: test_scoring.py
@pytest.mark.parametrize("name", list(STRUCTURES))
def test_scores_of_every_structure_equal_a_float64_brute_force(stores, name, method):
    store = stores[name]
    data = synthetic_probe(**{**ONE_PER_CLASS, "samples_per_class": 2, "seed": 3})
    got = score(store, None, data, method=method, top_k=5, executor="local")
    q = query_rows(store, data).rows.double().numpy()
    full = _brute_force(q, store.rows(np.arange(C)).astype(np.float64), method)
    want = -np.sort(-full, axis=1)[:, :5]
    # float32 products over k <= 824 terms (trak: float64 inverse, float32 transformed rows):
    # within 1e-5 of the largest score; the ids are those of the brute force's best scores.
    scale = np.abs(full).max()
    np.testing.assert_allclose(got.scores.double().numpy(), want, rtol=0, atol=1e-5 * scale)
    picked = np.take_along_axis(full, got.rows.numpy(), axis=1)
    np.testing.assert_allclose(picked, want, rtol=0, atol=1e-5 * scale)
    assert got.class_ids.tolist() == store.class_ids[got.rows.numpy()].tolist()


def test_a_logit_store_takes_the_query_s_own_logit(tmp_path):
    store = run_without_ray(mlp_job(tmp_path, loss={"kind": "logit"}, data={"kwargs": ONE_PER_CLASS}))
    x, y = _probe()
    q = query_rows(store, (x[:4], y[:4]))
    model = mlp(num_classes=C, in_features=8, hidden=16)
    for i in range(4):
        want = per_class_gradients(
            model, (x[i : i + 1], y[i : i + 1]), num_classes=C, loss="logit", classes=[int(y[i])]
        )
        # One example's d z_y / d theta, by the partitioned engine and by the dense engine's head path.
        torch.testing.assert_close(q.rows[i], want[0], rtol=1e-5, atol=1e-6)


def test_the_command_prints_a_sample_resumes_and_refuses_another_request(stores, tmp_path, capsys):
    from classgrad.service.commands.cli import main as cli_main

    queries = tmp_path / "queries.yaml"
    queries.write_text(
        "data:\n  factory: classgrad.workers.zoo:synthetic_probe\n"
        f"  kwargs: {{num_classes: {C}, samples_per_class: 1, kind: vector, input_shape: [8], seed: 3}}\n"
    )
    out = str(tmp_path / "scores.zarr")
    args = ["score", stores["dense"].url, "--queries", str(queries), "--method", "dot", "--top-k", "3", "--local"]
    assert cli_main([*args, "--out", out]) == 0
    printed = capsys.readouterr().out
    assert "24 queries x 24 classes" in printed and "query 0:" in printed
    assert cli_main([*args, "--out", out]) == 0
    assert "1 done before (resumed)" in capsys.readouterr().out
    assert cli_main([*args, "--out", out, "--top-k", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "another request" in err[0]


def test_the_command_refuses_bad_requests_in_one_line_before_any_model_runs(stores, tmp_path, capsys, monkeypatch):
    from classgrad.service.commands.cli import main as cli_main
    from classgrad.workers.actor_runtime import query

    monkeypatch.setattr(query, "engine_from_parts", lambda *a, **k: pytest.fail("a model ran"))
    queries = tmp_path / "queries.yaml"
    queries.write_text(f"data:\n  factory: classgrad.workers.zoo:synthetic_probe\n  kwargs: {ONE_PER_CLASS}\n")
    out = tmp_path / "scores.zarr"
    base = ["score", stores["full"].url, "--queries", str(queries), "--local"]
    for extra, words in (
        (["--precond-mb", "0.001", "--out", str(out)], "projection.dim"),  # trak too large for either form
        (["--all-scores", "--method", "dot"], "needs an output (--out)"),
        (["--method", "dot", "--fn", "hinge", "--out", str(out)], "query fn 'hinge' is unknown"),
    ):
        assert cli_main([*base, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err
    assert not out.exists()
    # Issue 45, item 6: a file without a factory scored the default probe set; a group field on
    # samples that are not dicts printed a torch warning with a source line before its line.
    no_factory = tmp_path / "no_factory.yaml"
    no_factory.write_text(f"data:\n  kwargs: {ONE_PER_CLASS}\n")
    tuples = tmp_path / "tuples.yaml"
    tuples.write_text(queries.read_text() + "group_field: nope\n")
    # Typos in a query file: the key as written, the keys its section takes, and no command-line
    # flag (a file's key has none).
    misspelt = tmp_path / "misspelt.yaml"
    misspelt.write_text(f"data:\n  factori: classgrad.workers.zoo:synthetic_probe\n  kwargs: {ONE_PER_CLASS}\n")
    batch_typo = tmp_path / "batch_typo.yaml"
    batch_typo.write_text(queries.read_text() + "  batch_sise: 4\n")
    for path, words in (
        (no_factory, "data.factory is missing"),
        (tuples, "group_field 'nope': the query samples"),
        (misspelt, "data.factory is missing: name the factory of the query set (data has: factori, kwargs)"),
        (batch_typo, "option data.batch_sise: unknown key (choices: factory, kwargs, batch_size,"),
    ):
        assert cli_main(["score", stores["full"].url, "--queries", str(path), "--local"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0] and "(--" not in err[0], err


def test_a_query_file_s_group_field_gives_each_example_s_group():
    from classgrad.service.analysis.score_api import QueryFile, query_data

    spec = QueryFile(
        data={"factory": "tests.support.hf_jobs:job_vector_rows", "kwargs": {"num_classes": 3, "per_class": 2}},
        group_field="labels",
    )
    data, groups = query_data(spec)
    assert len(data) == 6 and groups == [0, 0, 1, 1, 2, 2]
    with pytest.raises(InputError, match="group_field 'nope'"):
        query_data(QueryFile(data=spec.data, group_field="nope"))


def test_padded_token_queries_take_the_models_pad_id_as_the_store_did(tmp_path):
    """A GPT-2 store whose pad id is not 0 (the eos id, as docs/huggingface.md sets it): query
    batches are padded with it as the store's probe batches were, so the rows of the store's own
    examples come out as its rows (padded with 0, the model would read pads as tokens)."""
    from tests.support import hf_jobs
    from tests.support.hf_models import tiny_gpt2

    k = 4
    store = run_without_ray(
        mlp_job(
            tmp_path,
            model={"factory": "tests.support.hf_models:tiny_gpt2", "kwargs": {"num_classes": k, "pad_token_id": 47}},
            data={
                "factory": "tests.support.hf_jobs:job_text_rows",
                "kwargs": {"num_classes": k, "per_class": 1},
                "collate": "pad",
            },
            loss={"num_classes": k},
        )
    )
    examples = hf_jobs.job_text_rows(k, 1)
    # The model given: the store's config records the factory's kwargs with pad_token_id
    # redacted (a key with the word "token"), so it cannot be rebuilt from the store.
    q = query_rows(store, examples, model=tiny_gpt2(k, pad_token_id=47))
    want = store.rows(np.searchsorted(store.class_ids, [int(e["labels"]) for e in examples]))
    # The same forward per example, in other batches: float32 sums of a transformer in another
    # order, 1e-5 of the largest entry (padded with 0, they differ by tens of percent).
    np.testing.assert_allclose(q.rows.numpy(), want, rtol=0, atol=1e-5 * np.abs(want).max())
