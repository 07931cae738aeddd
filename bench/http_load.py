"""HTTP `/select` requests per second with wrk (keep-alive, loopback), side by side:
ours (`selection-proto serve`), the reference (`python -m dynamo.select_service`) and a bare h11
server answering `200 {}` (the ceiling of h11 on anyio).

    python bench/http_load.py [--reference-python /path/to/venv/bin/python] [--seconds 5] [--servers ours,bare_h11] [--rounds 3]
        [--compare-tree /path/to/worktree-of-an-earlier-commit]

The row `sansio_h11` is our Sans-IO connection on the bare server's loop (bench/sansio_h11.py).
A second table gives each server's CPU time per request (user + system, all its processes, from
/proc): less noisy than throughput on a shared machine; its column `transport` is what our
transport costs a request beyond the Sans-IO work (ours - sansio_h11). The row `ours_msgpack` is our server again, sent
`application/msgpack` bodies whose `token_ids` is a bin of little-endian u32 (docs/DECISIONS.md, "msgpack bodies"). `ours_ledger` is one process
sharing bookings through a redis-server ledger, `ours_processes2` two processes on one port
(`--processes 2`) sharing it (docs/REPLICATION.md), `ours_processes2_msgpack` the same sent msgpack
bodies; pass them in `--servers`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from workload import BLOCK_SIZE, WORKERS, prompts  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"port {port} did not open")


def post(port: int, path: str, body: object) -> None:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"}, method="POST")
    urllib.request.urlopen(req, timeout=10).read()


def register(port: int, tenant_field: str) -> None:
    for w in range(WORKERS):
        post(port, "/workers", {"worker_id": w, "model_name": "m", tenant_field: "default",
                                "endpoint": f"http://w{w}", "block_size": BLOCK_SIZE,
                                "kv_events_endpoint": f"tcp://127.0.0.1:{41000 + w}"})


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of `pid` and its children that are alive (--processes)."""
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(entry) == pid or int(fields[1]) == pid:  # fields[1]: the parent's pid
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def wrk(port: int, tokens: int, connections: int, seconds: int, msgpack_bin: bool = False,
        pid: int | None = None) -> tuple[float, float]:
    """Requests per second, and the server's CPU microseconds per request (nan without `pid`)."""
    import msgpack

    token_ids = prompts(tokens, 1)[0]
    if msgpack_bin:
        media = "application/msgpack"
        body = msgpack.packb({"model_name": "m", "token_ids": struct.pack(f"<{len(token_ids)}I", *token_ids)})
    else:
        media = "application/json"
        body = json.dumps({"model_name": "m", "token_ids": token_ids}).encode()
    with tempfile.NamedTemporaryFile("wb", suffix=".body", delete=False) as data:
        data.write(body)
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(f'wrk.method = "POST"\nwrk.headers["Content-Type"] = "{media}"\n'
                     f'local f = io.open("{data.name}", "rb")\nwrk.body = f:read("*all")\nf:close()\n')
    cpu_before = cpu_seconds(pid) if pid is not None else math.nan
    out = subprocess.run(["wrk", "-t", str(min(connections, 2)), "-c", str(connections), "-d", f"{seconds}s",
                          "-s", script.name, f"http://127.0.0.1:{port}/select"],
                         capture_output=True, text=True, check=True).stdout
    os.unlink(script.name)
    os.unlink(data.name)
    match = re.search(r"Requests/sec:\s+([\d.]+)", out)
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if errors:
        raise RuntimeError(f"{errors.group(1)} non-2xx answers:\n{out}")
    assert match, out
    requests = re.search(r"(\d+) requests in", out)
    assert requests, out
    cpu = cpu_seconds(pid) - cpu_before if pid is not None else math.nan
    return float(match.group(1)), 1e6 * cpu / int(requests.group(1))


