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

What it does not do: streams whose events come farther apart than a period (an engine's tokens,
milliseconds apart) do not start it, however many there are: pacing them would only trade a
blocking `epoll_wait` per read for a sleep and a poll per period (a first version that paced on
any two reads cost ~20% more CPU per request at 5 ms a token, 64 streams; docs/benchmarks.md).
Such streams start it only on their own bursts (a last event and the stream's end within a
period), for a couple of periods. At one or a few requests in flight it
never starts, so an idle mesh's latency is untouched.

Cost: while pacing, a read waits at most one period (plus the kernel's timer slack, ~50 us) before
the mesh handles it. `mesh serve --pace-us` sets the period (default 1000 us; 0: off). The default
was 250 us until a run beside the zero-cost upstreams and the fleet at 0.5 and 5 ms a token showed
1000 us spending 6-38% less CPU per SSE request at c=16 and c=64 with the same or lower p50
(docs/benchmarks.md, "ninth"): an event that comes faster than 1 ms after the one before may wait
up to 1 ms, at most a token's worth at 1,000 tokens a second per stream.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

MIN_ACTIVE = 4   # requests in flight before the loop may pace


def no_note(conn: Any) -> None:
    """`note` when pacing is off."""
    return None


class Pacer:
    """One per mesh app. The fast server counts its requests in `active`; every read of a relayed
    stream on the hot legs (`mesh.h1`) calls `note(conn)`, where `conn.read_at` is the stream
    connection's last read (time.monotonic, kept here)."""

    __slots__ = ("period", "active", "on", "seen", "quiet", "due", "loop", "naps", "slept", "starts", "note")

    def __init__(self, period_s: float) -> None:
        if period_s < 0:
            raise ValueError("the pacing period must be 0 (off) or more")
        self.period = period_s
        self.active = 0        # the fast server's requests in flight
        self.on = False        # pacing: `_tick` runs at the head of every loop iteration
        self.seen = 0          # reads of flowing streams since the last tick
        self.quiet = 0         # ticks in a row that found none
        self.due = 0.0         # the earliest time of the next poll while pacing
        self.loop: asyncio.AbstractEventLoop | None = None
        self.starts = 0        # times pacing started (tests, bench)
        self.naps = 0          # sleeps taken
        self.slept = 0.0       # seconds slept in all
        self.note = self._note if period_s > 0 else no_note   # the relays call this on every read

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
            self.on = True
            self.seen = 1
            self.quiet = 0
            self.starts += 1
            self.due = now + self.period
            if self.loop is None:
                self.loop = asyncio.get_running_loop()
            self.loop.call_soon(self._tick)

    def _tick(self) -> None:
        if not self.seen:
            self.quiet += 1
        else:
            self.quiet = 0
        if self.quiet >= 2 or self.active < MIN_ACTIVE:
            # two periods without a flowing stream's read, or little in flight: back to blocking
            # waits. (Two: on uvloop a tick follows the poll's reads; on asyncio's own loop it
            # runs before them.)
            self.on = False
            return
        self.seen = 0
        now = time.monotonic()
        rest = self.due - now
        if rest > 0:
            time.sleep(rest)
            self.naps += 1
            self.slept += time.monotonic() - now   # as slept: the kernel's timer slack included
            now = self.due                          # (the cadence keeps to the periods)
        self.due = now + self.period
        assert self.loop is not None   # set when pacing started
        self.loop.call_soon(self._tick)
