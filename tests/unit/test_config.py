"""Unit tests of src/classgrad/config/: defaults, YAML + overrides, one-line errors naming the field,
fingerprint, redaction and the generated config reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from classgrad.config import JobConfig, config_reference_markdown, load_config
from classgrad.errors import ClassgradError, ConfigError

# loss.num_classes is the one required key: it fixes the store's shape, so it is never guessed.
NC = "loss.num_classes=10"


def _write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _error(*overrides: str, path: Path | str | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    message = str(info.value)
    assert "\n" not in message, message
    assert message.startswith("config error: "), message
    return message


# --------------------------------------------------------------------------- loading


def test_defaults_load() -> None:
    cfg = load_config(overrides=[NC])
    assert cfg.model.factory == "classgrad.workers.zoo:small_cnn"
    assert cfg.model.kwargs == {} and cfg.model.checkpoint is None and cfg.model.mode == "eval"
    assert cfg.data.factory == "classgrad.workers.zoo:synthetic_probe" and cfg.data.batch_size == 256
    assert cfg.loss.kind == "cross_entropy" and cfg.loss.num_classes == 10
    assert cfg.precision.dtype == "fp32"
    assert cfg.precision.init_scale == 65536.0 and cfg.precision.min_scale == 1.0
    assert cfg.params.include == [] and cfg.params.exclude == []
    assert (cfg.engine.kind, cfg.engine.block_rows, cfg.engine.group_rows) == ("auto", None, 256)
    assert cfg.engine.device is None and cfg.resolved_device() == "cpu"
    assert (cfg.sharding.shard_rows, cfg.sharding.max_attempts) == (256, 3)
    assert cfg.store.url == "./stores/demo.zarr" and cfg.store.dtype == "float32"
    assert (cfg.store.row_chunk, cfg.store.col_chunk) == (16, 1048576)
    assert cfg.store.codec == "none" and cfg.store.sharded is False
    assert cfg.store.storage_options == {} and cfg.store.overwrite is False
    assert cfg.cluster.address is None and cfg.cluster.num_workers == 2
    assert cfg.cluster.num_gpus_per_worker == 0 and cfg.cluster.num_cpus_per_worker == 1
    assert cfg.cluster.inflight_per_worker == 2 and cfg.cluster.runtime_env == {}
    assert cfg.projection.dim is None and cfg.projection.kind == "rademacher"
    assert cfg.projection.seed == 0 and cfg.projection.per_param is False
    assert (cfg.run.lease_ttl_s, cfg.run.log_every_s, cfg.run.progress) == (60.0, 10.0, "auto")


def test_num_classes_is_required() -> None:
    assert _error() == "config error: loss.num_classes: Field required"


def test_empty_file_means_defaults(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, ""), [NC])
    assert cfg == load_config(overrides=[NC])


def test_empty_section_means_defaults(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, "store:\n#  url: elsewhere\nloss: {num_classes: 10}\n"))
    assert cfg == load_config(overrides=[NC])


def test_yaml_and_overrides(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
model: {factory: "my.models:resnet", kwargs: {depth: 18}}
loss: {kind: logit, num_classes: 1000}
store: {url: s3://bucket/g.zarr, row_chunk: 8}
sharding: {shard_rows: 64}
""",
    )
    cfg = load_config(
        path,
        [
            "data.batch_size=32",  # -> int
            "store.sharded=true",  # -> bool
            "params.include=[fc.*, 'layer4.*']",  # -> list
            "projection.dim=null",  # -> None
            "precision.init_scale=1024",  # int -> float field
            "model.kwargs.width=2.5",  # free-form mapping: new sub-key, merged with the file's
            "cluster.address=10.0.0.1:6379",  # stays a string
            "store.url=s3://other/x.zarr",  # later wins over the file
        ],
    )
    assert cfg.model.factory == "my.models:resnet"
    assert cfg.model.kwargs == {"depth": 18, "width": 2.5}
    assert cfg.loss.kind == "logit" and cfg.loss.num_classes == 1000
    assert cfg.data.batch_size == 32 and cfg.store.sharded is True
    assert cfg.params.include == ["fc.*", "layer4.*"]
    assert cfg.projection.dim is None
    assert cfg.precision.init_scale == 1024.0 and isinstance(cfg.precision.init_scale, float)
    assert cfg.cluster.address == "10.0.0.1:6379"
    assert cfg.store.url == "s3://other/x.zarr" and cfg.store.row_chunk == 8
    assert cfg.sharding.shard_rows == 64


