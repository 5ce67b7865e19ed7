"""Shared pytest fixtures.

- ``s3_server`` (session): a real S3-compatible HTTP endpoint, moto in server mode on
  127.0.0.1 on a free port, run as a subprocess; yields its endpoint URL. It sets no global
  credentials: tests pass them explicitly (``s3_storage_options``) or through monkeypatch.
- ``s3_storage_options``: fsspec/s3fs storage options for that server (dummy credentials,
  which moto accepts).
- ``s3_bucket``: a fresh, empty bucket on that server; yields its name.
- ``s3_requests``: the requests the server has answered since the test started (moto's own
  request log, read back): ``s3_requests.since_mark()`` lists (method, path) pairs.
- ``fresh_choices``: the engines' process-wide speed choices cleared before and after a test
  (it measures and spot-checks anew); modules that need it for every test say
  ``pytestmark = pytest.mark.usefixtures("fresh_choices")``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.support.cluster import free_port  # stdlib only: cheap to import here

# One OpenMP (and MKL) thread in every test process and in every process it starts (CLI drivers;
# Ray actors run one already), set before torch is imported (nothing above imports it). On a
# busy machine two threads of the tests' small tensors spend their time spinning at barriers for
# a descheduled peer: on 2 cores under a load of 10-12, a unit subset took over 400 s with two
# threads and 78 s with one (quiet: 11.9 s and 10.7 s); benchmarks/RESULTS.md, "The suite under load".
for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_name, "1")

_MOTO_START_TIMEOUT_S = 60.0
_MOTO_LOGS: dict[str, Path] = {}  # endpoint -> its server's log (every request it answered, a line each)
_REQUEST_LINE = re.compile(r'"(GET|PUT|HEAD|POST|DELETE) (\S+) HTTP/[\d.]+"')
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


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
        _MOTO_LOGS[endpoint] = log_path
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


class RequestLog:
    """The requests a moto server answered, from its log: those after the last ``mark``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.mark()

    def mark(self) -> None:
        self._offset = self.path.stat().st_size

    def since_mark(self, settle_s: float = 0.5) -> list[tuple[str, str]]:
        time.sleep(settle_s)  # the server writes its line after it answers
        with open(self.path, "rb") as fh:
            fh.seek(self._offset)
            text = _ANSI.sub("", fh.read().decode(errors="replace"))
        return [(m[1], m[2]) for m in _REQUEST_LINE.finditer(text)]


@pytest.fixture
def s3_requests(s3_server: str) -> RequestLog:
    return RequestLog(_MOTO_LOGS[s3_server])


@pytest.fixture
def fresh_choices():
    from classgrad.workers.engines import choices  # torch: imported only by the tests that use it

    choices.clear()
    yield
    choices.clear()
