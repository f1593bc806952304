"""Starting the processes a benchmark measures: wait for the line that says they are ready."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

_SCRIPT = Path(sys.executable).parent / "mesh"
# the `mesh` command: the console script, or `python -m mesh` where none is installed (a GPU machine)
MESH: list[str] = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "mesh"]


def start(args: list[str], until: str, timeout: float = 180) -> tuple[subprocess.Popen[str], list[str]]:
    """Start `args`; return the process and its stdout lines up to the first one starting with `until`."""
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
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
