"""The examples in examples/ run as they are documented."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("name", ["sync_loop.py", "asyncio_app.py", "trio_app.py"])
def test_python_examples(name: str) -> None:
    result = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


def test_sync_loop_prefers_the_cached_worker() -> None:
    result = subprocess.run([sys.executable, str(EXAMPLES / "sync_loop.py")], capture_output=True, text=True,
                            timeout=120)
    assert "req-0 -> worker 2 (cached 8 tokens)" in result.stdout


def test_node_client_of_the_jsonl_subprocess() -> None:
    node = shutil.which("node")
    if node is None:
        pytest.fail("node is not installed; the JSON-lines example needs Node.js")
    result = subprocess.run([node, str(EXAMPLES / "jsonl_client.js"), sys.executable], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert answer["worker_id"] in (1, 2) and answer["error_code"] == 404


def test_the_node_client_uses_the_active_virtualenv_and_fails_when_its_service_does(tmp_path: Path) -> None:
    node = shutil.which("node")
    if node is None:
        pytest.fail("node is not installed; the JSON-lines example needs Node.js")
    venv = Path(sys.executable).parent.parent  # this interpreter's virtualenv: no argument given
    result = subprocess.run([node, str(EXAMPLES / "jsonl_client.js")], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "VIRTUAL_ENV": str(venv)})
    assert result.returncode == 0 and json.loads(result.stdout)["error_code"] == 404, result.stderr
    broken = tmp_path / "python"  # a "Python" whose service dies at once
    broken.write_text("#!/bin/sh\nexit 0\n")
    broken.chmod(0o755)
    result = subprocess.run([node, str(EXAMPLES / "jsonl_client.js"), str(broken)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode != 0 and "selection-proto stdio ended" in result.stderr
