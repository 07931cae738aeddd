"""The examples in examples/ run as they are documented."""

from __future__ import annotations

import json
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
