"""bench/anchors.py's answer check: what makes the router comparison count only correct answers."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from bench.anchors import check_tokens


def sse(*texts: str, done: bool = True) -> bytes:
    chunks = [b"data: " + orjson.dumps({"choices": [{"index": 0, "text": t}]}) + b"\n\n" for t in texts]
    return b"".join(chunks) + (b"data: [DONE]\n\n" if done else b"")


def test_check_tokens_counts_each_token_once() -> None:
    check_tokens(sse(" t1", " t2", " t3"), True, 3)
    check_tokens(orjson.dumps({"choices": [{"text": " t5 t6"}]}), False, 2)
    with pytest.raises(RuntimeError, match="4 tokens, not 3"):   # token 0 relayed twice
        check_tokens(sse(" t1", " t1", " t2", " t3"), True, 3)
    with pytest.raises(RuntimeError, match="DONE"):
        check_tokens(sse(" t1", done=False), True, 1)
    with pytest.raises(RuntimeError, match="1 tokens, not 2"):
        check_tokens(orjson.dumps({"choices": [{"text": " t5"}]}), False, 2)


def test_syscall_counts_sum_perf_stat_lines_by_group() -> None:
    """`bench.procs.Syscalls.parse` on `perf stat -x,` output as perf 6 writes it (comment line,
    counted and uncounted events)."""
    from bench.procs import Syscalls

    csv = ("# started on Sun Dec  6 18:40:01 2026\n\n"
           "2950,,syscalls:sys_enter_read,4001230,100.00,,\n"
           "12,,syscalls:sys_enter_recvfrom,4001230,100.00,,\n"
           "<not counted>,,syscalls:sys_enter_recvmsg,0,0.00,,\n"
           "2012,,syscalls:sys_enter_write,4001230,100.00,,\n"
           "1872,,syscalls:sys_enter_writev,4001230,100.00,,\n"
           "0,,syscalls:sys_enter_sendto,4001230,100.00,,\n"
           "545,,syscalls:sys_enter_epoll_pwait,4001230,100.00,,\n"
           "7,,syscalls:sys_enter_epoll_wait,4001230,100.00,,\n")
    assert Syscalls.parse(csv) == {"reads": 2962, "writes": 3884, "waits": 552}


@pytest.mark.parametrize("dialect", ["atom", "vllm", "sglang"])
async def test_direct_baseline_runs_both_legs_in_each_dialect(dialect: str) -> None:
    """The baseline each proxy's added p50 is read against (`Client.direct`): against the mock fleet
    of that dialect, every answer carries its tokens once, JSON and SSE, and the fleet ends with
    nothing held or in flight (the prefill's KV went to a decode in every request)."""
    import asyncio

    import aiohttp

    from bench.overhead import Client
    from workers.mock import FleetSpec, MockFleet

    fleet = MockFleet(FleetSpec(prefill=1, decode=1, dialect=dialect))
    await fleet.start()
    try:
        async with aiohttp.ClientSession() as s:
            c = Client(s, "", [w.url for w in fleet.prefills], [w.url for w in fleet.decodes])
            c.check, c.dialect = True, dialect
            for stream in (False, True, False, True):
                total, ttft = await c.direct(stream)
                assert 0 < ttft <= total
            assert len(c.reads) == 2 and min(c.reads) >= 1   # the SSE streams' reads were counted
        workers = [*fleet.prefills, *fleet.decodes]
        for _ in range(100):
            if not any(len(p.holder) for p in fleet.prefills) and not any(w.in_flight for w in workers):
                break
            await asyncio.sleep(0.02)
        assert {p.id: len(p.holder) for p in fleet.prefills if len(p.holder)} == {}
        assert {w.id: w.in_flight for w in workers if w.in_flight} == {}
    finally:
        await fleet.close()


async def test_rounds_alternate_the_order_and_pool_every_round() -> None:
    """`bench.overhead.rounds`: unmeasured warm runs first, then A B, B A (no target always first
    after the fleet changed mode); each target's requests, errors and CPU pooled over its rounds."""
    import asyncio

    from bench.overhead import rounds

    log: list[str] = []

    class Fake:
        filler, reads = "", []

        def __init__(self, name: str) -> None:
            self.name = name

        async def _one(self, stream: bool) -> tuple[float, float]:
            if not log or log[-1] != self.name:
                log.append(self.name)
            await asyncio.sleep(0.002)
            return 0.002, 0.001

        via_mesh = direct = _one

    class Tree:
        def __init__(self) -> None:
            self.t = 0.0

        def cpu_times(self) -> tuple[float, float]:
            self.t += 0.5
            return self.t, self.t

        def procs(self) -> list[object]:
            return []

    a, b = Fake("a"), Fake("b")
    out = await rounds([(a, "mesh", Tree(), False), (b, "direct", Tree(), False)],  # type: ignore[list-item]
                       False, 1, 0.05, 2, warm=0.02)
    # warm a, b; round 1 a, b; round 2 b, a (the log merges b's two runs in a row; in a fixed order
    # it would read a, b, a, b, a, b)
    assert log == ["a", "b", "a", "b", "a"]
    ra, rb = out
    assert ra.target == "mesh" and rb.target == "direct"
    assert ra.requests > 10 and rb.requests > 10 and ra.errors == rb.errors == 0
    # two measured rounds of the mesh's tree: 2 x (0.5 user + 0.5 system) seconds over its requests
    assert ra.mesh_cpu_ms_per_req == round(2000 / ra.requests, 4) and rb.mesh_cpu_ms_per_req is None
    assert 0.1 <= ra.seconds < 0.2
    # and round by round, in the order they ran: 1 s of CPU over each round's own requests
    assert ra.cpu_ms_rounds is not None and len(ra.cpu_ms_rounds) == 2 and rb.cpu_ms_rounds is None
    per = [1000 / x for x in ra.cpu_ms_rounds]   # each round's requests, as the figures give them
    assert all(abs(n - round(n)) < 0.01 for n in per) and round(sum(per)) == ra.requests


def test_round_ratios_read_the_rounds_side_by_side() -> None:
    """`bench.anchors.round_ratios`: round i of the mesh against round i of the router (they ran
    next to each other); the median, range and count at or below 1; nothing under three rounds."""
    from bench.anchors import round_ratios

    assert round_ratios([0.2, 0.2], [0.2, 0.2]) == ""
    assert round_ratios(None, [0.2, 0.2, 0.2]) == "" and round_ratios([0.1] * 3, [0.1] * 4) == ""
    # ratios 0.5, 1.0, 1.5, 2.0: median 1.25, two of four at or below
    got = round_ratios([0.1, 0.2, 0.3, 0.4], [0.2, 0.2, 0.2, 0.2])
    assert got == "; by round: median x1.25, x0.50-2.00, 2/4 at or below"
    assert round_ratios([0.3, 0.1, 0.2], [0.2, 0.2, 0.2]) == "; by round: median x1.00, x0.50-1.50, 2/3 at or below"


async def test_paired_rotates_the_order_and_pairs_each_turn() -> None:
    """`bench.overhead.paired`: one request per target each turn, the first target rotated so each
    leads equally often; the added p50 and the median of per-turn differences are read against the
    first target (the baseline); a turn where any target failed is dropped for all, its error counted."""
    from bench.overhead import paired

    order: list[str] = []
    calls = {"b": 0}

    class Fake:
        def __init__(self, name: str, ms: float) -> None:
            self.name, self.ms = name, ms

        async def _one(self, stream: bool) -> tuple[float, float]:
            order.append(self.name)
            if self.name == "b":
                calls["b"] += 1
                if calls["b"] == 3:   # the warm-up is call 1: turn 2 fails
                    raise RuntimeError("b failed")
            return self.ms / 1e3, 0.0

        via_mesh = direct = _one

    base, a, b = Fake("base", 1.0), Fake("a", 1.5), Fake("b", 0.75)
    out = await paired([(base, "direct"), (a, "mesh"), (b, "mesh")], False, 0.0)   # type: ignore[list-item]
    assert order == ["base", "a", "b"] and out[0]["requests"] == 0   # the warm-up turn only: nothing measured
    order.clear()
    calls["b"] = 0
    out = await paired([(base, "direct"), (a, "mesh"), (b, "mesh")], False, 0.02)   # type: ignore[list-item]
    turns = [order[i:i + 3] for i in range(3, len(order), 3)]   # after the warm-up turn
    assert turns[0] == ["base", "a", "b"] and turns[1] == ["a", "b", "base"] and turns[2] == ["b", "base", "a"]
    assert len(turns) >= 6
    dropped = 1
    assert [x["requests"] for x in out] == [len(turns) - dropped] * 3
    assert [x["errors"] for x in out] == [0, 0, 1]
    assert out[0]["added_p50_ms"] == 0.0 and out[0]["median_diff_ms"] == 0.0
    assert out[1]["added_p50_ms"] == 0.5 and out[1]["median_diff_ms"] == 0.5
    assert out[2]["added_p50_ms"] == -0.25 and out[2]["median_diff_ms"] == -0.25
    assert out[1]["base_p50_ms"] == 1.0 and out[2]["p50_ms"] == 0.75


def test_cpu_awake_holds_a_zero_latency_request_and_ends_it_on_exit(tmp_path: Path) -> None:
    """`--awake`: the PM QoS request is the int32 0 written to the device, in force while the file is
    open; a device it cannot open is said, not ignored (the run then refuses to start)."""
    from bench.procs import CpuAwake

    dev = tmp_path / "cpu_dma_latency"
    dev.write_bytes(b"")
    aw = CpuAwake()
    aw.DEVICE = str(dev)
    with aw:
        assert aw.held and aw.fd is not None
        assert dev.read_bytes() == (0).to_bytes(4, "little", signed=True)
    assert not aw.held and aw.fd is None
    missing = CpuAwake()
    missing.DEVICE = str(tmp_path / "nowhere")
    with missing:
        assert not missing.held and "nowhere" in missing.why


@pytest.mark.parametrize("dialect", ["atom", "vllm", "sglang"])
async def test_null_upstream_replays_the_fleets_answers_to_the_mesh_and_to_direct(dialect: str) -> None:
    """`bench/overhead.py --upstream null`: the answers captured from the mock fleet in `dialect`
    (every block back in the fleet after the capture), replayed by size and mode: the direct
    baseline and the mesh in that dialect get every token once, JSON and SSE, short and long
    prompts; the prefill's answer is the capture for the largest size not above the body's length
    (a long prompt's block ids), byte for byte."""
    import aiohttp

    from bench.null_upstream import Answers, capture, serve
    from bench.overhead import Client
    from mesh.app import bound_port, create_app, start_site
    from mesh.config import MeshConfig, Timeouts, make_worker

    doc = await capture(dialect, [0, 8000])
    assert [c["size"] for c in doc["captures"]] == [0, 8000]
    answers = Answers(doc)
    servers = await serve(answers, 1, 1)
    pre, dec = (f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}" for s in servers)
    extra = {"bootstrap_port": int(pre.rsplit(":", 1)[1])} if dialect == "sglang" else {}
    app = create_app(MeshConfig(
        host="127.0.0.1", port=0, prefill_policy="round_robin", decode_policy="round_robin",
        prefill=(make_worker("prefill", {"url": pre, "model": "mock-model", "dialect": dialect, **extra}, 0),),
        decode=(make_worker("decode", {"url": dec, "model": "mock-model", "dialect": dialect}, 0),),
        timeouts=Timeouts(prefill=5, decode_first_byte=5, decode_idle=5, release=2)))
    runner = await start_site(app, "127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as s:
            for size in (0, 8000, 20000):
                c = Client(s, f"http://127.0.0.1:{bound_port(runner)}", [pre], [dec], prompt_bytes=size)
                c.check, c.dialect = True, dialect
                for stream in (False, True):
                    await c.direct(stream)   # raises on a wrong token count
                    await c.via_mesh(stream)
            long_body = orjson.dumps({"model": "mock-model", "prompt": "x" * 9000, "max_tokens": 1})
            async with s.post(pre + "/v1/completions", data=long_body) as r:
                assert r.status == 200 and await r.read() == doc["captures"][1]["prefill"].encode()
            async with s.post(pre + "/v1/completions", data=b'{"prompt":"short"}') as r:
                assert await r.read() == doc["captures"][0]["prefill"].encode()
    finally:
        await runner.cleanup()
        for srv in servers:
            srv.close()


async def test_null_upstream_reads_requests_in_any_pieces_and_refuses_bodies_it_cannot_delimit() -> None:
    """Pipelined requests in one write are answered in order; a request sent a byte at a time is
    answered once; GET /health and /v1/models answer, other paths 404 (no /load: the mesh finds no
    holder API); a body without a Content-Length (chunked) is a 411 and the connection closes."""
    import asyncio

    from bench.null_upstream import Answers, serve

    sse_events = b"".join(b'data: {"choices":[{"index":0,"text":" t%d"}]}\n\n' % i for i in (1, 2)) + b"data: [DONE]\n\n"
    answers = Answers({"model": "m", "captures": [
        {"size": 0, "prefill": '{"p":0}', "decode_json": '{"d":0}', "decode_sse": sse_events.decode()}]})
    servers = await serve(answers, 0, 1)
    port = servers[0].sockets[0].getsockname()[1]

    def post(body: bytes) -> bytes:
        return b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)

    async def exchange(data: bytes, pieces: int = 1) -> bytes:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        step = max(1, len(data) // pieces)
        for i in range(0, len(data), step):
            w.write(data[i:i + step])
            await w.drain()
        w.write_eof()
        out = await asyncio.wait_for(r.read(), 5)
        w.close()
        return out

    try:
        got = await exchange(post(b'{"a":1}') + post(b'{"stream":true}') + b"GET /health HTTP/1.1\r\n\r\n"
                             + b"GET /v1/models HTTP/1.1\r\n\r\n" + b"GET /load HTTP/1.1\r\n\r\n")
        heads = [h.split(b"\r\n")[0] for h in got.split(b"HTTP/1.1 ")[1:]]
        assert heads == [b"200 OK", b"200 OK", b"200 OK", b"200 OK", b"404 Not Found"]
        assert got.index(b'{"d":0}') < got.index(b"text/event-stream") < got.index(b'"id":"m"')
        assert b"%x\r\n" % len(b'data: {"choices":[{"index":0,"text":" t1"}]}\n\n') in got   # one chunk per event
        assert b"0\r\n\r\n" in got
        assert (await exchange(post(b'{"b":2}'), pieces=40)).count(b'{"d":0}') == 1
        refused = await exchange(b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
                                 b"5\r\nhello\r\n0\r\n\r\n" + post(b'{"c":3}'))
        assert refused.startswith(b"HTTP/1.1 411") and b'{"d":0}' not in refused
    finally:
        for srv in servers:
            srv.close()


async def test_null_upstream_spends_the_cpu_it_is_told_per_kb_of_a_post() -> None:
    """`--work-us-per-kb`: before a POST's answer the upstream spins that much of its CPU per kB of
    the body (a busy neighbour for the proxy); a GET costs nothing; a negative figure is refused."""
    import asyncio
    import time

    import pytest

    from bench.null_upstream import Answers, serve

    doc = {"model": "m", "captures": [{"size": 0, "prefill": "{}", "decode_json": '{"d":0}',
                                       "decode_sse": "data: [DONE]\n\n"}]}
    with pytest.raises(ValueError, match="work-us-per-kb"):
        Answers(doc, -1.0)
    servers = await serve(Answers(doc, 2000.0), 0, 1)   # 2 ms per kB: a 50 kB body costs 100 ms
    port = servers[0].sockets[0].getsockname()[1]
    body = b"x" * 50_000
    try:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        for req, least, most in ((b"GET /health HTTP/1.1\r\n\r\n", 0.0, 0.05),
                                 (b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body),
                                  0.1, 5.0)):
            cpu0 = time.thread_time()   # the server runs in this thread: its spin is this thread's CPU
            w.write(req)
            await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 10)
            spent = time.thread_time() - cpu0
            assert least <= spent < most, (req[:20], spent)
            await asyncio.wait_for(r.readexactly(2 if req.startswith(b"GET") else 7), 5)   # "{}" / '{"d":0}'
        w.close()
    finally:
        for s in servers:
            s.close()
