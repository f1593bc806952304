"""The ledger's state machine alone (mesh/ledger.py): every transition, time from a clock the test
moves, holder listings written by hand. No mesh, no sockets, no polling: the I/O half
(mesh/reconcile.py) is exercised by tests/test_ledger.py through a whole mesh."""

from __future__ import annotations

import pytest

from contract.protocol import FreedTransfer, HeldList, HeldTransfer
from contract.snapshot import make_worker
from mesh.ledger import Entry, Ledger, State

GRACE = 5.0


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Book:
    """What the ledger reports outward: blocks back to the pools, terminal states, duplicates."""

    def __init__(self) -> None:
        self.taken: list[tuple[str, int]] = []
        self.returned: list[tuple[str, int]] = []
        self.terminal: list[tuple[str, str, float | None]] = []
        self.unreclaimable_by: list[str] = []
        self.duplicates = 0

    def kv_taken(self, worker_id: str, blocks: int) -> None:
        self.taken.append((worker_id, blocks))

    def kv_returned(self, worker_id: str, blocks: int) -> None:
        self.returned.append((worker_id, blocks))

    def kv_terminal(self, state: str, reason: str, held_s: float | None) -> None:
        self.terminal.append((state, reason, held_s))

    def unreclaimable(self, pipeline: str) -> None:
        self.unreclaimable_by.append(pipeline)

    def duplicate_release(self) -> None:
        self.duplicates += 1


@pytest.fixture
def env() -> tuple[Ledger, Clock, Book]:
    clock, book = Clock(), Book()
    return Ledger("mesh-a", book, book, grace_s=GRACE, clock=clock), clock, book


W = make_worker("prefill", {"url": "http://127.0.0.1:9", "model": "m", "id": "pipe"}, 0)


def listing(*held: HeldTransfer, freed: tuple[FreedTransfer, ...] = (), seq: int = 0) -> HeldList:
    return HeldList(transfers=held, freed=freed, seq=seq)


def held_pair(led: Ledger, rid: str = "r1", tid: str = "t1", blocks: int = 3) -> Entry:
    e = led.begin(rid, W)
    led.held(e, tid, blocks)
    return e


def test_consumer_release_settles_as_released_and_returns_the_blocks(env):
    led, clock, book = env
    e = held_pair(led)
    led.decoding(e)
    assert e.state == State.DECODING and led.pipelines_to_ask() == [W]
    clock.t += 0.2
    led.decode_done(e)
    todo = led.apply(W, listing(freed=(FreedTransfer("t1", "consumer", 0.2, 7, "r1"),), seq=7))
    assert todo == [] and e.state == State.RELEASED
    assert book.taken == book.returned == [("pipe", 3)] and book.terminal == [("RELEASED", "holder:consumer", 0.2)]
    assert not led.open and not led.by_transfer and led.since(W) == 7 and led.totals == {"RELEASED": 1}


@pytest.mark.parametrize("path,state", [("ttl", State.EXPIRED), ("mesh-reclaim", State.RECLAIMED),
                                        ("consumer", State.RELEASED)])
def test_freed_paths_map_to_their_terminal_state(env, path, state):
    led, _, _ = env
    e = held_pair(led)
    led.apply(W, listing(freed=(FreedTransfer("t1", path, 1.0, 1),), seq=1))
    assert e.state == state


def test_a_lost_release_is_reclaimed_only_after_the_grace(env):
    led, clock, book = env
    e = held_pair(led)
    led.decoding(e)
    led.decode_done(e)
    still = HeldTransfer("t1", 3, 1.0, "r1", "mesh-a")
    clock.t += GRACE - 0.1
    assert led.apply(W, listing(still)) == []
    clock.t += 0.2
    assert led.apply(W, listing(still)) == [(e, "lost-release")]
    assert led.reclaim_start(e) and not led.reclaim_start(e)  # one release in flight at a time
    led.reclaim_done(e, "lost-release", True)
    assert e.state == State.RECLAIMED and book.returned == [("pipe", 3)]


def test_a_release_answered_already_freed_waits_for_the_listing(env):
    led, clock, book = env
    e = held_pair(led)
    assert led.reclaim_start(e)
    led.reclaim_done(e, "decode-failed", False)
    assert book.duplicates == 1 and e.state == State.HELD and e.decode_done_at == clock.t and not e.reclaiming
    led.apply(W, listing(freed=(FreedTransfer("t1", "consumer", 0.5, 2),), seq=2))
    assert e.state == State.RELEASED


def test_an_unanswered_release_is_settled_by_reconciliation(env):
    led, clock, _ = env
    e = held_pair(led)
    assert led.reclaim_start(e)
    led.reclaim_done(e, "client-disconnect", None)
    assert e.state == State.HELD and led.pipelines_to_ask() == [W]
    clock.t += GRACE + 0.1   # gone from the listing, and no freed record (the ring wrapped)
    assert led.apply(W, listing()) == [] and e.state == State.RELEASED
    assert led.recent[-1]["reason"] == "not-listed"


def test_a_definite_prefill_failure_is_no_kv_at_once(env):
    led, _, book = env
    e = led.begin("r1", W)
    led.prefill_failed(e, uncertain=False)
    assert e.state == State.NO_KV and book.returned == [] and book.terminal == [("NO_KV", "prefill-failed", None)]


