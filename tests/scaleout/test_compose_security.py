"""docker-compose.yml against the Compose schema, and what keeps the stack to its users: secrets
without defaults, loopback for what needs no remote access, one GPU holder per GPU (also for every
`docker compose up` the docs suggest), MinIO wired to the MLflow server as .env.example says, and
a slim MLflow image."""
from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from tests.scaleout.compose_helpers import (
    COMPOSE,
    ENV_EXAMPLE,
    ROOT,
    SECRETS,
    VAR_RE,
    resolve,
)

SCHEMA = Path(__file__).with_name("compose_spec.json")  # vendored: compose_spec.README.md says from where


def with_secrets(env: dict[str, str]) -> dict[str, str]:
    """.env.example as an operator fills it in (compose refuses to interpolate empty secrets)."""
    return {**env, **{name: f"example-{name.lower()}" for name in SECRETS}}


def services_started(compose: dict, *named: str, profiles: tuple[str, ...] = ()) -> set[str]:
    """What `docker compose [--profile P] up [SERVICE...]` starts: the named services (or every one
    without a profile, or of an enabled one) and everything they depend on."""
    services = compose["services"]
    todo = list(named) or [n for n, s in services.items() if not set(s.get("profiles", [])) - set(profiles)]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(services[name].get("depends_on", {}))
    return seen


def gpu_devices(service: dict) -> list[dict]:
    return service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])


# ---- schema ----------------------------------------------------------------------------------------
def test_the_compose_file_validates_against_the_compose_schema(compose, env_defaults):
    schema = json.loads(SCHEMA.read_text())
    schema["properties"]["name"] = {"type": "string"}  # newer than this schema copy (see its README)
    data = resolve(compose, with_secrets(env_defaults))
    for service in data["services"].values():  # compose casts interpolated numbers before validating
        deploy = service.get("deploy", {})
        if isinstance(deploy.get("replicas"), str):
            deploy["replicas"] = int(deploy["replicas"])
    # Its $schema URL (draft 2019-09, spelt with "http" and "#") is not one jsonschema knows by name.
    validator = jsonschema.Draft201909Validator(schema)
    problems = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(data)]
    assert not problems, "\n".join(problems)
    # The schema is strict: a misspelt key is caught (so the pass above means something).
    data["services"]["sweeps"]["deploy"]["resources"]["reservations"]["devices"][0]["device_id"] = ["0"]
    assert not validator.is_valid(data)


# ---- credentials -------------------------------------------------------------------------------------
def test_no_secret_has_a_default_and_compose_refuses_to_start_without_it(env_defaults):
    text = COMPOSE.read_text()
    for name in SECRETS:
        assert env_defaults.get(name, None) == "", f".env.example must leave {name} empty (no default secret)"
        uses = [(op, arg) for var, op, arg in VAR_RE.findall(text) if var == name]
        assert uses, name
        for op, arg in uses:
            # `:?` stops compose with the message when unset or empty; the one exception is the
            # MLflow server's S3 key, read only when the destination is s3:// (profile minio).
            if (op, arg) != (":-", ""):
                assert op == ":?" and f"set {name} in .env" in arg, (name, op, arg)
    assert not re.search(r"PASSWORD\w*:-\w", text), "a password with a default value"
    # The old default password is gone from every file an operator copies.
    for path in (COMPOSE, ENV_EXAMPLE):
        assert not re.search(r"PASSWORD\s*[:=]\s*sweeps\b", path.read_text()), path


def test_every_ray_process_uses_token_authentication(compose, env_defaults):
    ray = [n for n, s in compose["services"].items() if "ray" in s.get("profiles", [])]
    assert set(ray) == {"ray-head", "ray-worker", "sweeps-ray"}
    for name in ray:
        env = resolve(compose["services"][name]["environment"], env_defaults)
        assert env["RAY_AUTH_MODE"] == "token", name
        assert "RAY_AUTH_TOKEN" in compose["services"][name]["environment"], name


def test_what_needs_no_remote_access_is_published_on_loopback_only(compose, env_defaults):
    published = {}
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            bind = VAR_RE.match(port).group(1)
            published[name] = env_defaults[bind]
    assert published["ray-head"] == "127.0.0.1"  # the dashboard submits jobs: code execution
    assert published["minio"] == "127.0.0.1"     # artifacts go through the MLflow server
    # MLflow is reached from other machines behind a password; PostgreSQL (no TLS) only on request.
    assert published["mlflow"] == "0.0.0.0" and published["postgres"] == "127.0.0.1"
    assert "--app-name" in compose["services"]["mlflow"]["command"]
    assert set(published) == {"ray-head", "minio", "postgres", "mlflow"}


