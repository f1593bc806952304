"""Attacks on the KV planes from someone with network reach (issue 16): junk frames never end a
side-channel or KV-transport loop, a KV frame is checked before a byte lands, and no read or write
reaches memory outside the registered pools."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import torch
import zmq
import zmq.asyncio

from contract.errors import KVTransferError
from contract.protocol import ConsumerRank, WriteRequest
from tests.test_sidechannel import params, pipeline, ranks
from workers.engine.kv_cache import KVPool
from workers.kv.holder import BlockPool, TransferHolder
from workers.kv.sidechannel import ConsumerChannel
from workers.kv.stage import make_writer, register_pool
from workers.kv.transport import create

JUNK = [b"\x92\x91\x01\x80", b"\xc1", b"", msgpack.packb(["write_request", 5]), msgpack.packb([["x"], {}]),
        msgpack.packb(["write_done", {"request_id": 1}]), msgpack.packb({"a": 1}), b"\x00" * 100]


async def _send_junk(port: int) -> None:
    ctx = zmq.asyncio.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://127.0.0.1:{port}")
    for j in JUNK:
        await s.send(j)
    await s.send_multipart([b"a", b"b", b"c"])
    await asyncio.sleep(0.2)
    s.close(0)


async def test_junk_frames_leave_both_side_channels_serving():
    holder = TransferHolder(BlockPool(16))
    blocks = holder.pool.alloc(2)
    holder.hold("t1", blocks, consumers=1)
    stages = await pipeline(2, holder)
    consumer = ConsumerChannel(host="127.0.0.1")
    await consumer.start()
    try:
        for port in (stages[0].port, stages[1].port, consumer.port):
            await _send_junk(port)
        assert all(s.stats.bad_frames >= len(JUNK) for s in stages) and consumer.stats.bad_frames >= len(JUNK)
        await consumer.pull(params(stages, blocks), ranks(1), (3, 4), request_id="r", deadline_s=5)
    finally:
        await consumer.close()
        for s in stages:
            await s.close()


def test_zmq_receiver_checks_every_frame_and_keeps_serving():
    victim = create("zmq")
    pool = [torch.zeros(4, 64, dtype=torch.float64)]
    base = victim.register(pool)[0]
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(victim.segment)
    try:
        bad = [[msgpack.packb([[base], [-8]]), b""],                      # a negative length
               [msgpack.packb([[base + 8], [8, 8]]), b"\0" * 16],          # lists of unequal length
               [msgpack.packb([[base], [16]]), b"\0" * 8],                # the payload short of the lengths
               [msgpack.packb([[base - 10 ** 6], [8]]), b"\0" * 8],       # outside the registered pool
               [msgpack.packb("x"), b""], [b"\xc1", b""], [msgpack.packb([[base], [8]])]]  # junk, 2 frames
        for frames in bad:
            s.send_multipart(frames)
            assert s.poll(5000), frames
            assert s.recv(), frames   # refused with a reason
        assert not pool[0].any()
        prod = create("zmq")
        src = [torch.full((4, 64), 7.0, dtype=torch.float64)]
        sb = prod.register(src)[0]
        prod.write(victim.segment, [sb], [base], [64])   # the receiver still serves
        assert pool[0][0, :8].eq(7.0).all() and not pool[0][0, 8:].any()
        # a producer reads only inside its registered pools (no process memory past them)
        with pytest.raises(KVTransferError, match="outside the registered pools"):
            prod.write(victim.segment, [sb + 10 ** 6], [base], [64])
        prod.close()
    finally:
        s.close(0)
        ctx.term()
        victim.close()


async def test_a_stage_writes_only_blocks_of_its_own_pool():
    pool = KVPool(1, 4, 1, 4, 8, torch.float64, "cpu")
    ep = register_pool(pool, "zmq", "127.0.0.1")
    try:
        write = make_writer(ep, 0, 1)
        rank = ConsumerRank(tp_rank=0, segment=ep.transport.segment, head_start=0, head_end=1,
                            region_addrs=tuple(ep.regions))
        req = WriteRequest(request_id="r", transfer_id="t", src_block_ids=(2, 10 ** 6), dst_block_ids=(0, 1),
                           ranks=(rank,), notify_host="127.0.0.1", notify_port=1, write_nonce=1,
                           extra={"layout": {"block_size": 4, "head_dim": 8, "elem": 8}})
        with pytest.raises(ValueError, match="outside this stage's pool"):
            await write(req, rank)
    finally:
        ep.transport.close()


async def test_a_stage_without_the_holder_serves_only_what_stage_0_granted():
    """Stage 1 (no holder) writes only for a request carrying stage 0's grant of that transfer on
    exactly those blocks: a forged request, or other block ids, are refused."""
    import dataclasses

    from workers.engine.ctrl import kv_grant
    from workers.kv.sidechannel import StageChannel

    key = b"k" * 32
    holder = TransferHolder(BlockPool(16))
    blocks = holder.pool.alloc(2)
    holder.hold("t1", blocks, consumers=1)
    wrote: list[tuple[int, ...]] = []

    async def write(req: WriteRequest, rank: ConsumerRank) -> None:
        wrote.append(req.src_block_ids)

    stages = [StageChannel(host="127.0.0.1", port=0, pp_rank=0, holder=holder, writer=write),
              StageChannel(host="127.0.0.1", port=0, pp_rank=1, holder=None, writer=write, grant_key=key)]
    for s in stages:
        await s.start()
    consumer = ConsumerChannel(host="127.0.0.1")
    await consumer.start()
    try:
        p = params(stages, blocks)
        with pytest.raises(KVTransferError, match="stage 1"):   # no grant
            await consumer.pull(p, ranks(1), (3, 4), request_id="r", deadline_s=5)
        forged = dataclasses.replace(p, extra={**p.extra, "kv_grant": kv_grant(key, "t1", tuple(b + 5 for b in blocks))})
        with pytest.raises(KVTransferError, match="stage 1"):
            await consumer.pull(forged, ranks(1), (3, 4), request_id="r", deadline_s=5)
        assert all(w == tuple(blocks) for w in wrote)   # only stage 0 (which holds them) wrote
        good = dataclasses.replace(p, extra={**p.extra, "kv_grant": kv_grant(key, "t1", tuple(blocks))})
        await consumer.pull(good, ranks(1), (3, 4), request_id="r", deadline_s=5)
    finally:
        await consumer.close()
        for s in stages:
            await s.close()


def test_cuda_ipc_receiver_checks_every_frame_and_keeps_serving():
    """The device-to-device backend's receiver: a frame names producer regions by CUDA IPC export
    and source offsets; every field is typed, every source inside the exported region, every
    destination inside this process's pools; else it is refused and nothing is mapped or copied.
    A producer sends only ranges of its own registered device pools."""
    victim = create("cuda-ipc")
    pool = [torch.zeros(4, 64, dtype=torch.float64)]
    base = victim.register(pool)[0]
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(victim.segment)
    export = [0, 0, b"h" * 64, 4096, 0, b"rc", 0, b"ev" * 32, False, 0]   # region 0 of a 4 kB storage
    ok = [[base], [8], [0], [0], [export], [1024]]
    try:
        bad = [ok[:5],                                                    # 5 lists
               [[base], [-8], [0], [0], [export], [1024]],                # a negative length
               [[base], [8], [1], [0], [export], [1024]],                 # a source region not exported
               [[base], [8], [0], [1020], [export], [1024]],              # a source past its region
               [[base], [8], [0], [0], [export], [4097]],                 # a region past the storage
               [[base], [8], [0], [0], [[0, 0, "h", 4096, 0, b"", 0, b"", False, 0]], [1024]],  # a str handle
               [[base], [8], [0], [0], [[*export[:9], -1]], [1024]],      # a negative start
               [[base - 10 ** 6], [8], [0], [0], [export], [1024]],       # outside the registered pool
               [[base], [8], [0], [0], [export], [1024]]]                 # a host pool: nothing to map into
        for head in bad:
            s.send_multipart([msgpack.packb(head)])
            assert s.poll(5000), head
            why = s.recv()
            assert why, head   # refused with a reason
        for frames in ([b"\xc1"], [msgpack.packb("x")], [msgpack.packb(ok), b"payload"]):
            s.send_multipart(frames)
            assert s.poll(5000) and s.recv()
        assert not pool[0].any() and not victim._mapped
        prod = create("cuda-ipc")
        host = [torch.ones(4, 64, dtype=torch.float64)]
        hb = prod.register(host)[0]
        with pytest.raises(KVTransferError, match="registered device pools"):
            prod.write(victim.segment, [hb], [base], [64])      # host memory has no IPC handle
        prod.close()
    finally:
        s.close(0)
        ctx.term()
        victim.close()


@pytest.mark.parametrize("backend", ["zmq", "cuda-ipc"])
def test_with_the_worker_token_a_kv_write_needs_its_hmac(backend, monkeypatch):
    """`ATOMESH_WORKER_TOKEN` set: a KV write whose header is not signed with it (none, or another
    token's) is dropped and counted, nothing lands, and the receiver keeps serving the signed one."""
    monkeypatch.setenv("ATOMESH_WORKER_TOKEN", "kv-plane-token-0123456789")
    victim = create(backend)
    pool = [torch.zeros(4, 64, dtype=torch.float64)]
    base = victim.register(pool)[0]
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(victim.segment)
    try:
        head = msgpack.packb([[base], [64]])
        for frames in ([head, b"\x07" * 64], [b"\0" * 32, head, b"\x07" * 64], [b"", b""]):
            s.send_multipart(frames)
            assert s.poll(5000)
            assert b"HMAC" in s.recv()
        other = create(backend, token="another-token-0123456789")
        src = [torch.full((4, 64), 7.0, dtype=torch.float64)]
        sb = other.register(src)[0]
        if backend == "zmq":
            with pytest.raises(KVTransferError, match="HMAC"):
                other.write(victim.segment, [sb], [base], [64])
        other.close()
        assert victim.unauthenticated == 3 + (backend == "zmq") and not pool[0].any()
        if backend == "zmq":
            prod = create(backend)
            sb = prod.register(src)[0]
            prod.write(victim.segment, [sb], [base], [64])
            assert pool[0][0, :8].eq(7.0).all()
            prod.close()
    finally:
        s.close(0)
        ctx.term()
        victim.close()
