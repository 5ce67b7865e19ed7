"""Safety: no pickled code runs, Ray keeps its token, no credential is written anywhere.

- A checkpoint that is a malicious pickle (``os.system`` in its ``__reduce__``), saved by
  ``torch.save`` or as a bare pickle, is refused by ``classgrad run`` in one line
  (``torch.load(weights_only=True)``), and its payload never runs.
- One real job, started the way a user starts one (``classgrad -v run`` in a fresh process, with
  the local Ray its driver starts itself, its files in a private ``RAY_TMPDIR``), with
  its store on S3 (moto on loopback), AWS credentials in the environment and others in
  ``store.storage_options`` and ``cluster.runtime_env``. While its actors are held mid-shard
  (``faulty.write_plan(hold=True)``):
    * the driver's local Ray requires Ray's auth token although nothing asked for it
      (``RAY_AUTH_MODE`` unset): a GCS client without a token, or with a wrong one, is refused;
      one with the token is served (so the refusals are about the token);
    * nothing that Ray process tree listens on serves the job API (or anything else over HTTP)
      to a client without the token; the only open HTTP ports are Ray's read-only Prometheus
      metrics exporters (``include_dashboard=False`` starts no dashboard or job server).
  Afterwards no secret appears in any object of the bucket (store attributes, arrays, lease),
  in what the CLI printed (with ``-v``: debug logging), or in any file of the Ray session's logs
  (actors' output included), except one that is Ray's own doing (its runtime env agent logs
  ``runtime_env`` values; see the comment there); the store's config shows secrets as ``***``.

Where the multi-node test cluster's dashboard and job server listen (127.0.0.1 only) is checked
in ``test_faults.py``, on the cluster that module starts anyway.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
import s3fs  # noqa: E402
import torch

from classgrad.service.commands.cli import main as cli_main
from classgrad.store import open_store
from tests.support import faulty
from tests.support.harness import (
    LOOPBACK,
    WILDCARD,
    error_lines,
    fault_job,
    job_api_without_token,
    kill_session,
    listening,
    ray_processes,
    repo_env,
    start_cli,
    store_arrays,
    wait_for,
    write_job,
)


class _Payload:
    """Unpickling this runs ``touch <marker>``: what a malicious checkpoint would do."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _torch_save(path: Path, payload: _Payload) -> None:
    torch.save({"state_dict": {}, "extra": payload}, path)


def _bare_pickle(path: Path, payload: _Payload) -> None:
    with open(path, "wb") as fh:
        pickle.dump({"extra": payload}, fh, protocol=2)  # the protocol torch.load expects


@pytest.mark.parametrize("save", [_torch_save, _bare_pickle], ids=["torch_save", "bare_pickle"])
def test_a_malicious_checkpoint_is_refused_and_its_code_never_runs(tmp_path, capsys, save):
    marker = tmp_path / "pwned"
    checkpoint = tmp_path / "model.pt"
    save(checkpoint, _Payload(str(marker)))
    url = str(tmp_path / "store.zarr")
    job = fault_job(url, model={"checkpoint": str(checkpoint)})
    code = cli_main(["run", write_job(tmp_path / "job.yaml", job)])
    out, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in out + err
    (line,) = error_lines(err)
    assert f"model.checkpoint '{checkpoint}': refused, not a plain weights file (torch.load weights_only=True" in line
    assert not marker.exists(), "the pickled payload ran"
    assert not os.path.exists(url)


def _gcs_probe(port: int, env: dict) -> subprocess.CompletedProcess:
    """Ask the GCS at 127.0.0.1:port for its keys, as a client with the given environment."""
    code = (
        f"from ray._raylet import GcsClient\n"
        f"print('KEYS', len(GcsClient(address='127.0.0.1:{port}').internal_kv_keys(b'', None, timeout=10)))\n"
    )
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