def test_base_then_file_then_overrides(tmp_path: Path) -> None:
    path = _write(tmp_path, "data: {batch_size: 64}\n")
    base = {"loss": {"num_classes": 7}, "data": {"batch_size": 8, "kwargs": {"seed": 1}}}
    cfg = load_config(path, ["cluster.num_workers=4"], base=base)
    assert cfg.loss.num_classes == 7 and cfg.data.batch_size == 64
    assert cfg.data.kwargs == {"seed": 1}  # merged, not replaced, by the file
    assert cfg.cluster.num_workers == 4
    assert base == {"loss": {"num_classes": 7}, "data": {"batch_size": 8, "kwargs": {"seed": 1}}}


def test_override_replaces_a_whole_section() -> None:
    cfg = load_config(overrides=["loss={kind: bce, num_classes: 3}"])
    assert cfg.loss.kind == "bce" and cfg.loss.num_classes == 3


def test_yaml_merge_keys_may_override(tmp_path: Path) -> None:
    # Overriding a merged key is ordinary YAML, not a duplicate.
    path = _write(
        tmp_path,
        "loss: &l {kind: logit, num_classes: 4}\nprojection: {dim: 8}\n"
        "store:\n  <<: {row_chunk: 4, col_chunk: 8}\n  row_chunk: 16\n",
    )
    cfg = load_config(path)
    assert cfg.store.row_chunk == 16 and cfg.store.col_chunk == 8


def test_import_paths_and_registered_names_accepted() -> None:
    cfg = load_config(overrides=[NC, "loss.kind=my_pkg.losses:Weighted.per_class", "model.factory=m:f"])
    assert cfg.loss.kind == "my_pkg.losses:Weighted.per_class" and cfg.model.factory == "m:f"
    for kind in ("cross_entropy", "logit", "bce"):
        assert load_config(overrides=[NC, f"loss.kind={kind}"]).loss.kind == kind


@pytest.mark.parametrize("address", ["auto", "local", "ray://head:10001", "head:6379", "10.1.2.3:6379", "[::1]:6379"])
def test_ray_addresses_accepted(address: str) -> None:
    cfg = load_config(overrides=[NC, f"cluster.address='{address}'"])
    assert cfg.cluster.address == address


def test_resolved_device() -> None:
    cfg = load_config(overrides=[NC, "cluster.num_gpus_per_worker=0.5"])
    assert cfg.resolved_device() == "cuda"
    cfg = load_config(overrides=[NC, "cluster.num_gpus_per_worker=1", "engine.device=cpu"])
    assert cfg.resolved_device() == "cpu"


def test_config_is_immutable() -> None:
    cfg = load_config(overrides=[NC])
    with pytest.raises(ValidationError, match="frozen"):
        cfg.store.url = "elsewhere"  # type: ignore[misc]


def test_config_error_is_a_classgrad_error() -> None:
    with pytest.raises(ClassgradError):
        load_config(overrides=["loss.num_classes=0"])


# --------------------------------------------------------------------------- errors

