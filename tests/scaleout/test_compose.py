"""docker-compose.yml without Docker: it parses and validates against the Compose schema, every
command uses flags the installed mlflow / ray / sweeps accept, and names, ports, volumes, GPUs and
credentials agree across the compose file, .env.example, docker/ and the study specs it runs.
Secrets have no defaults; only what must be reached from other machines is published off loopback."""
from __future__ import annotations

import configparser
import os
import re
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from sweeps.spec.load import load_spec
from tests.scaleout.compose_helpers import (
    COMPOSE,
    HELP,
    ROOT,
    VAR_RE,
    all_commands,
    commands_of,
    flag_value,
    flags_of,
    program_of,
    resolve,
)


# ---- the file and its variables ---------------------------------------------------------------
def test_every_variable_is_in_env_example_with_the_same_default(env_defaults):
    used = VAR_RE.findall(COMPOSE.read_text())
    assert used
    for var, op, default in used:
        assert var in env_defaults, f"${{{var}}} is used by docker-compose.yml but not set in .env.example"
        if op.endswith("-") and default:
            assert default == env_defaults[var], (var, default, env_defaults[var])
    unused = set(env_defaults) - {var for var, _, _ in used}
    assert not unused, f".env.example sets {sorted(unused)}, which docker-compose.yml never reads"


def test_the_stack_has_its_services(compose):
    services = compose["services"]
    assert {"postgres", "mlflow", "ray-head", "ray-worker", "sweeps", "sweeps-worker", "minio"} <= set(services)
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


def test_mlflow_server_uses_postgres_basic_auth_and_serves_artifacts(compose, env_defaults):
    service = compose["services"]["mlflow"]
    argv = commands_of(service, env_defaults)[0]
    assert flag_value(argv, "--app-name") == "basic-auth"
    # A plain postgresql:// URL: SQLAlchemy 2.1 opens it with psycopg 3, installed in the image.
    store = urlsplit(flag_value(argv, "--backend-store-uri"))
    assert store.scheme == "postgresql" and store.hostname == "postgres"
    assert store.path == "/" + env_defaults["MLFLOW_DB"] and store.password is None
    env = resolve(service["environment"], env_defaults)
    assert env["PGPASSWORD"] == env_defaults["POSTGRES_PASSWORD"]
    assert "--serve-artifacts" in argv and flag_value(argv, "--host") == "0.0.0.0"
    destination = flag_value(argv, "--artifacts-destination")
    assert destination == env_defaults["MLFLOW_ARTIFACTS_DESTINATION"]
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


def test_mlflow_auth_config_is_mounted_and_its_admin_is_the_stacks_account(compose, env_defaults):
    service = compose["services"]["mlflow"]
    env = resolve(service["environment"], env_defaults)
    mounts = {v.split(":")[1]: v.split(":")[0] for v in service["volumes"]}
    ini_source = mounts[env["MLFLOW_AUTH_CONFIG_PATH"]]
    ini = configparser.ConfigParser()
    assert ini.read(ROOT / ini_source), ini_source
    auth = ini["mlflow"]
    assert auth["authorization_function"] == "mlflow.server.auth:authenticate_request_basic_auth"
    assert "admin_password" not in auth  # from MLFLOW_AUTH_ADMIN_PASSWORD (.env), never in the repository
    assert auth["default_permission"] in ("READ", "NO_PERMISSIONS")
    # The auth store lives on a named volume, so users survive a restart of the container.
    db = auth["database_uri"]
    assert db.startswith("sqlite:////"), db
    folder = str(Path(db[len("sqlite:///"):]).parent)
    assert folder in mounts and not mounts[folder].startswith((".", "/")), (folder, mounts)
    assert int(auth.get("auth_cache_ttl_seconds", "0")) > 0  # else every request pays the password hash
    # The server's admin is the account every sweeps service signs in with.
    for name in ("sweeps", "sweeps-worker", "sweeps-ray"):
        client = resolve(compose["services"][name]["environment"], env_defaults)
        assert client["MLFLOW_TRACKING_USERNAME"] == env["MLFLOW_AUTH_ADMIN_USERNAME"], name
        assert client["MLFLOW_TRACKING_PASSWORD"] == env["MLFLOW_AUTH_ADMIN_PASSWORD"], name
    assert env["MLFLOW_FLASK_SERVER_SECRET_KEY"] == env_defaults["MLFLOW_FLASK_SERVER_SECRET_KEY"]


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
        "minio": services["minio"]["command"][services["minio"]["command"].index("--console-address") + 1][1:],
    }
    published = {"postgres": "POSTGRES", "mlflow": "MLFLOW", "ray-head": "RAY_DASHBOARD", "minio": "MINIO_CONSOLE"}
    for name, service in services.items():
        for port in service.get("ports", []):
            # Always with a bind address, so nothing is published on every interface by accident.
            bind, host, container = re.fullmatch(r"(\$\{[^}]*\}):(\$\{[^}]*\}):(\d+)", port).groups()
            assert container == listen[name], (name, port)
            for part, suffix in ((bind, "_BIND"), (host, "_PORT")):
                var = VAR_RE.fullmatch(part)
                assert var and var.group(1) == published[name] + suffix, (name, port)  # set in .env.example
                assert resolve(part, env_defaults) == env_defaults[published[name] + suffix]


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


def test_images_are_built_from_the_dockerfile_in_docker(compose):
    built = {name: s for name, s in compose["services"].items() if "build" in s}
    assert set(built) >= {"mlflow", "sweeps", "sweeps-worker", "ray-head", "ray-worker"}
    assert built["mlflow"]["build"]["dockerfile"] == "mlflow.Dockerfile"  # its own slim image
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
    for line in text.splitlines():  # and let back in by the .dockerignore
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert any(source.rstrip("/") == p.lstrip("!").rstrip("/") for p in patterns), line


def test_services_that_start_processes_run_under_an_init_that_reaps(compose):
    """Drivers, workers and Ray nodes leave orphans when one of them is killed (their guardian or
    supervisor kills the rest, whose parent is gone); pid 1 must reap them, or they stay zombies."""
    sweeps_image = {name for name, s in compose["services"].items() if s.get("image", "").startswith("sweeps:")}
    assert {"sweeps", "sweeps-worker", "ray-head", "ray-worker", "sweeps-ray"} <= sweeps_image
    assert [name for name in sorted(sweeps_image) if compose["services"][name].get("init") is not True] == []
