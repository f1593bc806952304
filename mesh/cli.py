"""`mesh` command line: serve | mock-fleet | demo.

argparse lives here and only here: it builds the frozen configs and hands them over.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import Any, Awaitable, Callable

from mesh.admission import AdmissionConfig
from mesh.config import MeshConfig, Timeouts, load_toml, workers_from
from mesh.dialects import DIALECTS, SGLANG, VLLM_MOONCAKE
from mesh.errors import ConfigError
from mesh.etcd import EtcdConfig
from mesh.protocol import CAPABILITIES
from mesh.request import Limits

log = logging.getLogger("mesh")


def _run(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run `main(stop)` on uvloop when installed; SIGTERM / SIGINT set `stop`."""
    try:
        import uvloop
        factory: Any = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        factory = None

    async def wrapper() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(wrapper())


# -- etcd options (serve, register, workers, mock-fleet) ------------------------------------

def add_etcd_options(p: argparse.ArgumentParser, required: bool = False) -> None:
    g = p.add_argument_group("etcd")
    g.add_argument("--etcd", required=required, metavar="URL[,URL]", help="etcd endpoint(s)")
    g.add_argument("--etcd-prefix", default="/atomesh/v1")
    g.add_argument("--cluster", default="default", help="cluster name under the prefix")
    g.add_argument("--etcd-user", default=os.environ.get("ATOMESH_ETCD_USER"))
    g.add_argument("--etcd-password", default=os.environ.get("ATOMESH_ETCD_PASSWORD"),
                   help="or ATOMESH_ETCD_PASSWORD (keeps it out of the process list)")
    g.add_argument("--etcd-ca", help="CA bundle for TLS to etcd")
    g.add_argument("--etcd-cert", help="client certificate for TLS to etcd")
    g.add_argument("--etcd-key", help="client key for TLS to etcd")


def etcd_config(a: argparse.Namespace) -> EtcdConfig:
    return EtcdConfig.from_url(a.etcd, prefix=a.etcd_prefix, cluster=a.cluster, username=a.etcd_user,
                               password=a.etcd_password, ca_file=a.etcd_ca, cert_file=a.etcd_cert,
                               key_file=a.etcd_key)


def api_keys(a: argparse.Namespace) -> tuple[str, ...]:
    """Client API keys: one per line of --api-key-file, and/or ATOMESH_API_KEYS (comma separated)."""
    keys = [k.strip() for k in os.environ.get("ATOMESH_API_KEYS", "").split(",") if k.strip()]
    if a.api_key_file:
        try:
            with open(a.api_key_file) as f:
                keys += [line.strip() for line in f if line.strip() and not line.startswith("#")]
        except OSError as e:
            raise ConfigError(f"--api-key-file: {e}") from None
    return tuple(keys)


# -- serve ----------------------------------------------------------------------------------