_SECTION_KEYS = {
    "model": "checkpoint, factory, kwargs, mode, output",
    "data": "batch_size, collate, factory, kwargs, label_field, pad_values",
    "loss": "kind, num_classes",
    "precision": "dtype, init_scale, min_scale",
    "params": "exclude, include",
    "engine": "block_rows, device, group_rows, kind, plugins",
    "sharding": "max_attempts, shard_rows",
    "store": "codec, col_chunk, dtype, overwrite, recompute, row_chunk, sharded, storage_options, url",
    "cluster": "address, inflight_per_worker, min_workers, num_cpus_per_worker, num_gpus_per_worker, num_workers, "
    "runtime_env",
    # structure unset: the keys of dense, sketch and tensorsketch (each structure has its own)
    "projection": "dim, kind, per_param, seed, sketch_nonzeros, structure",
    "run": "actor_start_timeout_s, lease_ttl_s, log_every_s, progress",
}
_SECTIONS = "cluster, data, engine, loss, model, params, precision, projection, run, sharding, store"


@pytest.mark.parametrize("section", sorted(_SECTION_KEYS))
def test_unknown_key_in_file_lists_the_section_keys(tmp_path: Path, section: str) -> None:
    text = f"{section}: {{bogus: 1}}\n" + ("" if section == "loss" else "loss: {num_classes: 3}\n")
    # With loss.num_classes missing too, the unknown key is still reported first: it is
    # usually the misspelling of the missing key.
    path = _write(tmp_path, text)
    assert _error(path=path).startswith(
        f"config error: {section}.bogus: unknown key (choices: {_SECTION_KEYS[section]})"
    )


@pytest.mark.parametrize("section", sorted(_SECTION_KEYS))
def test_unknown_key_in_set_lists_the_section_keys(section: str) -> None:
    # A --set is checked before the section's structure is known: every structure's keys.
    keys = _EVERY_PROJECTION_KEY if section == "projection" else _SECTION_KEYS[section]
    assert _error(NC, f"{section}.bogus=1") == f"config error: --set {section}.bogus: unknown key (choices: {keys})"


_EVERY_PROJECTION_KEY = (
    "allocation, dense_layers, dim, kind, low_rank, per_param, rest, seed, sketch_nonzeros, structure"
)


