"""Event-loop pacing under load (`mesh.pacer`): while enough requests are in flight and reads come
densely, the loop polls at most once a period, so one read gathers what arrived meanwhile; it never
starts with few requests in flight, never sleeps once a period is spent anyway, stops when reads
thin out, and a mesh that paces answers exactly as one that does not."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from types import SimpleNamespace

import aiohttp
import openai
import pytest

from contract.errors import ConfigError
from mesh.cli import build_config, parser
from mesh.config import MeshConfig
from mesh.pacer import MIN_ACTIVE, MIN_REQUEST_PERIODS, WHOLE_MIN, WINDOW, Pacer, no_note
from workers.fake import MockTiming
from workers.mock import FleetSpec


class _Reader(asyncio.Protocol):
    """A relayed stream's socket, as the mesh's `h1` pool reads one: every read tells the pacer."""

    def __init__(self, pacer: Pacer) -> None:
        self.pacer, self.reads, self.bytes, self.read_at = pacer, 0, 0, 0.0

    def data_received(self, data: bytes) -> None:
        self.pacer.note(self)
        self.reads += 1
        self.bytes += len(data)


def _drip(sock: socket.socket, n: int, gap_s: float, done: threading.Event, delay_s: float = 0.0) -> None:
    """`n` one-byte writes, `gap_s` apart, from another thread (an upstream streaming events)."""
    time.sleep(delay_s)
    try:
        for _ in range(n):
            sock.send(b"x")
            time.sleep(gap_s)
    finally:
        done.set()


async def _stream(pacer: Pacer, n: int = 300, gap_s: float = 0.0002, delay_s: float = 0.0) -> _Reader:
    """`n` dripped bytes read through `pacer` on this loop (the first after `delay_s`)."""
    loop = asyncio.get_running_loop()
    a, b = socket.socketpair()
    a.setblocking(False)
    reader = _Reader(pacer)
    transport, _ = await loop.connect_accepted_socket(lambda: reader, a)
    done = threading.Event()
    th = threading.Thread(target=_drip, args=(b, n, gap_s, done, delay_s), daemon=True)
    th.start()
    try:
        while reader.bytes < n:
            await asyncio.sleep(0.005)
    finally:
        th.join(10)
        transport.close()
        b.close()
    return reader


async def _dense() -> None:
    pacer = Pacer(0.002)
    pacer.active = MIN_ACTIVE
    n, gap = 300, 0.0002          # ~60 ms of one-byte events, one every 0.2 ms (plus sleep slack)
    t0 = time.monotonic()
    reader = await _stream(pacer, n, gap)
    took = time.monotonic() - t0
    assert reader.bytes == n                      # nothing lost
    assert pacer.starts >= 1 and pacer.naps > 0
    # at most about one read per 2 ms period (and the read that started pacing): without pacing
    # this reader takes a read per byte or nearly
    assert reader.reads <= took / 0.002 + 5, (reader.reads, took)
    assert reader.reads < n / 3


async def test_dense_reads_under_load_are_gathered_a_period_at_a_time():
    await _dense()


def test_dense_reads_are_gathered_on_uvloop_too():
    """The mesh serves on uvloop, which runs a tick after the poll's reads (asyncio: before)."""
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as r:
        r.run(_dense())


async def test_reads_thin_out_and_the_loop_blocks_again():
    pacer = Pacer(0.002)
    pacer.active = MIN_ACTIVE
    await _stream(pacer, 200, 0.0002)
    await asyncio.sleep(0.02)                      # ten periods without a read
    assert not pacer.on
    naps = pacer.naps
    await asyncio.sleep(0.05)
    assert pacer.naps == naps                      # idle: no pacing, no sleeps


async def test_few_requests_in_flight_never_pace():
    pacer = Pacer(0.002)
    pacer.active = MIN_ACTIVE - 1
    reader = await _stream(pacer, 200, 0.0002)
    assert pacer.starts == 0 and pacer.naps == 0
    assert reader.bytes == 200