def build_config(a: argparse.Namespace) -> MeshConfig:
    doc = load_toml(a.config) if a.config else {}
    m = doc.get("mesh", {})
    if not isinstance(m, dict):
        raise ConfigError("[mesh] must be a table")
    ws = workers_from(doc, a.prefill or [], a.decode or [], a.worker or [])
    to = Timeouts(**m.get("timeouts", {})) if isinstance(m.get("timeouts"), dict) else Timeouts()
    lim = Limits(**m.get("limits", {})) if isinstance(m.get("limits"), dict) else Limits()

    def pick(flag: Any, key: str, default: Any) -> Any:
        return flag if flag is not None else m.get(key, default)

    try:
        return MeshConfig(
            host=a.host, port=a.port, prefill=ws["prefill"], decode=ws["decode"], workers=ws["worker"],
            etcd=etcd_config(a) if a.etcd else None, registry_ttl=a.ttl,
            advertise_url=a.advertise_url or "", admin_token=a.admin_token or os.environ.get("ATOMESH_ADMIN_TOKEN"),
            prefill_policy=pick(a.prefill_policy, "prefill_policy", "cache_aware"),
            decode_policy=pick(a.decode_policy, "decode_policy", "least_loaded"),
            worker_policy=pick(a.worker_policy, "worker_policy", "least_loaded"),
            policy_options=m.get("policy_options", {}),
            decode_retries=pick(a.decode_retries, "decode_retries", 1),
            session_header=m.get("session_header", "X-Session-Id"),
            health_interval=pick(a.health_interval, "health_interval", 2.0),
            unhealthy_after=m.get("unhealthy_after", 2), timeouts=to, limits=lim,
            mesh_id=pick(a.mesh_id, "mesh_id", ""), ledger_grace=pick(a.ledger_grace, "ledger_grace", 5.0),
            ledger_interval=pick(a.ledger_interval, "ledger_interval", 0.5),
            kv_leak_after=pick(a.kv_leak_after, "kv_leak_after", 120.0),
            first_token_early=not a.no_first_token_early and m.get("first_token_early", True),
            admission=AdmissionConfig(max_concurrency=pick(a.max_concurrency, "max_concurrency", 0),
                                      max_queue=pick(a.max_queue, "max_queue", 256),
                                      queue_timeout=pick(a.queue_timeout, "queue_timeout", 5.0),
                                      per_key_concurrency=pick(a.per_key_concurrency, "per_key_concurrency", 0)),
            api_keys=api_keys(a), forward_client_auth=a.forward_client_auth or m.get("forward_client_auth", False))
    except TypeError as e:
        raise ConfigError(f"[mesh]: {e}") from None


def _opaque(role: str, url: str) -> str:
    """A default worker id that is not its address (ids show in /metrics and logs)."""
    import hashlib

    return f"{role}-{hashlib.sha256(url.encode()).hexdigest()[:12]}"


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