def test_a_key_of_another_structure_is_one_line_naming_the_structure() -> None:
    assert _error(NC, "projection.dim=8", "projection.structure=tensorsketch", "projection.rest=dense") == (
        "config error: projection.rest: unknown key (choices: dim, seed, sketch_nonzeros, structure) "
        "of structure tensorsketch"
    )
    # The structure's own keys pass; another structure's key at its default is inert (a config
    # recorded before each structure had its own options holds every key at its default).
    cfg = load_config(overrides=[NC, "projection.dim=8", "projection.structure=kronecker", "projection.rest=dense"])
    assert cfg.projection.rest == "dense"  # type: ignore[attr-defined]
    cfg = load_config(overrides=[NC, "projection.dim=8", "projection.structure=sketch", "projection.rest=sketch"])
    assert "rest" not in cfg.model_dump()["projection"]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        # wrong types
        ([NC, "data.batch_size=abc"], "data.batch_size: Input should be a valid integer"),
        ([NC, "data.batch_size=2.5"], "data.batch_size: Input should be a valid integer"),
        ([NC, "store.sharded=maybe"], "store.sharded: Input should be a valid boolean"),
        ([NC, "model.factory={a: 1}"], "model.factory: Input should be a valid string, got a mapping"),
        ([NC, "model.kwargs=[1]"], "model.kwargs: expected a mapping, got a list"),
        ([NC, "params.include=fc.*"], "params.include: Input should be a valid list"),
        ([NC, "params.exclude=[1]"], "params.exclude[0]: Input should be a valid string"),
        ([NC, "loss=5"], "loss: expected a mapping, got int"),
        ([NC, "engine=[1, 2]"], "engine: expected a mapping, got a list"),
        # out of range
        (["loss.num_classes=0"], "loss.num_classes: Input should be greater than 0"),
        ([NC, "data.batch_size=0"], "data.batch_size: Input should be greater than 0"),
        ([NC, "precision.init_scale=-1"], "precision.init_scale: Input should be greater than 0"),
        ([NC, "precision.init_scale=.inf"], "precision.init_scale: Input should be a finite number"),
        ([NC, "engine.block_rows=0"], "engine.block_rows: Input should be greater than 0"),
        ([NC, "engine.group_rows=-3"], "engine.group_rows: Input should be greater than 0"),
        ([NC, "sharding.max_attempts=0"], "sharding.max_attempts: Input should be greater than 0"),
        ([NC, "store.row_chunk=0"], "store.row_chunk: Input should be greater than 0"),
        ([NC, "cluster.num_workers=0"], "cluster.num_workers: Input should be greater than 0"),
        (
            [NC, "cluster.num_gpus_per_worker=-1"],
            "cluster.num_gpus_per_worker: Input should be greater than or equal to 0",
        ),
        (
            [NC, "cluster.num_gpus_per_worker=1.5"],
            "cluster.num_gpus_per_worker: above 1 must be a whole number, got 1.5",
        ),
        ([NC, "projection.dim=0"], "projection.dim: Input should be greater than 0"),
        ([NC, "projection.seed=-1"], "projection.seed: Input should be greater than or equal to 0"),
        ([NC, "run.lease_ttl_s=0"], "run.lease_ttl_s: Input should be greater than 0"),
        # An fp16 loss scale beyond float32's range makes every scaled loss inf (issue 56, item 3).
        ([NC, "precision.init_scale=1e39"], "precision.init_scale: must be within float32's range (|x| <= 3.4e38)"),
        # A lease shorter than its renewals lets another driver take over a live run (issue 60, item 10).
        (
            [NC, "run.lease_ttl_s=1e-9"],
            "run.lease_ttl_s: must be at least 5 s (the lease is renewed every third of it; a shorter one "
            "lets another driver take over a live run), got 1e-09",
        ),
        ([NC, "store.url=''"], "store.url: String should have at least 1 character"),
        # bad enums
        ([NC, "precision.dtype=fp8"], "precision.dtype: Input should be 'fp32', 'fp16' or 'bf16', got 'fp8'"),
        ([NC, "model.mode=training"], "model.mode: Input should be 'eval' or 'train'"),
        ([NC, "engine.kind=fast"], "engine.kind: Input should be 'auto', 'partitioned', 'dense' or 'reference'"),
        ([NC, "store.dtype=float64"], "store.dtype: Input should be 'float32', 'float16' or 'bfloat16'"),
        ([NC, "store.codec=gzip"], "store.codec: Input should be 'none', 'zstd' or 'blosc'"),
        ([NC, "projection.kind=sparse"], "projection.kind: Input should be 'rademacher' or 'gaussian'"),
        ([NC, "run.progress=fancy"], "run.progress: Input should be 'auto', 'bar', 'log' or 'none'"),
        (
            [NC, "loss.kind=cross_entropie"],
            "loss.kind: unknown loss kind 'cross_entropie' (choices: bce, cross_entropy, logit, "
            "or an import path 'module:function')",
        ),
        # bad import path / device / address / checkpoint syntax
        (
            [NC, "model.factory=classgrad.workers.zoo.small_cnn"],
            "model.factory: must be an import path 'module:function'",
        ),
        ([NC, "model.factory=classgrad.workers.zoo:1net"], "model.factory: must be an import path"),
        ([NC, "model.factory='classgrad.workers.zoo:'"], "model.factory: must be an import path"),
        ([NC, "data.factory=:probe"], "data.factory: must be an import path"),
        ([NC, "data.factory=a-b:c"], "data.factory: must be an import path"),
        ([NC, "loss.kind=my losses:f"], "loss.kind: must be an import path"),
        ([NC, "engine.device=gpu"], "engine.device: must be cpu, cuda, cuda:N or mps, got 'gpu'"),
        ([NC, "cluster.address=http://head:8265"], "cluster.address: must be null, 'auto'"),
        ([NC, "model.checkpoint=w.ckpt"], "model.checkpoint: must end in .pt, .pth, .safetensors"),
        # cross-field checks name both fields
        (
            [NC, "sharding.shard_rows=20"],
            "sharding.shard_rows must be a multiple of store.row_chunk (16), got 20",
        ),
        (
            [NC, "precision.min_scale=100", "precision.init_scale=10"],
            "precision.min_scale (100.0) must be at most precision.init_scale (10.0)",
        ),
        (
            [NC, "engine.kind=partitioned", "loss.kind=logit"],
            "engine.kind 'partitioned' needs a class-partitioned loss, but loss.kind 'logit' is dense",
        ),
        ([NC, "engine.device=cuda"], "engine.device 'cuda' needs cluster.num_gpus_per_worker > 0"),
        # bad --set syntax and paths
        (["foo"], "--set foo: expected section.field=value"),
        (["=3"], "--set =3: expected section.field=value"),
        (["a..b=3"], "--set a..b=3: expected section.field=value"),
        ([NC, "foo=3"], f"--set foo: unknown section (choices: {_SECTIONS})"),
        (
            [NC, "engine.blok_rows=3"],
            "--set engine.blok_rows: unknown key (choices: block_rows, device, group_rows, kind, plugins)",
        ),
        ([NC, "store.url.x=3"], "--set store.url.x: store.url is not a mapping"),
        ([NC, "data.batch_size=[1"], "--set data.batch_size: malformed value ("),
        (["loss=3", "loss.num_classes=3"], "--set loss.num_classes: loss is int, not a mapping"),
    ],
)
def test_errors_are_one_line_naming_the_field(overrides: list[str], expected: str) -> None:
    message = _error(*overrides)
    assert message.startswith("config error: " + expected), message


