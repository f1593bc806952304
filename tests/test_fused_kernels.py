"""The fused element-wise kernels (workers/engine/fused.py, Triton) checked on the CPU under
Triton's interpreter, in a process of their own (the interpreter is chosen when a kernel is
defined): each against the eager torch code it replaces in `workers.engine.model`, on random
inputs (`bench.kernel_checks.fused_vs_eager`, which bench/gpu_check.py runs on the GPU), float32
and float16 (float16 as the working dtype checks that each rounds where the eager
code rounds: equal to its last bit but for float32 summation order); with the paged pool's
layout, slots in any block and position, and padded-out GQA heads. The whole engine through them
is checked against HF `transformers` by tests/test_paged_attention.py (same interpreter). On a GPU
the same kernels run compiled (bench/gpu_check.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parent.parent

SCRIPT = r"""
import torch
from bench.kernel_checks import fused_vs_eager
from workers.engine import fused
assert fused.usable("cpu", 16) and not fused.usable("cpu", 24)
print(fused_vs_eager("cpu", (torch.float32, torch.float16)))
print("fused ok")
"""


def test_the_fused_kernels_under_the_interpreter(tmp_path: Path) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", SCRIPT], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "fused ok" in r.stdout
