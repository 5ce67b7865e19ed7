"""Bad input, as a user gives it: ``classgrad run`` ends with one line, a non-zero exit, no
traceback, and leaves no store that a rerun (or a reader) would wrongly trust.

The table (``CASES``) runs the real CLI entry point in this process (``classgrad.service.commands.cli.main``, the
function the console script calls); ``test_in_a_real_process`` repeats a few cases in a fresh
``python -m classgrad`` process to show the real exit status and that no traceback leaks,
also from a Ray actor. Each case builds its job (usually ``conftest.small_job`` with one thing
wrong) and names the text its one error line must contain.

After every case, ``harness.trusted_state`` checks what is left at the store's location: nothing,
a half-created store that readers refuse and a rerun recreates, or a store whose done shards
hold exactly the rows the job's engine computes for them.

The module's local Ray (``ray_local``) serves the cases that need a running job (a disk that
fills up mid-job, an error only an actor can see, empty classes); every other case fails
before the driver touches Ray. Empty classes are not an error: ``test_empty_classes_work``.
"""

from __future__ import annotations

import contextlib
import json
import os
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from classgrad.config import JobConfig
from classgrad.service.commands.cli import main as cli_main
from classgrad.service.driver_runtime.preparation import prepare_store
from classgrad.store import open_store
from tests.support import faulty
from tests.support.cluster import free_port
from tests.support.harness import (
    assert_identical,
    classgrad_cli,
    error_lines,
    store_arrays,
    tmpfs,
    trusted_state,
    uninterrupted,
    write_job,
)
from tests.support.jobs import small_job

C = 48


class Ctx:
    """What a case builds: its files under ``tmp``, the job it runs, and how to check the store."""

    def __init__(self, tmp: Path, request: pytest.FixtureRequest):
        self.tmp = tmp
        self.request = request
        self.url = str(tmp / "store.zarr")
        self.config: JobConfig | None = None
        self.check: Callable[[], str] | None = None  # replaces trusted_state (S3 cases)

    def job(self, url: str | None = None, **sections) -> str:
        """``small_job`` with ``sections`` merged in, written as YAML; returns its path."""
        self.url = url or self.url
        job = small_job(self.url, **sections)
        try:
            self.config = JobConfig.model_validate(job)
        except ValidationError:
            self.config = None
        return write_job(self.tmp / "job.yaml", job)

    def raw(self, text: str) -> str:
        path = self.tmp / "job.yaml"
        path.write_text(text)
        return str(path)

    def fixture(self, name: str):
        return self.request.getfixturevalue(name)


CASES: list = []


def case(message: str):
    """Register a case: ``fn(ctx) -> argv after "run"``; its error line must contain ``message``."""

    def register(fn: Callable[[Ctx], list[str]]):
        CASES.append(pytest.param(fn, message, id=fn.__name__))
        return fn

    return register


VECTOR = {
    "model": {"factory": "classgrad.workers.zoo:mlp", "kwargs": {"num_classes": C, "in_features": 8, "hidden": 16}},
    "data": {"kwargs": {"num_classes": C, "samples_per_class": 3, "kind": "vector", "input_shape": [8], "seed": 2}},
}


# --- the job file ------------------------------------------------------------------------------


@case("malformed YAML")
def malformed_yaml(t: Ctx):
    return [t.raw("model: {factory: classgrad.workers.zoo:small_cnn\nloss: [num_classes: 48\n")]


@case("the top level must be a mapping of sections")
def top_level_is_a_list(t: Ctx):
    return [t.raw("- model\n- loss\n")]


@case("duplicate key 'num_classes'")
def duplicate_key(t: Ctx):
    return [t.raw("loss:\n  num_classes: 48\n  num_classes: 47\n")]


@case("config error: optimizer: unknown section")
def unknown_section(t: Ctx):
    return [t.job(optimizer={"lr": 0.1})]


@case("config error: store.chunk_rows: unknown key (choices: codec, col_chunk,")
def unknown_key(t: Ctx):
    return [t.job(store={"chunk_rows": 4})]


