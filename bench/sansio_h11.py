"""Our Sans-IO HTTP connection (`HttpConnection` and `handle`) on the bare h11 server's loop:
no timeouts, no send lock, no output pump, no metrics of the transport. Side by side with
`ours` and `bare_h11` in `http_load.py`, it splits a request's cost into h11 on anyio (bare), the
Sans-IO work (this row) and our transport's own machinery (`ours` minus this row).

    python bench/sansio_h11.py PORT
"""

from __future__ import annotations

import random
import sys
import time

import anyio
import anyio.abc

from selection_proto import SelectionService, Settings
from selection_proto.adapters.http import HttpConnection

CHUNK = 65536


def main(port: int) -> None:
    service = SelectionService(Settings(kv_events="push"), random.Random(0))

    async def client(stream: anyio.abc.SocketStream) -> None:
        conn = HttpConnection(service, time.monotonic)
        async with stream:
            while not conn.closed:
                try:
                    data = await stream.receive(CHUNK)
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    data = b""
                conn.receive_data(data)
                while out := conn.data_to_send():
                    await stream.send(out)
                if not data:
                    return

    async def serve() -> None:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=port)
        await listener.serve(client)

    anyio.run(serve)


if __name__ == "__main__":
    main(int(sys.argv[1]))
