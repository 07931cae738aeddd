"""The deployment kit: the Kubernetes manifests read and agree with the service (routes, settings,
volume, user, timings), and the Dockerfile's own steps build and run the service outside a
container runtime: its RUN lines in a fresh virtualenv, its ENV, ENTRYPOINT and CMD, its
HEALTHCHECK, and a SIGTERM that leaves the last snapshot on the volume."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from selection_proto import __version__
from selection_proto.config import SETTING_FIELDS, TRANSPORT, env_name
from selection_proto.core.base.routes import ROUTES

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "deploy" / "kubernetes" / "selection-proto.yaml"
KNOWN_ENV = {env_name(f.name) for f in SETTING_FIELDS} | {env_name(name) for name in TRANSPORT}


def dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) in order, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", (ROOT / "Dockerfile").read_text())
    steps = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, rest = line.strip().partition(" ")
            steps.append((name.upper(), rest.strip()))
    return steps


def docker_env(steps: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for name, rest in steps:
        if name == "ENV":
            env.update(pair.split("=", 1) for pair in shlex.split(rest))
    return env


def test_the_manifests_agree_with_the_service() -> None:
    documents = list(yaml.safe_load_all(MANIFEST.read_text()))
    by_kind = {d["kind"]: d for d in documents}
    assert set(by_kind) == {"PersistentVolumeClaim", "Deployment", "Service"}
    pod = by_kind["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert set(env) <= KNOWN_ENV, set(env) - KNOWN_ENV
    assert container["image"] == f"selection-proto:{__version__}"
    # Probes name GET routes the service has: liveness the process, readiness its own (not the fleet's).
    gets = {r.template for r in ROUTES if r.method == "GET"}
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz" and "/readyz" in gets
    port, ext_proc = container["ports"]
    assert int(env["SELECTION_PROTO_PORT"]) == port["containerPort"]
    assert int(env["SELECTION_PROTO_EXT_PROC_PORT"]) == ext_proc["containerPort"]
    assert [p["targetPort"] for p in by_kind["Service"]["spec"]["ports"]] == [port["name"], ext_proc["name"]]
    assert container["readinessProbe"]["httpGet"]["port"] == port["name"]
    # The snapshot lives on the claimed volume; the image's user owns it.
    (mount,) = container["volumeMounts"]
    assert os.path.dirname(env["SELECTION_PROTO_SNAPSHOT"]) == mount["mountPath"]
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == by_kind["PersistentVolumeClaim"]["metadata"]["name"]
    assert str(pod["securityContext"]["runAsUser"]) == dict(dockerfile())["USER"]
    # SIGTERM: the drain delay, then the drain, then the last snapshot, before the kill.
    assert pod["terminationGracePeriodSeconds"] > float(env["SELECTION_PROTO_DRAIN_DELAY_SECS"]) + float(
        env["SELECTION_PROTO_SHUTDOWN_TIMEOUT_SECS"]) + 10
    assert container["resources"]["limits"]["memory"] == "4Gi" and int(env["SELECTION_PROTO_MAX_STATE_BYTES"]) < 4 * 2**30
    # Every value is one the service starts with.
    shown = subprocess.run([sys.executable, "-m", "selection_proto", "serve", "--print-config"],
                           capture_output=True, text=True, timeout=60, env={**os.environ, **env})
    assert shown.returncode == 0, shown.stderr
    assert "drain_delay_secs = 5.0  # SELECTION_PROTO_DRAIN_DELAY_SECS" in shown.stdout


def test_the_gateway_example_points_at_the_picker() -> None:
    """deploy/kubernetes/gateway.yaml: the HTTPRoute sends to the InferencePool, whose endpoint
    picker is selection-proto's Service on its ext_proc port."""
    service = next(d for d in yaml.safe_load_all(MANIFEST.read_text()) if d["kind"] == "Service")
    by_kind = {d["kind"]: d for d in yaml.safe_load_all((MANIFEST.parent / "gateway.yaml").read_text())}
    assert set(by_kind) == {"InferencePool", "Gateway", "HTTPRoute"}
    pool = by_kind["InferencePool"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    picker = pool["spec"]["endpointPickerRef"]
    assert picker["name"] == service["metadata"]["name"]
    ext_proc = next(p for p in service["spec"]["ports"] if p["name"] == "ext-proc")
    assert picker["port"]["number"] == ext_proc["port"] and ext_proc["appProtocol"] == "kubernetes.io/h2c"
    (rule,) = by_kind["HTTPRoute"]["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                    "name": pool["metadata"]["name"]}]
    assert by_kind["HTTPRoute"]["spec"]["parentRefs"][0]["name"] == by_kind["Gateway"]["metadata"]["name"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_dockerfile_steps_build_and_run_the_service(tmp_path: Path) -> None:
    steps = dockerfile()
    image = tmp_path / "image"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    path = f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}"
    workdir = image
    for name, rest in steps:
        if name == "WORKDIR":
            workdir = image / rest.lstrip("/")
            workdir.mkdir(parents=True, exist_ok=True)
        elif name == "COPY":
            *sources, target = rest.split()
            for source in sources:
                destination = workdir / target
                if (ROOT / source).is_dir():
                    shutil.copytree(ROOT / source, destination, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    shutil.copy(ROOT / source, destination)
        elif name == "RUN" and not rest.startswith("useradd"):  # the image's user: this test's own
            done = subprocess.run(["bash", "-c", rest], cwd=workdir, capture_output=True, text=True,
                                  timeout=600, env={**os.environ, "PATH": path})
            assert done.returncode == 0, done.stderr[-3000:]
    # The image's settings, but a free port and the volume in a temporary folder.
    env = {**os.environ, "PATH": path, **docker_env(steps)}
    env["SELECTION_PROTO_PORT"] = str(_free_port())
    volume = tmp_path / "volume"
    volume.mkdir()
    env["SELECTION_PROTO_SNAPSHOT"] = str(volume / os.path.basename(env["SELECTION_PROTO_SNAPSHOT"]))
    assert docker_env(steps)["SELECTION_PROTO_HOST"] == "0.0.0.0"
    command = json.loads(dict(steps)["ENTRYPOINT"]) + json.loads(dict(steps)["CMD"])
    server = subprocess.Popen(command, cwd="/", env=env, stderr=subprocess.PIPE, text=True)
    try:
        assert server.stderr is not None
        started: dict[str, Any] = json.loads(server.stderr.readline())
        assert started["event"] == "listening" and started["url"].startswith("http://0.0.0.0:")
        health = dict(steps)["HEALTHCHECK"].split(" CMD ", 1)[1]
        checked = subprocess.run(["sh", "-c", health], env=env, capture_output=True, text=True, timeout=30)
        assert checked.returncode == 0, checked.stderr
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
    finally:
        if server.poll() is None:
            server.kill()
    assert json.loads((volume / "state.json").read_bytes())["format"] == "selection-proto-dump/1"
