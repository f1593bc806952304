"""The workers' `mesh` subcommands: `prefill`, `decode`, `stage` (the reference engine's
processes), `register` (enroll any engine in etcd) and `mock-fleet` (the benchmark fleet).
Registered through the `atomesh.commands` entry point; `mesh/cli.py` only dispatches."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

from contract.clikit import (
    Subcommands,
    add_etcd_options,
    etcd_config,
    opaque_worker_id,
    run_until_stopped,
    settle_gc,
)
from contract.dialects import ATOM, DIALECTS, SGLANG, VLLM, VLLM_MOONCAKE
from contract.errors import ConfigError
from contract.protocol import CAPABILITIES, KV_BACKENDS, PrefillRecord

# -- mock-fleet -----------------------------------------------------------------------------

def _fleet_spec(a: argparse.Namespace) -> Any:
    from workers.mock import FleetSpec, MockTiming

    return FleetSpec(prefill=a.prefill, decode=a.decode, host=a.host, base_port=a.base_port, model=a.model,
                     pp_size=a.pp_size, tp_size=a.tp_size, num_blocks=a.num_blocks, ttl_s=a.kv_ttl,
                     timing=MockTiming(prefill_ms_per_token=a.prefill_ms_per_token,
                                       decode_ms_per_token=a.decode_ms_per_token, jitter=a.jitter),
                     seed=a.seed, dialect=getattr(a, "dialect", ATOM),
                     worker_token=os.environ.get("ATOMESH_WORKER_TOKEN") or None)


def cmd_mock_fleet(a: argparse.Namespace) -> None:
    from workers.mock import MockFleet

    spec = _fleet_spec(a)

    async def main(stop: asyncio.Event) -> None:
        fleet = MockFleet(spec)
        await fleet.start()
        # bench/fleet_cpu.py: JSON at c=16 went from 1.21x to 1.10x of the old mock's CPU with this
        settle_gc()
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

    run_until_stopped(main)


# -- register -------------------------------------------------------------------------------

def cmd_register(a: argparse.Namespace) -> None:
    from contract.snapshot import make_worker
    from workers.register import EnrollConfig, Enrollment, parse_stage

    stages = tuple(parse_stage(s) for s in a.stage or [])
    ecfg = EnrollConfig(ttl=a.ttl, health_path=a.health_path, health_interval=a.health_interval,
                        drain_deadline=a.drain_deadline)
    record = None
    if a.role in ("prefill", "decode"):
        if not a.url or not a.model:
            raise ConfigError(f"--role {a.role} needs --url and --model")
        spec = {"url": a.url, "model": a.model, "id": a.id or opaque_worker_id(a.role, a.url),
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
                from contract.protocol import StageRecord
                stages = (StageRecord(pp_rank=0, host=a.url.split("://")[-1].rsplit(":", 1)[0], kv_port=0,
                                      layers=(0, 1)),)
        record = make_worker(a.role, spec, 0, here=False).record
        if isinstance(record, PrefillRecord) and len({s.pp_rank for s in record.stages}) not in (0, a.pp_size):
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

    run_until_stopped(main)


# -- the reference engine's processes ---------------------------------------------------------

def cmd_worker(a: argparse.Namespace) -> None:
    from workers.engine.group import process_env
    from workers.engine.rank import RankDied
    from workers.launch import serve_worker, worker_config

    cfg = worker_config(a.cmd, a, etcd_config(a) if a.etcd else None)   # checked before any process starts
    quiet_native_logs(a)
    process_env()
    try:
        code = run_until_stopped(lambda stop: serve_worker(cfg, stop))
    except RankDied as e:  # a rank or stage that never came, failed the handshake, or a stop meanwhile
        print(f"{a.cmd}: {e}", file=sys.stderr, flush=True)
        sys.exit(3)
    if code:
        sys.exit(code)


def quiet_native_logs(a: argparse.Namespace) -> None:
    """Mooncake logs INFO and up, ~10 lines per process at start: at WARNING unless `--log-level
    DEBUG` (as the Python side's third-party loggers). Its own variable (MC_LOG_LEVEL; its glog
    ignores GLOG_minloglevel), set before the library loads and inherited by the rank processes;
    an operator's own MC_LOG_LEVEL wins."""
    os.environ.setdefault("MC_LOG_LEVEL", "INFO" if getattr(a, "log_level", "INFO") == "DEBUG" else "WARNING")