def test_misspelt_key_is_reported_before_the_missing_one() -> None:
    assert _error("loss.num_clases=10") == (
        "config error: --set loss.num_clases: unknown key (choices: kind, num_classes)"
    )
    with pytest.raises(ConfigError) as info:
        load_config(base={"loss": {"num_clases": 10}})
    assert str(info.value) == ("config error: loss.num_clases: unknown key (choices: kind, num_classes) (and 1 more)")


def test_several_errors_are_counted() -> None:
    message = _error(NC, "data.batch_size=0", "store.row_chunk=0", "run.progress=x")
    assert message == "config error: data.batch_size: Input should be greater than 0 (and 2 more)"


def test_several_cross_field_errors_are_counted() -> None:
    message = _error(NC, "sharding.shard_rows=3", "engine.kind=partitioned", "loss.kind=bce")
    assert message.startswith("config error: sharding.shard_rows must be a multiple")
    assert message.endswith("(and 1 more)")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("loss: {num_classes: 3}\nbogus: {a: 1}\n", f"bogus: unknown section (choices: {_SECTIONS})"),
        (
            "loss:\n  num_classes: 3\n  num_classes: 4\n",
            "job.yaml line 3: malformed YAML (duplicate key 'num_classes')",
        ),
        ("loss: {num_classes: 3\nstore: {}\n", "job.yaml line 2: malformed YAML ("),
        ("loss:\n  kind: logit\n bad indent: 1\n", "job.yaml line 3: malformed YAML ("),
        ("- loss\n- store\n", "job.yaml: the top level must be a mapping of sections (model, data,"),
        ("just a string\n", "job.yaml: the top level must be a mapping of sections"),
        ("loss: 3\n", "loss: expected a mapping, got int"),
        ("loss: {kind: logit}\n", "loss.num_classes: Field required"),
    ],
)
def test_file_errors(tmp_path: Path, text: str, expected: str) -> None:
    path = _write(tmp_path, text)
    message = _error(path=path)
    expected = expected.replace("job.yaml", str(path))
    assert message.startswith("config error: " + expected), message