def test_steady_streams_never_pace_however_many(monkeypatch):
    """Eight streams, each an event every 10 ms (an engine's tokens), staggered: together a read
    every 1.25 ms, so reads of different streams often come within a period, but no stream is
    faster than the period. Pacing them would gather nothing per stream; it never starts. (The
    reads on a clock of the test's own: on a loaded machine a late read followed by a timely one
    is a real burst, which may start it for a couple of periods.)"""
    clock = [1000.0]
    monkeypatch.setattr("mesh.pacer.time.monotonic", lambda: clock[0])
    pacer = Pacer(0.002)
    pacer.active = MIN_ACTIVE
    streams = [_Reader(pacer) for _ in range(8)]
    for k in range(12):
        for i, r in enumerate(streams):
            clock[0] = 1000.0 + k * 0.010 + i * 0.00125
            r.data_received(b"x")
    assert pacer.starts == 0 and not pacer.on
    ticks: list[object] = []
    pacer.loop = SimpleNamespace(call_soon=ticks.append)   # type: ignore[assignment]  # takes the tick only
    clock[0] += 0.0015                     # and one stream read again within the period: it starts
    streams[-1].data_received(b"x")
    assert pacer.starts == 1 and pacer.on and ticks == [pacer._tick]


class _Clock:
    """time.monotonic and time.sleep of `mesh.pacer` on a clock of the test's own."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 1000.0
        monkeypatch.setattr("mesh.pacer.time.monotonic", lambda: self.now)
        monkeypatch.setattr("mesh.pacer.time.sleep", self.sleep)

    def sleep(self, s: float) -> None:
        self.now += s


def _answers(pacer: Pacer, clock: _Clock, per_period: float, periods: int, ticks: list[object]) -> None:
    """Whole answers coming at `per_period` a period for `periods` periods. Not pacing, each is
    read as it comes; pacing, the loop runs its tick (which sleeps out the period, on the test's
    clock, and queues the next: taken from `ticks`) and then reads what came meanwhile."""
    conn = SimpleNamespace()
    gap = pacer.period / per_period
    end = clock.now + periods * pacer.period
    due = clock.now + gap       # the next answer's arrival
    while clock.now < end:
        if pacer.on:
            ticks.pop()
            pacer._tick()
            if not pacer.on:
                continue
            if clock.now < due:   # a period of no answers: the tick sleeps nothing more
                clock.now = min(due, clock.now + pacer.period)
        else:
            clock.now = max(clock.now, due)
        while due <= clock.now:
            pacer.note_whole(conn)
            due += gap


def _loaded(period: float, monkeypatch: pytest.MonkeyPatch) -> tuple[Pacer, _Clock, list[object]]:
    clock = _Clock(monkeypatch)
    pacer = Pacer(period)
    pacer.active = MIN_ACTIVE
    for _ in range(64):
        pacer.finished(MIN_REQUEST_PERIODS * period * 2)   # requests take 8 periods
    ticks: list[object] = []
    pacer.loop = SimpleNamespace(call_soon=ticks.append)   # type: ignore[assignment]  # takes the tick only
    return pacer, clock, ticks


def test_dense_answers_under_load_pace_until_they_thin_out(monkeypatch):
    """JSON legs' answers (and streams' heads) coming WHOLE_MIN or more a period, over a window of
    WINDOW periods, with 4 or more requests in flight that take MIN_REQUEST_PERIODS periods or
    more: the loop paces; it goes on while they come half as densely, and ends two periods after a
    window finds them thinner than that."""
    pacer, clock, ticks = _loaded(0.002, monkeypatch)
    _answers(pacer, clock, WHOLE_MIN - 1, 3 * WINDOW, ticks)        # a little thinner: never
    assert pacer.starts == 0 and not pacer.on
    _answers(pacer, clock, WHOLE_MIN + 1, 2 * WINDOW, ticks)        # dense: it starts
    assert pacer.whole_starts == pacer.starts == 1 and pacer.on and pacer.dense
    naps = pacer.naps
    _answers(pacer, clock, WHOLE_MIN / 2 + 0.5, 3 * WINDOW, ticks)   # half as dense still: it goes on
    assert pacer.on and pacer.starts == 1 and pacer.naps > naps + 2 * WINDOW
    _answers(pacer, clock, WHOLE_MIN / 4, 3 * WINDOW, ticks)         # thin: it ends
    assert not pacer.on and not pacer.dense and pacer.starts == 1


def test_answers_of_fast_requests_never_pace(monkeypatch):
    """Upstreams that answer within a few periods (a zero-cost one): the loop's sleeps would be the
    requests' time, and a closed loop of clients would slow to the period's pace. However dense
    their answers, they do not start pacing."""
    pacer, clock, ticks = _loaded(0.002, monkeypatch)
    pacer.took = 0.0
    for _ in range(64):
        pacer.finished(0.9 * MIN_REQUEST_PERIODS * 0.002)
    _answers(pacer, clock, 10 * WHOLE_MIN, 3 * WINDOW, ticks)
    assert pacer.starts == 0 and not pacer.on


def test_answers_with_few_in_flight_never_pace(monkeypatch):
    pacer, clock, ticks = _loaded(0.002, monkeypatch)
    pacer.active = MIN_ACTIVE - 1
    _answers(pacer, clock, 10 * WHOLE_MIN, 3 * WINDOW, ticks)
    assert pacer.starts == 0


def test_pacing_ends_after_a_period_with_few_in_flight_not_at_a_tick_with_few(monkeypatch):
    """A paced loop answers a period's requests together and reads their next ones while it sleeps,
    so at a tick few may be in flight. A tick ends pacing only when the whole period since the
    one before had fewer than MIN_ACTIVE in flight (the fast server keeps the peak)."""
    pacer, clock, ticks = _loaded(0.002, monkeypatch)
    _answers(pacer, clock, WHOLE_MIN + 1, 2 * WINDOW, ticks)
    assert pacer.on
    pacer.active, pacer.peak = 0, MIN_ACTIVE   # answered all; 4 were in flight earlier this period
    ticks.pop()
    pacer._tick()
    assert pacer.on
    ticks.pop()
    pacer._tick()                              # a period with none in flight
    assert not pacer.on


async def test_a_period_already_spent_is_not_slept():
    """The tick's arithmetic: an iteration that outlasted the period (a saturated loop) sleeps
    nothing; one that did not sleeps out the rest, and the next period starts where it ends."""
    pacer = Pacer(0.002)
    pacer.active = pacer.peak = MIN_ACTIVE
    pacer.loop = asyncio.get_running_loop()
    pacer.on, pacer.seen, pacer.due = True, 1, time.monotonic() - 0.001
    pacer._tick()
    assert pacer.naps == 0 and pacer.slept == 0
    assert pacer.due - time.monotonic() > 0.0015       # the next period starts now
    pacer.seen = 1
    t0 = time.monotonic()
    pacer._tick()                                      # the rest of the period: slept
    assert pacer.naps == 1 and 0.001 < pacer.slept < 0.02   # the rest of the period, plus timer slack
    assert time.monotonic() - t0 >= pacer.slept
    pacer.active = 0            # the next tick (queued) sees 4 in flight this period still; the one after ends it
    for _ in range(3):
        await asyncio.sleep(0)
    assert not pacer.on


def test_period_zero_is_off():
    pacer = Pacer(0.0)
    assert pacer.note is no_note
    with pytest.raises(ValueError):
        Pacer(-0.001)


@pytest.mark.parametrize("value", [-1, 10_001, True, 2.5, "250"])
def test_pace_us_out_of_range_is_a_config_error(value):
    with pytest.raises(ConfigError, match="pace_us"):
        MeshConfig(pace_us=value)


def test_pace_us_flag():
    p = parser()
    a = p.parse_args(["serve", "--decode", "http://127.0.0.1:1", "--prefill", "http://127.0.0.1:2",
                      "--pace-us", "0"])
    assert build_config(a).pace_us == 0
    a = p.parse_args(["serve", "--decode", "http://127.0.0.1:1", "--prefill", "http://127.0.0.1:2"])
    assert build_config(a).pace_us == 1000


@pytest.mark.parametrize("dialect", ["atom", "sglang"])
async def test_a_pacing_mesh_answers_as_one_that_does_not(make_pd, dialect):
    """Concurrent 64-token streams through a mesh that paces and one that does not: the same text
    from both, every stream whole, every block back. (The mock decode, on this loop, writes an
    event every 0.2 ms or as soon after as the loop comes round, ~1.5 ms: a stream faster than the
    period.)"""
    spec = FleetSpec(prefill=1, decode=1, dialect=dialect, seed=7, timing=MockTiming(decode_ms_per_token=0.2))
    paced = await make_pd(spec, pace_us=5000)   # longer than this crowded loop takes to come round
    plain = await make_pd(spec, pace_us=0)

    async def streams(url: str) -> list[str]:
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)

        async def one(i: int) -> str:
            out = []
            s = await c.completions.create(model="mock-model", prompt=f"prompt {i} " * 20, max_tokens=64,
                                           stream=True)
            async for ch in s:
                out.append(ch.choices[0].text)
            return "".join(out)

        try:
            return list(await asyncio.gather(*(one(i) for i in range(2 * MIN_ACTIVE))))
        finally:
            await c.close()

    got = await streams(paced.url)
    assert paced.state.pacer.starts >= 1 and paced.state.pacer.naps > 0   # it did pace
    assert plain.state.pacer.note is no_note
    assert got == await streams(plain.url)
    assert all(t for t in got)
    assert paced.state.pacer.active == 0 and plain.state.pacer.active == 0
    async with aiohttp.ClientSession() as http:   # an operator sees it pace
        async with http.get(paced.url + "/metrics") as r:
            text = await r.text()
    naps = [ln for ln in text.splitlines() if ln.startswith("atomesh_loop_paced_periods_total ")]
    assert naps and float(naps[0].split()[1]) == paced.state.pacer.naps
    assert await paced.wait_released() == 0 and await plain.wait_released() == 0


@pytest.mark.parametrize("dialect", ["atom", "sglang"])
async def test_dense_json_answers_pace_and_answer_as_without(make_pd, dialect):
    """Concurrent JSON requests in a closed loop, each taking ~40 ms of mock decode, through a mesh
    that paces (a 5 ms period) and one that does not: dense answers start pacing; the same text
    from both, every block back."""
    spec = FleetSpec(prefill=1, decode=1, dialect=dialect, seed=7, timing=MockTiming(decode_ms_per_token=2.5))
    paced = await make_pd(spec, pace_us=5000)
    plain = await make_pd(spec, pace_us=0)

    async def answers(url: str) -> list[str]:
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        out: dict[int, str] = {}

        async def client(k: int) -> None:
            for j in range(6):
                i = j * 32 + k
                r = await c.completions.create(model="mock-model", prompt=f"prompt {i} " * 20, max_tokens=16)
                out[i] = r.choices[0].text

        try:
            await asyncio.gather(*(client(k) for k in range(32)))
        finally:
            await c.close()
        return [out[i] for i in sorted(out)]

    got = await answers(paced.url)
    assert paced.state.pacer.whole_starts >= 1 and paced.state.pacer.naps > 0   # it paced on answers
    assert got == await answers(plain.url)
    assert len(got) == 192 and all(got)
    assert paced.state.pacer.active == 0
    assert await paced.wait_released() == 0 and await plain.wait_released() == 0