def start(cmd: list[str], port: int, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    wait_port(port)
    return proc


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reference-python", default=os.environ.get("REFERENCE_PYTHON"))
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--servers", default="ours,ours_msgpack,reference,bare_h11,sansio_h11",
                        help="comma-separated subset to measure (ours is always measured)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure every server this many times, alternating; report medians")
    parser.add_argument("--compare-tree", action="append", default=[], metavar="PATH",
                        help="also measure `selection-proto serve` from this source tree (e.g. a "
                             "`git worktree` of an earlier commit), as the row ours@PATH")
    args = parser.parse_args()
    wanted = {"ours", *args.servers.split(","), *(f"ours@{t}" for t in args.compare_tree)}
    samples: dict[str, dict[tuple[int, int], list[float]]] = {}
    cpus: dict[str, dict[tuple[int, int], list[float]]] = {}  # server CPU microseconds per request
    servers: list[tuple[str, list[str], dict[str, str] | None, str | None]] = [
        ("ours", [sys.executable, "-m", "selection_proto", "serve", "--kv-events", "push",
                  "--log-level", "warning", "--port"], None, "tenant_id"),
        ("ours_msgpack", [sys.executable, "-m", "selection_proto", "serve", "--kv-events", "push",
                          "--log-level", "warning", "--port"], None, "tenant_id"),
        ("bare_h11", [sys.executable, os.path.join(HERE, "bare_h11.py")], None, None),
        ("sansio_h11", [sys.executable, os.path.join(HERE, "sansio_h11.py")], None, "tenant_id"),
    ]
    for tree in args.compare_tree:
        servers.insert(1, (f"ours@{tree}", servers[0][1], {**os.environ, "PYTHONPATH": tree}, "tenant_id"))
    if args.reference_python:
        servers.insert(1, ("reference", [args.reference_python, "-m", "dynamo.select_service", "--port"],
                           {**os.environ, "RUST_LOG": "warn", "DYN_LOG": "warn"}, "routing_group"))
    ledger = None
    if wanted & {"ours_ledger", "ours_processes2", "ours_processes2_msgpack"}:
        sys.path.insert(0, os.path.join(HERE, "..", "tests"))
        from ledger_server import LedgerServer

        ledger = LedgerServer(Path(tempfile.mkdtemp()), persistent=False).start()
        for name, extra in (("ours_ledger", []), ("ours_processes2", ["--processes", "2"]),
                            ("ours_processes2_msgpack", ["--processes", "2"])):
            servers.insert(1, (name, [*servers[0][1][:-1], "--ledger", ledger.url, *extra, "--port"], None,
                               "tenant_id"))
    for _ in range(args.rounds):
        for name, cmd, env, tenant_field in servers:
            if name not in wanted:
                continue
            port = free_port()
            proc = start(cmd + [str(port)], port, env)
            if ledger is not None and name.startswith(("ours_ledger", "ours_processes2")):
                time.sleep(1.0)  # connected to the ledger (catalog writes need it)
            try:
                if tenant_field is not None:
                    register(port, tenant_field)
                for tokens in (1024, 16384):
                    for connections in (1, 8, 64):
                        rate, cpu = wrk(port, tokens, connections, args.seconds,
                                        msgpack_bin=name.endswith("msgpack"), pid=proc.pid)
                        samples.setdefault(name, {}).setdefault((tokens, connections), []).append(rate)
                        cpus.setdefault(name, {}).setdefault((tokens, connections), []).append(cpu)
            finally:
                proc.terminate()
                proc.wait(timeout=30)
    if ledger is not None:
        ledger.kill()
    rows = {name: {case: statistics.median(rates) for case, rates in cases.items()}
            for name, cases in samples.items()}
    cpu_rows = {name: {case: statistics.median(values) for case, values in cases.items()}
                for name, cases in cpus.items()}
    widths = {n: max(12, len(n) + 2) for n in rows}
    header = f"{'tokens':>7}{'conns':>6}" + "".join(f"{n:>{widths[n]}}" for n in rows)
    print("requests per second")
    print(header + "   ours/ref  ours/bare")
    for tokens in (1024, 16384):
        for connections in (1, 8, 64):
            values = [(n, rows[n][(tokens, connections)]) for n in rows]
            ours = rows["ours"][(tokens, connections)]
            ref = rows.get("reference", {}).get((tokens, connections))
            bare = rows.get("bare_h11", {}).get((tokens, connections))
            print(f"{tokens:>7}{connections:>6}" + "".join(f"{v:>{widths[n]},.0f}" for n, v in values)
                  + f"{(ours / ref if ref else math.nan):>11.2f}{(ours / bare if bare else math.nan):>11.2f}")
    print("server CPU microseconds per request (all its processes); transport = ours - sansio_h11")
    print(header + "  transport")
    for tokens in (1024, 16384):
        for connections in (1, 8, 64):
            values = [(n, cpu_rows[n][(tokens, connections)]) for n in cpu_rows]
            sansio = cpu_rows.get("sansio_h11", {}).get((tokens, connections), math.nan)
            print(f"{tokens:>7}{connections:>6}" + "".join(f"{v:>{widths[n]},.1f}" for n, v in values)
                  + f"{cpu_rows['ours'][(tokens, connections)] - sansio:>11.1f}")

if __name__ == "__main__":
    main()
