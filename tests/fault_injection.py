"""Run the `selection-proto` command with one component made to raise, to prove that the failure
stays inside its request, connection, stream, task or call:

    python tests/fault_injection.py FAULT serve --port 0 ...

FAULT names the component (see FAULTS). Used by tests/test_isolation.py as a real subprocess."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from selection_proto import cli
from selection_proto.adapters.ext_proc import ExtProcStream
from selection_proto.adapters.http import HttpConnection
from selection_proto.adapters.jsonl import JsonRpcSession
from selection_proto.adapters.ws import PushSession
from selection_proto.core.routing.selection import Selector
from selection_proto.core.service import SelectionService
from selection_proto.transports.subscriber import Subscriptions


class InjectedFault(RuntimeError):
    pass


def _raising(name: str, when: Callable[..., bool] = lambda *a, **k: True) -> Callable[..., Any]:
    def patch(owner: Any, attr: str) -> None:
        original = getattr(owner, attr)

        def raising(*args: Any, **kwargs: Any) -> Any:
            if when(*args, **kwargs):
                raise InjectedFault(f"injected fault in {name}")
            return original(*args, **kwargs)

        setattr(owner, attr, raising)
    return patch


def _select_on_model(model: str) -> Callable[..., bool]:
    return lambda self, req, **kw: getattr(req, "model_name", None) == model


FAULTS: dict[str, Callable[[], None]] = {
    # the core's typed method behind /select, for the model "boom" only
    "handle": lambda: _raising("select", _select_on_model("boom"))(SelectionService, "select"),
    # the HTTP adapter, for requests to /boom only
    "http": lambda: _raising("http", lambda self: self._request is not None
                             and self._request.target.startswith(b"/boom"))(HttpConnection, "_finish"),
    # every WebSocket message of a push stream
    "websocket": lambda: _raising("websocket")(PushSession, "_message"),
    # every timer tick
    "timer": lambda: _raising("timer")(SelectionService, "tick"),
    # every outbound WebSocket subscription
    "subscription": lambda: _raising("subscription")(Subscriptions, "_websocket"),
    # the JSON-RPC dispatch of the method "loads" only
    "jsonrpc": lambda: _raising("jsonrpc", lambda self, rid, answer, method, *a: method == "loads")(
        JsonRpcSession, "_call"),
    # queue dispatch: a queued selection fails when it is finally run (not when run at once)
    "dispatch": lambda: _raising("dispatch", lambda self, *a: self._dispatching)(
        Selector, "_finish"),
    # the endpoint picker's booking of a request body that names the model "boom" (small bodies
    # are booked in the connection's reader, large ones in a task of their own)
    "ext_proc": lambda: _raising("ext_proc", lambda self, prepared, now: getattr(prepared, "value", {}).get(
        "model_name") == "boom")(ExtProcStream, "route_prepared"),
}

if __name__ == "__main__":
    FAULTS[sys.argv[1]]()
    sys.exit(cli.main(sys.argv[2:]))
