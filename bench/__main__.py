"""`python -m bench all [--reference-python PY] [--rounds N] [--seconds N]`: every benchmark, in one run.

Sub-commands: core (in-process select and hashing), index (lookup latency, memory), events,
http (wrk against ours, the reference, bare h11 and our Sans-IO connection on its loop), path
(one request's phases in process), jsonl, simulate, booking (one huge booking and its expiry), all. One sub-command passes its flags on as
given; `all` passes each script the flags it takes (`--rounds` to core and http, `--seconds` to
http, `--reference-python` to those compared with the reference).
"""

from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = {"core": "run.py", "index": "index.py", "events": "events.py", "http": "http_load.py",
           "path": "request_path.py", "jsonl": "jsonl_load.py", "simulate": "simulate.py", "booking": "booking.py"}
TAKES = {"core": {"--reference-python", "--rounds"}, "index": {"--reference-python"},
         "events": {"--reference-python"}, "http": {"--reference-python", "--rounds", "--seconds"}}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in (*SCRIPTS, "all"):
        print(__doc__)
        return 2
    extra = argv[1:]
    if argv[0] != "all":
        return subprocess.run([sys.executable, os.path.join(HERE, SCRIPTS[argv[0]]), *extra]).returncode
    if len(extra) % 2 or any(flag not in {"--reference-python", "--rounds", "--seconds"} for flag in extra[::2]):
        print(__doc__)
        return 2
    flags = dict(zip(extra[::2], extra[1::2], strict=True))
    for name, script in SCRIPTS.items():
        print(f"== {name} ==", flush=True)
        args = [part for flag, value in flags.items() if flag in TAKES.get(name, ()) for part in (flag, value)]
        result = subprocess.run([sys.executable, os.path.join(HERE, script), *args])
        if result.returncode != 0:
            return result.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
