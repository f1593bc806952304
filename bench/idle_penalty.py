"""What a halt costs the work after it: the same piece of Python work, timed after idle gaps of
several lengths, with idle CPUs halting (as this machine is configured) and kept polling
(`bench.procs.CpuAwake`, a PM QoS request of 0 us), in alternating rounds, pinned to one core.

Two pieces of work: `step`, a proxy step in miniature (parse a 1 kB JSON body, edit two keys,
encode it; ten times), whose data fits the L1 cache; and `wide`, the same plus 400 lookups at
random in a dict of 60,000 entries (several MB: a process's many objects, what an interpreter
walks through per request). A proxy at low load halts between every event (a request in, a leg's
answer, the next leg's answer), so the ratio is what its CPU per request and its added latency
carry at c=1 on such a machine (bench/overhead.py --awake measures the proxies both ways).

    sudo .venv/bin/python bench/idle_penalty.py [--reps 200] [--rounds 2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.procs import CpuAwake, cpu_idle  # noqa: E402

GAPS_MS = (0.0, 0.2, 0.5, 2.0, 5.0, 16.0)
BODY = orjson.dumps({"model": "m", "prompt": "benchmark prompt 3 " * 48, "max_tokens": 16, "stream": False})
WIDE = {i * 7919: str(i) for i in range(60_000)}
KEYS = [random.Random(1).randrange(60_000) * 7919 for _ in range(400)]


def step() -> None:
    for _ in range(10):
        d = orjson.loads(BODY)
        d["max_tokens"] = 1
        d["kv_transfer_params"] = {"do_remote_decode": True}
        orjson.dumps(d)


def wide() -> None:
    step()
    n = 0
    for k in KEYS:
        n += len(WIDE[k])


WORK = {"step": step, "wide": wide}


def measure(work: str, gap_ms: float, reps: int) -> tuple[list[float], list[float]]:
    """(wall us, this thread's CPU us) of `work` after each of `reps` sleeps of `gap_ms`."""
    fn = WORK[work]
    wall, cpu = [], []
    for _ in range(reps):
        if gap_ms:
            time.sleep(gap_ms / 1e3)
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        fn()
        t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        wall.append((t1 - t0) / 1e3)
        cpu.append((c1 - c0) / 1e3)
    return wall, cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=200, help="timed pieces of work per gap, mode and round")
    ap.add_argument("--rounds", type=int, default=2, help="rounds, each mode in turn")
    a = ap.parse_args()
    core = sorted(os.sched_getaffinity(0))[-1]
    os.sched_setaffinity(0, {core})
    idle = cpu_idle()
    print(f"core {core}; idle CPUs: {idle}")
    wide()
    cells = [(w, g) for w in WORK for g in GAPS_MS]
    got: dict[str, dict[tuple[str, float], tuple[list[float], list[float]]]] = {
        m: {c: ([], []) for c in cells} for m in ("halting", "awake")}
    for _ in range(a.rounds):
        for mode in ("halting", "awake"):
            aw = CpuAwake()
            with aw if mode == "awake" else contextlib.nullcontext():
                if mode == "awake" and not aw.held:
                    print(f"cannot hold the CPUs out of halting: {aw.why}")
                    return 2
                for cell in cells:
                    w, c = measure(*cell, a.reps)
                    got[mode][cell][0].extend(w)
                    got[mode][cell][1].extend(c)
    rows = []
    print(f"\n{'work':>5} {'gap ms':>7} | {'halting: wall us':>16} {'cpu us':>7} | {'awake: wall us':>14} "
          f"{'cpu us':>7} | {'halting / awake (cpu)':>21}")
    for cell in cells:
        hw, hc = (statistics.median(x) for x in got["halting"][cell])
        aw_, ac = (statistics.median(x) for x in got["awake"][cell])
        rows.append({"work": cell[0], "gap_ms": cell[1], "halting_wall_us": round(hw, 1),
                     "halting_cpu_us": round(hc, 1), "awake_wall_us": round(aw_, 1), "awake_cpu_us": round(ac, 1)})
        print(f"{cell[0]:>5} {cell[1]:7.1f} | {hw:16.1f} {hc:7.1f} | {aw_:14.1f} {ac:7.1f} | {hc / ac:21.2f}")
    out = ROOT / "bench" / "results" / f"idle-penalty-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"core": core, "cpu_idle": idle, "reps": a.reps, "rounds": a.rounds, "rows": rows},
                              indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
