"""No secret of a job's config reaches its store, the driver's output or a ``--json`` output,
after a whole job on a real local Ray (issue 15, item 8).

The job plants every secret of ``tests/unit/test_redaction.py``'s ``SECRETS`` (storage options,
a URL password, env vars, a connection string, a data factory's token) and runs in a fresh
``python -m classgrad run`` process, verbose, so that every log line the driver writes is
captured. Ray's own logs are not searched: Ray writes ``runtime_env`` into them (the driver warns
about it when a value looks like a credential).
"""

from __future__ import annotations

import json
from pathlib import Path

from classgrad.store import open_store
from tests.support.harness import classgrad_cli, repo_env, write_job
from tests.support.jobs import small_job
from tests.unit.test_redaction import SECRETS, leaked, secret_sections, store_text


def test_a_whole_job_leaks_no_secret(tmp_path: Path) -> None:
    url = str(tmp_path / "secrets.zarr")
    sections = secret_sections()
    sections["cluster"] = {**sections["cluster"], "num_workers": 1}
    path = write_job(tmp_path / "job.yaml", small_job(url, **sections))
    env = {k: v for k, v in repo_env().items() if k != "RAY_ADDRESS"}  # its own local Ray
    run = classgrad_cli("-v", "run", path, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "run " in run.stdout and ": complete" in run.stdout, run.stdout
    # The actors got the real values: the job ran, and its env vars are what the actors saw.
    assert "secret-looking values" in run.stderr  # the warning that Ray logs its runtime env
    outputs = {"run": run.stdout + run.stderr}
    for argv in (["status", url, "--json"], ["inspect", url, "--json"], ["estimate", path, "--json"]):
        proc = classgrad_cli(*argv, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        json.loads(proc.stdout)
        outputs[argv[0]] = proc.stdout + proc.stderr
    assert leaked(store_text(url)) == []
    for name, text in outputs.items():
        assert leaked(text) == [], (name, text[-3000:])
    attrs = json.loads((Path(url) / "zarr.json").read_text())["attributes"]["classgrad"]
    assert open_store(url).runs[-1]["status"] == "complete"
    assert set(attrs["config"]["cluster"]["runtime_env"]["env_vars"].values()) == {"***"}
    assert SECRETS  # every value searched above
