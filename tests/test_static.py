"""mypy --strict on the whole package and ruff on the package, as part of the test command."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_mypy_strict_package() -> None:
    if shutil.which("mypy") is None and _run("mypy", "--version").returncode != 0:
        pytest.fail("mypy is not installed (pip install -e '.[test]')")
    result = _run("mypy", "--strict", "selection_proto")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_clean() -> None:
    result = _run("ruff", "check", "selection_proto", "tests", "bench", "examples")
    assert result.returncode == 0, result.stdout + result.stderr
