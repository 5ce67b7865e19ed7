"""deploy/ and job submission, without a cluster: manifests, image, launcher, entrypoints.

- The KubeRay manifests parse, have the kinds and fields a cluster needs (GPU worker group,
  ``shutdownAfterJobFinishes``, token auth from a secret, no literal credentials), their
  entrypoints name real ``classgrad`` subcommands and real configs that load, and the cluster
  has the GPUs and CPUs the config asks for.
- One Ray version everywhere: requirements/lock.txt, the Dockerfile, ``rayVersion`` and image tags.
- Every ``configs/*.yaml`` and ``classgrad`` subcommand that the deployment guide names exists.
- ``classgrad.service.driver_runtime.submit``: the entrypoint and runtime env it builds, what it
  refuses before uploading anything, how it finds the job server address and the auth token, and how it tells the job
  server's "no such job" from its other errors.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import requests
import yaml
from ray.dashboard.modules.dashboard_sdk import SubmissionClient

from classgrad.config import load_config
from classgrad.errors import ConfigError
from classgrad.service.commands.cli import COMMANDS
from classgrad.service.driver_runtime.submit import (
    DEFAULT_EXCLUDES,
    STOP_ENV,
    JobSubmitError,
    find_token,
    is_job_not_found,
    prepare_submission,
    resolve_address,
)

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
IMAGE_ROOT = "/home/ray/classgrad/"  # where deploy/Dockerfile puts the repository


def ray_pin() -> str:
    pins = re.findall(r"^ray==(\S+)$", (REPO / "requirements/lock.txt").read_text(), re.MULTILINE)
    assert len(pins) == 1, pins
    return pins[0]


def manifests() -> dict[str, dict]:
    docs = {}
    for path in sorted((DEPLOY / "kuberay").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs[doc["kind"]] = doc
    return docs


def cluster_spec(doc: dict) -> dict:
    return doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]


def containers(doc: dict) -> list[dict]:
    spec = cluster_spec(doc)
    pods = [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]
    if doc["kind"] == "RayJob" and "submitterPodTemplate" in doc["spec"]:
        pods.append(doc["spec"]["submitterPodTemplate"])
    return [c for pod in pods for c in pod["spec"]["containers"]]


def parse_entrypoint(entrypoint: str) -> tuple[str, str, list[str]]:
    """(subcommand, config path in the repo, --set overrides) of a classgrad command line."""
    argv = shlex.split(entrypoint)
    if argv[0] == "classgrad":
        rest = argv[1:]
    else:
        assert argv[:3] in (["python", "-m", "classgrad"], ["python3", "-m", "classgrad"]), argv
        rest = argv[3:]
    sub, config, *options = rest
    overrides = [options[i + 1] for i, a in enumerate(options) if a == "--set"]
    return sub, config.removeprefix(IMAGE_ROOT), overrides


def quantity(value) -> float:
    return float(str(value).rstrip("m")) / (1000 if str(value).endswith("m") else 1)


# --------------------------------------------------------------------------- KubeRay


def test_manifests_parse_with_the_expected_kinds():
    docs = manifests()
    assert set(docs) == {"RayJob", "RayCluster"}
    for doc in docs.values():
        assert doc["apiVersion"] == "ray.io/v1" and doc["metadata"]["name"]


def test_rayjob_runs_a_real_command_on_a_real_config_and_cleans_up():
    job = manifests()["RayJob"]["spec"]
    assert job["shutdownAfterJobFinishes"] is True
    sub, config, overrides = parse_entrypoint(job["entrypoint"])
    assert sub in COMMANDS and sub == "run"
    assert (REPO / config).is_file(), config
    cfg = load_config(REPO / config, overrides)
    # Inside a Ray job the driver joins the cluster it runs in; a store on a pod's disk would
    # vanish with the cluster (shutdownAfterJobFinishes), so it must be object storage.
    assert cfg.cluster.address == "auto" and cfg.store.url.startswith("s3://")
    # Stopped like `classgrad submit` jobs are: SIGINT, with time to record the run.
    assert yaml.safe_load(job["runtimeEnvYAML"])["env_vars"] == STOP_ENV


@pytest.mark.parametrize("kind", ["RayJob", "RayCluster"])
def test_gpu_worker_group_and_token_auth(kind):
    doc = manifests()[kind]
    spec = cluster_spec(doc)
    assert spec["rayVersion"] == ray_pin()
    gpu_groups = [
        g
        for g in spec["workerGroupSpecs"]
        if any("nvidia.com/gpu" in c["resources"]["limits"] for c in g["template"]["spec"]["containers"])
    ]
    assert gpu_groups, "no worker group requests nvidia.com/gpu"
    for c in containers(doc):
        env = {e["name"]: e for e in c.get("env", [])}
        assert env["RAY_AUTH_MODE"]["value"] == "token", c["name"]
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"], c["name"]
        assert c["image"].endswith(f"-ray{ray_pin()}"), c["image"]
        for name, e in env.items():
            if re.search(r"KEY|SECRET|TOKEN|PASSWORD", name):
                assert "value" not in e and "secretKeyRef" in e["valueFrom"], f"{name} must come from a secret"


def test_rayjob_cluster_has_the_gpus_and_cpus_its_config_asks_for():
    doc = manifests()["RayJob"]
    _, config, overrides = parse_entrypoint(doc["spec"]["entrypoint"])
    cluster = load_config(REPO / config, overrides).cluster
    gpus = cpus = 0.0
    for group in cluster_spec(doc)["workerGroupSpecs"]:
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        gpus += group["replicas"] * quantity(limits.get("nvidia.com/gpu", 0))
        cpus += group["replicas"] * quantity(limits["cpu"])
    assert gpus >= cluster.num_workers * cluster.num_gpus_per_worker > 0
    assert cpus >= cluster.num_workers * cluster.num_cpus_per_worker
    # Actors stay off the head, which only runs the driver.
    assert cluster_spec(doc)["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"


# --------------------------------------------------------------------------- image and launcher


def test_dockerfile_uses_the_pinned_ray():
    text = (DEPLOY / "Dockerfile").read_text()
    bases = re.findall(r"^FROM\s+(\S+)", text, re.MULTILINE)
    assert bases == [f"rayproject/ray:{ray_pin()}-py311-gpu"], bases
    assert f'"ray[default]=={ray_pin()}"' in text and f"ray.__version__ == '{ray_pin()}'" in text
    ignored = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    assert {".venv", ".git", "stores"} <= set(ignored)


def test_cluster_launcher_config():
    launcher = yaml.safe_load((DEPLOY / "cluster-launcher/aws-gpu.yaml").read_text())
    assert launcher["docker"]["image"].endswith(f"-ray{ray_pin()}")
    head = " ".join(launcher["head_start_ray_commands"])
    worker = " ".join(launcher["worker_start_ray_commands"])
    assert "RAY_AUTH_MODE=token ray start --head" in head and "--dashboard-host=127.0.0.1" in head
    assert "RAY_AUTH_MODE=token ray start --address=" in worker
    assert "~/.ray/auth_token" in launcher["file_mounts"].values()
    assert launcher["head_node_type"] in launcher["available_node_types"]


def test_the_guide_names_real_configs_and_commands():
    texts = [p.read_text() for p in DEPLOY.rglob("*") if p.is_file()]
    texts += [(REPO / "configs" / name).read_text() for name in ("cluster_s3.yaml", "gpu_resnet18_multi.yaml")]
    configs = {m for t in texts for m in re.findall(r"\bconfigs/[\w.-]+\.yaml\b", t)}
    assert {"configs/gpu_resnet18_multi.yaml", "configs/cluster_s3.yaml"} <= configs
    for name in configs:
        load_config(REPO / name)  # exists and is valid
    # Command lines only: at a line start, after a backtick, a prompt or an indent (not prose).
    command = re.compile(r"(?:^|`|\$ |\s{2,})classgrad ([a-z]+)\b", re.MULTILINE)
    subcommands = {m for t in texts for m in command.findall(t)}
    assert {"submit", "run", "jobs"} <= subcommands and subcommands <= set(COMMANDS), subcommands


def test_gpu_examples_are_one_computation_on_one_and_on_eight_gpus():
    one = load_config(REPO / "configs/gpu_resnet18_1gpu.yaml")
    multi = load_config(REPO / "configs/gpu_resnet18_multi.yaml")
    assert one.model.factory == "classgrad.workers.zoo:resnet18" and one.loss.num_classes == 10000
    assert one.fingerprint() == multi.fingerprint()  # a store started on one can be finished on the other
    assert one.cluster.num_workers * one.cluster.num_gpus_per_worker == 1
    assert multi.cluster.num_workers * multi.cluster.num_gpus_per_worker == 8


# --------------------------------------------------------------------------- submission


def test_entrypoint_and_runtime_env(monkeypatch):
    monkeypatch.chdir(REPO)
    sub = prepare_submission(
        "configs/cluster_s3.yaml",
        ["store.url=s3://b/x.zarr", "cluster.num_workers=4"],
        working_dir=".",
        excludes=["data/"],
    )
    assert shlex.split(sub.entrypoint) == [
        "python",
        "-m",
        "classgrad",
        "run",
        "configs/cluster_s3.yaml",
        "--set",
        "store.url=s3://b/x.zarr",
        "--set",
        "cluster.num_workers=4",
        "--set",
        "cluster.address=auto",
    ]
    assert sub.runtime_env["working_dir"] == str(REPO)
    assert set(DEFAULT_EXCLUDES) | {"data/"} == set(sub.runtime_env["excludes"])
    assert {".venv", ".git", "stores", "*.zarr"} <= set(DEFAULT_EXCLUDES)
    # `jobs stop` reaches the driver as SIGINT, which it handles like Ctrl-C.
    assert (
        sub.runtime_env["env_vars"] == STOP_ENV == {"RAY_JOB_STOP_SIGNAL": "SIGINT", "RAY_JOB_STOP_WAIT_TIME_S": "30"}
    )
    assert sub.metadata["classgrad_config"] == "configs/cluster_s3.yaml"
    # An explicit address wins over the default `auto`; the Python is configurable.
    own = prepare_submission(
        REPO / "configs/cluster_s3.yaml",
        ["cluster.address=10.0.0.1:6379"],
        working_dir=REPO,
        python="/opt/py/bin/python",
    )
    assert own.entrypoint.startswith("/opt/py/bin/python -m classgrad run configs/cluster_s3.yaml")
    assert "cluster.address=auto" not in own.entrypoint


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["store.url=stores/x.zarr"], "is a relative path"),
        (["store.url=memory://x"], "memory:// store lives in one process"),
        (["cluster.nodes=3"], "cluster.nodes"),
    ],
)
def test_refused_before_anything_is_uploaded(overrides, message):
    error = ConfigError if overrides[0].startswith("cluster.nodes") else JobSubmitError
    with pytest.raises(error, match=re.escape(message)):
        prepare_submission(REPO / "configs/cluster_s3.yaml", overrides, working_dir=REPO)


def test_config_must_travel_with_the_working_dir(tmp_path):
    with pytest.raises(JobSubmitError, match="outside the working dir"):
        prepare_submission(REPO / "configs/cluster_s3.yaml", [], working_dir=tmp_path)


def test_address_resolution(monkeypatch):
    for var in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    assert resolve_address(None) == "http://127.0.0.1:8265"
    assert resolve_address("10.0.0.5:8265/") == "http://10.0.0.5:8265"
    assert resolve_address("https://ray.example.com") == "https://ray.example.com"
    monkeypatch.setenv("RAY_ADDRESS", "http://head:8265")
    assert resolve_address(None) == "http://head:8265"
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", "http://api:8265")
    assert resolve_address(None) == "http://api:8265"
    assert resolve_address("http://mine:8265") == "http://mine:8265"  # explicit wins
    with pytest.raises(JobSubmitError, match="expected http://HOST:8265"):
        resolve_address("ftp://head:8265")


def _sdk_error(status: int, body: str) -> RuntimeError:
    """The error Ray's job client raises for an HTTP answer of ``status`` (its own ``_raise_error``)."""
    response = requests.Response()
    response.status_code, response._content = status, body.encode()
    with pytest.raises(RuntimeError) as raised:
        SubmissionClient.__new__(SubmissionClient)._raise_error(response)
    return raised.value


