"""KV transports between two real processes: Mooncake over TCP and ZMQ, with head re-layout."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from contract.errors import KVTransferError
from workers.kv.transport import Layout, copy_plan, create

NB, KVH, BS, HD = 8, 4, 4, 8


def consumer(backend: str, kv_heads: int, q_out, q_in) -> None:
    t = create(backend)
    pools = [torch.zeros(NB, 2, kv_heads, BS, HD, dtype=torch.float64) for _ in range(2)]
    q_out.put((t.segment, t.register(pools)))
    q_in.get()
    q_out.put([p.clone() for p in pools])
    q_in.get()
    t.close()


@pytest.mark.parametrize("backend", ["mooncake", "zmq"])
def test_relayout_write_between_processes(backend):
    ctx = mp.get_context("spawn")
    q_out, q_in = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=consumer, args=(backend, 2, q_out, q_in), name="kv-consumer")
    p.start()
    prod = create(backend)
    try:
        segment, dst_bases = q_out.get(timeout=60)
        src = [torch.randn(NB, 2, KVH, BS, HD, dtype=torch.float64) for _ in range(2)]
        src_bases = prod.register(src)
        # this consumer rank holds heads [2, 4) of 4; blocks 1, 5 -> its blocks 0, 3
        plan = copy_plan(src_bases, Layout(KVH, BS, HD, 8), dst_bases, Layout(2, BS, HD, 8), 2, 4, [1, 5], [0, 3])
        assert len(plan[0]) == 2 * 2 * 2  # layers x blocks x (k, v): a head slice is never contiguous
        prod.write(segment, *plan)
        q_in.put("read")
        got = q_out.get(timeout=30)
        for layer in range(2):
            assert torch.equal(got[layer][0], src[layer][1, :, 2:4])
            assert torch.equal(got[layer][3], src[layer][5, :, 2:4])
            assert not got[layer][1].any()
        if backend == "zmq":  # ranges outside the peer's registered memory are refused
            with pytest.raises(KVTransferError, match="outside the registered regions"):
                prod.write(segment, [src_bases[0]], [dst_bases[0] + 10 ** 9], [64])
        q_in.put("stop")
        p.join(30)
    finally:
        prod.close()
        if p.is_alive():
            p.kill()


def test_layout_mismatch_is_refused():
    with pytest.raises(KVTransferError, match="layouts differ"):
        copy_plan([0], Layout(4, 16, 8, 4), [0], Layout(4, 8, 8, 4), 0, 4, [0], [0])


def test_contiguous_ranges_are_merged():
    lay = Layout(4, 4, 8, 8)
    s, d, n = copy_plan([0, 10 ** 6], lay, [0, 10 ** 7], lay, 0, 4, [3, 4, 5, 9], [0, 1, 2, 7])
    # full heads: k and v of a block are adjacent, and blocks 3-5 -> 0-2 are consecutive on both sides
    assert len(s) == 2 * 2 and sum(n) == 2 * 4 * 2 * 4 * 4 * 8 * 8


def test_a_tp_producer_moves_only_the_heads_both_sides_hold():
    """A TP prefill rank holding heads [2, 4) of 4, into consumers of TP 1 (all 4 heads), TP 2
    (heads [0, 2) and [2, 4)) and TP 4 (one head each)."""
    src = Layout(2, 4, 8, 4)                      # 2 heads held, block 4, head_dim 8, 4-byte elements
    span = src.head_span()                        # bytes of one head of one block (K or V)

    def plan(dst_heads: int, start: int):
        return copy_plan([0], src, [0], Layout(dst_heads, 4, 8, 4), start, start + dst_heads, [0], [0], src_head0=2)

    s, d, n = plan(4, 0)                          # TP 1 consumer: our two heads land at heads 2-3
    assert s == [0, src.offset(0, 1, 0)] and n == [2 * span] * 2
    assert d == [Layout(4, 4, 8, 4).offset(0, 0, 2), Layout(4, 4, 8, 4).offset(0, 1, 2)]
    assert plan(2, 0) == ([], [], [])             # TP 2, rank 0: holds heads 0-1, none of ours
    s, d, n = plan(2, 2)                          # TP 2, rank 1: exactly ours (K and V adjacent: one range)
    assert s == [0] and d == [0] and n == [4 * span]
    s, d, n = plan(1, 3)                          # TP 4, rank 3: our second head
    assert s == [src.offset(0, 0, 1), src.offset(0, 1, 1)] and d == [0, Layout(1, 4, 8, 4).offset(0, 1, 0)]
    assert n == [span] * 2
