"""The deployment files: docker-compose.yml must be accepted by the compose CLI."""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _compose_cmd() -> list[str] | None:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def test_compose_file_is_valid():
    cmd = _compose_cmd()
    if cmd is None:
        pytest.skip("no docker compose CLI installed (.ci/run installs Debian's docker-compose)")
    out = subprocess.run([*cmd, "-f", str(ROOT / "docker-compose.yml"), "config"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    for service in ("postgres", "redis", "migrate", "api", "worker"):
        assert f"  {service}:" in out.stdout
    assert "capabilities:" in out.stdout and "gpu" in out.stdout  # the worker's GPU reservation survived parsing
