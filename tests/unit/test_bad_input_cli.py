"""Bad input that fails before Ray is touched: ``classgrad run`` ends in one line
``classgrad: error: ...``, exit 2, and writes nothing at the store's location (issue 15, item 9).

Each case of ``CASES`` builds a job (``small_job`` with one thing wrong) and names the text its
error line must contain; the table runs the CLI's entry point in this process, and
``test_in_a_real_process`` repeats some in a fresh ``python -m classgrad``. Cases that need a
running Ray are in tests/integration/test_bad_input.py. ``test_the_python_api_checks_the_device``
covers ``per_class_gradients``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from classgrad.config.loading import MAX_YAML_NODES
from classgrad.config.placement import ENV_VAR_MAX_BYTES
from classgrad.service.commands.cli import main as cli_main
from tests.support import faulty
from tests.support.harness import classgrad_cli, error_lines, write_job
from tests.support.jobs import small_job

C = 48
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
NO_MPS = pytest.mark.skipif(torch.backends.mps.is_available(), reason="checks a machine without MPS")


class Ctx:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.url = str(tmp / "store.zarr")

    def job(self, **sections) -> str:
        return write_job(self.tmp / "job.yaml", small_job(self.url, **sections))

    def raw(self, text: str) -> str:
        path = self.tmp / "job.yaml"
        path.write_text(text)
        return str(path)


CASES: list = []


def case(message: str, *marks: pytest.MarkDecorator):
    def register(fn: Callable[[Ctx], list[str]]):
        CASES.append(pytest.param(fn, message, id=fn.__name__, marks=marks))
        return fn

    return register


def _probe(**extra) -> dict:
    return {"num_classes": C, "samples_per_class": 3, "input_shape": [3, 8, 8], "seed": 2, **extra}


@case("does not fit the model: features.0.weight is (8, 3, 3, 3) in the checkpoint, (4, 3, 3, 3) in the model")
def checkpoint_with_wrong_shapes(t: Ctx):
    path = faulty.resized_checkpoint(str(t.tmp / "wide.pt"), num_classes=C, width=8)
    return [t.job(model={"checkpoint": path})]


@case("data: item 57 of the probe set raised OSError: image file 57.png is truncated")
def dataset_item_raises(t: Ctx):
    return [t.job(data={"factory": "tests.support.faulty:raising_dataset", "kwargs": _probe(bad_item=57)})]


@case(f"env_vars.BLOB is 10485760 bytes, more than the {ENV_VAR_MAX_BYTES} bytes")
def huge_env_var(t: Ctx):
    return [t.job(cluster={"runtime_env": {"env_vars": {"BLOB": "x" * (10 << 20)}}})]


@case("store.url: unsupported scheme ftp:// (supported: a path, file://, s3://, memory://)")
def ftp_store(t: Ctx):
    return [t.job(), "--set", "store.url=ftp://host/grads.zarr"]


@case("loss.num_classes: Input should be less than or equal to 2147483647")
def too_many_classes(t: Ctx):
    return [t.job(), "--set", f"loss.num_classes={10**24}"]


@case(f"expands to more than {MAX_YAML_NODES} values (YAML aliases of aliases?)")
def yaml_alias_bomb(t: Ctx):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    lines.append("model: {kwargs: {blob: *a8}}\nloss: {num_classes: 48}")
    text = "\n".join(lines) + "\n"
    assert len(text) < 1000  # a kilobyte that would expand to 10**9 values
    return [t.raw(text)]


@case("data.batch_size: Input should be a valid integer, got bool")
def batch_size_true(t: Ctx):
    return [t.job(), "--set", "data.batch_size=true"]


@case("cluster.num_workers: Input should be a valid integer, got bool")
def num_workers_true(t: Ctx):
    return [t.raw("loss: {num_classes: 48}\ncluster: {num_workers: yes}\n")]


@case("sharding.max_attempts: Input should be a valid integer, got bool")
def max_attempts_true(t: Ctx):
    return [t.job(sharding={"max_attempts": True})]


@case("run.lease_ttl_s: must be a number, got a bool (true)")
def float_field_true(t: Ctx):
    return [t.job(run={"lease_ttl_s": True})]


@case("--set model=null: a section cannot be null (to reset it to its defaults: --set model={})")
def section_set_to_null(t: Ctx):
    return [t.job(), "--set", "model=null"]


@case("--set cluster.num_workers: expected section.field=value")  # the hint, not masked as a secret
def set_without_a_value(t: Ctx):
    return [t.job(), "--set", "cluster.num_workers"]


@case("a memory:// store lives in one process, and a job's actors run in others")
def memory_store(t: Ctx):
    return [t.job(), "--set", "store.url=memory://grads.zarr"]


# Its hint names the GPUs asked for: "use cpu" alone would leave the actors pending.
@case("(use cpu); with engine.device=cpu, set cluster.num_gpus_per_worker=0 too", NO_CUDA)
def cuda_without_cuda(t: Ctx):
    return [t.job(engine={"device": "cuda"}, cluster={"num_gpus_per_worker": 1})]


@case("engine.device 'mps': MPS (Apple GPU) is not available on this machine", NO_MPS)
def mps_without_mps(t: Ctx):
    return [t.job(engine={"device": "mps"})]


@pytest.fixture(autouse=True)
def _no_ray_address(monkeypatch):
    # A job without cluster.address starts a local Ray (here: the machine whose device is checked).
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


@pytest.mark.parametrize("build,message", CASES)
def test_bad_input_ends_in_one_line(build, message, tmp_path, capsys):
    ctx = Ctx(tmp_path)
    code = cli_main(["run", *build(ctx)])
    out, err = capsys.readouterr()
    assert code == 2, (out, err[-3000:])
    assert "Traceback" not in out + err
    lines = error_lines(err)
    assert len(lines) == 1 and lines[0].startswith("classgrad: error: ") and message in lines[0], err[-3000:]
    assert len(lines[0]) < 600, lines[0]  # one readable line, never a value of megabytes
    assert not os.path.exists(ctx.url), "nothing may be written where the store would be"


@pytest.mark.parametrize("build", [yaml_alias_bomb, cuda_without_cuda, dataset_item_raises], ids=lambda f: f.__name__)
def test_in_a_real_process(build, tmp_path):
    if build is cuda_without_cuda and torch.cuda.is_available():
        pytest.skip("checks a machine without CUDA")
    ctx = Ctx(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    from tests.support.harness import repo_env

    proc = classgrad_cli("run", *build(ctx), env=repo_env(env), timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stdout == "" and len(proc.stderr.splitlines()) == 1, proc.stderr[-3000:]
    assert proc.stderr.startswith("classgrad: error: ")
    assert not os.path.exists(ctx.url)


@NO_CUDA
@NO_MPS
@pytest.mark.parametrize("device", ["cuda", "cuda:1", "mps"])
def test_the_python_api_checks_the_device(device):
    from classgrad.errors import InputError
    from classgrad.workers import zoo
    from classgrad.workers.gradients import per_class_gradients

    data = zoo.synthetic_probe(**_probe())
    with pytest.raises(InputError, match=f"device '{device}': .* not available on this machine"):
        per_class_gradients(zoo.small_cnn(C, width=4), data, num_classes=C, device=device)


def test_an_empty_section_in_a_file_still_means_its_defaults(tmp_path):
    from classgrad.config import load_config

    path = Path(tmp_path / "job.yaml")
    path.write_text("model:\nloss: {num_classes: 4}\n")
    assert load_config(path).model.factory == "classgrad.workers.zoo:small_cnn"
    assert load_config(path, ["model={}"]).model.factory == "classgrad.workers.zoo:small_cnn"


# --- Hugging Face-style inputs (issue 16): refused by the driver's check, before any store ------

HF = "tests.support.hf_jobs"
_VECTORS = {"factory": f"{HF}:job_vector_rows", "kwargs": {"num_classes": C}}


@case("model output: a dict with no tensor to take as the logits")
def output_without_a_tensor(t: Ctx):
    return [t.job(model={"factory": f"{HF}:job_no_tensor_output", "kwargs": {"num_classes": C}}, data=_VECTORS)]


@case("data: item 4 has no label key 'labels' (it has: features, note)")
def dict_sample_without_its_label(t: Ctx):
    model = {"factory": f"{HF}:job_tuple_mlp", "kwargs": {"num_classes": C}}
    return [t.job(model=model, data={"factory": f"{HF}:job_rows_missing_label", "kwargs": {"num_classes": C}})]


@case("data: item 0 has no label key 'target'")
def label_field_not_in_the_samples(t: Ctx):
    model = {"factory": f"{HF}:job_tuple_mlp", "kwargs": {"num_classes": C}}
    return [t.job(model=model, data=_VECTORS), "--set", "data.label_field=target"]


@case("model: its forward uses tensors on another device than engine.device 'cpu'")
def model_on_another_device(t: Ctx):
    return [t.job(model={"factory": f"{HF}:job_off_device", "kwargs": {"num_classes": C}}, data=_VECTORS)]


@case("model: config.pad_token_id is not set, so it cannot find the last token of each of several samples")
def gpt2_without_a_pad_token(t: Ctx):
    text = {"factory": f"{HF}:job_text_rows", "kwargs": {"num_classes": C, "per_class": 1}, "collate": "pad"}
    return [t.job(model={"factory": f"{HF}:job_gpt2", "kwargs": {"num_classes": C}}, data=text)]
