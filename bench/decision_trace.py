"""Run `selection-proto` recording where each of the endpoint picker's decisions spends its time,
for bench/gateway.py's `--trace FILE` (docs/PERFORMANCE.md, "The picker's long tail"):

    python bench/decision_trace.py FILE serve --ext-proc-port ... (as `python -m selection_proto`)

On the event loop's thread, with the wall clock and the thread's CPU time (a stretch whose CPU
is near its wall time is work; one whose CPU is low waited: for a core, a lock, a peer), it
records each `ExternalProcessor` message handled (which message, from the first byte of its
protobuf), each write to Envoy, each return from the loop's epoll wait (with the thread's
context switches so far: it blocked, or was preempted), and each pass of the cyclic collector (gc.callbacks, any thread); at exit, the heap's size and what a full pass of
the collector over it costs. FILE gets one JSON line a record when serve exits; `report`
joins them to the decisions in Envoy's access log."""

from __future__ import annotations

import atexit
import gc
import itertools
import json
import os
import runpy
import selectors
import sys
import threading
import time

MAIN = threading.get_ident()
clock, cpu = time.perf_counter, time.thread_time
records: list[tuple[object, ...]] = []
STATUS = "/proc/thread-self/status"
_status = -1  # the loop thread's STATUS, opened by that thread (/proc/thread-self resolves then)


def switches() -> tuple[int, int]:
    """The loop thread's context switches so far: voluntary (it blocked: epoll, a lock, the GIL)
    and not (the kernel gave its core to another thread)."""
    lines = os.pread(_status, 4096, 0).splitlines()
    counts = dict(line.split(b":") for line in lines if line.endswith(b"ctxt_switches", 0, line.find(b":")))
    return int(counts[b"voluntary_ctxt_switches"]), int(counts[b"nonvoluntary_ctxt_switches"])


def on_gc(phase: str, info: dict[str, int]) -> None:
    records.append(("gc", phase, info["generation"], clock(), cpu(), threading.get_ident() == MAIN,
                    info.get("collected", 0)))


_select = selectors.EpollSelector.select


def select(self: selectors.EpollSelector, timeout: float | None = None) -> list[tuple[object, int]]:
    if threading.get_ident() != MAIN:
        return _select(self, timeout)
    start, started = clock(), cpu()
    ready = _select(self, timeout)
    records.append(("wake", start, clock(), started, cpu(), len(ready), *switches()))
    return ready


KINDS = {0x12: "request_headers", 0x1a: "response_headers", 0x22: "request_body", 0x2a: "response_body",
         0x32: "request_trailers", 0x3a: "response_trailers"}


def patch() -> None:
    from selection_proto.transports import ext_proc, ext_proc_calls

    message = ext_proc_calls.ProcessHandler.message

    def traced(self: ext_proc_calls.ProcessHandler, payload: bytes) -> object:
        start, started = clock(), cpu()
        out = message(self, payload)
        stream = self.stream
        routed = stream is not None and stream.past_body and not getattr(self, "traced_routed", False)
        if routed:
            self.traced_routed = True  # type: ignore[attr-defined]
        records.append(("msg", id(self), KINDS.get(payload[0] if payload else 0, "?"), start, clock(),
                        cpu() - started, routed))
        return out

    ext_proc_calls.ProcessHandler.message = traced  # type: ignore[method-assign]
    from selection_proto.adapters import openai

    encode = openai.ChatTokenizer._encode

    def traced_encode(self: openai.ChatTokenizer, text: str, add_special_tokens: bool) -> list[int]:
        start, started = clock(), cpu()
        out = encode(self, text, add_special_tokens)
        if threading.get_ident() == MAIN:
            records.append(("tokenize", start, clock(), cpu() - started))
        return out

    openai.ChatTokenizer._encode = traced_encode  # type: ignore[method-assign]
    flush = ext_proc._Connection.flush

    async def traced_flush(self: ext_proc._Connection) -> None:
        await flush(self)
        records.append(("flush", clock(), cpu(), *switches()))

    ext_proc._Connection.flush = traced_flush  # type: ignore[method-assign]


def dump(path: str) -> None:
    # What a full pass of the collector would cost the loop here (CPU), over the heap it has now.
    gc.callbacks.remove(on_gc)
    tracked, started = len(gc.get_objects()), cpu()
    gc.collect()
    records.append(("heap", tracked, (cpu() - started) * 1000, [s["collections"] for s in gc.get_stats()]))
    with open(path, "w") as fh:
        for record in records:
            fh.write(json.dumps(record) + "\n")


