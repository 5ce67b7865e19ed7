"""Unit tests of the fingerprint scheme (src/classgrad/config/fingerprint.py) and of resuming a store
written before it: defaults and old module spellings leave the fingerprint alone, a config recorded
in an old store is recognised as the same job, and a different job is still refused."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from classgrad.config import FINGERPRINT_VERSION, JobConfig, load_config, recorded_fingerprint
from classgrad.errors import StoreMismatchError
from classgrad.service.driver_runtime.preparation import prepare_store, resumable_fingerprint

NC = "loss.num_classes=10"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "stores"
LEGACY_JOB = FIXTURES / "v1_resume.yaml"
LEGACY_STORE = FIXTURES / "v1_resume.zarr"


def _fp(*overrides: str) -> str:
    return load_config(overrides=[NC, *overrides]).fingerprint()


def _legacy_attrs() -> dict[str, Any]:
    """The classgrad attributes of the fixture store, read as plain JSON (no store code involved)."""
    return json.loads((LEGACY_STORE / "zarr.json").read_text())["attributes"]["classgrad"]


def _legacy_config(store_url: str | Path | None = None, *overrides: str) -> JobConfig:
    url = [f"store.url={store_url}"] if store_url is not None else []
    return load_config(LEGACY_JOB, [*url, *overrides])


# --------------------------------------------------------------------------- the scheme


def test_fingerprint_of_the_default_config_is_pinned() -> None:
    # A changed value here changes every store's fingerprint: bump FINGERPRINT_VERSION (and keep
    # old stores resuming through recorded_fingerprint) rather than editing this line alone.
    assert FINGERPRINT_VERSION == 2
    assert _fp() == "1aa112417238d2fb4088d7b8131a12016d406a9fbb11d403ded3679a2f892a98"


@pytest.mark.parametrize(
    "override",
    [
        "model.factory=classgrad.workers.zoo:small_cnn",
        "model.kwargs={}",
        "model.checkpoint=null",
        "model.mode=eval",
        "data.factory=classgrad.workers.zoo:synthetic_probe",
        "data.batch_size=256",
        "loss.kind=cross_entropy",
        "precision.dtype=fp32",
        "precision.init_scale=65536",
        "precision.min_scale=1",
        "params.include=[]",
        "params.exclude=[]",
        "engine.kind=auto",
        "engine.block_rows=null",
        "engine.group_rows=256",
        "sharding.shard_rows=256",
        "store.dtype=float32",
        "store.row_chunk=16",
        "store.col_chunk=1048576",
        "store.codec=none",
        "store.sharded=false",
        "projection.dim=null",
        "projection.kind=rademacher",
        "projection.seed=0",
        "projection.per_param=false",
    ],
)
def test_a_default_spelt_out_is_the_same_as_leaving_it_out(override: str) -> None:
    assert _fp(override) == _fp()


@pytest.mark.parametrize(
    "old,new",
    [
        ("model.factory=workers.zoo:mlp", "model.factory=classgrad.workers.zoo:mlp"),
        ("data.factory=workers.data:probe", "data.factory=classgrad.workers.data:probe"),
        ("loss.kind=workers.losses:my_loss", "loss.kind=classgrad.workers.losses:my_loss"),
        ("model.factory=service.models:net", "model.factory=classgrad.service.models:net"),
    ],
)
def test_an_old_module_spelling_is_the_same_as_the_new(old: str, new: str) -> None:
    assert _fp(old) == _fp(new) != _fp()


def test_recorded_config_missing_keys_added_since_takes_their_defaults() -> None:
    # A store written before a key existed records a config without it.
    recorded = load_config(overrides=[NC, "precision.dtype=bf16"]).redacted()
    del recorded["precision"]["min_scale"], recorded["engine"]["group_rows"], recorded["run"]
    assert recorded_fingerprint(recorded) == _fp("precision.dtype=bf16")


# The one projection section every store recorded before each structure had its own options: every
# structure's key, at its default where the job left it.
_FLAT_PROJECTION = {
    "dim": 16,
    "kind": "rademacher",
    "seed": 0,
    "per_param": False,
    "structure": None,
    "rest": "sketch",
    "sketch_nonzeros": 4,
    "allocation": "norm",
    "low_rank": "dense",
    "dense_layers": [],
}


@pytest.mark.parametrize(
    ("structure", "set_key"),
    [
        (None, {}),
        ("tensorsketch", {}),
        ("sketch", {"sketch_nonzeros": 2}),
        ("dense", {"kind": "gaussian"}),
        ("kronecker", {"rest": "dense", "dense_layers": ["fc"]}),
    ],
)
def test_a_projection_recorded_with_every_structure_s_keys_is_the_same_job(structure, set_key) -> None:
    overrides = [f"projection.{k}={json.dumps(v)}" for k, v in {"dim": 16, **set_key}.items()]
    overrides += [f"projection.structure={structure}"] if structure else []
    recorded = load_config(overrides=[NC, *overrides]).redacted()
    recorded["projection"] = {**_FLAT_PROJECTION, "structure": structure, **set_key}
    assert recorded_fingerprint(recorded) == _fp(*overrides)


def test_recorded_config_ignores_what_is_not_hashed() -> None:
    recorded = load_config(overrides=[NC, "store.storage_options={key: abc}"]).redacted()
    assert recorded["store"]["storage_options"] == {"key": "***"}
    # Keys today's schema does not know, outside the hashed fields, are not looked at either.
    recorded["cluster"]["retired_key"] = 1
    recorded["store"]["retired_key"] = 1
    recorded["run"] = "anything"
    recorded["engine"]["device"] = "cuda"  # would fail the cross-field check against cluster
    assert recorded_fingerprint(recorded) == _fp()


@pytest.mark.parametrize(
    "recorded",
    [
        None,
        [],
        "model: x",
        {"loss": {"num_classes": 10}, "model": {"retired_key": 1}},
        {"loss": {"num_classes": 0}},
        {"loss": {"num_classes": 10}, "precision": "fp16"},
    ],
)
def test_recorded_config_today_refuses_is_not_the_same_job(recorded: Any) -> None:
    assert recorded_fingerprint(recorded) is None
    assert not load_config(overrides=[NC]).same_job(recorded)


# --------------------------------------------------------------------------- the legacy store


def test_legacy_store_records_the_old_scheme_but_is_the_same_job() -> None:
    attrs = _legacy_attrs()
    config = _legacy_config()
    assert attrs["config"]["model"]["factory"] == "workers.zoo:mlp"  # the old spelling, as written
    assert config.model.factory == "classgrad.workers.zoo:mlp"
    assert config.fingerprint() != attrs["fingerprint"]
    assert config.same_job(attrs["config"])
    assert not _legacy_config(None, "model.kwargs.seed=1").same_job(attrs["config"])


@pytest.fixture
def legacy_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "v1_resume.zarr"
    shutil.copytree(LEGACY_STORE, copy)
    return copy


def test_legacy_store_is_reopened_with_its_recorded_fingerprint(legacy_copy: Path) -> None:
    config = _legacy_config(legacy_copy)
    assert resumable_fingerprint(config) == _legacy_attrs()["fingerprint"]
    prepared = prepare_store(config)
    assert prepared.store.fingerprint == _legacy_attrs()["fingerprint"]
    assert prepared.store.shard_done.tolist() == [True, True, True]


@pytest.mark.parametrize("override", ["model.kwargs.seed=1", "data.kwargs.seed=1", "precision.dtype=bf16"])
def test_legacy_store_refuses_another_job(legacy_copy: Path, override: str) -> None:
    config = _legacy_config(legacy_copy, override)
    assert resumable_fingerprint(config) == config.fingerprint()
    key = override.split("=")[0]  # the refusal names the key that differs (values are not shown)
    with pytest.raises(StoreMismatchError, match=rf"was made by another config: {re.escape(key)} differ; "):
        prepare_store(config)


def test_missing_store_gets_todays_fingerprint(tmp_path: Path) -> None:
    config = _legacy_config(tmp_path / "new.zarr")
    assert resumable_fingerprint(config) == config.fingerprint()


def test_the_keys_that_differ_are_named_down_to_the_mapping_entry() -> None:
    base = load_config(overrides=["model.kwargs={num_classes: 10, seed: 0}", "loss.num_classes=10"])
    other = load_config(
        overrides=["model.kwargs={num_classes: 10, seed: 1}", "loss.num_classes=10", "store.dtype=bfloat16"]
    )
    assert base.differing_keys(other.redacted()) == ["model.kwargs.seed", "store.dtype"]
    assert base.differing_keys(base.redacted()) == []
    assert base.differing_keys({"model": "not a section"}) is None