# ---- GPUs ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("named, profiles", [
    ((), ()),                         # docker compose up
    (("sweeps-ray",), ()),            # docker compose up sweeps-ray (the Ray study)
    (("sweeps-worker",), ()),         # docker compose --profile workers up --no-deps sweeps-worker
    ((), ("minio",)),
])
def test_each_gpu_of_a_host_has_one_holder(compose, named, profiles):
    assert_one_holder_per_gpu(compose, services_started(compose, *named, profiles=profiles))


def assert_one_holder_per_gpu(compose: dict, started: set[str]) -> None:
    holders = {n: gpu_devices(compose["services"][n]) for n in started if gpu_devices(compose["services"][n])}
    assert holders, started
    everything = [n for n, devices in holders.items() for d in devices if d.get("count") == "all"]
    assert len(everything) <= 1, f"{everything} each reserve every GPU of the host"
    ids: list[str] = []
    for name, devices in holders.items():
        service = compose["services"][name]
        for d in devices:
            assert d["driver"] == "nvidia" and "gpu" in d["capabilities"], name
            # `count: N` on one host gives every replica the same GPUs; pin ids or take all once.
            assert d.get("count") == "all" or d.get("device_ids"), (name, d)
            ids += d.get("device_ids", [])
        if any(d.get("count") == "all" for d in devices):
            assert "replicas" not in service.get("deploy", {}), f"{name}: replicas would each get every GPU"
    assert not (everything and ids), f"{everything} take every GPU while others pin {ids}"
    assert len(ids) == len(set(ids)), f"a GPU id reserved twice: {ids}"


# `docker compose [--profile P]... up [-d|--build|--no-deps]... [SERVICE]...` as the docs spell it.
UP_RE = re.compile(r"docker compose((?: --profile [\w-]+)*) up((?: --?[\w-]+)*)((?: [a-z][\w-]*)*)")


def test_every_up_command_the_docs_suggest_keeps_one_holder_per_gpu(compose):
    texts = {"docker-compose.yml": COMPOSE.read_text(), "SCALE_OUT.md": (ROOT / "docs" / "SCALE_OUT.md").read_text()}
    seen = 0
    for where, text in texts.items():
        for found in UP_RE.finditer(text):
            profiles = tuple(found.group(1).split()[1::2])
            named = tuple(found.group(3).split())
            started = set(named) if "--no-deps" in found.group(2) else services_started(
                compose, *named, profiles=profiles)
            if any(gpu_devices(compose["services"][n]) for n in started):
                seen += 1
                try:
                    assert_one_holder_per_gpu(compose, started)
                except AssertionError as exc:
                    raise AssertionError(f"{where}: `{found.group(0)}`: {exc}") from None
    assert seen >= 4, seen  # the pattern still finds the documented commands


# ---- MinIO ----------------------------------------------------------------------------------------------
def test_minio_profile_matches_the_mlflow_server_and_env_example(compose, env_defaults):
    services = compose["services"]
    assert {n for n, s in services.items() if "minio" in s.get("profiles", [])} == {"minio", "minio-init"}
    mlflow = resolve(services["mlflow"]["environment"], env_defaults)
    minio = resolve(services["minio"]["environment"], env_defaults)
    init = resolve(services["minio-init"]["environment"], env_defaults)
    assert mlflow["MLFLOW_S3_ENDPOINT_URL"] == "http://minio:9000"  # minio's S3 API port inside the network
    assert mlflow["AWS_ACCESS_KEY_ID"] == minio["MINIO_ROOT_USER"] == init["MINIO_ROOT_USER"]
    assert services["mlflow"]["environment"]["AWS_SECRET_ACCESS_KEY"].startswith("${MINIO_ROOT_PASSWORD")
    # .env.example tells which destination the profile needs, and it names the bucket minio-init makes.
    bucket = init["MINIO_BUCKET"]
    assert f"MLFLOW_ARTIFACTS_DESTINATION=s3://{bucket}" in ENV_EXAMPLE.read_text()
    assert "mc mb" in " ".join(services["minio-init"]["entrypoint"]) and "MINIO_BUCKET" in str(
        services["minio-init"]["entrypoint"])
    assert services["minio-init"]["depends_on"] == {"minio": {"condition": "service_healthy"}}
    assert "minio:/data" in services["minio"]["volumes"]
    for name in ("minio", "minio-init"):
        assert re.fullmatch(r"minio/\w+:RELEASE\.[\dT-]+Z", services[name]["image"]), name  # pinned


def test_the_mlflow_image_is_slim_and_pins_what_the_clients_run():
    from importlib.metadata import version

    text = "\n".join(line for line in (ROOT / "docker" / "mlflow.Dockerfile").read_text().splitlines()
                     if not line.startswith("#"))
    pins = dict(re.findall(r'"([\w\[\]-]+)==([\w.]+)"', text))
    assert pins["mlflow"] == version("mlflow"), "server and clients must run the same MLflow"
    assert pins["psycopg[binary]"] == version("psycopg") and pins["Flask-WTF"] == version("Flask-WTF")
    assert "boto3" in pins and "torch" not in text and "COPY" not in text
