"""Where a serving decode worker's time goes: one `mesh decode` (the monolithic engine of
bench/e2e.py) measured with the load generator, once as started by default and once with one
intra-op thread (`OMP_NUM_THREADS=1`), each while py-spy samples every thread of the worker
(`--idle`: waits included). Prints TTFT / TPOT per setting; py-spy's raw stacks go to `--out`.

    python3 bench/serve_profile.py --device cuda --dtype bfloat16 --size large --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.e2e import measure  # noqa: E402
from bench.engine import SIZES  # noqa: E402
from bench.procs import MESH, start  # noqa: E402
from workers.engine.checkpoint import generate, tiny_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--kv-backend", default="zmq")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=8.0, help="py-spy's sampling time per setting")
    ap.add_argument("--settings", default="default,omp1", help="which of: default, omp1")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args()
    import torch

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix="atomesh-prof-")) / "bench-llama"
    generate(d, tiny_config(**SIZES[a.size]), seed=0, dtype=getattr(torch, a.dtype))
    spy = shutil.which("py-spy")
    res = {"cpus": os.cpu_count(), "torch_threads_default": torch.get_num_threads(), "rows": []}
    settings = {"default": {}, "omp1": {"OMP_NUM_THREADS": "1"}}
    for name in a.settings.split(","):
        env = settings[name]
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            p, lines = start([*MESH, "decode", "--checkpoint", str(d), "--num-blocks", "2048", "--max-batch-tokens",
                              "2048", "--dtype", a.dtype, "--kv-backend", a.kv_backend, "--device", a.device,
                              "--tp-size", "1"], "decode ")
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        url = lines[-1].split()[1]
        try:
            measure(url, 2, a.prompt_len, a.new_tokens, 1)   # warm-up (graphs, compile)
            rec = None
            if spy:
                rec = subprocess.Popen([spy, "record", "-p", str(p.pid), "--idle", "--threads", "-r", "200", "-d",
                                        str(int(a.seconds)), "-f", "raw", "-o", str(out / f"spy-{name}.txt")],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            r = measure(url, a.requests, a.prompt_len, a.new_tokens, 1)
            if rec is not None:
                rec.wait(60)
            row = {"setting": name, **r}
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
        finally:
            p.terminate()
            p.wait(30)
    (out / "serve-profile.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