def cmd_stage(a: argparse.Namespace) -> None:
    """One PP stage of a pipeline whose head runs `mesh prefill --remote-stages PORT` elsewhere."""
    from workers import rank_hooks
    from workers.engine.rank import RankDied, serve_remote_stage

    host, _, port = a.head.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--head must be HOST:PORT, got {a.head!r}")
    if a.pp_rank < 1:
        raise ConfigError("--pp-rank must be >= 1 (stage 0 is the head, mesh prefill)")
    quiet_native_logs(a)
    print(f"stage {a.pp_rank} joining {a.head}", flush=True)
    code = 0
    try:
        serve_remote_stage(host, int(port), a.pp_rank, a.checkpoint, a.host, a.connect_timeout,
                           startup=rank_hooks.startup)
    except RankDied as e:
        print(f"stage {a.pp_rank}: {e}", file=sys.stderr, flush=True)
        code = 3
    sys.stdout.flush()
    os._exit(code)  # the KV side channel's threads are not waited for: this stage is done


def add_worker_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="folder with config.json and *.safetensors")
    p.add_argument("--model", help="served model name (default: the checkpoint folder's name)")
    p.add_argument("--id", help="worker id in the registry (default: an opaque id from the URL)")
    p.add_argument("--host", default="127.0.0.1", help="address every listener of this worker binds")
    p.add_argument("--port", type=int, default=0, help="HTTP port (0: a free one, printed at start)")
    p.add_argument("--kv-backend", default="mooncake", choices=["mooncake", "zmq", "cuda-ipc"],
                   help="how KV moves to / from the other side (cuda-ipc: both sides on one host's GPUs, "
                        "device to device)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--num-blocks", type=int, default=1024, help="KV blocks in the pool (per stage / rank)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences in one engine step at most")
    p.add_argument("--max-batch-tokens", type=int, default=512, help="tokens in one engine step at most")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"],
                   help="weights and KV")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N for every rank / stage of this worker, or "
                   "one per stage / rank (cuda:0,cuda:1,...: with distinct GPUs the ranks talk over NCCL); "
                   "with --kv-backend zmq on GPUs: Mooncake's CUDA build is not bundled")
    p.add_argument("--ttl", type=int, default=10, help="etcd lease TTL")
    p.add_argument("--inject-faults", metavar="JSON", help="chaos testing: faults this worker commits on purpose, "
                   "e.g. '{\"drop_release\": 0.2, \"crash_after_pull\": 0.05}' (the names of `mesh mock-fleet`'s "
                   "POST /mock/faults)")
    add_etcd_options(p)
    p.set_defaults(func=cmd_worker)


