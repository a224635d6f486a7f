"""The main job (python -m kvxfer.demo) runs P and D as processes and verifies what moved."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("transport", ["ipc", "pg"])
def test_demo_moves_and_verifies(transport):
    cmd = [
        sys.executable,
        "-m",
        "kvxfer.demo",
        "--layers",
        "2",
        "--tokens",
        "100",
        "37",
        "16",
        "--transport",
        transport,
        "--deadline",
        "60",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "verified byte for byte: 3/3" in r.stdout, r.stdout
    assert f"'prefill': '{transport}'" in r.stdout, r.stdout