def report(path: str, decisions: list[float]) -> str:
    """Each decision Envoy logged (ms, in order) beside the picker's own records of it: the
    median and the slowest 1%, then the loop's longest turns and the collector's passes."""
    import bisect

    with open(path) as fh:
        rows = [json.loads(line) for line in fh]
    wakes = [r for r in rows if r[0] == "wake"]
    flushes = [r for r in rows if r[0] == "flush"]
    gcs = [r for r in rows if r[0] == "gc"]
    routed = [r for r in rows if r[0] == "msg" and r[6]]
    if len(routed) != len(decisions):
        return f"{len(routed)} decisions traced against {len(decisions)} logged: not joined"
    wake_ends, flush_times = [w[2] for w in wakes], [f[1] for f in flushes]
    gc_pairs = [(a[3], b[3], a[2]) for a, b in itertools.pairwise(gcs) if a[1] == "start" and b[1] == "stop"]
    out = []
    for decision, (_, _, _, start, end, msg_cpu, _) in zip(decisions, routed, strict=True):
        wake = wakes[max(0, bisect.bisect_right(wake_ends, start) - 1)]  # the loop's turn it came in
        flushed = flushes[min(len(flushes) - 1, bisect.bisect_left(flush_times, end))]  # its answer written
        window = [g for g in gc_pairs if g[1] >= wake[2] and g[0] <= flushed[1]]
        out.append((decision, (flushed[1] - wake[2]) * 1000, (flushed[2] - wake[4]) * 1000,
                    flushed[3] - wake[6], flushed[4] - wake[7], (end - start) * 1000, msg_cpu * 1000,
                    sum(g[1] - g[0] for g in window) * 1000))
    out.sort()
    lines = ["Envoy's ms | picker, from the loop's wake to the answer written: wall / CPU ms, its thread's"
             " switches blocked / preempted | the body's message: wall / CPU | collector ms"]
    for envoy, wall, used, blocked, preempted, msg, msg_cpu, collector in [
            out[len(out) // 2], *out[-max(1, len(out) // 100):]]:
        lines.append(f"{envoy:6.0f} | {wall:7.2f} / {used:5.2f}, {blocked} / {preempted} | {msg:6.2f} / {msg_cpu:5.2f}"
                     f" | {collector:5.2f}")
    lines.append(f"all decisions' windows: {sum(o[3] for o in out)} switches blocked,"
                 f" {sum(o[4] for o in out)} preempted")
    tokenized = [r for r in rows if r[0] == "tokenize"]
    bodies = [r for r in rows if r[0] == "msg" and r[2] == "request_body"]
    in_tokenizer = sum(max(0.0, r[2] - r[1] - r[3]) for r in tokenized) * 1000
    in_bodies = sum(max(0.0, r[4] - r[3] - r[5]) for r in bodies) * 1000
    lines.append(f"request bodies' messages: {in_bodies:.0f} ms of wall beyond their CPU over the run,"
                 f" {in_tokenizer:.0f} of it while tokenizing ({sum(r[3] for r in tokenized) * 1000:.0f} of their"
                 f" {sum(r[5] for r in bodies) * 1000:.0f} ms of CPU)")
    serving = routed[0][3]
    turns = sorted(((b[1] - a[2]) * 1000, (b[3] - a[4]) * 1000) for a, b in itertools.pairwise(wakes) if a[2] >= serving)
    lines.append("the loop's longest turns while serving, wall / CPU ms: " + ", ".join(f"{w:.1f} / {c:.1f}" for w, c in turns[-5:]))
    lines.append(f"collector passes while serving: {sum(1 for g in gc_pairs if g[0] >= serving)}"
                 f" ({sum(1 for g in gc_pairs if g[0] >= serving and g[2] == 2)} of generation 2)")
    heap = [r for r in rows if r[0] == "heap"]
    if heap:
        lines.append(f"at exit: {heap[0][1]:,} objects tracked; a full pass over them {heap[0][2]:.0f} ms of CPU")
    return "\n".join(lines)


if __name__ == "__main__":
    _status = os.open(STATUS, os.O_RDONLY)
    gc.callbacks.append(on_gc)
    selectors.EpollSelector.select = select  # type: ignore[method-assign]
    patch()
    atexit.register(dump, sys.argv[1])
    sys.argv = ["selection-proto", *sys.argv[2:]]
    runpy.run_module("selection_proto", run_name="__main__")
