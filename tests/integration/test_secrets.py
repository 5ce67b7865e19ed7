"""No secret of a job's config reaches its store, the driver's output or a ``--json`` output,
after a whole job on a real local Ray (issue 15, item 8).

The job plants every secret of ``tests/unit/test_redaction.py``'s ``SECRETS`` (storage options,
a URL password, env vars, a connection string, a data factory's token) and runs in a fresh
``python -m classgrad run`` process, verbose, so that every log line the driver writes is
captured. Ray's own logs are not searched there: Ray writes ``runtime_env`` into them (the driver
warns about it when a value looks like a credential). They are searched for what an actor's
exception carries: a data factory failing on the actors with tokens in its message.
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


def test_a_factory_failing_on_the_actors_leaks_no_token_into_rays_logs(tmp_path: Path) -> None:
    """The data factory works on the driver and fails on every actor, its exception quoting a
    Bearer header, an ``hf_`` token, a JWT and other keys by their shape (issue 56, item 2):
    the actor raises it redacted, so neither the driver's line, the store nor any file of Ray's
    own session (worker logs included) holds one of them."""
    import shutil
    import tempfile

    from tests.support import faulty

    url = str(tmp_path / "leak.zarr")
    data = {"factory": "tests.support.faulty:leaky_on_actors"}
    job = small_job(url, data=data, cluster={"num_workers": 1}, sharding={"max_attempts": 1})
    ray_tmp = tempfile.mkdtemp(prefix="cgleak", dir="/tmp")  # short: Ray's socket paths are bounded
    try:
        env = {**{k: v for k, v in repo_env().items() if k != "RAY_ADDRESS"}, "RAY_TMPDIR": ray_tmp}
        run = classgrad_cli("run", write_job(tmp_path / "job.yaml", job), env=env, timeout=300)
        assert run.returncode != 0 and "ConnectionError" in run.stderr, run.stderr[-3000:]
        texts = {"driver": run.stdout + run.stderr, "store": store_text(url) if Path(url).exists() else ""}
        for path in Path(ray_tmp).rglob("*"):
            if path.is_file() and path.suffix in (".log", ".out", ".err", ".txt", ".json", ""):
                try:
                    texts[str(path)] = path.read_text(errors="replace")
                except OSError:
                    continue
        assert any("ConnectionError" in t for name, t in texts.items() if name.startswith(ray_tmp)), "no Ray log"
        for name, token in faulty.PLANTED_TOKENS.items():
            secret = token.split()[-1]
            found = [where for where, text in texts.items() if secret in text]
            assert not found, (name, found)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
