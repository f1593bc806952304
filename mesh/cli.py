"""The `mesh` command: the gateway's subcommands (`serve`, `workers`, `bench`, `etcd-auth`) and the dispatcher
that adds what the other sides register (entry points `atomesh.commands`: the workers'
`prefill | decode | stage | register | mock-fleet` in workers/cli.py, the demo supervisor in
demo/supervisor.py). argparse lives in these modules only: they build the frozen configs and hand
them over.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from contract.clikit import (
    LOG_LEVELS,
    Help,
    Subcommands,
    add_etcd_options,
    etcd_config,
    loopback,
    port_free,
    run_until_stopped,
    settle_gc,
)
from contract.errors import ConfigError
from mesh.admission import AdmissionConfig
from mesh.config import MeshConfig, Timeouts, load_toml, workers_from
from mesh.request import Limits

log = logging.getLogger("mesh")

# where the `atomesh.commands` entry points point (pyproject.toml); used as they are when the
# project runs from a source tree without being installed (`python -m mesh` on a GPU machine)
BUILTIN_COMMANDS = {"gateway": "mesh.cli:add_commands", "workers": "workers.cli:add_commands",
                    "demo": "demo.supervisor:add_commands"}


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
            api_keys=api_keys(a), forward_client_auth=a.forward_client_auth or m.get("forward_client_auth", False),
            pace_us=pick(a.pace_us, "pace_us", 1000))
    except TypeError as e:
        raise ConfigError(f"[mesh]: {e}") from None


async def serve_until(cfg: MeshConfig, stop: asyncio.Event, announce: str | None = None) -> None:
    """Serve the gateway until `stop` is set (`mesh serve`, and the demo in front of its workers)."""
    from mesh.app import bound_port, create_app, start_site

    if not (cfg.prefill or cfg.decode or cfg.workers or cfg.etcd):
        raise ConfigError("no workers: give --prefill/--decode (PD), --worker (regular), --config or --etcd")
    if not cfg.reuse_port:   # `--workers N`: the parent checked the port; its siblings hold it too
        port_free(cfg.host, cfg.port)
    if not loopback(cfg.host) and not cfg.admin_token:
        log.warning("mesh serves on %s without an admin token: /workers, /kv/ledger and the dashboard map every "
                    "worker to anyone who can reach it; set --admin-token or ATOMESH_ADMIN_TOKEN (docs/security.md)",
                    cfg.host)
    runner = await start_site(create_app(cfg), cfg.host, cfg.port, reuse_port=cfg.reuse_port)
    port = bound_port(runner)
    settle_gc()   # bench/overhead.py --prompt-bytes: a tenth of a long prompt's CPU went to collections
    log.info("mesh listening on http://%s:%d (%s mode)", cfg.host, port, "PD" if cfg.pd else "regular")
    print(f"mesh http://{cfg.host}:{port}" + (f" process {cfg.mesh_id}" if cfg.reuse_port else ""), flush=True)
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
    if a.workers > 1:
        raise SystemExit(serve_processes(cfg, a.workers))
    run_until_stopped(lambda stop: serve_until(cfg, stop))


def serve_processes(cfg: MeshConfig, n: int) -> int:
    """`mesh serve --workers N`: N processes forked from this one, each a whole mesh on the same port
    (SO_REUSEPORT: the kernel spreads connections), sharing nothing but the registry: each has its
    own mesh id `<id>-<i>` (so its own ledger and `mesh/<id>` replica key: a process adopts and
    reclaims only the transfers it made, and a process restarted under its id takes its own back),
    its own admission limits (`--max-concurrency` is per process), its own health probes. /metrics,
    from any of them, covers all (mesh/metrics.py). This process only forks, restarts a process
    that dies (same index, same id), and passes SIGTERM / SIGINT on; it exits when they have."""
    import dataclasses
    import shutil
    import signal
    import socket
    import tempfile
    import time

    if "prometheus_client" in sys.modules:   # its value class is chosen at import: the directory first
        raise ConfigError("--workers: prometheus_client was imported before the processes were set up")
    port_free(cfg.host, cfg.port)
    port = cfg.port
    if port == 0:   # one port for all: pick it here
        with socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET) as s:
            s.bind((cfg.host, 0))
            port = s.getsockname()[1]
    base = cfg.mesh_id or f"mesh-{socket.gethostname()}-{port}"
    prom = tempfile.mkdtemp(prefix="atomesh-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = prom
    stopping = False

    def spawn(i: int) -> int:
        pid = os.fork()
        if pid == 0:   # the child: a whole mesh (nothing of the parent's runs here: no loop, no threads)
            code = 1
            try:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                c = dataclasses.replace(cfg, port=port, mesh_id=f"{base}-{i}", reuse_port=True)
                run_until_stopped(lambda stop: serve_until(c, stop))
                code = 0
            except BaseException:  # noqa: BLE001 - the child's end, said in its log; its exit status tells
                log.exception("mesh process %d failed", i)
            finally:
                sys.stdout.flush()
                os._exit(code)
        return pid

    def forward(sig: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True
        for pid in list(procs):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    procs = {spawn(i): i for i in range(n)}
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    worst = 0
    started: dict[int, float] = {}
    try:
        while procs:
            pid, status = os.wait()
            i = procs.pop(pid, None)
            if i is None:
                continue
            code = os.waitstatus_to_exitcode(status)
            if stopping:
                worst = max(worst, abs(code))
                continue
            log.error("mesh process %d (%s-%d) exited with %d: starting it again", i, base, i, code)
            if time.monotonic() - started.get(i, 0.0) < 5:   # dying at once again: do not spin
                time.sleep(2)
            started[i] = time.monotonic()
            procs[spawn(i)] = i
    finally:
        shutil.rmtree(prom, ignore_errors=True)
    return worst


# -- workers table, bench ------------------------------------------------------------------

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



# -- the command ------------------------------------------------------------------------------

def add_commands(sub: Subcommands) -> None:
    """The gateway's own subcommands."""
    s = sub.add("serve", "run the gateway", "mesh serve --etcd http://127.0.0.1:2379 --port 8000   |   "
                "mesh serve --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200")
    s.add_argument("--host", default="127.0.0.1", help="address the gateway binds")
    s.add_argument("--port", type=int, default=8000, help="0: a free port, printed at start")
    s.add_argument("--workers", type=int, default=1, help="processes serving the port (SO_REUSEPORT), each with "
                   "its own mesh id <id>-<n>, ledger and admission limits (--max-concurrency is per process)")
    s.add_argument("--prefill", action="append", metavar="URL", help="a prefill pipeline (stage-0 URL)")
    s.add_argument("--decode", action="append", metavar="URL", help="a decode engine (rank-0 URL)")
    s.add_argument("--worker", action="append", metavar="URL", help="a full worker (regular, non-PD mode)")
    s.add_argument("--config", metavar="FILE", help="TOML file with [mesh] and [[prefill]]/[[decode]]/[[worker]]")
    from policies import available

    names = ", ".join(available())
    s.add_argument("--prefill-policy", metavar="NAME", help=f"one of {names} (default cache_aware)")
    s.add_argument("--decode-policy", metavar="NAME", help=f"one of {names} (default least_loaded)")
    s.add_argument("--worker-policy", metavar="NAME", help=f"regular mode: one of {names} (default least_loaded)")
    s.add_argument("--decode-retries", type=int, help="another decode engine after a failed decode leg (default 1)")
    s.add_argument("--health-interval", type=float, help="seconds between worker probes (default 2)")
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
    s.add_argument("--pace-us", type=int, help="with 4 or more requests in flight and a relayed stream read twice "
                   "within this many microseconds, or answers coming 3 or more a period to requests that take "
                   "4 periods or more, the loop polls at most once per period: a burst comes in one read and "
                   "one write, answers with one wake-up (default 1000; 0: off)")
    s.add_argument("--ttl", type=int, default=10, help="lease TTL of this replica's registration (etcd)")
    s.add_argument("--advertise-url", help="this replica's URL for its etcd record")
    s.add_argument("--admin-token", help="require it as a bearer token on admin routes "
                   "(or ATOMESH_ADMIN_TOKEN)")
    s.add_argument("--otel", action="store_true", help="OpenTelemetry spans, exported as the OTEL_* variables say "
                   "(OTEL_TRACES_EXPORTER=otlp|console); a provider set up by opentelemetry-instrument works "
                   "without this flag")
    add_etcd_options(s)
    s.set_defaults(func=cmd_serve)

    w = sub.add("workers", "table of the fleet, from etcd or from a mesh",
                "mesh workers --etcd http://127.0.0.1:2379   |   mesh workers --mesh http://127.0.0.1:8000")
    add_etcd_options(w)
    w.add_argument("--mesh", metavar="URL", help="ask a running mesh instead of etcd")
    w.add_argument("--admin-token", default=os.environ.get("ATOMESH_ADMIN_TOKEN"),
                   help="the mesh's admin token (or ATOMESH_ADMIN_TOKEN)")
    w.set_defaults(func=cmd_workers)

    b = sub.add("bench", "load-test any OpenAI endpoint (the mesh or one engine)",
                "mesh bench --url http://127.0.0.1:8000 --model tiny-llama --requests 200 --concurrency 16")
    b.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    b.add_argument("--model", required=True, help="the model name to ask for")
    b.add_argument("--requests", type=int, default=100, help="requests in all")
    b.add_argument("--concurrency", type=int, default=8, help="requests at once")
    b.add_argument("--prompt-len", type=int, default=128, help="prompt length in characters")
    b.add_argument("--max-tokens", type=int, default=64, help="tokens per answer")
    b.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="or OPENAI_API_KEY")
    b.add_argument("--out", help="write the results as JSON here")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.set_defaults(func=cmd_bench)

    e = sub.add("etcd-auth", "create the cluster's etcd users and roles (workers write their own keys, meshes "
                "read the fleet and write their record) and enable auth; passwords from ATOMESH_ETCD_ROOT_PASSWORD, "
                "ATOMESH_ETCD_MESH_PASSWORD, ATOMESH_ETCD_WORKER_PASSWORD",
                "mesh etcd-auth --etcd https://etcd-0.etcd:2379 --etcd-ca /etc/etcd-tls/ca.crt --cluster prod")
    add_etcd_options(e, required=True)
    e.add_argument("--mesh-user", default="atomesh-mesh", help="the user meshes log in as")
    e.add_argument("--worker-user", default="atomesh-worker", help="the user workers (and mesh register) log in as")
    e.set_defaults(func=cmd_etcd_auth)


