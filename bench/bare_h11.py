"""The ceiling: a bare h11 server on anyio that answers every request `200 {}`."""

from __future__ import annotations

import sys

import anyio
import anyio.abc
import h11


async def client(stream: anyio.abc.SocketStream) -> None:
    conn = h11.Connection(h11.SERVER)
    async with stream:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                try:
                    data = await stream.receive(65536)
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    return
                conn.receive_data(data)
                continue
            if isinstance(event, h11.EndOfMessage):
                out = conn.send(h11.Response(status_code=200, headers=[("content-type", "application/json"),
                                                                        ("content-length", "2")]))
                out += conn.send(h11.Data(data=b"{}")) + conn.send(h11.EndOfMessage())
                await stream.send(out)
                conn.start_next_cycle()
            elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                return


async def main(port: int) -> None:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=port)
    print("ready", flush=True)
    await listener.serve(client)


if __name__ == "__main__":
    anyio.run(main, int(sys.argv[1]))
