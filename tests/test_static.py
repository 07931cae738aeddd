"""mypy --strict on the whole package and ruff on the package, as part of the test command; and no
comment names an issue by number."""

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


def test_no_comment_names_an_issue_by_number() -> None:
    """Issues close, and their numbers tell a reader of the code nothing: a comment or docstring
    names the docs page that holds the concept instead."""
    import re

    issue = re.compile(r"\bissues? ?#?[0-9]+", re.IGNORECASE)
    texts = (".py", ".pyi", ".sh", ".js", ".json", ".yaml", ".yml", ".toml", ".md")
    files = [path for folder in ("selection_proto", "tests", "bench", "fuzz", "deploy", "examples")
             for path in sorted((ROOT / folder).rglob("*")) if path.suffix in texts]
    assert len(files) > 200
    named = [f"{path.relative_to(ROOT)}:{n}" for path in files
             for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if issue.search(line)]
    assert named == []
