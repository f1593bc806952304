"""contract.protocol: typed messages, one codec each, unknown fields preserved."""

from __future__ import annotations

import pytest

from contract.errors import ProtocolError
from contract.protocol import (
    DecodeRecord,
    HeldList,
    KVHandoffParams,
    KVRequestParams,
    LoadReport,
    PrefillRecord,
    Release,
    WriteDone,
    WriteRequest,
    decode_frame,
    encode_frame,
    handoff_for_decode,
)

HANDOFF = {"remote_engine_id": "p0", "remote_host": "h", "remote_port": 5, "remote_block_ids": [1, 2],
           "transfer_id": "t", "first_token_id": 9, "remote_handshake_port": 5, "remote_pp_size": 2,
           "tp_size": 1, "dp_rank": 0, "do_remote_prefill": True, "do_remote_decode": False,
           "stages": [{"pp_rank": 0, "host": "h", "port": 5, "layers": [0, 2], "mine": 1},
                      {"pp_rank": 1, "host": "h", "port": 6, "layers": [2, 4]}],
           "engine_specific": {"a": [1, {"b": None}]}}


def test_roundtrip_keeps_unknown_fields_everywhere():
    m = KVHandoffParams.decode(HANDOFF)
    assert m.extra == {"engine_specific": {"a": [1, {"b": None}]}}
    assert m.stages[0].extra == {"mine": 1}
    assert m.encode() == HANDOFF


@pytest.mark.parametrize("patch,path", [
    ({"remote_port": "5"}, "remote_port"), ({"remote_block_ids": [1, "x"]}, "remote_block_ids[1]"),
    ({"stages": [{"pp_rank": 0}]}, "stages[0].host"), ({"first_token_id": True}, "first_token_id"),
    ({"transfer_id": None}, "transfer_id")])
def test_decode_errors_name_the_path(patch, path):
    with pytest.raises(ProtocolError) as e:
        KVHandoffParams.decode({**HANDOFF, **patch})
    assert e.value.param == path


def test_missing_field():
    d = dict(HANDOFF)
    del d["transfer_id"]
    with pytest.raises(ProtocolError, match="transfer_id: missing"):
        KVHandoffParams.decode(d)


def test_stage_addrs_fall_back_to_atom_port_layout():
    d = {k: v for k, v in HANDOFF.items() if k != "stages"}
    d.update(remote_handshake_port=7000, tp_size=2, dp_rank=1, remote_pp_size=3)
    ports = [s.port for s in KVHandoffParams.decode(d).stage_addrs()]
    assert ports == [7000 + r * 2 + 1 * 2 for r in range(3)]


def test_handoff_for_decode_flips_only_the_flags():
    out = handoff_for_decode({**HANDOFF, "do_remote_prefill": False, "do_remote_decode": True})
    assert out == HANDOFF


def test_records_and_side_messages_roundtrip():
    rec = PrefillRecord.decode({"id": "p", "model": "m", "url": "http://h:1", "pp_size": 2,
                                "stages": [{"pp_rank": 0, "host": "h", "kv_port": 3, "layers": [0, 4]}], "x": 1})
    assert PrefillRecord.decode(rec.encode()) == rec and rec.encode()["x"] == 1
    dec = DecodeRecord.decode({"id": "d", "model": "m", "url": "http://h:2", "tp_size": 2,
                               "ranks": [{"tp_rank": 0, "host": "h", "segment": "s0"}]})
    assert DecodeRecord.decode(dec.encode()) == dec
    req = KVRequestParams(remote_engine_id="d", remote_host="h", remote_port=1, remote_handshake_port=2,
                          remote_tp_size=2)
    assert req.encode()["do_remote_decode"] is True
    for msg in (WriteRequest(request_id="r", transfer_id="t", src_block_ids=(1,), dst_block_ids=(2,), ranks=(),
                             notify_host="h", notify_port=3, write_nonce=2 ** 63 + 5),
                WriteDone(request_id="r", transfer_id="t", pp_rank=1, tp_rank=0, write_nonce=1, ok=False, error="e"),
                Release(transfer_id="t", tp_rank=1, extra={"future": True})):
        assert decode_frame(encode_frame(msg)) == msg
    assert LoadReport.decode({"in_flight": 2}).encode()["free_blocks"] == 0
    assert HeldList.decode({"transfers": []}).transfers == ()


def test_bad_frames():
    import msgpack
    with pytest.raises(ProtocolError):
        decode_frame(b"\xc1garbage")
    with pytest.raises(ProtocolError, match="unknown message type"):
        decode_frame(msgpack.packb(["nope", {}]))
    with pytest.raises(ProtocolError):
        decode_frame(msgpack.packb(["release", {"transfer_id": 1, "tp_rank": 0}]))


@pytest.mark.parametrize("ids,bad_at", [([1, 2, True], "src_block_ids[2]"), ([1, "2"], "src_block_ids[1]"),
                                        ([1.0], "src_block_ids[0]"), ([None], "src_block_ids[0]")])
def test_a_scalar_array_is_checked_element_by_element(ids, bad_at):
    """The codec's fast path for arrays of scalars (one type set, no call per element) refuses what the
    element check refuses, and the error names the element."""
    from contract.protocol import ConsumerRank, WriteRequest

    base = WriteRequest("r", "t", (1,), (2,), (ConsumerRank(0, "s", 0, 1),), "h", 1, 7).encode()
    ok = WriteRequest.decode({**base, "src_block_ids": [3, 4, 5]})
    assert ok.src_block_ids == (3, 4, 5) and type(ok.src_block_ids) is tuple
    with pytest.raises(ProtocolError) as e:
        WriteRequest.decode({**base, "src_block_ids": ids})
    assert e.value.param == bad_at