def test_a_cut_off_prefill_that_held_is_taken_over_and_reclaimed(env):
    led, clock, _ = env
    e = led.begin("r1", W)
    led.prefill_failed(e, uncertain=True)
    assert e.look_until == clock.t + GRACE and led.pipelines_to_ask() == [W]
    clock.t += 1.0
    todo = led.apply(W, listing(HeldTransfer("t9", 4, 0.5, "r1", "mesh-a")))
    assert todo == [(e, "client-disconnect")] and e.transfer_id == "t9" and e.blocks == 4
    assert led.by_transfer["t9"] is e


def test_a_cut_off_prefill_freed_before_the_listing_is_settled(env):
    led, _, _ = env
    e = led.begin("r1", W)
    led.prefill_failed(e, uncertain=True)
    led.apply(W, listing(freed=(FreedTransfer("t9", "ttl", 120.0, 3, "r1"),), seq=3))
    assert e.state == State.EXPIRED and e.transfer_id == "t9"


def test_a_cut_off_prefill_that_never_held_ends_no_kv_after_the_grace(env):
    led, clock, _ = env
    e = led.begin("r1", W)
    led.prefill_failed(e, uncertain=True)
    led.apply(W, listing())
    assert e.state == State.PREFILLING
    clock.t += GRACE + 0.1
    led.apply(W, listing())
    assert e.state == State.NO_KV and led.recent[-1]["reason"] == "prefill-cut-off"


def test_a_restarted_mesh_adopts_its_own_old_transfers_not_others(env):
    led, clock, book = env
    mine = HeldTransfer("t-old", 2, GRACE + 1, "r-old", "mesh-a")
    young = HeldTransfer("t-young", 2, GRACE - 1, "r-young", "mesh-a")   # may still be in a live request
    other = HeldTransfer("t-other", 2, 60.0, "r-x", "mesh-b")
    assert led.apply(W, listing(mine, young, other)) == []
    assert set(led.by_transfer) == {"t-old"} and led.by_transfer["t-old"].adopted
    adopted = led.by_transfer["t-old"]
    # adopted as if its decode finished a grace ago: reclaimed at the next listing that still holds it
    clock.t += 0.1
    assert led.apply(W, listing(mine, other)) == [(adopted, "lost-release")]
    led.reclaim_start(adopted)
    led.reclaim_done(adopted, "lost-release", True)
    assert adopted.state == State.RECLAIMED and led.adopted_totals == {"RECLAIMED": 1} and not led.totals
    assert book.taken == book.returned == []    # never counted out of the pool by this mesh


def test_a_finished_transfer_is_never_adopted_again(env):
    led, _, _ = env
    e = held_pair(led, tid="t1")
    led.finish(e, State.RELEASED, "test")
    led.apply(W, listing(HeldTransfer("t1", 3, GRACE + 1, "r1", "mesh-a")))
    assert "t1" not in led.by_transfer


def test_a_restarted_holder_ends_what_it_held(env):
    led, _, _ = env
    e = held_pair(led)
    led.apply(W, listing(seq=10))
    led.apply(W, listing(seq=2))   # the sequence went back: a new holder, the old transfers are gone
    assert e.state == State.RELEASED and led.recent[-1]["reason"] == "holder-restarted"


def test_an_unreachable_holder_closes_waiting_entries_after_three_graces(env):
    led, clock, _ = env
    e = held_pair(led)
    led.decode_done(e)
    cut = led.begin("r2", W)
    led.prefill_failed(cut, uncertain=True)
    clock.t += 2 * GRACE + 0.1
    led.unreachable(W)
    assert cut.state == State.NO_KV and e.state == State.HELD
    clock.t += GRACE
    led.unreachable(W)
    assert e.state == State.EXPIRED and led.recent[-1]["reason"] == "holder-unreachable"


def test_orphans_are_drained_or_counted_unreclaimable_never_polled(env):
    led, _, book = env
    a = led.orphan("r1", W, "t1", 2)
    b = led.orphan("r2", W, "t2", 2)
    assert led.pipelines_to_ask() == []
    led.drained(a)
    led.unreclaimable(b, "no decode engine")
    assert a.state == State.RECLAIMED and b.state == State.UNRECLAIMABLE
    assert book.unreclaimable_by == ["pipe"] and not led.open


def test_a_terminal_entry_stays_terminal(env):
    led, _, book = env
    e = held_pair(led)
    led.finish(e, State.RELEASED, "first")
    led.finish(e, State.EXPIRED, "second")
    assert not led.reclaim_start(e)
    assert e.state == State.RELEASED and [t[0] for t in book.terminal] == ["RELEASED"]


def test_finished_ring_stays_bounded_and_in_step(env):
    led, _, _ = env
    for i in range(10000):
        e = led.begin(f"r{i}", W)
        led.held(e, f"t{i}", 1)
        led.finish(e, State.RELEASED, "test")
    assert len(led._finished_set) == len(led._finished) == led._finished.maxlen
    assert led._finished_set == set(led._finished)
    assert led.totals == {"RELEASED": 10000} and not led.open and not led.by_transfer
