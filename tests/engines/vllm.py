"""Real vLLM engines for the tests (docs/REAL_ENGINES.md): the tiny model built once, engines started
on the CPU with KV events over ZMQ, killed and started again on the same ports.

The engines run in their own virtualenv (`tests/engines/install-vllm.sh`, or the Python named by
`VLLM_PYTHON`): vLLM pins its own torch, transformers and protobuf, which must not meet ours. A
missing engine fails the tests that need it, never skips them."""

from __future__ import annotations

import http.client
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT = 420.0  # a cold start under load took 157 s here; two at once on two cores, more
GATEWAY_DOC = ROOT / "docs" / "GATEWAY.md"
# The ports docs/GATEWAY.md's recipe names, by what listens there; the tests put free ones in their place.
RECIPE_PORTS = {"engine": 8000, "events": 5557, "replay": 5558, "api": 8092, "picker": 9002, "gateway": 8081}
RECIPE_MODEL = "qwen"  # the recipe's served model name; the tests' engines serve `tiny`
# What a test engine adds to the recipe's command: the tiny model's dtype and length, few blocks
# (evictions come quickly), no CUDA graphs on the CPU.
TEST_ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "8",
                    "--max-num-batched-tokens", "2048", "--enforce-eager"]


def recipe_blocks() -> dict[str, str]:
    """The real-engine recipe of docs/GATEWAY.md: each `sh` block after a `<!-- recipe: NAME -->`."""
    blocks = dict(re.findall(r"<!-- recipe: ([\w-]+) -->\n```sh\n(.*?)```", GATEWAY_DOC.read_text(), re.S))
    assert set(blocks) == {"engine", "serve", "envoy", "register", "request", "approximate-serve",
                           "approximate-register"}, sorted(blocks)
    return blocks


def render_recipe(block: str, ports: dict[str, int], model: Path) -> str:
    """A recipe block for this machine: the test's ports, model folder and model name."""
    text = block.replace("$MODEL", str(model))
    for name, port in ports.items():
        text = re.sub(rf"\b{RECIPE_PORTS[name]}\b", str(port), text)
    return re.sub(rf"\b{RECIPE_MODEL}\b", "tiny", text)


def recipe_args(command: str) -> list[str]:
    """A rendered one-command block split as the shell splits it (a backslash-newline joins lines)."""
    return shlex.split(command.replace("\\\n", ""))


def vllm_python() -> str:
    """The engines' interpreter; a missing one fails loudly with the command that makes it."""
    path = os.environ.get("VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    assert os.path.exists(path), (f"no vLLM interpreter at {path}: run `bash tests/engines/install-vllm.sh` "
                                  "(or set VLLM_PYTHON)")
    return path


def build_model(folder: Path) -> Path:
    """The tiny Llama (random weights, its own tokenizer and chat template) in `folder`."""
    if not (folder / "model.safetensors").exists():
        subprocess.run([vllm_python(), str(ROOT / "tests" / "engines" / "tiny_model.py"), str(folder)],
                       check=True, capture_output=True, timeout=300)
    return folder


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


