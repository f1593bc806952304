"""Event-loop pacing for bursty streams: fewer, fuller reads (issue 20).

Why: an upstream that writes a stream's events faster than the mesh comes back to the socket
costs the mesh a wake-up, a read and a write per event. A zero-cost decode's 64-event SSE stream
took 26-38 reads, writes and wake-ups of the mesh per stream at c=16; the Rust routers, slower to
come back to their sockets, took 5-9 reads for the same stream. That, not Python, was most of the
mesh's lead over sglang-router in CPU per SSE request (docs/benchmarks.md).

What it does: while at least `MIN_ACTIVE` client requests are in flight on the fast server and a
relayed stream is read twice within `period` (its upstream writes events faster than that), the
loop polls at most once per `period`: a callback at the head of each iteration sleeps out what is
left of the period since the last poll, then the loop's poll gathers everything that arrived
meanwhile, so a bursty stream's events come in one read and go out in one write. An iteration that
took a period or longer by itself sleeps nothing, so a saturated loop loses no capacity. Pacing
lasts while some stream keeps being read period after period (read again within two periods); two
periods in a row without such a read, or fewer than `MIN_ACTIVE` requests in flight, end it, and
the loop blocks in `epoll_wait` again, as it does when pacing is off.

Dense answers do the same (issue 20): JSON legs' whole answers and streams' heads, read under
load at `WHOLE_MIN` (3) or more a period over a window of `WINDOW` (8) periods, while the fast
server's requests take `MIN_REQUEST_PERIODS` (4) periods or more each (an average of the last ~16),
start pacing too; it goes on while they come half as densely and ends two periods after a window
finds them thinner. Every answer still takes its own read, but the loop wakes once a period
instead of once an answer: against the zero-cost mock fleet at 16 and 64 JSON requests in flight
the mesh woke 4.5-4.9 times a request, sglang-router 1.6-1.7, and the mesh spent more CPU a
request where the routers spent less. Paced on answers, the mesh wakes ~0.5 times a request and
spends 15-26% less CPU on one, with the same or higher throughput (docs/benchmarks.md, "tenth").
The request-time guard keeps a zero-cost upstream's closed loop from slowing to the period's
pace: against one that answers in microseconds a 1 ms period capped 16 clients at ~5,000
requests a second, half of what they got without. Pacing ends too once a whole period passed with
fewer than `MIN_ACTIVE` in flight (the fast server keeps the period's peak: a paced loop answers a
period's requests together, so at a tick itself few may be in flight).

What it does not do: streams whose events come farther apart than a period (an engine's tokens,
milliseconds apart) do not start it, however many there are: pacing them would only trade a
blocking `epoll_wait` per read for a sleep and a poll per period (a first version that paced on
any two reads cost ~20% more CPU per request at 5 ms a token, 64 streams; docs/benchmarks.md).
Such streams start it only on their own bursts (a last event and the stream's end within a
period), for a couple of periods. At one or a few requests in flight it
never starts, so an idle mesh's latency is untouched.

Cost: while pacing, a read (an event, an answer) waits at most one period (plus the kernel's
timer slack, ~50 us) before the mesh handles it. `mesh serve --pace-us` sets the period (default
1000 us; 0: off). The default was 250 us until a run beside the zero-cost upstreams and the fleet at 0.5 and 5 ms a token showed
1000 us spending 6-38% less CPU per SSE request at c=16 and c=64 with the same or lower p50
(docs/benchmarks.md, "ninth"): an event that comes faster than 1 ms after the one before may wait
up to 1 ms, at most a token's worth at 1,000 tokens a second per stream.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

MIN_ACTIVE = 4   # requests in flight before the loop may pace
WHOLE_MIN = 3    # whole answers (JSON legs, stream heads) a period, over a window, that start pacing
WINDOW = 8       # periods a window of whole answers spans
MIN_REQUEST_PERIODS = 4   # ... and only while requests take this many periods or more


def no_note(conn: Any) -> None:
    """`note` when pacing is off."""
    return None


class Pacer:
    """One per mesh app. The fast server counts its requests in `active` (and their peak since the
    last tick in `peak`) and tells `finished` how long each took; every read of a relayed stream on
    the hot legs (`mesh.h1`) calls `note(conn)`, where `conn.read_at` is the stream connection's
    last read (time.monotonic, kept here), and every other read there `note_whole(conn)`."""

    __slots__ = ("period", "active", "on", "seen", "quiet", "due", "loop", "naps", "slept", "starts", "note",
                 "note_whole", "dense", "took", "whole_starts", "_win_at", "_win_n", "peak")

    def __init__(self, period_s: float) -> None:
        if period_s < 0:
            raise ValueError("the pacing period must be 0 (off) or more")
        self.period = period_s
        self.active = 0        # the fast server's requests in flight
        self.peak = 0          # the most in flight since the last tick (the fast server keeps it)
        self.on = False        # pacing: `_tick` runs at the head of every loop iteration
        self.seen = 0          # reads of flowing streams since the last tick
        self.quiet = 0         # ticks in a row that found none
        self.due = 0.0         # the earliest time of the next poll while pacing
        self.loop: asyncio.AbstractEventLoop | None = None
        self.starts = 0        # times pacing started (tests, bench)
        self.naps = 0          # sleeps taken
        self.slept = 0.0       # seconds slept in all
        self.note = self._note if period_s > 0 else no_note   # the relays call this on every read
        # every other read on the hot legs (a whole answer, a stream's head) calls this one
        self.note_whole = self._note_whole if period_s > 0 else no_note
        self.dense = False       # the last window's whole answers came densely enough to pace (`_window`)
        self.took = 0.0          # the fast server's requests lately, seconds each (`finished`)
        self.whole_starts = 0    # of `starts`, those by dense whole answers
        self._win_at = 0.0       # the current window's start (time.monotonic)
        self._win_n = 0          # whole answers read in it under load

    def finished(self, seconds: float) -> None:
        """The fast server's request took this long (an average over the last ~16)."""
        self.took += (seconds - self.took) * 0.0625

    def _window(self, now: float, need: float) -> bool:
        """At the end of a window of WINDOW periods: were the whole answers read under load in it at
        least `need` a period, with requests taking MIN_REQUEST_PERIODS or more? Sets and returns
        `dense` and starts the next window. Before its end: False, `dense` as it was."""
        span = now - self._win_at
        if span < WINDOW * self.period:
            return False
        self.dense = self._win_n * self.period >= need * span and self.took >= MIN_REQUEST_PERIODS * self.period
        self._win_at, self._win_n = now, 0
        return self.dense

    def _note_whole(self, conn: Any) -> None:
        if self.active < MIN_ACTIVE:
            return
        self._win_n += 1
        if self.on:
            return
        now = time.monotonic()
        if self._window(now, WHOLE_MIN):   # dense answers under load: pace
            self.whole_starts += 1
            self._start(now)

    def _note(self, conn: Any) -> None:
        if self.active < MIN_ACTIVE:
            return
        now = time.monotonic()
        gap = now - conn.read_at
        conn.read_at = now
        if self.on:
            if gap < 2 * self.period:   # read again a period later: the stream still flows
                self.seen += 1
        elif gap < self.period:         # a stream read twice within a period, under load: pace
            self._start(now)

    def _start(self, now: float) -> None:
        self.on = True
        self.seen = 1
        self.quiet = 0
        self.peak = self.active   # (both notes start it only with MIN_ACTIVE or more in flight)
        self.starts += 1
        self.due = now + self.period
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        self.loop.call_soon(self._tick)

    def _tick(self) -> None:
        now = time.monotonic()
        if self.dense:   # pacing by dense answers goes on while they come half as densely (hysteresis)
            self._window(now, WHOLE_MIN / 2)
        if not self.seen and not self.dense:
            self.quiet += 1
        else:
            self.quiet = 0
        if self.quiet >= 2 or self.peak < MIN_ACTIVE:
            # two periods without a flowing stream's read, answers no longer dense, or little in
            # flight all period: back to blocking waits. (Two: on uvloop a tick follows the poll's
            # reads; on asyncio's own loop it runs before them. The peak, not the count now: a
            # paced loop answers a period's requests together, and their next ones come in while
            # it sleeps, so at a tick few may be in flight.)
            self.on = self.dense = False
            return
        self.seen = 0
        self.peak = self.active
        rest = self.due - now
        if rest > 0:
            time.sleep(rest)
            self.naps += 1
            self.slept += time.monotonic() - now   # as slept: the kernel's timer slack included
            now = self.due                          # (the cadence keeps to the periods)
        self.due = now + self.period
        assert self.loop is not None   # set when pacing started
        self.loop.call_soon(self._tick)
