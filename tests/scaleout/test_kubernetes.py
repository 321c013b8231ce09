"""deploy/kubernetes/ checked without a cluster: every manifest against the Kubernetes schemas
that kubernetes-validate ships (strict: an unknown field is an error), the RayJob against the
KubeRay CRD schema kept in deploy/kubernetes/schemas/ (closed the same way), and what the
manifests refer to: volumes, ConfigMaps, the Secrets docs/SCALE_OUT.md makes, the specs they run
(validated by sweeps), the commands and flags (parsed by the installed programs), the MLflow
server's --allowed-hosts against the URI the specs use. Nothing here was applied to a cluster."""
from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from sweeps.spec.load import load_spec
from tests.scaleout.compose_helpers import flags_of

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
K8S_VERSION = "1.33.0"  # podFailurePolicy and backoffLimitPerIndex are GA from 1.33


def manifests() -> list[dict]:
    return [doc for path in sorted(DEPLOY.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc]


def by_kind(kind: str) -> list[dict]:
    return [doc for doc in manifests() if doc["kind"] == kind]


def closed(schema):
    """The CRD schema as the API server applies it, unknown fields an error instead of pruned:
    every object with properties and no other allowance gets additionalProperties: false."""
    if isinstance(schema, dict):
        out = {k: closed(v) for k, v in schema.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [closed(v) for v in schema]
    return schema


RAYJOB_SCHEMA = closed(json.loads((DEPLOY / "schemas" / "ray.io_rayjobs.v1.json").read_text()))


def validate(doc: dict) -> None:
    if doc["apiVersion"] == "ray.io/v1":
        jsonschema.Draft7Validator(RAYJOB_SCHEMA).validate(doc)
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_every_manifest_validates_against_its_schema():
    kinds = sorted(doc["kind"] for doc in manifests())
    assert kinds == ["ConfigMap", "ConfigMap", "Deployment", "Job", "PersistentVolumeClaim", "PersistentVolumeClaim",
                     "PersistentVolumeClaim", "RayJob", "Service"], kinds
    for doc in manifests():
        validate(doc)


@pytest.mark.parametrize("kind, edit, says", [
    ("RayJob", lambda d: d["spec"]["rayClusterSpec"].update(workerGroupSpec=[]), "workerGroupSpec"),
    ("RayJob", lambda d: d["spec"]["rayClusterSpec"]["authOptions"].update(mode="tokens"), "tokens"),
    ("Job", lambda d: d["spec"].update(completions="four"), "four"),
    ("Job", lambda d: d["spec"]["template"]["spec"]["containers"][0].update(gpus=1), "gpus"),
])
def test_a_wrong_field_is_refused(kind, edit, says):
    doc = copy.deepcopy(by_kind(kind)[0])
    edit(doc)
    with pytest.raises(jsonschema.ValidationError) as err:
        validate(doc)
    assert says in str(err.value)


def pod_specs() -> dict[str, dict]:
    """Every pod template's spec, by where it is."""
    out = {}
    for doc in manifests():
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] in ("Job", "Deployment"):
            out[name] = doc["spec"]["template"]["spec"]
        elif doc["kind"] == "RayJob":
            cluster = doc["spec"]["rayClusterSpec"]
            out[f"{name}/head"] = cluster["headGroupSpec"]["template"]["spec"]
            for group in cluster["workerGroupSpecs"]:
                out[f"{name}/{group['groupName']}"] = group["template"]["spec"]
    return out


def documented_secrets() -> dict[str, set[str]]:
    """The Secrets docs/SCALE_OUT.md tells the operator to make, with their keys."""
    text = (ROOT / "docs" / "SCALE_OUT.md").read_text().replace("\\\n", " ")  # join continued lines
    secrets: dict[str, set[str]] = {}
    for command in re.findall(r"kubectl create secret generic [^\n]*", text):
        argv = shlex.split(command)
        secrets[argv[4]] = {a.split("=", 2)[1] for a in argv if a.startswith("--from-literal=")}
    return secrets


def test_volumes_configmaps_and_secrets_exist():
    claims = {d["metadata"]["name"] for d in by_kind("PersistentVolumeClaim")}
    maps = {d["metadata"]["name"]: set(d["data"]) for d in by_kind("ConfigMap")}
    secrets = documented_secrets()
    assert set(secrets) == {"sweeps-credentials", "mlflow-server"}, secrets
    for where, pod in pod_specs().items():
        for volume in pod.get("volumes", []):
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims, where
            if "configMap" in volume:
                assert volume["configMap"]["name"] in maps, where
        for container in pod["containers"]:
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets.get(ref["name"], set()), (where, ref)
            mounted = {v["name"] for v in pod.get("volumes", [])}
            assert {m["name"] for m in container.get("volumeMounts", [])} <= mounted, where


def test_pods_that_train_hold_gpus_and_share_the_runs_volume():
    for where, pod in pod_specs().items():
        if where.startswith(("Deployment/", "RayJob/sweeps-lr-bs-ray/head")):
            assert "nvidia.com/gpu" not in json.dumps(pod), where  # the server and the driver train nothing
            continue
        [container] = pod["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1, where
        assert {"name": "runs", "mountPath": "/app/runs"} in container["volumeMounts"], where
    [claim] = [d for d in by_kind("PersistentVolumeClaim") if d["metadata"]["name"] == "sweeps-runs"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # every node reads a retried trial's checkpoint


def test_the_indexed_job_execs_sweeps_and_survives_preemption():
    [job] = by_kind("Job")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    rules = spec["podFailurePolicy"]["rules"]
    assert rules[0] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    assert rules[1] == {"action": "Ignore", "onExitCodes": {"operator": "In", "values": [143]}}
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["terminationGracePeriodSeconds"] >= 60
    [container] = pod["containers"]
    script = container["command"][2]
    lines = [ln.strip() for ln in script.splitlines() if ln.strip().startswith("exec ")]
    assert len(lines) == 2, script  # both commands replace the shell: SIGTERM reaches sweeps
    env = {e["name"]: e.get("value") for e in container["env"]}
    for line in lines:
        argv = shlex.split(line.replace('"$SPEC"', env["SPEC"]).replace('"$JOB_COMPLETION_INDEX"', "1"))[1:]
        program = (argv[0], argv[1])
        assert program in (("sweeps", "run"), ("sweeps", "worker")), argv
        assert {a for a in argv if a.startswith("--")} <= flags_of(program), argv


def test_the_specs_validate_and_reach_the_services(tmp_path):
    [study] = [d for d in by_kind("ConfigMap") if d["metadata"]["name"] == "sweeps-study"]
    specs = {}
    for name, text in study["data"].items():
        (tmp_path / name).write_text(text)
        specs[name] = load_spec(str(tmp_path / name))
    optuna_spec, ray_spec = specs["lr_bs_cluster.yaml"], specs["lr_bs_ray.yaml"]
    assert optuna_spec.backend == "optuna" and optuna_spec.storage_url().startswith("postgresql://")
    assert ray_spec.backend == "ray" and ray_spec.resources.ray_address == "auto"
    [job] = by_kind("Job")
    assert job["spec"]["template"]["spec"]["containers"][0]["env"][0]["value"] == "/app/study/lr_bs_cluster.yaml"
    [ray_job] = by_kind("RayJob")
    assert shlex.split(ray_job["spec"]["entrypoint"]) == ["sweeps", "run", "/app/study/lr_bs_ray.yaml"]

    from mlflow.server.security_utils import is_allowed_host_header

    [service] = by_kind("Service")
    [deployment] = by_kind("Deployment")
    argv = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    assert {a for a in argv if a.startswith("--")} <= flags_of(("mlflow", "server")), argv
    allowed = argv[argv.index("--allowed-hosts") + 1].split(",")
    for spec in specs.values():
        host = spec.tracking_uri().split("://", 1)[1].rstrip("/")
        assert host == f"{service['metadata']['name']}:{service['spec']['ports'][0]['port']}", host
        assert is_allowed_host_header(allowed, host), (host, allowed)
    for host in ("127.0.0.1:5000", "localhost:5000", "mlflow.sweeps.svc.cluster.local:5000"):
        assert is_allowed_host_header(allowed, host), host
    assert argv[argv.index("--backend-store-uri") + 1].startswith("postgresql://sweeps@postgres:5432/")


def test_rayjob_runs_the_images_ray_version():
    [ray_job] = by_kind("RayJob")
    constraints = (ROOT / "docker" / "constraints.txt").read_text()
    pinned = re.search(r"^ray==(\S+)$", constraints, re.M)
    assert pinned and ray_job["spec"]["rayClusterSpec"]["rayVersion"] == pinned.group(1)