async def _serve(cfg: MeshConfig, stop: asyncio.Event, announce: str | None = None) -> None:
    from mesh.app import bound_port, create_app, start_site

    if not (cfg.prefill or cfg.decode or cfg.workers or cfg.etcd):
        raise ConfigError("no workers: give --prefill/--decode (PD), --worker (regular), --config or --etcd")
    _port_free(cfg.host, cfg.port)
    if not _loopback(cfg.host) and not cfg.admin_token:
        log.warning("mesh serves on %s without an admin token: /workers, /kv/ledger and the dashboard map every "
                    "worker to anyone who can reach it; set --admin-token or ATOMESH_ADMIN_TOKEN (docs/security.md)",
                    cfg.host)
    runner = await start_site(create_app(cfg), cfg.host, cfg.port)
    port = bound_port(runner)
    log.info("mesh listening on http://%s:%d (%s mode)", cfg.host, port, "PD" if cfg.pd else "regular")
    print(f"mesh http://{cfg.host}:{port}", flush=True)
    if announce:
        print(announce.format(host=cfg.host, port=port), flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def cmd_serve(a: argparse.Namespace) -> None:
    cfg = build_config(a)
    if a.otel:
        try:
            from mesh.tracing import setup_sdk

            setup_sdk()
        except ImportError as e:
            raise ConfigError(f"--otel needs opentelemetry-sdk (and the exporter OTEL_TRACES_EXPORTER names): "
                              f"{e}") from None
    _run(lambda stop: _serve(cfg, stop))


# -- mock-fleet -----------------------------------------------------------------------------

def _fleet_spec(a: argparse.Namespace) -> Any:
    from workers.mock import FleetSpec, MockTiming

    return FleetSpec(prefill=a.prefill, decode=a.decode, host=a.host, base_port=a.base_port, model=a.model,
                     pp_size=a.pp_size, tp_size=a.tp_size, num_blocks=a.num_blocks, ttl_s=a.kv_ttl,
                     timing=MockTiming(prefill_ms_per_token=a.prefill_ms_per_token,
                                       decode_ms_per_token=a.decode_ms_per_token, jitter=a.jitter),
                     seed=a.seed, dialect=getattr(a, "dialect", "atom"),
                     worker_token=os.environ.get("ATOMESH_WORKER_TOKEN") or None)


def cmd_mock_fleet(a: argparse.Namespace) -> None:
    from workers.mock import MockFleet

    spec = _fleet_spec(a)

    async def main(stop: asyncio.Event) -> None:
        fleet = MockFleet(spec)
        await fleet.start()
        enrolled = await fleet.enroll(etcd_config(a), ttl=a.ttl) if a.etcd else []
        try:
            for w in fleet.prefills:
                print(f"prefill {w.url}", flush=True)
            for w2 in fleet.decodes:
                print(f"decode {w2.url}", flush=True)
            print("ready", flush=True)
            await stop.wait()
        finally:
            for e in enrolled:
                await e.close()
            await fleet.close()

    _run(main)


# -- register -------------------------------------------------------------------------------

def cmd_register(a: argparse.Namespace) -> None:
    from mesh.config import make_worker
    from workers.register import EnrollConfig, Enrollment, parse_stage

    stages = tuple(parse_stage(s) for s in a.stage or [])
    ecfg = EnrollConfig(ttl=a.ttl, health_path=a.health_path, health_interval=a.health_interval,
                        drain_deadline=a.drain_deadline)
    record = None
    if a.role in ("prefill", "decode"):
        if not a.url or not a.model:
            raise ConfigError(f"--role {a.role} needs --url and --model")
        spec = {"url": a.url, "model": a.model, "id": a.id or _opaque(a.role, a.url),
                "tp_size": a.tp_size, "block_size": a.block_size, "num_blocks": a.num_blocks,
                "kv_backend": a.kv_backend, "dialect": a.dialect, "capabilities": a.capability or [],
                "api_key_env": a.api_key_env or ""}
        if a.dp_size != 1:
            if a.role != "prefill":
                raise ConfigError("--dp-size is for --role prefill")
            spec["dp_size"] = a.dp_size
        if a.bootstrap_port is not None:
            if a.dialect not in (SGLANG, VLLM_MOONCAKE) or a.role != "prefill":
                raise ConfigError("--bootstrap-port is for --role prefill with --dialect sglang or vllm-mooncake")
            spec["bootstrap_port"] = a.bootstrap_port
        if a.role == "prefill":
            spec.update(pp_size=a.pp_size, stages=[s.encode() for s in stages])
            if not stages and a.pp_size == 1:  # a one-stage pipeline without --stage: stage 0 here
                from mesh.protocol import StageRecord
                stages = (StageRecord(pp_rank=0, host=a.url.split("://")[-1].rsplit(":", 1)[0], kv_port=0,
                                      layers=(0, 1)),)
        record = make_worker(a.role, spec, 0, here=False).record
        if a.role == "prefill" and len({s.pp_rank for s in record.stages}) not in (0, a.pp_size):
            raise ConfigError(f"give all {a.pp_size} --stage entries of the pipeline, or none")
        if a.role == "decode":
            stages = ()
    elif not (a.pipeline_id and stages):
        raise ConfigError("--role stage needs --pipeline-id and --stage")
    enr = Enrollment(etcd=etcd_config(a), record=record, stages=stages, pipeline_id=a.pipeline_id or "",
                     cfg=ecfg, pid=a.pid or os.getpid())

    async def main(stop: asyncio.Event) -> None:
        await enr.start()
        what = record.id if record is not None else f"{a.pipeline_id} stages {[s.pp_rank for s in stages]}"
        print(f"registered {a.role} {what}", flush=True)
        await stop.wait()
        print("draining", flush=True)
        idle = await enr.drain()
        print("deregistered" + ("" if idle else " (drain deadline passed with work in flight)"), flush=True)

    _run(main)


# -- workers ----------------------------------------------------------------------------------

def cmd_workers(a: argparse.Namespace) -> None:
    import aetcd
    import httpx

    from mesh.workers_table import from_etcd, from_mesh, render

    try:
        rows = asyncio.run(from_etcd(etcd_config(a))) if a.etcd else from_mesh(a.mesh, a.admin_token)
    except (aetcd.ClientError, OSError, TimeoutError) as e:
        raise ConfigError(f"cannot read etcd at {a.etcd} ({type(e).__name__}): is it running, and is that its "
                          "client URL? (`make run` prints the line with the demo's own etcd)") from None
    except httpx.HTTPStatusError as e:
        hint = " (give --admin-token)" if e.response.status_code in (401, 403) else ""
        raise ConfigError(f"the mesh at {a.mesh} answered {e.response.status_code} to GET /workers{hint}") from None
    except httpx.HTTPError as e:
        raise ConfigError(f"cannot reach the mesh at {a.mesh} ({type(e).__name__}): is `mesh serve` running "
                          "there?") from None
    print(render(rows))


# -- real workers -------------------------------------------------------------------------

def cmd_worker(a: argparse.Namespace) -> None:
    from workers.launch import EXIT, serve_worker

    from workers.engine.dist import RankDied

    etcd = etcd_config(a) if a.etcd else None
    try:
        _run(lambda stop: serve_worker(a.cmd, a, stop, etcd))
    except RankDied as e:  # a rank or stage that never came, failed the handshake, or a stop meanwhile
        print(f"{a.cmd}: {e}", file=sys.stderr, flush=True)
        sys.exit(3)
    if EXIT["code"]:
        sys.exit(EXIT["code"])


def cmd_stage(a: argparse.Namespace) -> None:
    """One PP stage of a pipeline whose head runs `mesh prefill --remote-stages PORT` elsewhere."""
    from workers.engine.dist import RankDied, serve_remote_stage

    host, _, port = a.head.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--head must be HOST:PORT, got {a.head!r}")
    if a.pp_rank < 1:
        raise ConfigError("--pp-rank must be >= 1 (stage 0 is the head, mesh prefill)")
    print(f"stage {a.pp_rank} joining {a.head}", flush=True)
    code = 0
    try:
        serve_remote_stage(host, int(port), a.pp_rank, a.checkpoint, a.host, a.connect_timeout)
    except RankDied as e:
        print(f"stage {a.pp_rank}: {e}", file=sys.stderr, flush=True)
        code = 3
    sys.stdout.flush()
    os._exit(code)  # the KV side channel's threads are not waited for: this stage is done


def add_worker_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="folder with config.json and *.safetensors")
    p.add_argument("--model", help="served model name (default: the checkpoint folder's name)")
    p.add_argument("--id", help="worker id in the registry")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--kv-backend", default="mooncake", choices=["mooncake", "zmq"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N for every rank / stage of this worker, or "
                   "one per stage / rank (cuda:0,cuda:1,...: with distinct GPUs the ranks talk over NCCL); "
                   "with --kv-backend zmq on GPUs: Mooncake's CUDA build is not bundled")
    p.add_argument("--ttl", type=int, default=10, help="etcd lease TTL")
    p.add_argument("--inject-faults", metavar="JSON", help="chaos testing: faults this worker commits on purpose, "
                   "e.g. '{\"drop_release\": 0.2, \"crash_after_pull\": 0.05}' (the names of `mesh mock-fleet`'s "
                   "POST /mock/faults)")
    add_etcd_options(p)
    p.set_defaults(func=cmd_worker)


