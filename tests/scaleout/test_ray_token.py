"""Ray 2.60 token authentication as docker-compose.yml and docs/SCALE_OUT.md set it up
(RAY_AUTH_MODE=token, RAY_AUTH_TOKEN in the environment of the head and of every driver): a
driver without the token cannot join the head, one with it can."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.scaleout.scaleout_helpers import stop_group, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]

TOKEN = "test-token-0123456789abcdef"
DRIVER = """
import ray
try:
    ray.init(address="127.0.0.1:{port}")
    print("JOINED", ray.get(ray.remote(lambda: 41).remote()) + 1)
except ConnectionError as exc:
    print("REFUSED", str(exc).splitlines()[0])
"""


def clean_env(home: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    # HOME apart: Ray would also read (and `ray start` write) a token in ~/.ray/auth_token.
    return {**env, "HOME": str(home), **extra}


def test_a_token_head_refuses_drivers_without_the_token(tmp_path, free_port):
    ray = Path(sys.executable).with_name("ray")
    log = tmp_path / "head.log"
    # Ray's socket paths must fit 107 bytes: pytest's tmp_path is too deep for them.
    temp_dir = tempfile.mkdtemp(prefix="rtok", dir="/tmp")
    token_env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": TOKEN}
    with open(log, "w") as out:
        head = subprocess.Popen([str(ray), "start", "--head", f"--port={free_port}", "--num-cpus=1", "--num-gpus=0",
                                 "--include-dashboard=false", "--disable-usage-stats",
                                 f"--temp-dir={temp_dir}", "--block"],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=clean_env(tmp_path, **token_env))
    try:
        wait_for(lambda: head.poll() is not None or "Ray runtime started" in log.read_text(), timeout=300,
                 every=0.5, what=lambda: f"the Ray head (log: {log.read_text()[-2000:]})")
        assert head.poll() is None, log.read_text()[-2000:]

        def drive(**env: str) -> str:
            out = subprocess.run([sys.executable, "-c", DRIVER.format(port=free_port)], capture_output=True, text=True,
                                 timeout=300, env=clean_env(tmp_path, **env))
            return out.stdout + out.stderr

        refused = drive()
        assert "REFUSED" in refused and "JOINED" not in refused, refused[-2000:]
        assert "JOINED 42" in drive(**token_env)
        wrong = drive(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="not-" + TOKEN)
        assert "JOINED" not in wrong, wrong[-2000:]
    finally:
        stop_group(head, grace=60)
        shutil.rmtree(temp_dir, ignore_errors=True)
