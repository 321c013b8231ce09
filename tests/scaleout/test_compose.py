"""docker-compose.yml without Docker: it parses, every command uses flags the installed
mlflow / ray / sweeps accept, and names, ports, volumes and credentials agree across the
compose file, .env.example, docker/ and the study specs it runs."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from sweeps.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
BIN = Path(sys.executable).parent
# `${VAR}`, `${VAR:-default}`, `${VAR-default}`; `$${...}` is an escaped dollar, not a variable.
VAR_RE = re.compile(r"(?<!\$)\$\{(\w+)(?::?-([^}]*))?\}")
# The programs a service may run, and how to ask each for its flags.
HELP = {
    ("mlflow", "server"): [str(BIN / "mlflow"), "server", "--help"],
    ("ray", "start"): [str(BIN / "ray"), "start", "--help"],
    ("sweeps", "run"): [sys.executable, "-m", "sweeps.cli", "run", "--help"],
    ("sweeps", "worker"): [sys.executable, "-m", "sweeps.cli", "worker", "--help"],
}


@pytest.fixture(scope="module")
def compose() -> dict:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict) and isinstance(data.get("services"), dict)
    return data


@pytest.fixture(scope="module")
def env_defaults() -> dict[str, str]:
    values = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


def resolve(value, env: dict[str, str]):
    """A compose value with every ${VAR...} replaced by its .env.example value."""
    if isinstance(value, str):
        return VAR_RE.sub(lambda m: env[m.group(1)], value)
    if isinstance(value, list):
        return [resolve(v, env) for v in value]
    if isinstance(value, dict):
        return {k: resolve(v, env) for k, v in value.items()}
    return value


@cache
def flags_of(program: tuple[str, str]) -> frozenset[str]:
    out = subprocess.run(HELP[program], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    return frozenset(re.findall(r"(?<![\w-])(--[A-Za-z0-9][A-Za-z0-9-]*)", out.stdout))


def commands_of(service: dict, env: dict[str, str]) -> list[list[str]]:
    """The service's command as argument lists: one, or each part of an `sh -c "a && b"`."""
    command = resolve(service["command"], env)
    if isinstance(command, str):
        command = shlex.split(command)
    if command[:2] in (["sh", "-c"], ["bash", "-c"]):
        return [shlex.split(part) for part in re.split(r"&&|;", command[2])]
    return [command]


def program_of(argv: list[str]) -> tuple[str, str]:
    args = argv[1:] if argv[0] == "exec" else argv
    return args[0], args[1]


def flag_value(argv: list[str], flag: str) -> str:
    for i, arg in enumerate(argv):
        if arg == flag:
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{flag} not in {argv}")


def all_commands(compose: dict, env: dict[str, str]):
    for name, service in compose["services"].items():
        if "command" in service:
            for argv in commands_of(service, env):
                yield name, argv


# ---- the file and its variables ---------------------------------------------------------------
def test_every_variable_is_in_env_example_with_the_same_default(env_defaults):
    used = VAR_RE.findall(COMPOSE.read_text())
    assert used
    for var, default in used:
        assert var in env_defaults, f"${{{var}}} is used by docker-compose.yml but not set in .env.example"
        if default:
            assert default == env_defaults[var], (var, default, env_defaults[var])
    unused = set(env_defaults) - {var for var, _ in used}
    assert not unused, f".env.example sets {sorted(unused)}, which docker-compose.yml never reads"


def test_the_stack_has_its_services(compose):
    services = compose["services"]
    assert {"postgres", "mlflow", "ray-head", "ray-worker", "sweeps", "sweeps-worker"} <= set(services)
    assert services["postgres"]["image"].startswith("postgres:")


# ---- commands -----------------------------------------------------------------------------------
@pytest.mark.ray
@pytest.mark.slow
def test_every_command_uses_flags_the_installed_programs_accept(compose, env_defaults):
    seen = set()
    for name, argv in all_commands(compose, env_defaults):
        program = program_of(argv)
        assert program in HELP, f"service {name}: unexpected command {argv}"
        seen.add(program)
        for arg in argv:
            if arg.startswith("--"):
                flag = arg.split("=", 1)[0]
                assert flag in flags_of(program), f"service {name}: {' '.join(program)} has no {flag}"
    assert seen == set(HELP)  # each of them is run somewhere


def test_sweeps_commands_run_specs_that_validate_and_fit_the_stack(compose, env_defaults):
    mlflow_port = flag_value(commands_of(compose["services"]["mlflow"], env_defaults)[0], "--port")
    tracking = f"http://mlflow:{mlflow_port}"
    head = commands_of(compose["services"]["ray-head"], env_defaults)[0]
    ray_address = f"ray-head:{flag_value(head, '--port')}"
    specs = {}
    for name, argv in all_commands(compose, env_defaults):
        program = program_of(argv)
        if program[0] == "sweeps":
            path = argv[argv.index(program[1]) + 1]
            spec = load_spec(ROOT / path)  # raises SpecError if it does not validate
            specs[path] = spec
            assert spec.tracking_uri() == tracking, (name, spec.tracking_uri())
            env = resolve(compose["services"][name]["environment"], env_defaults)
            assert env["MLFLOW_TRACKING_URI"] == tracking
            if spec.backend == "optuna":
                url = urlsplit(spec.storage_url())
                assert url.scheme.startswith("postgresql") and url.hostname == "postgres" and url.port == 5432
                assert url.username == env_defaults["POSTGRES_USER"] and url.password is None  # PGPASSWORD
                assert url.path == "/" + env_defaults["POSTGRES_DB"]
                assert env["PGPASSWORD"] == env_defaults["POSTGRES_PASSWORD"]
            else:
                assert spec.resources.ray_address == ray_address
        if program == ("ray", "start") and "--head" not in argv:
            assert flag_value(argv, "--address") == ray_address, (name, argv)
    workers = [argv for name, argv in all_commands(compose, env_defaults) if program_of(argv) == ("sweeps", "worker")]
    assert workers and all(specs[argv[2]].is_rdb_storage() for argv in workers)


