"""A plain `pip install selection-proto`, no extras, serves: the sdist and the wheel are built as a
release would build them, the wheel installed bare in a fresh virtualenv, and `serve`, `stdio` and
`simulate` run from it. Every other test installs `.[test]`, which brings every extra."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT
from test_http import api_call

TRACES = Path(os.environ.get("SELECTION_PROTO_TRACES", ROOT.parent / "shared" / "traces"))
OPTIONAL = ("hpack", "google.protobuf", "tokenizers", "jinja2", "redis", "trio", "uvloop", "blake3", "h2")


def _clean_env() -> dict[str, str]:
    # Nothing of the test's own interpreter may leak into the bare one.
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The `bin` folder of a fresh virtualenv holding the wheel built from the sdist, no extras."""
    out = tmp_path_factory.mktemp("dist")
    # No --sdist/--wheel: `build` makes the sdist, then the wheel from the sdist, which proves the
    # sdist holds everything a wheel needs.
    built = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)],
                           capture_output=True, text=True, timeout=600, env=_clean_env())
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (sdist,) = out.glob("selection_proto-*.tar.gz")
    (wheel,) = out.glob("selection_proto-*.whl")
    with tarfile.open(sdist) as archive:
        names = archive.getnames()
    assert any(name.endswith("selection_proto/py.typed") for name in names)
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    installed = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(wheel)],
                               capture_output=True, text=True, timeout=600, env=_clean_env())
    assert installed.returncode == 0, installed.stderr[-3000:]
    yield venv / "bin"


def test_the_bare_install_has_no_optional_dependency(bare: Path) -> None:
    # Without this the tests below would prove nothing: the extras must really be absent.
    probe = "import importlib.util as u, sys; print([m for m in sys.argv[1:] if u.find_spec(m.split('.')[0])])"
    done = subprocess.run([str(bare / "python"), "-c", probe, *OPTIONAL], capture_output=True, text=True,
                          timeout=60, env=_clean_env(), cwd="/")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_bare_install_serves_the_http_api(bare: Path) -> None:
    proc = subprocess.Popen([str(bare / "selection-proto"), "serve", "--port", "0", "--kv-events", "push"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=_clean_env(),
                            cwd="/")
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()
        assert '"listening"' in first, first + proc.stderr.read()[-3000:]
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # never block on a full pipe
        port = int(json.loads(first)["url"].rsplit(":", 1)[1])
        assert api_call(port, "GET", "/health") == (200, {"status": "ok"})
        status, _ = api_call(port, "POST", "/workers", {"worker_id": 1, "model_name": "m",
                                                        "endpoint": "http://w1:8000", "block_size": 4})
        assert status in (200, 201)
        status, answer = api_call(port, "POST", "/select_and_reserve",
                                  {"model_name": "m", "token_ids": list(range(9)), "reservation_id": "r"})
        assert status == 200 and answer["worker_id"] == 1
        assert api_call(port, "DELETE", "/reservations/r")[0] == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize(("flags", "extra"), [
    (("--ext-proc-port", "0"), "gateway"),
    (("--ledger", "redis://127.0.0.1:1"), "ledger"),
    (("--backend", "trio"), "trio"),
    (("--backend", "uvloop"), "uvloop"),
    (("--router-tracking-hash", "keyed-xxh3-v1", "--router-tracking-key-id", "k",
      "--router-tracking-key-file", "/dev/null"), "tracking"),
])
def test_a_flag_without_its_extra_says_which_to_install(bare: Path, flags: tuple[str, ...], extra: str) -> None:
    done = subprocess.run([str(bare / "selection-proto"), "serve", "--port", "0", *flags],
                          capture_output=True, text=True, timeout=60, env=_clean_env(), cwd="/")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"install 'selection-proto[{extra}]'" in lines[0], done.stderr


def test_the_bare_install_answers_json_lines(bare: Path) -> None:
    calls = [{"jsonrpc": "2.0", "id": 1, "method": "health"},
             {"jsonrpc": "2.0", "id": 2, "method": "workers.create",
              "params": {"worker_id": 1, "model_name": "m", "endpoint": "http://w1", "block_size": 4}},
             {"jsonrpc": "2.0", "id": 3, "method": "select",
              "params": {"model_name": "m", "token_ids": [1, 2, 3, 4, 5]}}]
    done = subprocess.run([str(bare / "selection-proto"), "stdio", "--kv-events", "push"],
                          input="".join(json.dumps(c) + "\n" for c in calls), capture_output=True, text=True,
                          timeout=60, env=_clean_env(), cwd="/")
    assert done.returncode == 0, done.stderr
    answers = {a["id"]: a for a in map(json.loads, done.stdout.splitlines())}
    assert answers[1]["result"] == {"status": "ok"}
    assert "error" not in answers[2], answers[2]
    assert answers[3]["result"]["worker_id"] == 1


def test_the_bare_install_simulates_a_trace(bare: Path, tmp_path: Path) -> None:
    trace = TRACES / "conversation_trace.jsonl.gz"
    if not trace.is_file():
        pytest.fail(f"trace missing: {trace} (set SELECTION_PROTO_TRACES)")
    short = tmp_path / "short.jsonl"
    with gzip.open(trace, "rt") as fh:
        short.write_text("".join(line for _, line in zip(range(200), fh, strict=False)))
    assert subprocess.run([str(bare / "selection-proto"), "simulate", "--help"], capture_output=True,
                          timeout=60, env=_clean_env(), cwd="/").returncode == 0
    out = tmp_path / "result.json"
    done = subprocess.run([str(bare / "selection-proto"), "simulate", "--engines", "2", "--requests", "200",
                           "--no-baselines", "--json", str(out), str(short)],
                          capture_output=True, text=True, timeout=300, env=_clean_env(), cwd="/")
    assert done.returncode == 0, done.stderr[-3000:]
    assert out.read_text().strip().startswith("{")