def test_missing_file_is_named(tmp_path: Path) -> None:
    assert _error(path="configs/x.yaml") == "config error: configs/x.yaml: not found"
    assert _error(path=tmp_path) == f"config error: {tmp_path}: not a file"


def test_non_mapping_base() -> None:
    with pytest.raises(ConfigError, match="base config must be a mapping"):
        load_config(base=[1, 2])  # type: ignore[arg-type]


def test_direct_construction_validates_too() -> None:
    # The driver may build a JobConfig from a dict it received; the same checks apply.
    with pytest.raises(ValueError, match="multiple of store.row_chunk"):
        JobConfig.model_validate({"loss": {"num_classes": 3}, "sharding": {"shard_rows": 5}})


# --------------------------------------------------------------------------- fingerprint


def _fp(*overrides: str) -> str:
    return load_config(overrides=[NC, *overrides]).fingerprint()


def test_fingerprint_is_stable_hex() -> None:
    fp = _fp()
    assert fp == _fp() and len(fp) == 64 and int(fp, 16) >= 0


def test_fingerprint_ignores_file_vs_override_and_key_order(tmp_path: Path) -> None:
    path = _write(tmp_path, "store: {codec: zstd, dtype: float16}\nloss: {num_classes: 10}\n")
    assert load_config(path).fingerprint() == _fp("store.dtype=float16", "store.codec=zstd")


@pytest.mark.parametrize(
    "override",
    [
        "store.url=s3://elsewhere/g.zarr",
        "store.storage_options={endpoint_url: 'http://127.0.0.1:9000', key: abc}",
        "store.overwrite=true",
        "cluster.address=auto",
        "cluster.num_workers=16",
        "cluster.num_gpus_per_worker=1",
        "cluster.num_cpus_per_worker=4",
        "cluster.inflight_per_worker=3",
        "cluster.runtime_env={env_vars: {A: b}}",
        "run.lease_ttl_s=5",
        "run.log_every_s=1",
        "run.progress=none",
        "sharding.max_attempts=9",
        "engine.device=cpu",
    ],
)
def test_fingerprint_ignores_where_and_how_it_runs(override: str) -> None:
    assert _fp(override) == _fp()


@pytest.mark.parametrize(
    "override",
    [
        "model.factory=other.mod:net",
        "model.kwargs={width: 3}",
        "model.checkpoint=w.safetensors",
        "model.mode=train",
        "data.factory=other.mod:data",
        "data.kwargs={seed: 2}",
        "data.batch_size=64",
        "loss.kind=logit",
        "loss.num_classes=11",
        "precision.dtype=bf16",
        "precision.init_scale=1024",
        "precision.min_scale=0.5",
        "params.include=[fc.*]",
        "params.exclude=[bn.*]",
        "engine.kind=dense",
        "engine.block_rows=32",
        "engine.group_rows=128",
        "sharding.shard_rows=128",
        "store.dtype=bfloat16",
        "store.row_chunk=32",
        "store.col_chunk=4096",
        "store.codec=blosc",
        "store.sharded=true",
        "projection.dim=512",
        "projection.kind=gaussian",
        "projection.seed=1",
        "projection.per_param=true",
    ],
)
def test_fingerprint_changes_with_what_is_stored(override: str) -> None:
    assert _fp(override) != _fp()


# --------------------------------------------------------------------------- redaction


