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


def fleet_num_blocks(prompt_bytes: int) -> int:
    """The mock fleet's pool for prompts of `prompt_bytes` (one token a byte, 16 to a block): room
    for 8 such prompts at once, and never under 4096 blocks."""
    return max(4096, 8 * prompt_bytes // 16)


def fleet_blocks(prompt_bytes: int) -> list[str]:
    """`mesh mock-fleet`'s arguments for that pool."""
    return ["--num-blocks", str(fleet_num_blocks(prompt_bytes))]


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


class Syscalls:
    """The system calls a set of processes makes between `start` and `stop`, counted by `perf stat`
    on the kernel's syscall tracepoints (no sampling, no slowdown worth the name; strace would slow
    them several-fold and change what it counts). Where `perf` is missing or not allowed
    (`kernel.perf_event_paranoid`, no tracefs), `available()` is False and nothing is counted.

    Grouped as a proxy's work per request: `reads` (read, recvfrom, recvmsg), `writes` (write,
    writev, sendto, sendmsg), `waits` (epoll_wait, epoll_pwait: the loop going to the kernel for
    events, once per wake-up)."""

    GROUPS = {"reads": ("read", "recvfrom", "recvmsg"), "writes": ("write", "writev", "sendto", "sendmsg"),
              "waits": ("epoll_wait", "epoll_pwait")}

    def __init__(self, pids: list[int], out: Path) -> None:
        self.pids, self.out = pids, out
        self.p: subprocess.Popen[bytes] | None = None

    @staticmethod
    def available() -> bool:
        import shutil

        if shutil.which("perf") is None:
            return False
        r = subprocess.run(["perf", "stat", "-x,", "-e", "syscalls:sys_enter_read", "true"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        return r.returncode == 0 and "<not" not in r.stderr

    def start(self) -> None:
        ev = [f"syscalls:sys_enter_{n}" for names in self.GROUPS.values() for n in names]
        self.p = subprocess.Popen(["perf", "stat", "-x,", "-o", str(self.out), "-e", ",".join(ev),
                                   "-p", ",".join(str(p) for p in self.pids)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.3)   # perf attaches

    def stop(self) -> dict[str, int]:
        """The counts by group (perf is stopped by SIGINT, as at a terminal, to print them)."""
        import signal

        assert self.p is not None
        self.p.send_signal(signal.SIGINT)
        self.p.wait(30)
        return self.parse(self.out.read_text())

    @classmethod
    def parse(cls, csv: str) -> dict[str, int]:
        """`perf stat -x,` output (`count,unit,event,...`; `<not counted>` where it could not count)
        summed by group."""
        counts = {g: 0 for g in cls.GROUPS}
        for line in csv.splitlines():
            parts = line.split(",")
            if len(parts) < 3 or not parts[0].strip().isdigit():
                continue
            name = parts[2].removeprefix("syscalls:sys_enter_")
            for g, names in cls.GROUPS.items():
                if name in names:
                    counts[g] += int(parts[0])
        return counts


class CpuAwake:
    """Hold the CPUs out of their halting idle state while a benchmark runs: a PM QoS request of 0 us
    CPU latency (`/dev/cpu_dma_latency`, held open), the request `tuned`'s latency-performance
    profile and `cyclictest` make. An idle CPU then polls instead of halting.

    Why a benchmark may want it: on this KVM guest (cpuidle driver `haltpoll` with
    `guest_halt_poll_ns` 0) an idle vCPU halts at once, and the work it does after a halt of a few
    ms runs 1.2-2.8x slower than the same work back to back (`bench/idle_penalty.py`, charged as
    the process's CPU time). A proxy at low load halts between every event, so its CPU per
    request and its added latency then measure the halts as much as its own code. The polling is
    idle time: it is no process's CPU time.

    Needs write access to the device (root). `held` says whether the request is in force; `why`,
    where it is not, says why."""

    DEVICE = "/dev/cpu_dma_latency"

    def __init__(self) -> None:
        self.fd: int | None = None
        self.held = False
        self.why = ""

    def __enter__(self) -> "CpuAwake":
        import struct

        try:
            self.fd = os.open(self.DEVICE, os.O_WRONLY)
            os.write(self.fd, struct.pack("i", 0))
            self.held = True
        except OSError as e:
            self.why = f"{self.DEVICE}: {e.strerror or e}"
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)   # the request ends when its file is closed
            self.fd = None
        self.held = False


def cpu_idle() -> dict[str, Any]:
    """What an idle CPU does here: the cpuidle driver and governor, and the guest's halt-polling
    window (KVM's haltpoll driver), where these exist. (Whether a PM QoS request is held cannot be
    read back: the caller says whether it holds one.)"""
    base = Path("/sys/devices/system/cpu/cpuidle")

    def read(p: Path) -> str | None:
        try:
            return p.read_text().strip()
        except OSError:
            return None

    out: dict[str, Any] = {"driver": read(base / "current_driver"), "governor": read(base / "current_governor_ro")
                           or read(base / "current_governor")}
    poll = read(Path("/sys/module/haltpoll/parameters/guest_halt_poll_ns"))
    if poll is not None:
        out["guest_halt_poll_ns"] = int(poll)
    return out
