"""Starting the processes a benchmark measures: wait for the line that says they are ready."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_SCRIPT = Path(sys.executable).parent / "mesh"
# the `mesh` command: the console script, or `python -m mesh` where none is installed (a GPU machine)
MESH: list[str] = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "mesh"]


# where the started processes' stderr goes (one file each); unset: nowhere. A device call sets it
# under $OUT so that a worker's traceback comes back with the results.
LOG_DIR_ENV = "ATOMESH_BENCH_LOGS"
_started = 0


def start(args: list[str], until: str, timeout: float = 180) -> tuple[subprocess.Popen[str], list[str]]:
    """Start `args`; return the process and its stdout lines up to the first one starting with `until`."""
    global _started
    err: Any = subprocess.DEVNULL
    logs = os.environ.get(LOG_DIR_ENV)
    if logs:
        _started += 1
        role = next((a for a in args if a in ("prefill", "decode", "stage", "serve", "mock-fleet")), "proc")
        Path(logs).mkdir(parents=True, exist_ok=True)
        err = open(Path(logs) / f"{_started:02d}-{role}.log", "w")  # noqa: SIM115 - the child holds it
    try:
        p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, text=True)
    finally:
        if err is not subprocess.DEVNULL:
            err.close()   # the child has its own descriptor
    lines: list[str] = []
    assert p.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"{' '.join(args[:2])} exited early: {lines}")
        lines.append(line.strip())
        if line.startswith(until):
            return p, lines
    p.terminate()
    raise RuntimeError(f"{' '.join(args[:2])} not ready within {timeout:.0f}s")
