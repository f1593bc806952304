"""The KV side channel (docs/protocol.md section 6) over real ZMQ sockets on loopback."""

from __future__ import annotations

import asyncio

import pytest

from contract.errors import KVTransferError
from contract.protocol import ConsumerRank, KVHandoffParams, StageAddr, WriteRequest
from workers.kv.holder import BlockPool, TransferHolder
from workers.kv.sidechannel import ChannelFaults, ConsumerChannel, StageChannel


async def pipeline(pp: int, holder: TransferHolder, stage_delay: dict[int, float] | None = None,
                   **kw) -> list[StageChannel]:
    stages = []
    for r in range(pp):
        async def write(req: WriteRequest, rank: ConsumerRank, r=r) -> None:
            await asyncio.sleep((stage_delay or {}).get(r, 0.0))
        ch = StageChannel(host="127.0.0.1", port=0, pp_rank=r, holder=holder, writer=write, **kw)
        await ch.start()
        stages.append(ch)
    return stages


def params(stages, blocks, tid="t1") -> KVHandoffParams:
    return KVHandoffParams(remote_engine_id="p", remote_host="127.0.0.1", remote_port=stages[0].port,
                           remote_block_ids=blocks, transfer_id=tid, first_token_id=1,
                           remote_pp_size=len(stages),
                           stages=tuple(StageAddr(pp_rank=s.pp_rank, host="127.0.0.1", port=s.port) for s in stages))


def ranks(tp: int) -> tuple[ConsumerRank, ...]:
    return tuple(ConsumerRank(tp_rank=r, segment=f"s{r}", head_start=r, head_end=r + 1) for r in range(tp))


async def test_receive_waits_for_every_stage_and_release_frees_once():
    holder = TransferHolder(BlockPool(16))
    blocks = holder.pool.alloc(3)
    holder.hold("t1", blocks, consumers=2)
    # 4 stages x 3 write_done each; stage 3 is slow: 9 early write_dones must not complete the receive
    stages = await pipeline(4, holder, stage_delay={3: 0.4}, write_done_repeats=3)
    consumer = ConsumerChannel(host="127.0.0.1")
    await consumer.start()
    try:
        p = params(stages, blocks)
        task = asyncio.create_task(consumer.pull(p, ranks(2), (7, 8, 9), request_id="r", deadline_s=5))
        await asyncio.sleep(0.25)
        assert not task.done()  # three stages (x 2 ranks x 3 sends) reported, the fourth not yet
        await task
        # the slow stage's repeats may land after completion (stray); the others' before it
        assert consumer.stats.duplicate_write_done >= 3 * 2 * 2
        assert consumer.stats.duplicate_write_done + consumer.stats.stray_write_done <= 4 * 2 * 2
        for r in range(2):
            await consumer.release(p, r)
        await consumer.release(p, 0)  # a repeated release
        for _ in range(100):
            if len(holder) == 0 and stages[0].stats.releases_received == 3:
                break
            await asyncio.sleep(0.01)
        assert len(holder) == 0 and holder.pool.free == 16
        assert holder.freed_by["consumer"] == 1 and holder.duplicate_releases == 1
    finally:
        await consumer.close()
        for s in stages:
            await s.close()


async def test_one_release_of_two_ranks_does_not_free():
    holder = TransferHolder(BlockPool(4))
    holder.hold("t", holder.pool.alloc(2), consumers=1)
    holder.expect_consumers("t", 2)
    assert holder.release_rank("t", 0) and len(holder) == 1
    assert not holder.release_rank("t", 0) and len(holder) == 1
    assert holder.release_rank("t", 1) and len(holder) == 0
    assert not holder.release("t") and holder.pool.free == 4


async def test_unknown_transfer_fails_fast_and_deadline():
    holder = TransferHolder(BlockPool(4))
    stages = await pipeline(2, holder)
    consumer = ConsumerChannel(host="127.0.0.1")
    await consumer.start()
    try:
        with pytest.raises(KVTransferError, match="not held"):
            await consumer.pull(params(stages, (0,), "ghost"), ranks(1), (0,), request_id="r", deadline_s=5)
        holder.hold("t2", holder.pool.alloc(1))
        for s in stages:
            s.faults = ChannelFaults(drop_write_done=1.0)
        with pytest.raises(KVTransferError, match="0/2 write_done"):
            await consumer.pull(params(stages, holder.blocks_of("t2"), "t2"), ranks(1), (0,), request_id="r",
                                deadline_s=0.3)
    finally:
        await consumer.close()
        for s in stages:
            await s.close()


def test_holder_ttl_expiry():
    holder = TransferHolder(BlockPool(4), ttl_s=10)
    holder.hold("t", holder.pool.alloc(4))
    assert holder.expire() == [] and holder.pool.free == 0
    import time
    assert holder.expire(time.monotonic() + 11) == ["t"]
    assert holder.pool.free == 4 and holder.freed_by["ttl"] == 1