# -- bench ----------------------------------------------------------------------------------

def cmd_bench(a: argparse.Namespace) -> None:
    import json

    from mesh.loadgen import BenchConfig, run, summary, table

    cfg = BenchConfig(url=a.url, model=a.model, requests=a.requests, concurrency=a.concurrency,
                      prompt_len=a.prompt_len, max_tokens=a.max_tokens, api_key=a.api_key)
    # the progress line rewrites itself with \r: only on a terminal, never into a log file
    s = summary(cfg, asyncio.run(run(cfg, progress=not a.quiet and sys.stderr.isatty())))
    print(table(s))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(s, f, indent=2)


# -- demo (what `make run` starts) ----------------------------------------------------------

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


def _port_free(host: str, port: int) -> None:
    import socket

    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as so:
        so.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            so.bind((host, port))
        except OSError as e:
            raise ConfigError(f"cannot listen on {host}:{port} ({e.strerror}): another `make run` or mesh is "
                              "there? stop it, or give --port") from None


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

    _port_free(a.host, a.port)   # before anything starts: a second `make run` says so and leaves
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
        me = [sys.executable, "-m", "mesh.cli", "--log-level", "WARNING"]
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
        _run(lambda stop: _serve(cfg, stop, announce=text))
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


# -- parser ---------------------------------------------------------------------------------

