"""Deployment files: the Dockerfile's stages, the generated requirement lists, and
docker-compose.yml as docker-compose itself reads it.

No image is built here (no Docker engine on CI): the tests check what can be checked
without one. The serving stage installs only the base dependencies and the `serve`
extra (no torch), runs as a non-root user and has a health check that works; the
compose file is valid for docker-compose 1.29, its services, profiles, GPU
reservations and volumes are the documented ones, its VITRIEVAL_* variables are real
settings that validate, and its job commands parse with the real CLIs.
"""

from __future__ import annotations

import http.server
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from vitrieval._folders import SUBPACKAGE_FOLDERS
from vitrieval.service.settings import Settings

REPO = Path(__file__).resolve().parents[1]
COMPOSE = shutil.which("docker-compose")
needs_compose = pytest.mark.skipif(
    COMPOSE is None,
    reason="the docker-compose binary is not installed (.ci/run installs Debian's package)",
)


def _load_requirements_module():
    spec = importlib.util.spec_from_file_location(
        "docker_requirements", REPO / "docker/requirements.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


reqs = _load_requirements_module()
PROJECT = reqs.load_project(REPO / "pyproject.toml")


def names(lines: list[str]) -> set[str]:
    return {reqs.requirement_name(line) for line in lines}


BASE = names(PROJECT["dependencies"])
SERVE = names(PROJECT["optional-dependencies"]["serve"])
TRAIN_ONLY = names(PROJECT["optional-dependencies"]["train"]) - BASE - SERVE


# -- the Dockerfile ---------------------------------------------------------------------


def dockerfile_stages() -> dict[str, dict]:
    """Stage name -> {"base": FROM image, "instructions": [(KEYWORD, arguments)]}."""
    text = (REPO / "Dockerfile").read_text()
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    stages: dict[str, dict] = {}
    current = None
    for line in logical:
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            parts = args.split()
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else f"#{len(stages)}"
            current = stages[name] = {"base": parts[0], "instructions": []}
        elif current is not None:
            current["instructions"].append((keyword, args.strip()))
    return stages


STAGES = dockerfile_stages()


def lineage(stage: str) -> list[str]:
    """`stage` and the stages it is built FROM (both runtimes for runtime-${RUNTIME})."""
    chain = [stage]
    base = STAGES[stage]["base"]
    for candidate in STAGES:
        pattern = re.escape(base).replace(r"\$\{RUNTIME\}", "(cpu|gpu)")
        if re.fullmatch(pattern, candidate):
            chain += lineage(candidate)
    return chain


def instructions(stage: str, keyword: str) -> list[str]:
    return [
        args
        for name in lineage(stage)
        for kw, args in STAGES[name]["instructions"]
        if kw == keyword
    ]


def pip_installs(stage: str) -> list[str]:
    commands = [c.strip() for run in instructions(stage, "RUN") for c in run.split("&&")]
    return [c for c in commands if re.match(r"(\S*/)?pip3? install\b|python3? -m pip install\b", c)]


def test_stages_and_targets():
    assert {"builder", "runtime-cpu", "runtime-gpu", "serve", "train"} <= set(STAGES)
    assert STAGES["serve"]["base"] == "runtime-${RUNTIME}"
    assert lineage("serve") == ["serve", "runtime-cpu", "runtime-gpu"]
    assert STAGES["runtime-gpu"]["base"] == "${CUDA_IMAGE}"
    cuda_image = re.search(r"^ARG CUDA_IMAGE=(\S+)", (REPO / "Dockerfile").read_text(), re.M)
    assert cuda_image and re.fullmatch(
        r"nvidia/cuda:\d+\.\d+\.\d+-cudnn-runtime-\S+", cuda_image[1]
    )


def test_serving_stage_installs_nothing_from_the_train_extra():
    installs = pip_installs("serve")
    # exactly: the generated requirement list of the runtime, then the wheel without deps
    assert installs == [
        "pip install --only-binary=:all: -r /tmp/dist/serve-${RUNTIME}.txt",
        "pip install --no-deps /tmp/dist/vitrieval-*.whl",
    ]
    for command in instructions("serve", "RUN"):
        for package in ("apt-get install", "conda install", "uv pip"):
            if package in command:
                assert not TRAIN_ONLY & _tokens(command), command
    # the builder writes those lists with docker/requirements.py for the serve set
    builder = " ".join(instructions("builder", "RUN"))
    assert "requirements.py serve --runtime cpu > /dist/serve-cpu.txt" in builder
    assert re.search(r"requirements\.py serve --runtime gpu .*> /dist/serve-gpu\.txt", builder)
    assert "requirements.py train > /dist/train.txt" in builder
    # and the serving image refuses to build if torch got in anyway
    assert any("find_spec('torch') is None" in run for run in instructions("serve", "RUN"))


def _tokens(text: str) -> set[str]:
    return {reqs.canonical(t) for t in re.findall(r"[A-Za-z0-9][A-Za-z0-9._-]*", text)}


@pytest.mark.parametrize("runtime", ["cpu", "gpu"])
def test_serve_requirement_lists(runtime):
    lines = reqs.requirements(PROJECT, ["serve"], runtime)
    got = names(lines)
    assert not got & TRAIN_ONLY
    if runtime == "cpu":
        assert got == BASE | SERVE
    else:
        swapped = (BASE - {"onnxruntime", "faiss-cpu"}) | {"onnxruntime-gpu", "faiss-gpu"}
        assert got == swapped | SERVE
        assert "onnxruntime-gpu>=1.18,<2" in lines  # the version bounds are kept
        custom = reqs.requirements(PROJECT, ["serve"], "gpu", faiss_gpu="faiss-gpu-cu12")
        assert "faiss-gpu-cu12" in names(custom) and "faiss-gpu" not in names(custom)
    # the script's output is the same list
    out = subprocess.run(
        [sys.executable, str(REPO / "docker/requirements.py"), "serve", "--runtime", runtime],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.splitlines() == lines
    with pytest.raises(ValueError, match="unknown extra"):
        reqs.requirements(PROJECT, ["nope"], runtime)


def test_serve_dependencies_do_not_pull_torch_transitively():
    """Followed through the installed metadata: nothing in base + [serve] depends on
    torch or the other train-only packages (a test-only or training library slipping
    into the base set would)."""
    found, _missing = reqs.closure(reqs.requirements(PROJECT, ["serve"], "cpu"))
    assert "onnxruntime" in found and "fastapi" in found
    assert not set(found) & (TRAIN_ONLY | {"triton"}), sorted(set(found) & TRAIN_ONLY)
    assert not [name for name in found if name.startswith("nvidia-")]
    train, _ = reqs.closure(reqs.requirements(PROJECT, ["train"], "cpu"))
    assert {"torch", "torchvision", "timm"} <= set(train)


def test_images_run_as_non_root_with_a_health_check():
    for stage in ("serve", "train"):
        users = instructions(stage, "USER")
        assert users, f"{stage} has no USER"
        user = users[-1].split(":")[0]
        assert user not in ("root", "0"), stage
    creates = " ".join(instructions("serve", "RUN"))
    assert "useradd --system --uid 10001" in creates
    (healthcheck,) = instructions("serve", "HEALTHCHECK")
    assert "/healthz" in healthcheck and "curl" not in healthcheck
    assert instructions("serve", "EXPOSE") == ["8000"]
    assert instructions("serve", "ENTRYPOINT") == ['["vitrieval-serve"]']
    assert instructions("train", "ENTRYPOINT") == ['["vitrieval-train"]']


def test_serve_image_environment_names_real_settings():
    env = {}
    for line in instructions("serve", "ENV"):
        env.update(dict(pair.split("=", 1) for pair in shlex.split(line)))
    settings = {k: v for k, v in env.items() if k.startswith("VITRIEVAL_")}
    assert settings == {
        "VITRIEVAL_MODEL": "/models/model.onnx",
        "VITRIEVAL_INDEX": "/index",
        "VITRIEVAL_HOST": "0.0.0.0",
        "VITRIEVAL_PORT": "8000",
    }
    fields = {f"VITRIEVAL_{name.upper()}" for name in Settings.model_fields}
    assert set(settings) <= fields


def test_health_check_command(tmp_path: Path):
    """The HEALTHCHECK command exits 0 against a server answering /healthz on
    VITRIEVAL_PORT, and non-zero when nothing answers."""
    (healthcheck,) = instructions("serve", "HEALTHCHECK")
    command = healthcheck.split(" CMD ", 1)[1]
    argv = shlex.split(command)
    assert argv[0] == "python"
    argv[0] = sys.executable
    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.path)
            self.send_response(200 if self.path == "/healthz" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        env = {**os.environ, "VITRIEVAL_PORT": str(server.server_address[1])}
        assert subprocess.run(argv, env=env, timeout=30).returncode == 0
        assert seen == ["/healthz"]
    finally:
        server.shutdown()
        server.server_close()
    env = {**os.environ, "VITRIEVAL_PORT": str(server.server_address[1])}
    failed = subprocess.run(argv, env=env, timeout=30, capture_output=True)
    assert failed.returncode != 0


def test_dockerignore_keeps_the_context_small():
    lines = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines[0] == "*"  # an allowlist: .venv, runs, tests, .git stay out
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    assert allowed == {
        "pyproject.toml",
        "setup.py",
        "README.md",
        "vitrieval",
        "docker/requirements.py",
        "index",
        "service",
        "training",
        "distributed",
        "recipes",  # the training image's fit --recipe files
    }
    copied = {
        part
        for args in instructions("builder", "COPY")
        for part in args.split()[:-1]
        if not part.startswith("--")
    }
    assert copied <= allowed | {"docker/requirements.py"}
    # every folder the wheel is built from (setup.py maps them into vitrieval) is copied
    packages = {"vitrieval", "setup.py", *SUBPACKAGE_FOLDERS}
    assert packages <= copied, f"not copied into the builder: {packages - copied}"


# -- docker-compose.yml, read by docker-compose ------------------------------------------

SERVICES = {
    "serve": [],
    "serve-gpu": ["gpu"],
    "train": ["jobs"],
    "index": ["jobs"],
    "train-gpu": ["gpu-jobs"],
    "index-gpu": ["gpu-jobs"],
}
GPU_SERVICES = {"serve-gpu", "train-gpu", "index-gpu"}


def compose_config(*options: str, env: dict[str, str] | None = None) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("VITRIEVAL_", "COMPOSE_"))}
    result = subprocess.run(
        [COMPOSE, "-f", "docker-compose.yml", *options, "config"],
        cwd=REPO,
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


@needs_compose
@pytest.mark.parametrize("profiles", [[], ["gpu"], ["jobs"], ["gpu-jobs"]], ids=str)
def test_compose_config_is_valid(profiles):
    options = [arg for profile in profiles for arg in ("--profile", profile)]
    config = compose_config(*options)
    services = config["services"]
    assert set(services) == set(SERVICES)
    for name, service in services.items():
        assert service.get("profiles", []) == SERVICES[name], name
        devices = service.get("deploy", {}).get("resources", {}).get("reservations", {})
        if name in GPU_SERVICES:
            (device,) = devices["devices"]
            assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        else:
            assert not devices, name
    assert set(config["volumes"]) == {"models", "index", "runs", "data"}
    listed = subprocess.run(
        [COMPOSE, "-f", "docker-compose.yml", *options, "config", "--profiles"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listed.returncode == 0 and listed.stdout.split() == ["gpu", "gpu-jobs", "jobs"]


def _mounts(service: dict) -> dict[str, str]:
    """target -> "source[:mode]" of the service's volumes, as config prints them."""
    mounts = {}
    for volume in service["volumes"]:
        source, target, *mode = volume.split(":")
        mounts[target] = ":".join([source, *mode])
    return mounts


@needs_compose
def test_compose_servers_share_the_jobs_volumes_and_validate_as_settings():
    services = compose_config()["services"]
    for name in ("serve", "serve-gpu"):
        service = services[name]
        assert _mounts(service) == {
            "/models": "models:ro",
            "/index": "index:rw",
            "/data": "data:ro",
        }
        assert service["ports"][0]["target"] == 8000
        environment = {k: v for k, v in service["environment"].items() if v is not None}
        fields = {f"VITRIEVAL_{field.upper()}" for field in Settings.model_fields}
        assert set(environment) <= fields, set(environment) - fields
        settings = _settings_from(environment)
        assert settings.read_only and settings.api_key is None
        # the index's own model copy: a retrained /models/model.onnx never meets an old index
        assert str(settings.model) == "/index/model.onnx" and str(settings.index) == "/index"
    assert _settings_from(services["serve"]["environment"]).device == "cpu"
    assert _settings_from(services["serve-gpu"]["environment"]).device == "cuda"
    assert services["serve"]["ports"][0]["published"] == 8000
    assert services["serve-gpu"]["ports"][0]["published"] == 8001
    assert services["serve"]["build"]["args"]["RUNTIME"] == "cpu"
    assert services["serve-gpu"]["build"]["args"]["RUNTIME"] == "gpu"
    # what the jobs write is what the servers read
    assert _mounts(services["train"])["/models"] == "models:rw"
    assert _mounts(services["index"])["/index"] == "index:rw"
    assert _mounts(services["index"])["/data"] == "data:rw"


@needs_compose
def test_compose_mutations_configured_from_the_environment():
    key = "k" * 24
    env = {"VITRIEVAL_READ_ONLY": "false", "VITRIEVAL_API_KEY": key, "SERVE_PORT": "9000"}
    services = compose_config(env=env)["services"]
    settings = _settings_from(services["serve"]["environment"])
    assert not settings.read_only and settings.api_key.get_secret_value() == key
    assert services["serve"]["ports"][0]["published"] == 9000


def _settings_from(environment: dict) -> Settings:
    saved = {k: v for k, v in os.environ.items() if k.startswith("VITRIEVAL_")}
    for name in saved:
        del os.environ[name]
    try:
        os.environ.update({k: str(v) for k, v in environment.items() if v is not None})
        return Settings()
    finally:
        for name in environment:
            os.environ.pop(name, None)
        os.environ.update(saved)


@needs_compose
@pytest.mark.parametrize("service", ["train", "index", "train-gpu", "index-gpu"])
def test_compose_job_commands_parse_with_the_real_clis(service):
    """The jobs' shell is valid, and every vitrieval command in it parses with the CLI's
    own parser (defaults of the job variables substituted)."""
    config = compose_config()["services"][service]
    assert config["entrypoint"] == ["/bin/sh", "-ec"]
    (script,) = config["command"]
    script = script.replace("$$", "$")  # compose's escape; the container's shell expands
    assert subprocess.run(["sh", "-n", "-c", script], timeout=30).returncode == 0
    environment = config["environment"]
    expanded = re.sub(r"\$(\w+)", lambda m: str(environment.get(m[1], m[0])), script)
    commands = []
    for part in re.split(r"&&|;", expanded):
        part = part.strip().removeprefix("then ").strip()
        if part.startswith("vitrieval-"):
            commands.append(shlex.split(part))
    from vitrieval.index.cli import build_parser as index_parser
    from vitrieval.training.cli import build_parser as train_parser

    parsers = {"vitrieval-train": train_parser(), "vitrieval-index": index_parser()}
    programs = [argv[0] for argv in commands]
    if service.startswith("train"):
        assert programs == ["vitrieval-train", "vitrieval-train"]
        assert commands[0][1] == "fit" and commands[1][1] == "export"
        assert commands[1][-2:] == ["--out", "/models/model.onnx"]
    else:
        assert programs == ["vitrieval-index", "vitrieval-index"]
        assert commands[0][1] == "export-dataset" and "build" in commands[1]
        assert commands[1][commands[1].index("--model") + 1] == "/models/model.onnx"
        assert commands[1][commands[1].index("--out") + 1] == "/index"
    for argv in commands:
        parsers[argv[0]].parse_args(argv[1:])  # SystemExit (a failure) on a bad flag


def test_empty_setting_variables_count_as_unset(monkeypatch):
    monkeypatch.setenv("VITRIEVAL_API_KEY", "")
    monkeypatch.setenv("VITRIEVAL_READ_API_KEY", "")
    monkeypatch.setenv("VITRIEVAL_INTRA_OP_THREADS", "")
    monkeypatch.setenv("VITRIEVAL_READ_ONLY", "true")
    settings = Settings()
    assert settings.api_key is None and settings.read_api_key is None
    assert settings.intra_op_threads is None
    monkeypatch.setenv("VITRIEVAL_READ_ONLY", "")
    with pytest.raises(ValueError, match="no API key is configured"):
        Settings()