@pytest.fixture
def ray_tmp():
    """A short private Ray temp dir (Unix socket paths must stay under ~107 bytes), removed after."""
    path = tempfile.mkdtemp(prefix="cgsafe-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _gcs_port(ray_tmp: str) -> int | None:
    """The port the GCS of the Ray whose temp dir is ``ray_tmp`` listens on (ray.init picks it)."""
    gcs = [p for p in ray_processes(marker=ray_tmp) if p.name() == "gcs_server"]
    ports = sorted({port for _, port, _ in listening(gcs)})
    assert len(ports) <= 1, f"the GCS listens on several ports: {ports}"
    return ports[0] if ports else None


def test_token_auth_stays_on_and_no_credential_is_written_anywhere(tmp_path, ray_tmp, s3_bucket, s3_server):
    tag = uuid.uuid4().hex[:12].upper()
    secrets = {
        "env key": f"AKIAENV{tag}",
        "env secret": f"env-secret-{tag}",
        "options key": f"AKIAOPT{tag}",
        "options secret": f"options-secret-{tag}",
        "runtime_env token": f"session-token-{tag}",
    }
    plan = faulty.write_plan(tmp_path / "faults", hold=True)
    url = f"s3://{s3_bucket}/jobs/safe.zarr"
    options = {
        "key": secrets["options key"],
        "secret": secrets["options secret"],
        "client_kwargs": {"endpoint_url": s3_server},
    }
    job = fault_job(
        url,
        plan,
        store={"url": url, "storage_options": options},
        cluster={"runtime_env": {"env_vars": {"AWS_SESSION_TOKEN": secrets["runtime_env token"]}}},
    )
    path = write_job(tmp_path / "job.yaml", job)
    # Nobody asks for token auth (no RAY_AUTH_*), Ray's files go to a private temp dir, and the
    # driver has AWS credentials in its environment; -v: debug logging, the most it ever says.
    base = {k: v for k, v in repo_env().items() if not k.startswith(("RAY_", "AWS_"))}
    env = {
        **base,
        "RAY_TMPDIR": ray_tmp,
        "AWS_ACCESS_KEY_ID": secrets["env key"],
        "AWS_SECRET_ACCESS_KEY": secrets["env secret"],
    }
    proc = start_cli("-v", "run", path, env=env, output=tmp_path / "cli")
    try:
        wait_for(lambda: faulty.started(plan), 120, "the job's actors to start", alive=proc)
        port = wait_for(lambda: _gcs_port(ray_tmp), 10, "the GCS of the driver's Ray")

        # ...and yet the GCS of the driver's Ray wants the token.
        no_token = _gcs_probe(port, {**base, "HOME": str(tmp_path)})  # no ~/.ray/auth_token there
        wrong = _gcs_probe(
            port, {**base, "HOME": str(tmp_path), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "not-the-token"}
        )
        right = _gcs_probe(port, {**base, "RAY_AUTH_MODE": "token"})  # the token ray.init keeps in ~/.ray
        for refused in (no_token, wrong):
            assert refused.returncode != 0 and "InvalidAuthToken" in refused.stderr, refused.stderr[-2000:]
        assert right.returncode == 0 and "KEYS" in right.stdout, right.stderr[-2000:]

        # No dashboard or job server open to anyone: every port of this Ray that speaks HTTP
        # on loopback refuses a client without the token, or is a read-only metrics exporter.
        sockets = listening(ray_processes(marker=ray_tmp))
        assert sockets, "found no listening socket of the driver's Ray"
        answers = {port: job_api_without_token(port) for ip, port, _ in sockets if ip in LOOPBACK + WILDCARD}
        assert not [port for port, answer in answers.items() if answer.startswith("SERVED")], answers
    finally:
        faulty.release(plan)
        try:
            proc.wait(timeout=180)
        finally:
            kill_session(proc)
    out, err = ((tmp_path / f"cli.{name}").read_text() for name in ("stdout", "stderr"))
    assert proc.returncode == 0, err[-3000:]
    assert "run " in out and ": complete" in out

    # The store is complete and readable with the right options ...
    assert store_arrays(url, storage_options=options)["rows"].shape[0] == 48
    store = open_store(url, storage_options=options)
    assert store.attrs["config"]["store"]["storage_options"]["secret"] == "***"
    assert store.attrs["config"]["cluster"]["runtime_env"]["env_vars"]["AWS_SESSION_TOKEN"] == "***"
    # ... and no secret is anywhere: every object of the bucket, the output, Ray's logs.
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    objects = {key: fs.cat_file(key) for key in fs.find(s3_bucket)}
    assert any(key.endswith("zarr.json") for key in objects) and any(key.endswith("/c/0/0") for key in objects)
    log_files = [p for p in Path(ray_tmp).rglob("*") if p.is_file()]
    assert any(p.name.startswith("worker-") for p in log_files), "no actor logs found to check"
    places = {f"s3://{key}": data for key, data in objects.items()}
    places.update({"stdout": out.encode(), "stderr": err.encode()})
    places.update({str(p): p.read_bytes() for p in log_files})
    leaks = [
        (what, where) for what, secret in secrets.items() for where, data in places.items() if secret.encode() in data
    ]
    # Known, and Ray's own: its runtime env agent logs each runtime_env it creates, env_vars
    # values included. Credentials belong in the nodes' environment (or an IAM role), never in
    # cluster.runtime_env; classgrad keeps them out of the store, Ray's log is beyond it.
    rays_own = [
        (what, where)
        for what, where in leaks
        if what == "runtime_env token" and where.endswith("runtime_env_agent.log")
    ]
    assert [leak for leak in leaks if leak not in rays_own] == []