def test_redacted_hides_secrets_at_any_depth() -> None:
    cfg = load_config(
        overrides=[
            NC,
            "store.url=s3://bucket/g.zarr",
            "store.storage_options={endpoint_url: 'http://127.0.0.1:9000', key: AKIA1, "
            "secret: s3cr3t, anon: false, client_kwargs: {aws_secret_access_key: hidden1, "
            "aws_session_token: hidden2, region_name: eu-west-1}, "
            "config_kwargs: [{Password: hidden3}], Credentials: {a: hidden4}}",
            "cluster.runtime_env={env_vars: {AWS_SECRET_ACCESS_KEY: hidden5, OMP_NUM_THREADS: '1'}}",
        ]
    )
    red = cfg.redacted()
    so = red["store"]["storage_options"]
    assert so["endpoint_url"] == "http://127.0.0.1:9000" and so["anon"] is False
    assert so["key"] == "***" and so["secret"] == "***"
    assert so["client_kwargs"] == {
        "aws_secret_access_key": "***",
        "aws_session_token": "***",
        "region_name": "eu-west-1",
    }
    assert so["config_kwargs"] == [{"Password": "***"}]
    assert so["Credentials"] == "***"
    # Every env_vars value is hidden (any variable may carry a credential: DATABASE_URL, HF_AUTH).
    assert red["cluster"]["runtime_env"]["env_vars"] == {
        "AWS_SECRET_ACCESS_KEY": "***",
        "OMP_NUM_THREADS": "***",
    }
    text = json.dumps(red)  # JSON-able, and no secret survives anywhere in it
    for secret in ("AKIA1", "s3cr3t", "hidden1", "hidden2", "hidden3", "hidden4", "hidden5"):
        assert secret not in text
    assert red["store"]["url"] == "s3://bucket/g.zarr" and red["loss"]["num_classes"] == 10
    assert set(red) == set(JobConfig.model_fields)
    # The config object itself keeps the real values (the store needs them to connect).
    assert cfg.store.storage_options["client_kwargs"]["aws_secret_access_key"] == "hidden1"


# --------------------------------------------------------------------------- reference


def test_config_reference_mentions_every_field() -> None:
    text = config_reference_markdown()
    for section, section_info in JobConfig.model_fields.items():
        assert f"### `{section}`" in text
        block = text.split(f"### `{section}`")[1].split("### ")[0]
        rows = {line.split("`")[1]: line for line in block.splitlines() if line.startswith("| `")}
        model = section_info.annotation
        assert set(rows) == set(model.model_fields), section  # type: ignore[union-attr]
        for key, info in model.model_fields.items():  # type: ignore[union-attr]
            assert info.description, f"{section}.{key} has no description"
            assert info.description.replace("|", "\\|") in rows[key]
    assert "| `num_classes` | int > 0, ≤ 2147483647 | required |" in text
    assert "| `dtype` | `fp32` \\| `fp16` \\| `bf16` | `fp32` |" in text
    assert "| `block_rows` | int > 0 or null | `null` |" in text


def test_the_data_keys_of_dict_samples_are_kept_in_the_stored_config() -> None:
    # The stored config is the redacted one: the label's field must not read as a secret there.
    config = load_config(overrides=["loss.num_classes=3", "data.label_field=topic", "data.collate=pad"])
    assert config.redacted()["data"]["label_field"] == "topic"
    assert config.redacted()["data"]["collate"] == "pad"
    assert config.differing_keys(config.redacted()) == []


def test_a_new_store_on_object_storage_is_sharded_unless_the_job_says_otherwise() -> None:
    """``store.sharded`` left unset: sharded on s3:// (a shard is then a few PUTs), not on a
    local disk; set, as set. The fingerprint is that of ``false`` either way, so stores made
    before this default resume as they were."""
    from tests.support.jobs import small_job

    def store(url: str, **extra) -> JobConfig:
        return JobConfig.model_validate(small_job(url, store=extra))

    assert store("s3://b/x.zarr").store.sharded_layout() is True
    assert store("/tmp/x.zarr").store.sharded_layout() is False
    assert store("s3://b/x.zarr", sharded=False).store.sharded_layout() is False
    assert store("/tmp/x.zarr", sharded=True).store.sharded_layout() is True
    assert store("s3://b/x.zarr").fingerprint() == store("s3://b/x.zarr", sharded=False).fingerprint()
