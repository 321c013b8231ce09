"""Reading docker-compose.yml and .env.example for the compose tests (no Docker needed)."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
BIN = Path(sys.executable).parent
# `${VAR}`, `${VAR:-default}`, `${VAR-default}`, `${VAR:?error}`; `$${...}` is an escaped dollar.
VAR_RE = re.compile(r"(?<!\$)\$\{(\w+)(?:(:?[-?])([^}]*))?\}")
# Values with no default anywhere: .env.example leaves them empty, compose refuses to start without.
SECRETS = ("POSTGRES_PASSWORD", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_FLASK_SERVER_SECRET_KEY", "RAY_AUTH_TOKEN",
           "MINIO_ROOT_PASSWORD")
# The programs a service may run, and how to ask each for its flags.
HELP = {
    ("mlflow", "server"): [str(BIN / "mlflow"), "server", "--help"],
    ("ray", "start"): [str(BIN / "ray"), "start", "--help"],
    ("sweeps", "run"): [sys.executable, "-m", "sweeps.cli", "run", "--help"],
    ("sweeps", "worker"): [sys.executable, "-m", "sweeps.cli", "worker", "--help"],
}


def load_compose() -> dict:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict) and isinstance(data.get("services"), dict)
    return data


def env_example() -> dict[str, str]:
    """KEY=value lines of .env.example (secrets: empty)."""
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
        if "command" in service and "build" in service:  # ours; minio's are the image's own
            for argv in commands_of(service, env):
                yield name, argv