@case("config error: loss.num_classes: Input should be a valid integer")
def wrong_type_string_for_int(t: Ctx):
    return [t.job(loss={"num_classes": "many"})]


@case("config error: model: expected a mapping, got a list")
def wrong_type_list_for_section(t: Ctx):
    return [t.raw("model: [classgrad.workers.zoo:small_cnn]\nloss: {num_classes: 48}\n")]


@case("config error: cluster.num_workers: Input should be greater than 0")
def wrong_value_negative_workers(t: Ctx):
    return [t.job(cluster={"num_workers": -1})]


@case("config error: precision.dtype: Input should be 'fp32', 'fp16' or 'bf16', got 'fp8'")
def wrong_value_unknown_dtype(t: Ctx):
    return [t.job(precision={"dtype": "fp8"})]


@case("config error: loss.num_classes: Field required")
def missing_required_key(t: Ctx):
    return [t.raw("model: {factory: 'classgrad.workers.zoo:small_cnn'}\n")]


@case("sharding.shard_rows must be a multiple of store.row_chunk (4), got 6")
def shard_rows_not_a_multiple_of_row_chunk(t: Ctx):
    return [t.job(sharding={"shard_rows": 6}, store={"row_chunk": 4})]


@case("model.factory: must be an import path 'module:function'")
def factory_path_syntax(t: Ctx):
    return [t.job(model={"factory": "classgrad.workers.zoo.small_cnn"})]


@case("--set cluster.num_gpu: unknown key")
def override_of_an_unknown_key(t: Ctx):
    return [t.job(), "--set", "cluster.num_gpu=1"]


@case("engine.device 'cuda' needs cluster.num_gpus_per_worker > 0")
def cuda_without_gpus(t: Ctx):
    return [t.job(engine={"device": "cuda"})]


# A device the actors cannot have is refused once, before any actor starts (issue 15, item 9).
# In a fresh process without a cluster the driver checks its own machine before it writes
# anything (tests/unit/test_bad_input_cli.py); joining a running Ray (here, the module's), it
# checks the cluster's GPUs, and the device itself when every node is this machine.


@case("engine.device 'cuda': the Ray cluster has 0 GPUs, each actor asks for 1")
def cuda_on_a_cluster_without_gpus(t: Ctx):
    if torch.cuda.is_available():
        pytest.skip("checks a Ray cluster without GPUs")
    return [t.job(engine={"device": "cuda"}, cluster={"num_gpus_per_worker": 1})]


# The CPU device with a GPU asked for each actor: refused once, where Ray would keep the actors
# pending (0 rows/s) until run.actor_start_timeout_s.
@case("engine.device 'cpu': the Ray cluster has 0 GPUs, each actor asks for 1 (cluster.num_gpus_per_worker); set")
def cpu_actors_asking_for_gpus_the_cluster_lacks(t: Ctx):
    if torch.cuda.is_available():
        pytest.skip("checks a Ray cluster without GPUs")
    return [t.job(engine={"device": "cpu"}, cluster={"num_gpus_per_worker": 1})]


@case("engine.device 'mps': MPS (Apple GPU) is not available on this machine")
def mps_on_a_cluster_of_this_machine(t: Ctx):
    if torch.backends.mps.is_available():
        pytest.skip("checks a machine without MPS")
    return [t.job(engine={"device": "mps"})]


@case("not found")
def config_file_missing(t: Ctx):
    return [str(t.tmp / "no-such-job.yaml")]


# --- model, data and loss ----------------------------------------------------------------------


@case("model.factory 'no_such_module:build': cannot import module 'no_such_module'")
def model_factory_cannot_import(t: Ctx):
    return [t.job(model={"factory": "no_such_module:build"})]


@case("model.factory 'classgrad.workers.zoo:no_such_model': module 'classgrad.workers.zoo' has no attribute")
def model_factory_missing_attribute(t: Ctx):
    return [t.job(model={"factory": "classgrad.workers.zoo:no_such_model"})]