def cmd_etcd_auth(a: argparse.Namespace) -> None:
    from mesh.etcd_auth import AuthPlan, setup

    def secret(var: str) -> str:
        v = os.environ.get(var, "")
        if not v:
            raise ConfigError(f"set {var} (passwords come from the environment, never the command line)")
        return v

    plan = AuthPlan(root_password=secret("ATOMESH_ETCD_ROOT_PASSWORD"), mesh_user=a.mesh_user,
                    mesh_password=secret("ATOMESH_ETCD_MESH_PASSWORD"), worker_user=a.worker_user,
                    worker_password=secret("ATOMESH_ETCD_WORKER_PASSWORD"))
    for line in asyncio.run(setup(etcd_config(a), plan)) or ["nothing to do: users, roles and auth were there"]:
        print(line, flush=True)


def _command_sources() -> list[tuple[str, Any]]:
    """(name, entry point or "module:function") of every side's add_commands, the gateway's first."""
    found: dict[str, Any] = {}
    try:
        for ep in entry_points(group="atomesh.commands"):
            found.setdefault(ep.name, ep)
    except Exception:  # noqa: BLE001 - broken metadata: the built-in table still works
        found = {}
    for name, target in BUILTIN_COMMANDS.items():
        found.setdefault(name, target)
    return [(n, found[n]) for n in ["gateway", *sorted(n for n in found if n != "gateway")]]


