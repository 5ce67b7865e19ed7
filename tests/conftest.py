"""Shared pytest fixtures.

- ``s3_server`` (session): a real S3-compatible HTTP endpoint, moto in server mode on
  127.0.0.1 on a free port, run as a subprocess; yields its endpoint URL. It sets no global
  credentials: tests pass them explicitly (``s3_storage_options``) or through monkeypatch.
- ``s3_storage_options``: fsspec/s3fs storage options for that server (dummy credentials,
  which moto accepts).
- ``s3_bucket``: a fresh, empty bucket on that server; yields its name.
- ``fresh_choices``: the engines' process-wide speed choices cleared before and after a test
  (it measures and spot-checks anew); modules that need it for every test say
  ``pytestmark = pytest.mark.usefixtures("fresh_choices")``.
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
import uuid

import pytest

from tests.support.cluster import free_port  # stdlib only: cheap to import here

_MOTO_START_TIMEOUT_S = 60.0


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory):
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log_path = tmp_path_factory.mktemp("moto") / "moto.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + _MOTO_START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    f"moto server exited with {proc.returncode}: {log_path.read_text(errors='replace')[-2000:]}"
                )
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/reset", data=b"", timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"moto server did not answer on {endpoint} within {_MOTO_START_TIMEOUT_S:.0f}s")
                time.sleep(0.1)
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def s3_storage_options(s3_server: str) -> dict:
    return {"key": "testing-key-id", "secret": "testing-secret-key", "client_kwargs": {"endpoint_url": s3_server}}


@pytest.fixture
def s3_bucket(s3_storage_options: dict) -> str:
    import s3fs

    name = f"test-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(**s3_storage_options).mkdir(name)
    return name


@pytest.fixture
def fresh_choices():
    from classgrad.workers.engines import choices  # torch: imported only by the tests that use it

    choices.clear()
    yield
    choices.clear()