@case("model.factory 'classgrad.workers.zoo:small_cnn' raised TypeError")
def model_factory_raises(t: Ctx):
    return [t.job(model={"kwargs": {"num_classes": C, "width": 4, "depth": 3}})]


@case("model.factory 'classgrad.workers.zoo:mlp' raised RuntimeError: Trying to create tensor with negative dimension")
def model_factory_raises_inside(t: Ctx):
    return [t.job(model={"factory": "classgrad.workers.zoo:mlp", "kwargs": {"num_classes": C, "hidden": -1}})]


@case("data.factory 'classgrad.workers.zoo:synthetic_probe' raised ValueError: synthetic_probe kind must be")
def data_factory_raises(t: Ctx):
    return [t.job(data={"kwargs": {"num_classes": C, "kind": "audio"}})]


@case("model.factory 'classgrad.workers.zoo:synthetic_probe' returned tuple, not an nn.Module")
def model_factory_returns_no_module(t: Ctx):
    return [t.job(model={"factory": "classgrad.workers.zoo:synthetic_probe", "kwargs": {"num_classes": C}})]


@case("model output has shape (4, 50), expected (batch, 48)")
def model_output_width(t: Ctx):
    return [t.job(model={"kwargs": {"num_classes": 50, "width": 4}})]


@case("labels outside num_classes (loss.num_classes) [0, 48): sample 144 has label 48")
def labels_out_of_range(t: Ctx):
    return [t.job(data={"kwargs": {"num_classes": 50, "samples_per_class": 3, "input_shape": [3, 8, 8], "seed": 2}})]


@case("data: NaN/Inf in the inputs of probe sample 7")
def nan_inputs(t: Ctx):
    return [
        t.job(
            data={
                "factory": "tests.support.faulty:nan_probe",
                "kwargs": {
                    "nan_sample": 7,
                    "num_classes": C,
                    "samples_per_class": 3,
                    "input_shape": [3, 8, 8],
                    "seed": 2,
                },
            }
        )
    ]


def nan_inputs_only_an_actor_sees(t: Ctx):
    """Not in the table: ``test_an_error_inside_an_actor_in_a_real_process`` runs it."""
    # A Dataset's inputs are fetched batch by batch: the actor computing class 30 finds the NaN.
    return [
        t.job(
            data={
                "factory": "tests.support.faulty:nan_dataset",
                "kwargs": {
                    "nan_sample": 90,
                    "num_classes": C,
                    "samples_per_class": 3,
                    "input_shape": [3, 8, 8],
                    "seed": 2,
                },
            }
        )
    ]


@case("loss.kind 'classgrad.workers.zoo:no_such_loss': module 'classgrad.workers.zoo' has no attribute")
def loss_function_missing(t: Ctx):
    return [t.job(loss={"kind": "classgrad.workers.zoo:no_such_loss"})]


@case("params: include=['no_such_layer.*'] exclude=[] select no parameters")
def params_select_nothing(t: Ctx):
    return [t.job(params={"include": ["no_such_layer.*"]})]


@case("engine.kind=partitioned needs a model that treats samples independently")
def partitioned_engine_with_batchnorm_in_train_mode(t: Ctx):
    return [t.job(model={"factory": "classgrad.workers.zoo:bn_cnn", "mode": "train"}, engine={"kind": "partitioned"})]


@case("no such file")
def checkpoint_missing(t: Ctx):
    return [t.job(model={"checkpoint": str(t.tmp / "missing.pt")})]


@case("does not fit the model: missing")
def checkpoint_of_another_model(t: Ctx):
    path = faulty.other_model_checkpoint(str(t.tmp / "other.pt"))
    return [t.job(model={"checkpoint": path})]


# --- the store -----------------------------------------------------------------------------------


@case("was made by another config")
def store_made_by_another_config(t: Ctx):
    other = JobConfig.model_validate(small_job(t.url, **VECTOR))
    prepare_store(other)  # a real store of another job, at the same place
    fingerprint = open_store(t.url).fingerprint
    argv = [t.job()]
    t.check = lambda: f"untouched: {open_store(t.url).fingerprint == fingerprint}"
    return argv


