"""Secrets never reach a store, a log line or a ``--json`` output (issue 15, item 8).

The rule for secret-looking keys is tested as a table (``tokenizer`` and ``num_tokens`` are not
secrets); ``SECRETS`` plants every secret the issue found in plain text in a store's
``zarr.json`` into one job, whose store is created by the driver's own ``prepare_store`` (no Ray:
``tests/integration/test_secrets.py`` runs the whole job); every file of the store, every log
line and the ``--json`` output of ``status``, ``inspect`` and ``estimate`` are then searched for
each secret value.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from classgrad.config import JobConfig, load_config
from classgrad.config.redaction import REDACTED, RedactingFilter, is_secret_key, redact, redact_text
from classgrad.service.commands.cli import main as cli_main
from classgrad.service.driver_runtime.preparation import prepare_store
from tests.support.harness import write_job
from tests.support.jobs import small_job

# Each value is unique, so finding it anywhere means that secret leaked.
SECRETS = {
    "passwd": "pw-hunter2-storage",
    "url_password": "pw-in-endpoint-url",
    "hf_auth": "hf_auth_value_0123",
    "database_password": "pg-password-4567",
    "account_key": "QWNjb3VudEtleVZhbHVl+/==",
    "github_pat": "ghp_patvalue89",
    "api_token": "api-token-value-xyz",
    "plain_env": "an-ordinary-env-value",
}


def secret_sections() -> dict:
    """Job sections holding every secret of ``SECRETS`` (for a local store: the storage options
    are carried but unused)."""
    s = SECRETS
    return {
        "store": {
            "storage_options": {
                "passwd": s["passwd"],
                "client_kwargs": {"endpoint_url": f"http://me:{s['url_password']}@127.0.0.1:9"},
            }
        },
        "cluster": {
            "runtime_env": {
                "env_vars": {
                    "HF_AUTH": s["hf_auth"],
                    "DATABASE_URL": f"postgresql://app:{s['database_password']}@db.internal:5432/probe",
                    "AZURE_STORAGE_CONNECTION_STRING": (
                        f"DefaultEndpointsProtocol=https;AccountName=acct;AccountKey={s['account_key']};"
                        "EndpointSuffix=core.windows.net"
                    ),
                    "GITHUB_PAT": s["github_pat"],
                    "CLASSGRAD_NOTE": s["plain_env"],
                }
            }
        },
        "data": {
            "factory": "tests.support.faulty:authenticated_probe",
            "kwargs": {
                "source": {"url": "https://data.example/probe", "api_token": s["api_token"]},
                "num_classes": 48,
                "samples_per_class": 3,
                "input_shape": [3, 8, 8],
                "seed": 2,
            },
        },
    }


def leaked(text: str) -> list[str]:
    """The names of the secrets found in ``text``."""
    return [name for name, value in SECRETS.items() if value in text]


def store_text(url: str) -> str:
    """Every file of a local store, read as text (binary chunks included, as Latin-1)."""
    return "\n".join(p.read_bytes().decode("latin-1") for p in sorted(Path(url).rglob("*")) if p.is_file())


# --------------------------------------------------------------------------- the rules


@pytest.mark.parametrize(
    "key",
    [
        "key",
        "secret",
        "passwd",
        "password",
        "Password",
        "api_token",
        "apiKey",
        "GITHUB_PAT",
        "HF_AUTH",
        "AccountKey",
        "SharedAccessSignature",
        "X-Amz-Signature",
        "sig",
        "aws_secret_access_key",
        "aws_session_token",
        "private_key",
        "clientSecret",
        "authtoken",
        "Authorization",
        "Credentials",
        "db_pass",
        "oauth",
    ],
)
def test_secret_looking_keys(key: str) -> None:
    assert is_secret_key(key)


@pytest.mark.parametrize(
    "key",
    ["tokenizer", "num_tokens", "max_new_tokens", "author", "monkey", "keyboard", "signal", "bypass", "url", "passes"],
)
def test_keys_that_only_contain_a_secret_word_are_not_secret(key: str) -> None:
    assert not is_secret_key(key)


@pytest.mark.parametrize(
    "text,hidden,kept",
    [
        ("http://me:PASS@host:9000/x", "PASS", "http://me:***@host:9000/x"),
        ("postgresql://app:p@ss@db:5432/x", "ss@db", "postgresql://app:***@db:5432/x"),  # an unencoded @
        ("https://ghp_tok@github.com/r.git", "ghp_tok", "https://***@github.com/r.git"),
        ("AccountName=a;AccountKey=abc/d+e==;EndpointSuffix=x", "abc/d+e==", "AccountKey=***;EndpointSuffix=x"),
        ("BlobEndpoint=https://a.blob/;SharedAccessSignature=sv=1&sig=AbC%3D", "AbC%3D", "sig=***"),
        ("Server=db;User Id=app;Password=hunter2;", "hunter2", "Password=***"),
        ("https://x/blob?se=2030&X-Amz-Signature=deadbeef", "deadbeef", "X-Amz-Signature=***"),
    ],
)
def test_credentials_inside_strings(text: str, hidden: str, kept: str) -> None:
    out = redact_text(text)
    assert hidden not in out and kept in out, out


def test_ordinary_strings_are_untouched() -> None:
    for text in ("s3://bucket/g.zarr", "http://127.0.0.1:9000", "shard_rows=6", "a@b.c", "tokenizer=gpt2"):
        assert redact_text(text) == text


def test_numbers_that_count_or_index_are_kept_under_secret_looking_keys() -> None:
    """A Hugging Face config's token ids and key/value head counts are model settings: a store's
    recorded model kwargs must rebuild the model. Strings under such keys stay hidden."""
    kwargs = {
        "pad_token_id": 0,
        "eos_token_id": 2,
        "num_key_value_heads": 2,
        "api_token": "hf_abc",
        "aws_access_key_id": "AKIAEXAMPLE",
        "token_id": "tok-123",
        "auth_token_count": True,  # a bool is not a count
        "secret": 1234,  # a number under a key that names no count: hidden
    }
    got = redact({"model": {"kwargs": kwargs}})["model"]["kwargs"]
    assert got["pad_token_id"] == 0 and got["eos_token_id"] == 2 and got["num_key_value_heads"] == 2
    hidden = ("api_token", "aws_access_key_id", "token_id", "auth_token_count", "secret")
    assert all(got[k] == REDACTED for k in hidden), got


def test_redact_every_env_var_every_section_any_depth() -> None:
    value = {
        "env_vars": {"OMP_NUM_THREADS": "1", "X": "y"},
        "kwargs": {"deep": [{"api_token": "t"}, {"tokenizer": "gpt2", "num_tokens": 3}]},
    }
    assert redact(value) == {
        "env_vars": {"OMP_NUM_THREADS": REDACTED, "X": REDACTED},
        "kwargs": {"deep": [{"api_token": REDACTED}, {"tokenizer": "gpt2", "num_tokens": 3}]},
    }


def test_the_fingerprint_uses_the_real_values() -> None:
    # Redaction hides values only where the config is written: two jobs that differ only in a
    # credential the data factory takes still differ (and are both redacted the same way).
    a = JobConfig.model_validate(small_job("/tmp/a.zarr", **secret_sections()))
    job = small_job("/tmp/a.zarr", **secret_sections())
    job["data"]["kwargs"]["source"]["api_token"] = "another-token"
    b = JobConfig.model_validate(job)
    assert a.fingerprint() != b.fingerprint()
    assert a.redacted() == b.redacted()


def test_the_logging_filter_redacts_every_record(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("classgrad.test_redaction")
    handler_filter = RedactingFilter()
    caplog.handler.addFilter(handler_filter)
    try:
        with caplog.at_level(logging.INFO, logger="classgrad.test_redaction"):
            log.info("could not connect to %s", f"http://me:{SECRETS['url_password']}@host")
    finally:
        caplog.handler.removeFilter(handler_filter)
    assert leaked(caplog.text) == [] and "http://me:***@host" in caplog.text


# --------------------------------------------------------------------------- store and --json outputs


def test_no_secret_in_the_store_logs_or_json_outputs(tmp_path: Path, capsys, caplog) -> None:
    url = str(tmp_path / "secrets.zarr")
    job = small_job(url, **secret_sections())
    path = write_job(tmp_path / "job.yaml", job)
    config = load_config(path)
    # The config object keeps the real values (the actors need them).
    assert config.cluster.runtime_env["env_vars"]["GITHUB_PAT"] == SECRETS["github_pat"]
    with caplog.at_level(logging.DEBUG):
        prepare_store(config)  # what the driver writes before any actor starts
        outputs = []
        for argv in (
            ["status", url, "--json"],
            ["inspect", url, "--json"],
            ["estimate", path, "--json", "--sample-rows", "4"],
        ):
            assert cli_main(argv) == 0, argv
            out, err = capsys.readouterr()
            json.loads(out)  # each one prints JSON
            outputs.append(out + err)
    attrs = json.loads((Path(url) / "zarr.json").read_text())["attributes"]
    assert attrs["classgrad"]["config"]["cluster"]["runtime_env"]["env_vars"]["GITHUB_PAT"] == REDACTED
    assert leaked(store_text(url)) == []
    assert leaked(caplog.text) == []
    for text in outputs:
        assert leaked(text) == [], text[:2000]


def test_an_error_line_is_redacted(capsys) -> None:
    # A store location that cannot be reached, named with its password: the error line hides it.
    code = cli_main(["status", f"http://me:{SECRETS['url_password']}@127.0.0.1:9/x.zarr"])
    _, err = capsys.readouterr()
    assert code == 2 and err.startswith("classgrad: error: cannot open store at http://me:***@127.0.0.1:9/"), err
    assert leaked(err) == [], err


def test_submit_refuses_a_secret_in_an_override(tmp_path: Path) -> None:
    from classgrad.service.driver_runtime.submit import JobSubmitError, prepare_submission

    path = write_job(tmp_path / "job.yaml", small_job("/shared/x.zarr"))
    for override in (
        f"cluster.runtime_env.env_vars.HF_AUTH={SECRETS['hf_auth']}",
        f"store.storage_options.passwd={SECRETS['passwd']}",
        f"data.kwargs.source={{url: 'http://me:{SECRETS['url_password']}@h/x'}}",
    ):
        with pytest.raises(JobSubmitError) as info:
            prepare_submission(path, [override], working_dir=tmp_path)
        assert leaked(str(info.value)) == [] and "entrypoint" in str(info.value)
    ok = prepare_submission(path, ["cluster.num_workers=3"], working_dir=tmp_path)
    assert "cluster.num_workers=3" in ok.entrypoint


def test_jobs_status_json_hides_credentials_in_an_entrypoint() -> None:
    from types import SimpleNamespace

    from classgrad.service.commands.jobs import _details

    info = SimpleNamespace(
        submission_id="raysubmit_1",
        job_id=None,
        status="RUNNING",
        message=f"cannot reach http://me:{SECRETS['url_password']}@h",
        entrypoint=f"python -m classgrad run job.yaml --set store.storage_options.key={SECRETS['passwd']}",
        start_time=None,
        end_time=None,
        metadata={"classgrad_config": "job.yaml"},
    )
    assert leaked(json.dumps(_details(info))) == []


def test_token_shapes_in_an_exception_never_reach_the_error_line_or_the_store(tmp_path: Path, capsys) -> None:
    """A data factory whose exception quotes a Bearer header, an ``hf_`` token, a JWT and other
    keys by their shape, under no secret-looking name (issue 56, item 2): ``classgrad run``
    ends in one line that names the failure and none of them, and nothing is written."""
    from tests.support import faulty

    url = str(tmp_path / "leak.zarr")
    job = small_job(url, data={"factory": "tests.support.faulty:leaky_dataset", "kwargs": {}})
    code = cli_main(["run", write_job(tmp_path / "job.yaml", job)])
    _, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and lines[-1].startswith("classgrad: error: ") and "ConnectionError" in lines[-1], err
    for name, token in faulty.PLANTED_TOKENS.items():
        assert token not in err, name
        assert token.split()[-1] not in err, name  # the credentials of "Bearer ..." too
    assert not Path(url).exists()


@pytest.mark.parametrize("name", ["bearer", "hf", "jwt", "github", "aws", "openai"])
def test_each_token_shape_is_redacted_in_free_text(name: str) -> None:
    from tests.support import faulty

    token = faulty.PLANTED_TOKENS[name]
    text = redact_text(f"failed: {token} (retry later)")
    assert token.split()[-1] not in text and REDACTED in text and text.endswith("(retry later)"), text