class _Help(argparse.HelpFormatter):
    """Help that says each option's default (where it has one worth saying)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        h = action.help or ""
        if "%(default)" not in h and action.option_strings and action.default not in (None, False, argparse.SUPPRESS) \
                and not isinstance(action.default, list):
            h += " (default: %(default)s)"
        return h


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mesh", description="Atomesh: a prefill/decode disaggregation gateway",
                                formatter_class=_Help)
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = p.add_subparsers(dest="cmd", required=True)
    add = sub.add_parser

    def add_parser(name: str, **kw: Any) -> argparse.ArgumentParser:   # every subcommand shows its defaults
        kw.setdefault("formatter_class", _Help)
        sp = add(name, **kw)
        sp.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"], default=argparse.SUPPRESS,
                        help="as `mesh --log-level`, given after the subcommand")
        return sp

    sub.add_parser = add_parser  # type: ignore[method-assign]

    s = sub.add_parser("serve", help="run the gateway")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--prefill", action="append", metavar="URL", help="a prefill pipeline (stage-0 URL)")
    s.add_argument("--decode", action="append", metavar="URL", help="a decode engine (rank-0 URL)")
    s.add_argument("--worker", action="append", metavar="URL", help="a full worker (regular, non-PD mode)")
    s.add_argument("--config", metavar="FILE", help="TOML file with [mesh] and [[prefill]]/[[decode]]/[[worker]]")
    s.add_argument("--prefill-policy")
    s.add_argument("--decode-policy")
    s.add_argument("--worker-policy")
    s.add_argument("--decode-retries", type=int)
    s.add_argument("--health-interval", type=float)
    s.add_argument("--mesh-id", help="stable id of this replica (KV adoption after a restart); "
                   "default mesh-<hostname>-<port>")
    s.add_argument("--kv-leak-after", type=float, help="seconds a worker's KV census may leave blocks "
                   "unaccounted before the leak alarm takes it out of routing (default 120, the holder TTL)")
    s.add_argument("--ledger-grace", type=float, help="seconds a transfer may stay held after decode (default 5)")
    s.add_argument("--ledger-interval", type=float, help="seconds between /kv/held reconciliations (default 0.5)")
    s.add_argument("--max-concurrency", type=int, help="requests served at once (0: no limit); more wait")
    s.add_argument("--max-queue", type=int, help="requests waiting at most; more get 429 (default 256)")
    s.add_argument("--queue-timeout", type=float, help="seconds a request may wait for a slot (default 5)")
    s.add_argument("--per-key-concurrency", type=int, help="requests at once per API key (0: no limit)")
    s.add_argument("--api-key-file", help="client API keys, one per line (also ATOMESH_API_KEYS)")
    s.add_argument("--forward-client-auth", action="store_true",
                   help="pass the client's Authorization header on to workers that have no upstream key of their own")
    s.add_argument("--no-first-token-early", action="store_true",
                   help="PD streams: wait for decode's first byte instead of sending the prefill's token at once")
    s.add_argument("--ttl", type=int, default=10, help="lease TTL of this replica's registration (etcd)")
    s.add_argument("--advertise-url", help="this replica's URL for its etcd record")
    s.add_argument("--admin-token", help="require it as a bearer token on admin routes "
                   "(or ATOMESH_ADMIN_TOKEN)")
    s.add_argument("--otel", action="store_true", help="OpenTelemetry spans, exported as the OTEL_* variables say "
                   "(OTEL_TRACES_EXPORTER=otlp|console); a provider set up by opentelemetry-instrument works "
                   "without this flag")
    add_etcd_options(s)
    s.set_defaults(func=cmd_serve)

    f = sub.add_parser("mock-fleet", help="run mock prefill pipelines and decode engines")
    f.add_argument("--prefill", type=int, default=1)
    f.add_argument("--decode", type=int, default=1)
    f.add_argument("--host", default="127.0.0.1")
    f.add_argument("--base-port", type=int, default=0)
    f.add_argument("--model", default="mock-model")
    f.add_argument("--pp-size", type=int, default=1)
    f.add_argument("--dialect", default="atom", choices=["atom", "vllm", "sglang"],
                   help="the PD protocol the mock workers speak")
    f.add_argument("--tp-size", type=int, default=1)
    f.add_argument("--num-blocks", type=int, default=4096)
    f.add_argument("--kv-ttl", type=float, default=120.0)
    f.add_argument("--prefill-ms-per-token", type=float, default=0.0)
    f.add_argument("--decode-ms-per-token", type=float, default=0.0)
    f.add_argument("--jitter", type=float, default=0.0)
    f.add_argument("--seed", type=int)
    f.add_argument("--ttl", type=int, default=10, help="lease TTL when registering in etcd")
    add_etcd_options(f)
    f.set_defaults(func=cmd_mock_fleet)

    r = sub.add_parser("register", help="enroll a worker in etcd and keep it there until SIGTERM (then drain)")
    add_etcd_options(r, required=True)
    r.add_argument("--role", required=True, choices=["prefill", "decode", "stage"])
    r.add_argument("--url", help="the worker's HTTP URL (prefill: stage 0)")
    r.add_argument("--model")
    r.add_argument("--id", help="pipeline / engine id (default: from the URL)")
    r.add_argument("--pp-size", type=int, default=1)
    r.add_argument("--tp-size", type=int, default=1)
    r.add_argument("--dp-size", type=int, default=1,
                   help="--role prefill: data-parallel ranks behind the URL (ATOM's decode enrichment)")
    r.add_argument("--capability", action="append", choices=list(CAPABILITIES),
                   help="repeatable: what the worker serves beyond OpenAI (docs/engines.md, Capabilities); "
                        "an external engine declares none unless its operator says so")
    r.add_argument("--api-key-env", metavar="VAR",
                   help="the engine needs an API key: each mesh sends Bearer $VAR (VAR set in the mesh's "
                        "environment; only the variable's name goes to etcd)")
    r.add_argument("--stage", action="append", metavar="PP_RANK:HOST:KV_PORT:START-END")
    r.add_argument("--pipeline-id", help="--role stage: the pipeline whose stage(s) this process keeps alive")
    r.add_argument("--pid", type=int, help="pid written in stage liveness keys (default: this process)")
    r.add_argument("--block-size", type=int, default=16)
    r.add_argument("--num-blocks", type=int, default=0)
    r.add_argument("--kv-backend", default="zmq")
    r.add_argument("--dialect", default="atom", choices=list(DIALECTS),
                   help="how the mesh drives this worker's PD legs (docs/engines.md)")
    r.add_argument("--bootstrap-port", type=int, help="--dialect sglang or vllm-mooncake, prefill: the engine's "
                   "bootstrap port (SGLang's --disaggregation-bootstrap-port, vLLM's "
                   "VLLM_MOONCAKE_BOOTSTRAP_PORT; default 8998)")
    r.add_argument("--ttl", type=int, default=10)
    r.add_argument("--health-path", help="probe URL+PATH; withdraw the worker while it fails")
    r.add_argument("--health-interval", type=float, default=2.0)
    r.add_argument("--drain-deadline", type=float, default=60.0)
    r.set_defaults(func=cmd_register)

    pf = sub.add_parser("prefill", help="a prefill pipeline on the reference engine (PP stage processes)")
    add_worker_options(pf)
    pf.add_argument("--pp-size", type=int, default=1)
    pf.add_argument("--tp-size", type=int, default=1,
                    help="a TP prefill instead (--pp-size 1): each rank prefills its KV heads and serves them")
    pf.add_argument("--partition", help="layers per stage, e.g. 18,20,20,20 (default: even)")
    pf.add_argument("--kv-ttl", type=float, default=120.0, help="seconds a transfer is held without release")
    pf.add_argument("--remote-stages", type=int, metavar="PORT",
                    help="stages 1..N-1 run elsewhere (mesh stage --head HOST:PORT): the gloo store listens "
                         "on --host:PORT, stage r's control socket on PORT+r")

    st = sub.add_parser("stage", help="one PP stage in its own process / pod, joining a pipeline head")
    st.add_argument("--checkpoint", required=True, help="the same checkpoint as the head's")
    st.add_argument("--head", required=True, metavar="HOST:PORT", help="the head's --host and --remote-stages")
    st.add_argument("--pp-rank", type=int, required=True)
    st.add_argument("--host", default="127.0.0.1", help="this stage's address (its KV side channel binds here)")
    st.add_argument("--connect-timeout", type=float, default=600.0)
    st.set_defaults(func=cmd_stage)

    dc = sub.add_parser("decode", help="a decode engine on the reference engine (TP rank processes)")
    add_worker_options(dc)
    dc.add_argument("--tp-size", type=int, default=1)

    b = sub.add_parser("bench", help="load-test any OpenAI endpoint (the mesh or one engine)")
    b.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    b.add_argument("--model", required=True)
    b.add_argument("--requests", type=int, default=100)
    b.add_argument("--concurrency", type=int, default=8)
    b.add_argument("--prompt-len", type=int, default=128, help="prompt length in characters")
    b.add_argument("--max-tokens", type=int, default=64)
    b.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    b.add_argument("--out", help="write the results as JSON here")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.set_defaults(func=cmd_bench)

    w = sub.add_parser("workers", help="table of the fleet, from etcd or from a mesh")
    add_etcd_options(w)
    w.add_argument("--mesh", metavar="URL", help="ask a running mesh instead of etcd")
    w.add_argument("--admin-token", default=os.environ.get("ATOMESH_ADMIN_TOKEN"))
    w.set_defaults(func=cmd_workers)

    d = sub.add_parser("demo", help="a mesh over real local workers, with a curl line to try (make run)")
    d.add_argument("--host", default="127.0.0.1")
    d.add_argument("--port", type=int, default=8000)
    d.add_argument("--dir", default=".run", help="where the checkpoint and etcd data live")
    d.add_argument("--kv-backend", default="zmq", choices=["zmq", "mooncake"],
                   help="how KV moves between the workers (default: %(default)s; mooncake's ports listen on every "
                   "interface with the pinned mooncake-transfer-engine, whatever --host says)")
    d.set_defaults(func=cmd_demo)
    for sp in sub.choices.values():   # options without a help line still say their default
        for act in sp._actions:
            if act.option_strings and act.help is None and act.default not in (None, False, argparse.SUPPRESS):
                act.help = "(default: %(default)s)"
    return p


def main(argv: list[str] | None = None) -> None:
    a = parser().parse_args(argv)
    if a.cmd == "workers" and bool(a.etcd) == bool(a.mesh):
        parser().error("mesh workers needs exactly one of --etcd URL or --mesh URL")
    logging.basicConfig(level=a.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if a.log_level != "DEBUG":   # third-party chatter only when asked for
        for name in ("httpx", "httpcore", "aetcd", "grpc", "asyncio", "urllib3", "filelock", "torch"):
            logging.getLogger(name).setLevel(logging.WARNING)
    try:
        a.func(a)
    except (ConfigError, ValueError) as e:
        print(f"mesh: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