@case("already holds something that is not a classgrad store; refusing to write there")
def store_location_holds_other_files(t: Ctx):
    (t.tmp / "store.zarr").mkdir()
    (t.tmp / "store.zarr" / "notes.txt").write_text("mine")
    argv = [t.job()]
    t.check = lambda: f"untouched: {os.listdir(t.url) == ['notes.txt']}"
    return argv


@case("Not a directory")
def store_location_under_a_file(t: Ctx):
    (t.tmp / "plain-file").write_text("x")
    return [t.job(url=str(t.tmp / "plain-file" / "store.zarr"))]


@case("Read-only file system")
def store_location_read_only(t: Ctx):
    mount = t.request.getfixturevalue("read_only_dir")
    return [t.job(url=str(mount / "store.zarr"))]


@case("more on disk but")
def disk_too_small_for_the_store(t: Ctx):
    # 16 KiB for a store of 336 KiB: the preflight refuses before anything is written.
    mount = t.fixture("mount_tmpfs")("16k")
    return [t.job(url=str(mount / "store.zarr"))]


@case("No space left on device")
def disk_full_when_creating(t: Ctx):
    # 16 KiB: the group's metadata fits, the arrays' do not (preflight off: the write must say so).
    mount = t.fixture("mount_tmpfs")("16k")
    return [t.job(url=str(mount / "store.zarr")), "--no-preflight"]


@case("No space left on device")
def disk_full_mid_job(t: Ctx):
    # 200 KiB: the store (28 KiB) and its lease fit, then about two of 12 shards (~64 KiB each).
    # The actors find the disk full: a job on the module's Ray (preflight off, which would refuse it).
    mount = t.fixture("mount_tmpfs")("200k")
    return [t.job(url=str(mount / "store.zarr")), "--no-preflight"]


# --- object storage (moto on loopback) --------------------------------------------------------------


def _s3_job(t: Ctx, options: dict, bucket: str, *, look_with: dict | None = None) -> list[str]:
    """The job with its store on S3; ``look_with``: storage options that can list the bucket,
    to check that nothing was written (without them nothing can be: no bucket, no endpoint)."""
    url = f"s3://{bucket}/jobs/bad.zarr"
    argv = [t.job(url=url, store={"url": url, "storage_options": options})]
    if look_with is not None:
        import s3fs

        fs = s3fs.S3FileSystem(**look_with, skip_instance_cache=True)
        t.check = lambda: "none" if not fs.find(f"{bucket}/jobs") else f"objects: {fs.find(f'{bucket}/jobs')}"
    else:
        t.check = lambda: "none"
    return argv


@case("NoCredentialsError: Unable to locate credentials")
def s3_missing_credentials(t: Ctx):
    t.fixture("no_aws_credentials")
    options = t.fixture("s3_storage_options")
    return _s3_job(t, {"client_kwargs": options["client_kwargs"]}, t.fixture("s3_bucket"), look_with=options)


# The lease, next to the store, is read first: a GET, whose error body says what is wrong.
@case(
    "cannot read store location s3://auth-bucket/jobs/bad.zarr: PermissionError: The request signature we "
    "calculated does not match"
)
def s3_wrong_secret(t: Ctx):
    auth = t.fixture("s3_auth")
    return _s3_job(t, {**auth["good"], "secret": "not-the-secret"}, auth["bucket"], look_with=auth["good"])


@case(
    "cannot read store location s3://auth-bucket/jobs/bad.zarr: PermissionError: The AWS Access Key Id you "
    "provided does not exist"
)
def s3_unknown_access_key(t: Ctx):
    auth = t.fixture("s3_auth")
    return _s3_job(t, {**auth["good"], "key": "AKIANOSUCHKEY0000000"}, auth["bucket"], look_with=auth["good"])


