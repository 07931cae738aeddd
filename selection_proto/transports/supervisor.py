"""`serve --processes N`: N copies of `serve` on one port (SO_REUSEPORT), and on one picker port with
`--ext-proc-port`, each a process of its own, started again when it dies, stopped with the
supervisor's signal."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Final

from .logs import log

__all__ = ["PROCESS_INDEX", "SUPERVISOR", "supervise"]

PROCESS_INDEX: Final = "SELECTION_PROTO_PROCESS_INDEX"  # set in each process it starts
SUPERVISOR: Final = "SELECTION_PROTO_SUPERVISOR_PID"  # and the supervisor's pid


def _held_port(host: str) -> tuple[socket.socket, int]:
    """A port chosen once for every process: a bound socket that never listens keeps it ours."""
    holder = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    holder.bind((host, 0))
    return holder, int(holder.getsockname()[1])


def supervise(argv: Sequence[str], host: str, port: int, processes: int, ext_proc_port: int | None) -> int:
    """Run `processes` copies of `serve argv` until SIGTERM or SIGINT, which each gets; one that
    dies is started again after a second."""
    holders = []
    if port == 0:
        holder, port = _held_port(host)
        holders.append(holder)
    command = [sys.executable, "-m", "selection_proto", *argv, "--processes", "1", "--port", str(port)]
    if ext_proc_port == 0:  # the picker's port too: Envoy names one
        holder, ext_proc_port = _held_port(host)
        holders.append(holder)
        command += ["--ext-proc-port", str(ext_proc_port)]
    children: dict[int, subprocess.Popen[bytes]] = {}
    stopping: list[int] = []

    def start(index: int) -> None:
        # A session of its own: a terminal's Ctrl-C reaches the supervisor, which passes it on
        # once (twice would force the shutdown); each process stops when the supervisor dies.
        children[index] = subprocess.Popen(command, env={**os.environ, PROCESS_INDEX: str(index),
                                                          SUPERVISOR: str(os.getpid())}, start_new_session=True)

    def stop(signum: int, frame: object) -> None:
        stopping.append(signum)
        for child in children.values():
            if child.poll() is None:
                child.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for index in range(processes):
        start(index)
    log("info", "processes", count=processes, port=port, ext_proc_port=ext_proc_port)
    while True:
        time.sleep(0.1)
        if stopping:
            if all(child.poll() is not None for child in children.values()):
                break
            continue
        for index, child in list(children.items()):
            if child.poll() is not None:
                log("warning", "process_exited", index=index, code=child.returncode, restart_in_secs=1)
                time.sleep(1.0)
                if not stopping:
                    start(index)
    for holder in holders:
        holder.close()
    return max((abs(c.returncode or 0) for c in children.values()), default=0) if len(stopping) > 1 else 0
