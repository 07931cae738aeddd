"""The reference implementation (ai-dynamo-runtime 1.6.1) in its own virtualenv.

Found through REFERENCE_PYTHON, else `.venv-reference/` at the repository root, which is created on
first use. Where it cannot be installed the interop tests are skipped with the reason, unless
SELECTION_PROTO_REQUIRE_REFERENCE=1 (CI sets it), which makes that a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-reference"
PACKAGE = "ai-dynamo-runtime==1.6.1"


def _usable(python: str) -> bool:
    probe = subprocess.run([python, "-c", "import dynamo.llm"], capture_output=True, timeout=120)
    return probe.returncode == 0


def _install() -> str:
    python = VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True, timeout=300)
    result = subprocess.run([str(python), "-m", "pip", "install", "-q", PACKAGE], capture_output=True,
                            text=True, timeout=1200)
    if result.returncode != 0:
        raise RuntimeError(f"pip install {PACKAGE} failed: {result.stderr.strip()[-500:]}")
    return str(python)


@pytest.fixture(scope="session")
def reference_python() -> str:
    candidate = os.environ.get("REFERENCE_PYTHON")
    try:
        if candidate is None:
            existing = VENV / "bin" / "python"
            candidate = str(existing) if existing.exists() and _usable(str(existing)) else _install()
        if not _usable(candidate):
            raise RuntimeError(f"{candidate} cannot import dynamo.llm")
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        reason = f"the reference implementation is not available: {exc}"
        if os.environ.get("SELECTION_PROTO_REQUIRE_REFERENCE") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return candidate


def run_reference(python: str, script: str, payload: Any) -> Any:
    """Run `script` with the reference's Python; it reads JSON on stdin and prints JSON."""
    env = {**os.environ, "RUST_LOG": "error", "DYN_LOG": "error"}
    result = subprocess.run([python, "-c", script], input=json.dumps(payload), capture_output=True,
                            text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])