@case(
    "cannot take the lease of s3://no-such-bucket/jobs/bad.zarr: FileNotFoundError: The specified bucket does not exist"
)
def s3_missing_bucket(t: Ctx):
    return _s3_job(t, t.fixture("s3_storage_options"), "no-such-bucket")


@case("Could not connect to the endpoint URL")
def s3_unreachable_endpoint(t: Ctx):
    # A closed port on loopback; one attempt with a short timeout keeps the case fast.
    options = {
        "key": "k",
        "secret": "s",
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{free_port()}"},
        "config_kwargs": {"connect_timeout": 2, "retries": {"max_attempts": 1}},
    }
    return _s3_job(t, options, "some-bucket")


# --- fixtures the cases ask for ---------------------------------------------------------------------


@pytest.fixture
def mount_tmpfs(tmp_path):
    """mount(size) -> a directory on a fresh tmpfs of that size (unmounted after the test)."""
    with contextlib.ExitStack() as stack:
        yield lambda size: stack.enter_context(tmpfs(tmp_path / f"fs-{size}", size))


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory nobody can write to: a read-only tmpfs, or (without mount rights, as a user
    who is not root) a directory without write permission."""
    if os.geteuid() != 0:
        path = tmp_path / "ro"
        path.mkdir(mode=0o555)
        yield path
        path.chmod(0o755)
        return
    with tmpfs(tmp_path / "ro", "64k", readonly=True) as path:
        yield path


@pytest.fixture
def no_aws_credentials(monkeypatch, tmp_path):
    """No credentials anywhere botocore looks, and never the instance metadata service (which
    is not on loopback)."""
    for var in [v for v in os.environ if v.startswith("AWS_") and v != "AWS_CA_BUNDLE"]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))


def _moto_auth(endpoint: str, count: str) -> None:
    # moto checks signatures once INITIAL_NO_AUTH_ACTION_COUNT requests were served unchecked.
    request = urllib.request.Request(
        f"{endpoint}/moto-api/reset-auth", data=count.encode(), headers={"Content-Type": "text/plain"}
    )
    urllib.request.urlopen(request, timeout=10).close()


@pytest.fixture
def s3_auth(s3_server):
    """The shared moto server with signature checks on, for this test only: an IAM user with a
    real key pair (made by the 3 unchecked requests) and a bucket it owns."""
    import boto3
    import s3fs

    _moto_auth(s3_server, "3")
    iam = key = None
    user = f"classgrad-{uuid.uuid4().hex[:8]}"
    try:
        iam = boto3.client(
            "iam",
            endpoint_url=s3_server,
            region_name="us-east-1",
            aws_access_key_id="bootstrap",
            aws_secret_access_key="bootstrap",
        )
        iam.create_user(UserName=user)
        iam.put_user_policy(
            UserName=user,
            PolicyName="all",
            PolicyDocument=json.dumps(
                {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
            ),
        )
        key = iam.create_access_key(UserName=user)["AccessKey"]
        good = {
            "key": key["AccessKeyId"],
            "secret": key["SecretAccessKey"],
            "client_kwargs": {"endpoint_url": s3_server},
        }
        if not s3fs.S3FileSystem(**good, skip_instance_cache=True).exists("auth-bucket"):
            s3fs.S3FileSystem(**good, skip_instance_cache=True).mkdir("auth-bucket")
        yield {"bucket": "auth-bucket", "good": good}
        # The right key works, so the failures above are about the wrong ones.
        assert s3fs.S3FileSystem(**good, skip_instance_cache=True).ls("auth-bucket") == []
    finally:
        _moto_auth(s3_server, "inf")
        if key is not None:
            iam.delete_access_key(UserName=user, AccessKeyId=key["AccessKeyId"])


# --- the tests ---------------------------------------------------------------------------------------


def run_in_process(argv: list[str], capsys) -> tuple[int, str, str]:
    code = cli_main(["run", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("build,message", CASES)
def test_bad_input_ends_in_one_line(build, message, ray_local, tmp_path, capsys, request):
    # ray_local (module-scoped) is set up before capsys, so Ray's log handlers never hold a
    # stream that capsys closes; cases that need no Ray fail before the driver touches it.
    ctx = Ctx(tmp_path, request)
    argv = build(ctx)
    code, out, err = run_in_process(argv, capsys)
    assert code == 2, (out, err)
    assert "Traceback" not in out + err
    lines = error_lines(err)
    assert len(lines) == 1 and lines[0].startswith("classgrad: error: ") and message in lines[0], err[-3000:]
    left = ctx.check() if ctx.check else trusted_state(ctx.url, ctx.config)
    assert left in ("none", "refused", "untouched: True") or left.startswith("resumable"), left
    if left.startswith("resumable"):
        store = open_store(ctx.url)
        assert store.lease.info() is None, "a failed run must release its lease"
        runs = store.runs  # empty when the disk was too full to record the run
        assert not runs or runs[-1]["status"] == "failed"


def test_the_table_is_big_enough():
    assert len(CASES) >= 25


SUBPROCESS_CASES = [malformed_yaml, model_factory_cannot_import, labels_out_of_range]


@pytest.mark.parametrize("build", SUBPROCESS_CASES, ids=lambda fn: fn.__name__)
def test_in_a_real_process(build, tmp_path, request):
    # What a user sees: exit status 2 and the error line as all of stderr, nothing on stdout.
    ctx = Ctx(tmp_path, request)
    proc = classgrad_cli("run", *build(ctx), timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stdout == "" and len(proc.stderr.splitlines()) == 1, proc.stderr[-3000:]
    assert proc.stderr.startswith("classgrad: error: ")
    assert trusted_state(ctx.url, ctx.config) == "none"


def test_an_error_inside_an_actor_in_a_real_process(tmp_path, request, ray_local):
    # A fresh driver process joining the module's Ray (which has the repository on its workers'
    # path): the actor's error reaches the user as one line (no traceback from Ray's worker log
    # forwarding), exit 2, and the shards done before it are correct.
    ctx = Ctx(tmp_path, request)
    address = ray_local.get_runtime_context().gcs_address
    proc = classgrad_cli("run", *nan_inputs_only_an_actor_sees(ctx), "--set", f"cluster.address={address}", timeout=180)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    (line,) = error_lines(proc.stderr)
    assert "non-finite loss for class(es) [30]" in line, line
    assert trusted_state(ctx.url, ctx.config).startswith("resumable")


def test_an_unreachable_cluster_fails_fast_in_one_line(tmp_path, request):
    ctx = Ctx(tmp_path, request)
    argv = [ctx.job(), "--set", f"cluster.address=127.0.0.1:{free_port()}"]
    proc = classgrad_cli("run", *argv, timeout=60)  # Ray alone would retry for minutes
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    (line,) = error_lines(proc.stderr)
    assert "cannot reach the Ray cluster at 127.0.0.1:" in line, line
    assert trusted_state(ctx.url, ctx.config) == "resumable, 0 done"


def test_empty_classes_work(tmp_path, capsys, ray_local):
    # Class 0 (the first), 8-11 (a whole shard) and 47 (the last) have no samples.
    empty = [0, 5, 8, 9, 10, 11, 47]
    url = str(tmp_path / "empty.zarr")
    # An MLP (no convolutions): its rows computed here are bit-identical to an actor's.
    job = small_job(url, model=VECTOR["model"], data={"kwargs": {**VECTOR["data"]["kwargs"], "empty_classes": empty}})
    code, out, err = run_in_process([write_job(tmp_path / "empty.yaml", job)], capsys)
    assert code == 0, err[-3000:]
    got = store_arrays(url)
    assert (got["rows"][empty] == 0).all() and (got["count"][empty] == 0).all() and (got["loss"][empty] == 0).all()
    assert (got["count"][[c for c in range(C) if c not in empty]] == 3).all()
    clean = JobConfig.model_validate(small_job(str(tmp_path / "clean.zarr"), model=job["model"], data=job["data"]))
    assert_identical(got, uninterrupted(clean))