def test_the_job_servers_no_such_job_is_told_from_its_other_errors():
    assert is_job_not_found(_sdk_error(404, "Job raysubmit_abc does not exist"))
    assert not is_job_not_found(_sdk_error(500, "Internal Server Error"))
    assert not is_job_not_found(_sdk_error(400, "Invalid request"))
    assert not is_job_not_found(ConnectionError("Failed to connect to Ray at address: http://head:8265."))


def test_token_lookup_follows_rays_order(monkeypatch, tmp_path):
    for var in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert find_token() == (None, "none found")
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray/auth_token").write_text("from-home\n")
    assert find_token()[0] == "from-home"
    (tmp_path / "tok").write_text("from-path")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "tok"))
    assert find_token() == ("from-path", "RAY_AUTH_TOKEN_PATH")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "from-env")
    assert find_token() == ("from-env", "RAY_AUTH_TOKEN")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert find_token()[0] is None
    monkeypatch.delenv("RAY_AUTH_MODE")
    monkeypatch.delenv("RAY_AUTH_TOKEN")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "missing"))
    with pytest.raises(JobSubmitError, match="cannot read the token file"):
        find_token()


def test_the_100_node_example_keeps_the_gcs_in_redis_and_fits_its_job():
    """deploy/kuberay/scale/: a 100-node RayCluster with GCS fault tolerance (an external Redis,
    its password from a secret), token auth like the others, and room for the job its comment
    submits (one actor per GPU, the config's CPUs per actor)."""
    path = DEPLOY / "kuberay" / "scale" / "raycluster-100-nodes.yaml"
    docs = {doc["kind"]: doc for doc in yaml.safe_load_all(path.read_text()) if doc}
    assert set(docs) == {"Service", "Deployment", "PersistentVolumeClaim", "RayCluster"}
    cluster = docs["RayCluster"]
    spec = cluster["spec"]
    assert spec["rayVersion"] == ray_pin()
    ft = spec["gcsFaultToleranceOptions"]
    service = docs["Service"]
    assert ft["redisAddress"] == f"{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    assert ft["redisPassword"]["valueFrom"]["secretKeyRef"]["name"]
    redis = docs["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert {e["name"]: e for e in redis["env"]}["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    for c in containers(cluster):
        env = {e["name"]: e for e in c.get("env", [])}
        assert env["RAY_AUTH_MODE"]["value"] == "token" and c["image"].endswith(f"-ray{ray_pin()}")
    (group,) = spec["workerGroupSpecs"]
    assert group["replicas"] == 100
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    submit = " ".join(
        line.strip(" #\\")
        for line in path.read_text().splitlines()
        if line.startswith("#  ") or line.startswith("#       ")
    )
    match = re.search(r"classgrad submit (\S+) .*", submit)
    assert match, submit
    overrides = re.findall(r"--set (\S+)", submit)
    cfg = load_config(REPO / match[1], [o for o in overrides if not o.startswith("store.url=")])
    gpus = quantity(limits["nvidia.com/gpu"])
    actors_per_pod = gpus // cfg.cluster.num_gpus_per_worker
    assert actors_per_pod * cfg.cluster.num_cpus_per_worker <= quantity(limits["cpu"])
    assert cfg.cluster.num_workers <= group["replicas"] * actors_per_pod
    assert cfg.cluster.min_workers < cfg.cluster.num_workers and cfg.store.sharded
