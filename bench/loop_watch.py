"""Run `selection-proto` with a watchdog thread that reports where the event loop is held: every
`LOOP_WATCH_MS` (default 150) ms without the loop answering a ping, the main thread's stacks sampled
meanwhile are printed to stderr, most frequent first.

    python bench/loop_watch.py serve --port 0 ...      (bench/stalls.py --watch uses it)
"""

from __future__ import annotations

import asyncio
import collections
import os
import runpy
import sys
import threading
import time
import traceback

HELD_MS = float(os.environ.get("LOOP_WATCH_MS", "150"))
loops: list[asyncio.AbstractEventLoop] = []
_run_forever = asyncio.BaseEventLoop.run_forever


def run_forever(self: asyncio.BaseEventLoop) -> None:
    loops.append(self)
    _run_forever(self)


asyncio.BaseEventLoop.run_forever = run_forever  # type: ignore[method-assign]


def watch() -> None:
    main = threading.main_thread().ident
    while not loops:
        time.sleep(0.05)
    loop = loops[0]
    while True:
        answered = threading.Event()
        sent = time.perf_counter()
        try:
            loop.call_soon_threadsafe(answered.set)
        except RuntimeError:
            return
        samples: collections.Counter[str] = collections.Counter()
        while not answered.wait(0.01):
            frame = sys._current_frames().get(main)
            if frame is not None:
                samples["".join(traceback.format_stack(frame)[-6:])] += 1
        held = 1000 * (time.perf_counter() - sent)
        if held > HELD_MS:
            print(f"--- loop held {held:.0f} ms; {sum(samples.values())} samples", file=sys.stderr)
            for stack, n in samples.most_common(3):
                print(f"  [{n}]\n{stack}", file=sys.stderr)
        time.sleep(0.005)


threading.Thread(target=watch, daemon=True).start()
sys.argv = ["selection-proto", *sys.argv[1:]]
runpy.run_module("selection_proto", run_name="__main__")
