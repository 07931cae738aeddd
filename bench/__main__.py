"""`python -m bench all [--reference-python PY]`: every benchmark, in one run.

Sub-commands: core (in-process select and hashing), index (lookup latency, memory), events,
http (wrk against ours, the reference and bare h11), path (one request's phases in process),
jsonl, trace, all.
"""

from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = {"core": "run.py", "index": "index.py", "events": "events.py", "http": "http_load.py",
           "path": "request_path.py", "jsonl": "jsonl_load.py", "trace": "trace.py"}
TAKES_REFERENCE = {"core", "index", "events", "http"}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in (*SCRIPTS, "all"):
        print(__doc__)
        return 2
    names = list(SCRIPTS) if argv[0] == "all" else [argv[0]]
    extra = argv[1:]
    for name in names:
        print(f"== {name} ==", flush=True)
        args = extra if name in TAKES_REFERENCE else [a for a in extra if not a.startswith("--reference-python")]
        if name not in TAKES_REFERENCE and "--reference-python" in extra:
            i = extra.index("--reference-python")
            args = extra[:i] + extra[i + 2:]
        result = subprocess.run([sys.executable, os.path.join(HERE, SCRIPTS[name]), *args])
        if result.returncode != 0:
            return result.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