def add_commands(sub: Subcommands) -> None:
    """The workers' subcommands, in the `mesh` command (entry point `atomesh.commands`)."""
    f = sub.add("mock-fleet", "run mock prefill pipelines and decode engines (the benchmark fleet: the real "
                "adapters over a fake engine)",
                "mesh mock-fleet --prefill 2 --decode 2 --dialect vllm --decode-ms-per-token 5")
    f.add_argument("--prefill", type=int, default=1, help="prefill pipelines")
    f.add_argument("--decode", type=int, default=1, help="decode engines")
    f.add_argument("--host", default="127.0.0.1", help="address every listener binds")
    f.add_argument("--base-port", type=int, default=0, help="first HTTP port (0: free ports)")
    f.add_argument("--model", default="mock-model", help="served model name")
    f.add_argument("--pp-size", type=int, default=1, help="stages per prefill pipeline")
    f.add_argument("--dialect", default=ATOM.value, choices=[ATOM.value, VLLM.value, SGLANG.value],
                   help="the PD protocol the mock workers speak")
    f.add_argument("--tp-size", type=int, default=1, help="ranks per decode engine")
    f.add_argument("--num-blocks", type=int, default=4096, help="KV blocks per pool")
    f.add_argument("--kv-ttl", type=float, default=120.0, help="seconds a transfer is held without release")
    f.add_argument("--prefill-ms-per-token", type=float, default=0.0, help="timing model (0: zero-cost)")
    f.add_argument("--decode-ms-per-token", type=float, default=0.0, help="timing model (0: zero-cost)")
    f.add_argument("--jitter", type=float, default=0.0, help="timing model: relative random spread")
    f.add_argument("--seed", type=int, help="token model seed")
    f.add_argument("--ttl", type=int, default=10, help="lease TTL when registering in etcd")
    add_etcd_options(f)
    f.set_defaults(func=cmd_mock_fleet)

    r = sub.add("register", "enroll a worker in etcd and keep it there until SIGTERM (then drain)",
                "mesh register --etcd http://127.0.0.1:2379 --role decode --url http://10.0.0.7:8200 "
                "--model llama --dialect vllm --health-path /health")
    add_etcd_options(r, required=True)
    r.add_argument("--role", required=True, choices=["prefill", "decode", "stage"], help="what the worker is")
    r.add_argument("--url", help="the worker's HTTP URL (prefill: stage 0)")
    r.add_argument("--model", help="the model it serves")
    r.add_argument("--id", help="pipeline / engine id (default: an opaque id from the URL)")
    r.add_argument("--pp-size", type=int, default=1, help="--role prefill: stages in the pipeline")
    r.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks")
    r.add_argument("--dp-size", type=int, default=1,
                   help="--role prefill: data-parallel ranks behind the URL (ATOM's decode enrichment)")
    r.add_argument("--capability", action="append", choices=list(CAPABILITIES),
                   help="repeatable: what the worker serves beyond OpenAI (docs/engines.md, Capabilities); "
                        "an external engine declares none unless its operator says so")
    r.add_argument("--api-key-env", metavar="VAR",
                   help="the engine needs an API key: each mesh sends Bearer $VAR (VAR set in the mesh's "
                        "environment; only the variable's name goes to etcd)")
    r.add_argument("--stage", action="append", metavar="PP_RANK:HOST:KV_PORT:START-END",
                   help="repeatable: one stage of the pipeline (where its KV side channel listens, its layers)")
    r.add_argument("--pipeline-id", help="--role stage: the pipeline whose stage(s) this process keeps alive")
    r.add_argument("--pid", type=int, help="pid written in stage liveness keys (default: this process)")
    r.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    r.add_argument("--num-blocks", type=int, default=0, help="KV blocks in the pool (0: unknown)")
    r.add_argument("--kv-backend", default="zmq", choices=list(KV_BACKENDS),
                   help="how the engine moves KV (recorded for operators; the dialect says how the mesh drives it)")
    r.add_argument("--dialect", default=ATOM.value, choices=list(DIALECTS),
                   help="how the mesh drives this worker's PD legs (docs/engines.md)")
    r.add_argument("--bootstrap-port", type=int, help="--dialect sglang or vllm-mooncake, prefill: the engine's "
                   "bootstrap port (SGLang's --disaggregation-bootstrap-port, vLLM's "
                   "VLLM_MOONCAKE_BOOTSTRAP_PORT; default 8998)")
    r.add_argument("--ttl", type=int, default=10, help="etcd lease TTL")
    r.add_argument("--health-path", help="probe URL+PATH; withdraw the worker while it fails")
    r.add_argument("--health-interval", type=float, default=2.0, help="seconds between probes")
    r.add_argument("--drain-deadline", type=float, default=60.0,
                   help="seconds SIGTERM waits for the worker to go idle before the key goes")
    r.set_defaults(func=cmd_register)

    pf = sub.add("prefill", "a prefill pipeline on the reference engine (PP stage processes)",
                 "mesh prefill --checkpoint ./ckpt --pp-size 2 --kv-backend zmq --etcd http://127.0.0.1:2379")
    add_worker_options(pf)
    pf.add_argument("--pp-size", type=int, default=1, help="stages, each a process holding a slice of the layers")
    pf.add_argument("--tp-size", type=int, default=1,
                    help="a TP prefill instead (--pp-size 1): each rank prefills its KV heads and serves them")
    pf.add_argument("--partition", help="layers per stage, e.g. 18,20,20,20 (default: even)")
    pf.add_argument("--kv-ttl", type=float, default=120.0, help="seconds a transfer is held without release")
    pf.add_argument("--remote-stages", type=int, metavar="PORT",
                    help="stages 1..N-1 run elsewhere (mesh stage --head HOST:PORT): the gloo store listens "
                         "on --host:PORT, stage r's control socket on PORT+r")

    st = sub.add("stage", "one PP stage in its own process / pod, joining a pipeline head",
                 "ATOMESH_PIPELINE_SECRET=... mesh stage --checkpoint ./ckpt --head 10.0.0.5:29500 --pp-rank 1 "
                 "--host 10.0.0.6")
    st.add_argument("--checkpoint", required=True, help="the same checkpoint as the head's")
    st.add_argument("--head", required=True, metavar="HOST:PORT", help="the head's --host and --remote-stages")
    st.add_argument("--pp-rank", type=int, required=True, help="this stage's rank (1..pp_size-1)")
    st.add_argument("--host", default="127.0.0.1", help="this stage's address (its KV side channel binds here)")
    st.add_argument("--connect-timeout", type=float, default=600.0, help="seconds to wait for the head")
    st.set_defaults(func=cmd_stage)

    dc = sub.add("decode", "a decode engine on the reference engine (TP rank processes)",
                 "mesh decode --checkpoint ./ckpt --tp-size 2 --kv-backend zmq --etcd http://127.0.0.1:2379")
    add_worker_options(dc)
    dc.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks, one process each")
    dc.add_argument("--pull-deadline", type=float, default=30.0,
                    help="seconds a KV pull may take before the decode answers kv_transfer_failed (keep it under "
                         "the mesh's decode_first_byte: a pipeline that died under a pull is then blamed, not "
                         "this engine)")