class VllmEngine:
    """One `vllm.entrypoints.openai.api_server` on loopback, publishing KV events on `events_port`
    (bound: the subscriber connects) and replaying on `replay_port` when it has one. `kv_role`
    (`kv_producer`, `kv_consumer`) with `kv_folder`: a prefill/decode engine whose KV goes through
    that folder by vLLM's `ExampleConnector` (docs/PD.md)."""

    def __init__(self, model: Path, log_dir: Path, name: str, core: int, *, replay: bool = True,
                 prefix_caching: bool = True, gpu_blocks: int = 80, block_size: int = 32,
                 kv_role: str | None = None, kv_folder: Path | None = None, recipe: bool = False,
                 extra_args: tuple[str, ...] = ()) -> None:
        """`kv_role`/`kv_folder`: a P/D engine of vLLM's ExampleConnector (docs/PD.md); `recipe`:
        started with docs/GATEWAY.md's command as written (`TEST_ENGINE_ARGS` added), which must
        then give what the other arguments say; `extra_args`: more of vLLM's arguments."""
        self.model, self.name, self.core, self.recipe = model, name, core, recipe
        self.extra_args = extra_args
        self.kv_role, self.kv_folder = kv_role, kv_folder
        self.replay, self.prefix_caching = replay, prefix_caching
        self.gpu_blocks, self.block_size = gpu_blocks, block_size
        self.http_port, self.events_port, self.replay_port = free_ports(3)
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts: list[float] = []  # seconds each start took until /health answered

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def worker(self, worker_id: int, **extra: Any) -> dict[str, Any]:
        """Its worker record for our service."""
        record: dict[str, Any] = {"worker_id": worker_id, "model_name": "tiny", "endpoint": self.url,
                                  "block_size": self.block_size,
                                  "kv_events_endpoint": f"tcp://127.0.0.1:{self.events_port}"}
        if self.replay:
            record["replay_endpoint"] = f"tcp://127.0.0.1:{self.replay_port}"
        return {**record, **extra}

    def command(self) -> list[str]:
        """The engine's command line, on its current ports."""
        if self.recipe:
            ports = {"engine": self.http_port, "events": self.events_port, "replay": self.replay_port}
            args = recipe_args(render_recipe(recipe_blocks()["engine"], ports, self.model))
            assert args[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"], args
            return [vllm_python(), *args[1:], *TEST_ENGINE_ARGS,
                    "--num-gpu-blocks-override", str(self.gpu_blocks), *self.extra_args]
        events: dict[str, Any] = {"enable_kv_cache_events": True, "publisher": "zmq",
                                  "endpoint": f"tcp://*:{self.events_port}", "topic": "kv-events"}
        if self.replay:
            events["replay_endpoint"] = f"tcp://*:{self.replay_port}"
        args = [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
                "--served-model-name", "tiny", *TEST_ENGINE_ARGS, "--block-size", str(self.block_size),
                "--enable-prompt-tokens-details", "--num-gpu-blocks-override", str(self.gpu_blocks),
                "--host", "127.0.0.1", "--port", str(self.http_port), "--kv-events-config", json.dumps(events),
                "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching",
                *self.extra_args]
        if self.kv_role is not None:
            assert self.kv_folder is not None
            args += ["--kv-transfer-config", json.dumps({
                "kv_connector": "ExampleConnector", "kv_role": self.kv_role,
                "kv_connector_extra_config": {"shared_storage_path": str(self.kv_folder)}})]
        return args

    def start(self) -> None:
        args = self.command()
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu",
               "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(self.core),
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}
        env.pop("VIRTUAL_ENV", None)
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        self._started_at = time.monotonic()

    def wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = self._started_at + START_TIMEOUT
        while True:
            assert self.proc.poll() is None, f"engine {self.name} exited:\n{self.log_tail()}"
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=2)
                conn.request("GET", "/health")
                ok = conn.getresponse().status == 200
                conn.close()
                if ok:
                    self.starts.append(time.monotonic() - self._started_at)
                    return
            except OSError:
                pass
            assert time.monotonic() < deadline, f"engine {self.name} did not start:\n{self.log_tail()}"
            time.sleep(0.5)

    def healthy_or_retried(self) -> None:
        """`wait_healthy`; an engine that exited while starting (a chosen port taken meanwhile by
        another process) is started once more on fresh ports, with the first failure kept in its log."""
        try:
            self.wait_healthy()
        except AssertionError:
            if self.proc is None or self.proc.poll() is None:
                raise  # not an early exit: a start that takes too long is a failure
            self.http_port, self.events_port, self.replay_port = free_ports(3)
            self.start()
            self.wait_healthy()

    def kill(self) -> None:
        """SIGKILL to the engine's whole process group (API server, engine core, worker)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None
        # The ports must be free before the same ports are bound again.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                for port in (self.http_port, self.events_port, self.replay_port):
                    with socket.socket() as s:
                        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                        s.bind(("127.0.0.1", port))
                return
            except OSError:
                time.sleep(0.2)

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def post(self, path: str, body: Any, timeout: float = 60) -> tuple[int, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=timeout)
        conn.request("POST", path, json.dumps(body).encode(), {"content-type": "application/json"})
        response = conn.getresponse()
        payload = response.read()
        conn.close()
        return response.status, json.loads(payload) if payload.startswith((b"{", b"[")) else payload

    def complete(self, prompt: Any, max_tokens: int = 1) -> int:
        """Run a completion; the engine's own count of prompt tokens it found cached."""
        status, answer = self.post("/v1/completions", {"model": "tiny", "prompt": prompt,
                                                       "max_tokens": max_tokens, "temperature": 0})
        assert status == 200, answer
        return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])

    def metrics(self) -> str:
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=10)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
        return text