def _load(target: Any) -> Callable[[Subcommands], None]:
    if isinstance(target, str):
        mod, _, fn = target.partition(":")
        # (type: ignore below) an entry point's target is the add_commands callable
        return getattr(importlib.import_module(mod), fn)  # type: ignore[no-any-return]
    return target.load()  # type: ignore[no-any-return]  # an entry point's target is the add_commands callable


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mesh", description="Atomesh: a prefill/decode disaggregation gateway",
                                formatter_class=Help,
                                epilog="example:\n  mesh serve --etcd http://127.0.0.1:2379   (mesh SUBCOMMAND -h: "
                                       "its options and an example)")
    p.add_argument("--log-level", default="INFO", choices=LOG_LEVELS)
    sub = Subcommands(p.add_subparsers(dest="cmd", required=True, metavar="SUBCOMMAND"))
    for name, target in _command_sources():
        try:
            add = _load(target)
        except ImportError as e:  # a side that is not installed here
            log.debug("subcommands of %s not available: %s", name, e)
            continue
        add(sub)
    for sp in sub.parsers():   # options without a help line still say their default
        for act in sp._actions:
            if act.option_strings and act.help is None and act.default not in (None, False, argparse.SUPPRESS):
                act.help = "(default: %(default)s)"
    return p


def main(argv: list[str] | None = None) -> None:
    ap = parser()
    a = ap.parse_args(argv)
    if a.cmd == "workers" and bool(a.etcd) == bool(a.mesh):
        ap.error("mesh workers needs exactly one of --etcd URL or --mesh URL")
    logging.basicConfig(level=a.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if a.log_level != "DEBUG":   # third-party chatter only when asked for
        for name in ("httpx", "httpcore", "aetcd", "grpc", "asyncio", "urllib3", "filelock", "torch"):
            logging.getLogger(name).setLevel(logging.WARNING)
    try:
        a.func(a)
    except (ConfigError, ValueError) as e:
        print(f"mesh: error: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:   # etcd, a mesh or a worker out of reach, a file that is not there: one line
        print(f"mesh: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
