"""PD serving end to end: real etcd, real worker processes (PP stages, TP ranks), the mesh, and the
KV hand-off over Mooncake TCP or ZMQ; greedy output compared with HF transformers (float64)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time

import httpx
import openai
import orjson
import pytest
import torch

from tests.conftest import MESH_BIN, Proc
from tests.etcd_server import EtcdServer
from workers.engine.checkpoint import generate, tiny_config
from workers.engine.tokenizer import ByteTokenizer
from workers.openai_io import render_chat

N = 12
NUM_BLOCKS = 256
PIPELINE_SECRET = {"ATOMESH_PIPELINE_SECRET": "pipeline-secret-for-tests-0123"}
PROMPTS = ["Hello, mesh", "a", "The quick brown fox jumps over the lazy dog, twice over.", "0123456789abcdef",
           "\u00e9t\u00e9 \u2014 done"]
CHATS = [[{"role": "user", "content": "hi"}],
         [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is PD disaggregation?"}]]
COMBOS = [(2, 1, "mooncake"), (2, 2, "mooncake"), (3, 1, "mooncake"), (3, 2, "mooncake"),
          (2, 1, "zmq"), (2, 2, "zmq"), (3, 1, "zmq"), (3, 2, "zmq")]


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory):
    s = EtcdServer(tmp_path_factory.mktemp("etcd") / "data")
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return generate(tmp_path_factory.mktemp("model") / "tiny-llama", tiny_config(num_hidden_layers=6), seed=5)


@pytest.fixture(scope="module")
def expected(ckpt):
    """HF greedy token ids for every prompt and chat, float64."""
    from transformers import LlamaForCausalLM

    m = LlamaForCausalLM.from_pretrained(str(ckpt), dtype=torch.float64, attn_implementation="sdpa").eval()
    tok = ByteTokenizer()
    out = {}
    with torch.no_grad():
        for key, text in [(("c", p), p) for p in PROMPTS] + [(("m", i), render_chat(c)) for i, c in enumerate(CHATS)]:
            ids = torch.tensor([tok.encode(text)])
            g = m.generate(ids, max_new_tokens=N, do_sample=False, eos_token_id=None, pad_token_id=0,
                           attention_mask=torch.ones_like(ids))
            out[key] = g[0, ids.shape[1]:].tolist()
    return out


@pytest.fixture(scope="module", params=COMBOS, ids=[f"pp{p}-tp{t}-{b}" for p, t, b in COMBOS])
def fleet(request, ckpt, etcd_server):
    pp, tp, backend = request.param
    cluster = f"c-pp{pp}-tp{tp}-{backend}"
    common = ["--checkpoint", str(ckpt), "--dtype", "float64", "--block-size", "4", "--num-blocks", str(NUM_BLOCKS),
              "--max-batch-tokens", "32", "--kv-backend", backend, "--etcd", etcd_server.url, "--cluster", cluster,
              "--ttl", "3"]
    procs = []
    try:
        procs.append(Proc([MESH_BIN, "prefill", *common, "--pp-size", str(pp)], "ready", timeout=120))
        procs.append(Proc([MESH_BIN, "decode", *common, "--tp-size", str(tp)], "ready", timeout=120))
        procs.append(Proc([MESH_BIN, "serve", "--port", "0", "--etcd", etcd_server.url, "--cluster", cluster,
                           "--ledger-grace", "2"], "mesh ", timeout=60))
        url = procs[2].lines[-1].split()[1]
        deadline = time.monotonic() + 20
        while httpx.get(url + "/ready").status_code != 200:
            assert time.monotonic() < deadline, "mesh never became ready"
            time.sleep(0.1)
        yield {"url": url, "prefill": procs[0].lines[-2].split()[1], "decode": procs[1].lines[-2].split()[1],
               "model": "tiny-llama", "pp": pp, "tp": tp}
    finally:
        for p in procs[::-1]:
            p.stop()


def body(kind: str, key, stream: bool) -> dict:
    b = {"model": "tiny-llama", "max_tokens": N, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
         "stream": stream}
    if kind == "c":
        b["prompt"] = key
    else:
        b["messages"] = CHATS[key]
    return b


def ids_of(raw: bytes, stream: bool) -> list[int]:
    if not stream:
        return orjson.loads(raw)["choices"][0]["token_ids"]
    out: list[int] = []
    for ev in raw.split(b"\n\n"):
        if ev.startswith(b"data: {"):
            d = orjson.loads(ev[6:])
            for c in d["choices"]:
                out += c.get("token_ids", [])
    assert raw.endswith(b"data: [DONE]\n\n")
    return out


def settled(fleet) -> None:
    deadline = time.monotonic() + 10
    while True:
        held = httpx.get(fleet["prefill"] + "/kv/held").json()["transfers"]
        load = httpx.get(fleet["decode"] + "/load").json()
        if not held and load["free_blocks"] == NUM_BLOCKS and load["in_flight"] == 0:
            return
        assert time.monotonic() < deadline, f"still held {held}, decode load {load}"
        time.sleep(0.05)


@pytest.mark.timeout(300)
def test_atom_flow_checks_on_real_workers(fleet, expected):
    """The ATOM suite's checks (tests/test_atom.py) on this project's workers: one stream id, one role
    chunk, token 0 exactly once (ids == HF), a list of prompts as one PD pair each, merged; every
    transfer tracked by the ledger through the holder API and none expired."""
    with httpx.Client(timeout=60) as c:
        r = c.post(fleet["url"] + "/v1/chat/completions", json=body("m", 1, True))
        assert r.status_code == 200
        evs = [orjson.loads(e[6:]) for e in r.content.split(b"\n\n") if e.startswith(b"data: {")]
        assert len({e["id"] for e in evs}) == 1
        assert sum(1 for e in evs for ch in e["choices"] if (ch.get("delta") or {}).get("role")) == 1
        assert ids_of(r.content, True) == expected[("m", 1)]
        for stream in (False, True):
            r = c.post(fleet["url"] + "/v1/completions", json={**body("c", PROMPTS[0], stream), "prompt": PROMPTS[:2]})
            assert r.status_code == 200, r.text
            per: dict[int, list[int]] = {}
            if stream:
                for e in r.content.split(b"\n\n"):
                    if e.startswith(b"data: {"):
                        for ch in orjson.loads(e[6:])["choices"]:
                            per.setdefault(ch["index"], []).extend(ch.get("token_ids", []))
            else:
                per = {ch["index"]: ch["token_ids"] for ch in r.json()["choices"]}
            assert per == {0: expected[("c", PROMPTS[0])], 1: expected[("c", PROMPTS[1])]}
    settled(fleet)
    deadline = time.monotonic() + 10
    while (led := httpx.get(fleet["url"] + "/kv/ledger").json())["open"]:
        assert time.monotonic() < deadline, led
        time.sleep(0.1)
    assert led["terminal"].get("RELEASED", 0) >= 5
    assert "EXPIRED" not in led["terminal"] and "UNRECLAIMABLE" not in led["terminal"]


def census_adds_up(url: str) -> dict:
    load = httpx.get(url + "/load").json()
    assert load["free_blocks"] + load["held_blocks"] + load["running_blocks"] == load["num_blocks"], load
    return load


@pytest.mark.timeout(300)
async def test_clients_that_leave_during_a_long_prefill_leak_nothing(fleet, expected):
    """The newcomer's reproduction: clients that disconnect while their prefill still runs (its
    blocks would starve the pool: 6 x 150 blocks > 256 if they leaked), then a normal request answers
    and both pools are back to where they started, every block accounted for."""
    long = "x" * 600  # 150 blocks of 4 tokens; ~19 steps of 32 tokens: the client leaves mid-prefill
    async with httpx.AsyncClient(timeout=60) as c:
        left = 0
        for i in range(6):  # leaving after 10..60 ms: most leave mid-prefill (a fast machine may finish one)
            try:
                await c.post(fleet["url"] + "/v1/completions",
                             json={"model": "tiny-llama", "prompt": long + str(i), "max_tokens": 4, "stream": True},
                             timeout=httpx.Timeout(0.01 * (i + 1)))
            except httpx.TimeoutException:
                left += 1
        assert left >= 3
        r = await c.post(fleet["url"] + "/v1/completions", json=body("c", PROMPTS[2], False))
        assert r.status_code == 200 and ids_of(r.content, False) == expected[("c", PROMPTS[2])]
    await asyncio.to_thread(settled, fleet)
    deadline = time.monotonic() + 10
    while (p := census_adds_up(fleet["prefill"]))["free_blocks"] != NUM_BLOCKS:
        assert time.monotonic() < deadline, p
        await asyncio.sleep(0.05)
    assert p["held_blocks"] == 0 and p["running_blocks"] == 0
    assert census_adds_up(fleet["decode"])["free_blocks"] == NUM_BLOCKS


@pytest.mark.timeout(300)
def test_logprobs_stop_and_n_through_pd_equal_the_engine_alone(fleet):
    """PD through the mesh answers as the prefill engine alone: logprobs (the first token's from the
    prefill, streamed early or not), a stop string, n with a seed (the mesh splits n into pairs
    seeded seed + j; the engine alone seeds its choice j the same way)."""
    cases = [{"prompt": PROMPTS[2], "max_tokens": 8, "temperature": 0, "logprobs": 2, "ignore_eos": True},
             {"prompt": PROMPTS[0], "max_tokens": N, "temperature": 0, "stop": [" ", "e"], "ignore_eos": True},
             {"prompt": PROMPTS[3], "max_tokens": 6, "temperature": 1.0, "seed": 3, "n": 2, "ignore_eos": True}]
    with httpx.Client(timeout=60) as c:
        for case in cases:
            b = {"model": "tiny-llama", **case}
            alone = c.post(fleet["prefill"] + "/v1/completions", json=b).json()["choices"]
            for stream in (False, True):
                r = c.post(fleet["url"] + "/v1/completions", json={**b, "stream": stream})
                assert r.status_code == 200, r.text
                if not stream:
                    got = r.json()["choices"]
                else:
                    acc: dict[int, dict] = {}
                    for e in r.content.split(b"\n\n"):
                        if e.startswith(b"data: {"):
                            for ch in orjson.loads(e[6:])["choices"]:
                                a = acc.setdefault(ch["index"], {"index": ch["index"], "text": "", "lp": []})
                                a["text"] += ch["text"]
                                a["lp"] += (ch.get("logprobs") or {}).get("token_logprobs") or []
                                a["finish_reason"] = ch["finish_reason"] or a.get("finish_reason")
                    got = [{**a, "logprobs": {"token_logprobs": a["lp"]} if a["lp"] else None} for a in acc.values()]
                got = sorted(got, key=lambda x: x["index"])
                assert [x["text"] for x in got] == [x["text"] for x in alone], (case, stream)
                assert [x["finish_reason"] for x in got] == [x["finish_reason"] for x in alone], (case, stream)
                for g, w in zip(got, alone):
                    if w["logprobs"]:
                        gl, wl = g["logprobs"]["token_logprobs"], w["logprobs"]["token_logprobs"]
                        assert len(gl) == len(wl) and all(abs(x - y) < 1e-6 for x, y in zip(gl, wl)), (stream, gl, wl)
    settled(fleet)


@pytest.mark.timeout(300)
def test_greedy_output_equals_transformers(fleet, expected):
    with httpx.Client(timeout=60) as c:
        for stream in (False, True):
            for kind, keys in (("c", PROMPTS), ("m", range(len(CHATS)))):
                path = "/v1/completions" if kind == "c" else "/v1/chat/completions"
                for key in keys:
                    r = c.post(fleet["url"] + path, json=body(kind, key, stream))
                    assert r.status_code == 200, r.text
                    assert ids_of(r.content, stream) == expected[(kind, key)], (kind, key, stream)
    settled(fleet)


@pytest.mark.timeout(300)
async def test_16_concurrent_mixed_through_the_sdk(fleet, expected):
    async with openai.AsyncOpenAI(base_url=fleet["url"] + "/v1", api_key="unused", max_retries=0) as client:
        extra = {"ignore_eos": True, "return_token_ids": True}

        async def one(i: int) -> None:
            stream = bool(i % 2)
            if i % 4 < 2:
                p = PROMPTS[i % len(PROMPTS)]
                r = await client.completions.create(model="tiny-llama", prompt=p, max_tokens=N, temperature=0,
                                                    stream=stream, extra_body=extra)
                key = ("c", p)
            else:
                j = i % len(CHATS)
                r = await client.chat.completions.create(model="tiny-llama", messages=CHATS[j], max_tokens=N,
                                                         temperature=0, stream=stream, extra_body=extra)
                key = ("m", j)
            if stream:
                got = []
                async for ch in r:
                    for c in ch.choices:
                        got += (c.model_extra or {}).get("token_ids", [])
            else:
                got = r.choices[0].model_extra["token_ids"]
            assert got == expected[key], (i, key)

        await asyncio.gather(*(one(i) for i in range(16)))
    await asyncio.to_thread(settled, fleet)


@pytest.mark.timeout(120)
async def test_real_stage_enrolls_itself_and_its_death_takes_the_pipeline_out(ckpt, etcd_server):
    import os
    import signal

    import psutil

    from contract.etcd import EtcdConfig, open_client
    from tests.test_etcd_registry import wait_for

    cluster = "c-stage-death"
    pre = await asyncio.to_thread(Proc, [MESH_BIN, "prefill", "--checkpoint", str(ckpt), "--pp-size", "3",
                                         "--kv-backend", "zmq", "--etcd", etcd_server.url, "--cluster", cluster,
                                         "--ttl", "3"], "ready", timeout=120)
    try:
        cfg = EtcdConfig.from_url(etcd_server.url, cluster=cluster)
        c = open_client(cfg)
        kvs = (await c.get_prefix((cfg.keys.root + "prefill/").encode())).kvs
        await c.close()
        stage_keys = {x.key.decode().rsplit("/", 1)[1]: orjson.loads(x.value) for x in kvs if b"/stage/" in x.key}
        leases = {x.key.decode().rsplit("/", 1)[1]: x.lease for x in kvs if b"/stage/" in x.key}
        children = {p.pid for p in psutil.Process(pre.p.pid).children(recursive=True)}
        # stages 1 and 2 enrolled from their own processes, each under its own lease
        assert set(stage_keys) == {"0", "1", "2"} and len(set(leases.values())) == 3
        assert stage_keys["0"]["pid"] == pre.p.pid and {stage_keys["1"]["pid"], stage_keys["2"]["pid"]} <= children
        from mesh.app import STATE, create_app, start_site
        from mesh.config import MeshConfig

        app = create_app(MeshConfig(port=0, etcd=cfg))
        runner = await start_site(app, "127.0.0.1", 0)
        try:
            st = app[STATE]
            await wait_for(lambda: len(st.fleet.table.candidates("prefill", "tiny-llama")) == 1, 10)
            os.kill(stage_keys["2"]["pid"], signal.SIGKILL)
            dt = await wait_for(lambda: not st.fleet.table.candidates("prefill", "tiny-llama"), 4.0)
            print(f"real stage SIGKILL -> pipeline unroutable in {dt:.2f}s (TTL 3s)")
        finally:
            await runner.cleanup()
    finally:
        pre.stop()


def free_port_run(n: int) -> int:
    """A base port with n consecutive free ports after it (the head's store + one per stage)."""
    import random
    import socket

    for _ in range(200):
        base = random.randint(20000, 60000)
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                socks.append(s)   # closed below even when its bind fails
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no run of free ports")


@pytest.mark.timeout(240)
def test_pipeline_with_each_stage_in_its_own_process(ckpt, etcd_server, expected):
    """One process per stage, as one pod per stage runs in Kubernetes: `mesh stage` x2 join the
    head (`mesh prefill --remote-stages PORT`) over TCP; output equals HF; each stage enrolls its
    own liveness; a lost stage takes the head down (exit 3) and the other stage with it."""
    import orjson as _orjson

    from contract.etcd import EtcdConfig, open_client

    cluster = "c-remote-stages"
    port = free_port_run(3)
    common = ["--checkpoint", str(ckpt), "--dtype", "float64", "--block-size", "4", "--num-blocks", str(NUM_BLOCKS),
              "--max-batch-tokens", "32", "--kv-backend", "zmq", "--etcd", etcd_server.url, "--cluster", cluster,
              "--ttl", "3"]
    procs = []
    try:
        stages = [Proc([MESH_BIN, "stage", "--checkpoint", str(ckpt), "--head", f"127.0.0.1:{port}", "--pp-rank",
                        str(r)], f"stage {r} joining", PIPELINE_SECRET, timeout=60) for r in (1, 2)]
        procs += stages
        head = Proc([MESH_BIN, "prefill", *common, "--pp-size", "3", "--remote-stages", str(port)], "ready",
                    PIPELINE_SECRET, timeout=120)
        procs.append(head)
        procs.append(Proc([MESH_BIN, "decode", *common, "--tp-size", "2"], "ready", timeout=120))
        procs.append(Proc([MESH_BIN, "serve", "--port", "0", "--etcd", etcd_server.url, "--cluster", cluster],
                          "mesh ", timeout=60))
        url = procs[-1].lines[-1].split()[1]
        deadline = time.monotonic() + 20
        while httpx.get(url + "/ready").status_code != 200:
            assert time.monotonic() < deadline, "mesh never became ready"
            time.sleep(0.1)
        with httpx.Client(timeout=60) as c:
            for stream in (False, True):
                for p in PROMPTS:
                    r = c.post(url + "/v1/completions", json=body("c", p, stream))
                    assert r.status_code == 200, r.text
                    assert ids_of(r.content, stream) == expected[("c", p)], (p, stream)

        async def stage_pids() -> dict[str, int]:
            cfg = EtcdConfig.from_url(etcd_server.url, cluster=cluster)
            cl = open_client(cfg)
            kvs = (await cl.get_prefix((cfg.keys.root + "prefill/").encode())).kvs
            await cl.close()
            return {x.key.decode().rsplit("/", 1)[1]: _orjson.loads(x.value)["pid"] for x in kvs if b"/stage/" in x.key}

        assert asyncio.run(stage_pids()) == {"0": head.p.pid, "1": stages[0].p.pid, "2": stages[1].p.pid}
        # every listener of the head and its stages (the TCPStore's included) is bound to --host
        import psutil

        listening = {}
        for pr in [head, *stages]:
            ps = psutil.Process(pr.p.pid)
            for q in [ps, *ps.children(recursive=True)]:
                for cn in q.net_connections(kind="inet"):
                    if cn.status == psutil.CONN_LISTEN:
                        listening[(q.pid, cn.laddr.port)] = cn.laddr.ip
        assert (head.p.pid, port) in listening and set(listening.values()) == {"127.0.0.1"}, listening
        # a plain TCP connect to a stage's control port (anyone with network reach) is not the stage
        # leaving: the head stays up and serves
        for r in (1, 2):
            socket.create_connection(("127.0.0.1", port + r), timeout=5).close()
        time.sleep(2.5)
        assert head.p.poll() is None
        r = httpx.post(url + "/v1/completions", json=body("c", PROMPTS[0], False), timeout=60)
        assert r.status_code == 200 and ids_of(r.content, False) == expected[("c", PROMPTS[0])]
        os.kill(stages[1].p.pid, signal.SIGKILL)
        assert head.p.wait(30) == 3  # the head withdrew and exited: its supervisor restarts the pipeline
        # the surviving stage exits too: told to stop by the leaving head (0), or seeing it gone (3)
        assert stages[0].p.wait(30) in (0, 3)
    finally:
        for p in procs[::-1]:
            p.stop()


class _Pwn:
    """A pickle that runs a command when loaded: what an attacker sends to a control port."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.path}",))


@pytest.mark.timeout(180)
def test_remote_stage_control_runs_no_code_and_needs_the_secret(ckpt, tmp_path):
    """An attacker on the control plane: a pickle to a waiting head, a stranger without the secret,
    and a fake head answering a real `mesh stage` with a pickle. No code runs, nobody joins."""
    import pickle

    import zmq

    from workers.engine import ctrl

    pwned = tmp_path / "pwned"
    port = free_port_run(2)
    env = {**os.environ, **PIPELINE_SECRET}
    head_p = subprocess.Popen([MESH_BIN, "prefill", "--checkpoint", str(ckpt), "--kv-backend", "zmq", "--pp-size", "2",
                               "--remote-stages", str(port), "--num-blocks", "64"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ctx = zmq.Context()
    try:
        time.sleep(3)
        for payload in (pickle.dumps(_Pwn(str(pwned))), pickle.dumps(("hello", 1)),
                        ctrl.pack("hello", 1, b"\0" * 32)):
            s = ctx.socket(zmq.PAIR)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"tcp://127.0.0.1:{port + 1}")
            s.send(payload)
            if payload.startswith(b"\x93") and s.poll(5000):   # the typed hello: a challenge comes back
                _, (n_h, _proof) = ctrl.unpack(s.recv(), ("challenge",))
                s.send(ctrl.pack("auth", ctrl.mac(b"not-the-secret-000000", b"stage", 1, n_h)))
                assert not s.poll(2000) or ctrl.unpack(s.recv())[0] != "spec"   # no spec for a stranger
            s.close(0)
            time.sleep(0.5)
        assert head_p.poll() is None and not pwned.exists()
        # a fake head: a real stage (with the secret) connects and is sent a pickle instead of a challenge
        fake = ctx.socket(zmq.PAIR)
        fake.setsockopt(zmq.LINGER, 0)
        fport = free_port_run(2)
        fake.bind(f"tcp://127.0.0.1:{fport + 1}")
        stage = subprocess.Popen([MESH_BIN, "stage", "--checkpoint", str(ckpt), "--head", f"127.0.0.1:{fport}",
                                  "--pp-rank", "1", "--connect-timeout", "10"], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        assert fake.poll(30000)
        fake.recv()
        fake.send(pickle.dumps(_Pwn(str(pwned))))
        _, err = stage.communicate(timeout=30)
        assert stage.returncode == 3 and not pwned.exists()
        assert "the head at" in err and "Traceback" not in err   # refused before anything ran
        fake.close(0)
    finally:
        ctx.term()
        head_p.terminate()   # heard while it waits for its stages
        _, out = head_p.communicate(timeout=30)
    assert "failed the handshake" in out and not pwned.exists()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["mooncake", "zmq"])
def test_tp_prefill_feeds_decodes_of_any_tp(ckpt, etcd_server, expected, backend):
    """A TP=2 prefill (each rank prefills and serves its half of the KV heads, of every layer)
    behind the mesh, feeding a TP=1 and a TP=2 decode engine: output equals HF, nothing held."""
    cluster = f"c-tp-prefill-{backend}"
    common = ["--checkpoint", str(ckpt), "--dtype", "float64", "--block-size", "4", "--num-blocks", str(NUM_BLOCKS),
              "--max-batch-tokens", "32", "--kv-backend", backend, "--etcd", etcd_server.url, "--cluster", cluster,
              "--ttl", "3"]
    procs = []
    try:
        procs.append(Proc([MESH_BIN, "prefill", *common, "--tp-size", "2"], "ready", timeout=120))
        procs.append(Proc([MESH_BIN, "decode", *common, "--tp-size", "1"], "ready", timeout=120))
        procs.append(Proc([MESH_BIN, "decode", *common, "--tp-size", "2"], "ready", timeout=120))
        procs.append(Proc([MESH_BIN, "serve", "--port", "0", "--etcd", etcd_server.url, "--cluster", cluster,
                           "--decode-policy", "round_robin"], "mesh ", timeout=60))
        url = procs[-1].lines[-1].split()[1]
        deadline = time.monotonic() + 20
        while len(httpx.get(url + "/workers").json()["workers"]) < 3 or httpx.get(url + "/ready").status_code != 200:
            assert time.monotonic() < deadline, "mesh never saw the three workers"
            time.sleep(0.1)
        with httpx.Client(timeout=60) as c:
            for stream in (False, True):
                for p in PROMPTS:
                    r = c.post(url + "/v1/completions", json=body("c", p, stream))
                    assert r.status_code == 200, r.text
                    assert ids_of(r.content, stream) == expected[("c", p)], (p, stream)
        pre = procs[0].lines[-2].split()[1]
        decs = [procs[1].lines[-2].split()[1], procs[2].lines[-2].split()[1]]
        assert all(httpx.get(d + "/load").json()["in_flight"] == 0 for d in decs)
        deadline = time.monotonic() + 10
        while httpx.get(pre + "/kv/held").json()["transfers"]:
            assert time.monotonic() < deadline, "KV still held"
            time.sleep(0.05)
        pulls = [httpx.get(d + "/load").json() for d in decs]
        assert all(p["free_blocks"] == NUM_BLOCKS for p in pulls)
    finally:
        for p in procs[::-1]:
            p.stop()
