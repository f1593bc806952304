"""`mesh demo` (what `make run` starts): a supervisor that generates a small checkpoint, starts
etcd, a PP=2 prefill pipeline and a TP=2 decode engine of the reference engine (each its own process
group), serves a mesh in front of them, and on Ctrl-C stops them in order (the workers drain and
withdraw, etcd stops last, its data folder goes). It composes both sides, so it belongs to neither:
registered with the `mesh` command through the `atomesh.commands` entry point."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from contract.clikit import Subcommands, port_free, run_until_stopped
from contract.errors import ConfigError
from contract.etcd import EtcdConfig
from mesh.cli import serve_until
from mesh.config import MeshConfig

DEMO_TEXT = """
Atomesh is up: a PD mesh on http://{host}:{port} in front of real workers on a small generated
Llama checkpoint ({registry}): one prefill pipeline of 2 stage processes and one decode engine of
2 tensor-parallel ranks, KV moved with {kv}. (Random weights: the text is noise, the plumbing is real.)
Try:

  curl -s http://{host}:{port}/v1/completions -H 'Content-Type: application/json' \\
       -d '{{"model": "tiny-llama", "prompt": "Hello, mesh", "max_tokens": 8}}'

  .venv/bin/python -c "import openai; c = openai.OpenAI(base_url='http://{host}:{port}/v1', api_key='none'); \\
print(c.chat.completions.create(model='tiny-llama', max_tokens=8, \\
messages=[{{'role': 'user', 'content': 'Hi'}}]).choices[0].message)"

Also: /v1/models  /workers  /kv/ledger  /ready  /metrics   (Ctrl-C stops everything){workers_line}
"""


def _child(args: list[str], until: str, timeout: float = 180) -> tuple[Any, str]:
    """Start a worker process and wait for its `until` line; returns (process, that line)."""
    import subprocess
    import time

    p = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert p.stdout is not None
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        line = p.stdout.readline()
        if not line:
            raise ConfigError(f"{' '.join(args[:2])} exited with {p.wait()}")
        if line.startswith(until):
            return p, line.strip()
    p.terminate()
    raise ConfigError(f"{' '.join(args[:2])} did not start within {timeout:.0f}s")


def cmd_demo(a: argparse.Namespace) -> None:
    import shutil
    import tempfile
    from pathlib import Path

    from workers.engine.checkpoint import generate, tiny_config, write_tokenizer

    port_free(a.host, a.port)   # before anything starts: a second `make run` says so and leaves
    run = Path(a.dir)
    ckpt = run / "tiny-llama"
    if not (ckpt / "tokenizer.json").exists():   # a checkpoint with a real tokenizer (older ones had none)
        print(f"generating a small checkpoint in {ckpt} ...", flush=True)
        vocab = write_tokenizer(ckpt, 4096)  # byte-level BPE trained on local text, with a chat template
        generate(ckpt, tiny_config(hidden_size=128, intermediate_size=256, num_hidden_layers=4, vocab_size=vocab,
                                   bos_token_id=1, eos_token_id=2), seed=0)
    kv = a.kv_backend   # zmq by default: the pinned Mooncake listens on every interface (docs/security.md)
    children: list[Any] = []
    etcd_url = None
    data = None
    try:
        etcd_bin = shutil.which("etcd")
        if etcd_bin:
            import socket
            import subprocess

            def free() -> int:
                with socket.socket() as so:
                    so.bind(("127.0.0.1", 0))
                    return so.getsockname()[1]

            cport, pport = free(), free()
            data = tempfile.mkdtemp(prefix="etcd-", dir=run)   # removed at exit: .run/ does not grow
            etcd_url = f"http://127.0.0.1:{cport}"
            peer = f"http://127.0.0.1:{pport}"
            children.append(subprocess.Popen(
                [etcd_bin, "--name", "demo", "--data-dir", data, "--listen-client-urls", etcd_url,
                 "--advertise-client-urls", etcd_url, "--listen-peer-urls", peer, "--initial-advertise-peer-urls",
                 peer, "--initial-cluster", f"demo={peer}", "--log-level", "error"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        me = [sys.executable, "-m", "mesh", "--log-level", "WARNING"]
        common = ["--checkpoint", str(ckpt), "--model", "tiny-llama", "--kv-backend", kv, "--host", a.host]
        if etcd_url:
            common += ["--etcd", etcd_url]
        print("starting a PP=2 prefill pipeline and a TP=2 decode engine ...", flush=True)
        p, pline = _child([*me, "prefill", *common, "--pp-size", "2"], "prefill ")
        children.append(p)
        d, dline = _child([*me, "decode", *common, "--tp-size", "2"], "decode ")
        children.append(d)
        if etcd_url:
            cfg = MeshConfig(host=a.host, port=a.port, etcd=EtcdConfig.from_url(etcd_url))
            registry = f"registered in etcd at {etcd_url}"
        else:
            from mesh.config import make_worker

            cfg = MeshConfig(host=a.host, port=a.port,
                             prefill=(make_worker("prefill", {"url": pline.split()[1], "model": "tiny-llama"}, 0),),
                             decode=(make_worker("decode", {"url": dline.split()[1], "model": "tiny-llama",
                                                            "tp_size": 2}, 0),))
            registry = "static registry: no etcd binary found"
        wl = f"\nThe fleet as etcd has it:  .venv/bin/mesh workers --etcd {etcd_url}" if etcd_url else ""
        text = DEMO_TEXT.replace("{registry}", registry).replace("{kv}", kv).replace("{workers_line}", wl)
        run_until_stopped(lambda stop: serve_until(cfg, stop, announce=text))
    finally:
        # in order: the decode and the prefill drain and withdraw from etcd, then etcd stops (the
        # children run in their own sessions: a Ctrl-C reaches only this process, which stops them)
        for c in children[::-1]:
            if c.poll() is None:
                c.terminate()
            try:
                c.wait(15)
            except Exception:  # noqa: BLE001 - last resort for a child that ignores SIGTERM
                c.kill()
        if data is not None:
            shutil.rmtree(data, ignore_errors=True)


def add_commands(sub: Subcommands) -> None:
    d = sub.add("demo", "a mesh over real local workers, with a curl line to try (make run)",
                "mesh demo --port 8000 --kv-backend zmq")
    d.add_argument("--host", default="127.0.0.1", help="address every listener of the demo binds")
    d.add_argument("--port", type=int, default=8000, help="the mesh's port")
    d.add_argument("--dir", default=".run", help="where the checkpoint and etcd data live")
    d.add_argument("--kv-backend", default="zmq", choices=["zmq", "mooncake"],
                   help="how KV moves between the workers (mooncake's ports listen on every interface with the "
                   "pinned mooncake-transfer-engine, whatever --host says)")
    d.set_defaults(func=cmd_demo)