def test_mlflow_server_uses_postgres_and_serves_artifacts_from_a_volume(compose, env_defaults):
    service = compose["services"]["mlflow"]
    argv = commands_of(service, env_defaults)[0]
    store = urlsplit(flag_value(argv, "--backend-store-uri"))
    assert store.scheme == "postgresql+psycopg2" and store.hostname == "postgres"
    assert store.path == "/" + env_defaults["MLFLOW_DB"] and store.password is None
    assert resolve(service["environment"], env_defaults)["PGPASSWORD"] == env_defaults["POSTGRES_PASSWORD"]
    assert "--serve-artifacts" in argv and flag_value(argv, "--host") == "0.0.0.0"
    destination = flag_value(argv, "--artifacts-destination")
    assert any(v.split(":")[1] == destination for v in service["volumes"] if not v.startswith((".", "/")))
    # Host-header protection: the name the other services use must be allowed.
    allowed = flag_value(argv, "--allowed-hosts").split(",")
    assert f"mlflow:{flag_value(argv, '--port')}" in allowed or "mlflow:*" in allowed
    # MLflow and Optuna both keep an alembic_version table: two databases, the second made at init.
    assert env_defaults["MLFLOW_DB"] != env_defaults["POSTGRES_DB"]
    pg = compose["services"]["postgres"]
    init = [v.split(":")[0] for v in pg["volumes"] if "docker-entrypoint-initdb.d" in v]
    assert init and all(os.access(ROOT / p, os.X_OK) for p in init)
    assert "MLFLOW_DB" in (ROOT / init[0]).read_text() and "MLFLOW_DB" in pg["environment"]


# ---- dependencies, health, ports, volumes, GPUs -----------------------------------------------
def test_services_wait_for_a_healthy_postgres_and_mlflow(compose):
    services = compose["services"]
    assert "healthcheck" in services["postgres"]
    for name, service in services.items():
        depends = service.get("depends_on", {})
        assert isinstance(depends, dict), f"{name}: use the long depends_on form with conditions"
        for target, how in depends.items():
            assert target in services, (name, target)
            if target in ("postgres", "mlflow"):
                assert how == {"condition": "service_healthy"}, (name, target, how)
            if how.get("condition") == "service_healthy":
                assert "healthcheck" in services[target], (name, target)
    for name in ("mlflow", "sweeps", "sweeps-worker"):
        assert "postgres" in services[name]["depends_on"], name
    for name in ("sweeps", "sweeps-worker"):
        assert "mlflow" in services[name]["depends_on"], name


def test_published_ports_match_what_the_services_listen_on(compose, env_defaults):
    services = compose["services"]
    listen = {
        "postgres": "5432",
        "mlflow": flag_value(commands_of(services["mlflow"], env_defaults)[0], "--port"),
        "ray-head": flag_value(commands_of(services["ray-head"], env_defaults)[0], "--dashboard-port"),
    }
    published = {"postgres": "POSTGRES_PORT", "mlflow": "MLFLOW_PORT", "ray-head": "RAY_DASHBOARD_PORT"}
    for name, service in services.items():
        for port in service.get("ports", []):
            host, container = port.rsplit(":", 1)
            assert container == listen[name], (name, port)
            var = VAR_RE.fullmatch(host)
            assert var and var.group(1) == published[name], (name, port)  # set in .env.example
            assert resolve(host, env_defaults) == env_defaults[published[name]]


def test_every_named_volume_is_declared_and_every_bind_mount_exists(compose):
    declared = set(compose.get("volumes") or {})
    used = set()
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith((".", "/")):
                assert (ROOT / source).exists(), (name, volume)
            else:
                assert source in declared, f"service {name}: volume {source!r} is not declared"
                used.add(source)
    assert used == declared, f"declared but unused: {declared - used}"
    # Checkpoints are shared: a retry on another container resumes from its original's.
    for name in ("sweeps", "sweeps-worker", "ray-head", "ray-worker"):
        assert "runs:/app/runs" in compose["services"][name]["volumes"], name


def test_trial_runners_reserve_nvidia_gpus(compose):
    services = compose["services"]
    for name in ("sweeps", "sweeps-worker", "ray-worker"):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices and all(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices), name
        assert all(d.get("count") == "all" or isinstance(d.get("count"), int) for d in devices), name
    assert VAR_RE.fullmatch(str(services["sweeps-worker"]["deploy"]["replicas"]))


def test_images_are_built_from_the_dockerfile_in_docker(compose):
    built = {name: s for name, s in compose["services"].items() if "build" in s}
    assert set(built) >= {"mlflow", "sweeps", "sweeps-worker", "ray-head", "ray-worker"}
    for name, service in built.items():
        context = ROOT / service["build"]["context"]
        dockerfile = context / service["build"]["dockerfile"]
        assert dockerfile.is_file(), (name, dockerfile)
    text = (ROOT / "docker" / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", text, re.M) and "pip install" in text
    for line in text.splitlines():  # every file the image copies is in the build context
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), line
    patterns = [line.strip() for line in (ROOT / "docker" / "Dockerfile.dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert patterns[0] == "*"  # everything out (.venv, runs/, .git) but what is let back in
    assert not [p for p in patterns if p.startswith("!") and p.lstrip("!").rstrip("/") in (".venv", "runs", ".git")]
