"""Rank control frames (workers/engine/ctrl.py): typed msgpack, tensors with declared dtype and
shape, every frame checked; a pickle is only bytes that fail to parse."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from contract.errors import ConfigError, ProtocolError
from workers.engine import ctrl
from workers.engine.config import EngineConfig, Parallel
from workers.engine.model import ForwardBatch, SeqSlice
from workers.engine.rank import RankSpec


class Boom:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, ("exit 1",))


def test_frames_round_trip_typed():
    b = ForwardBatch([SeqSlice(0, 3, torch.tensor([4, 9]), True)], torch.arange(3), torch.tensor([16, 17, 18]))
    cmd, (raw, ids) = ctrl.unpack(ctrl.pack("forward", ctrl.batch_out(b), torch.tensor([1, 2, 3])))
    got = ctrl.batch_in(raw)
    assert cmd == "forward" and got.slices[0].block_table.tolist() == [4, 9] and got.slices[0].want_logits
    assert torch.equal(got.positions, b.positions) and ids.tolist() == [1, 2, 3]
    kv = torch.randn(2, 2, 1, 4, 8, dtype=torch.float64)
    assert torch.equal(ctrl.unpack(ctrl.pack("tensor", kv))[1][0], kv)
    assert ctrl.unpack(ctrl.pack("tensor", torch.randn(3).bfloat16()))[1][0].dtype == torch.bfloat16
    spec = RankSpec("pp", "/m", EngineConfig(), Parallel(pp_rank=1, pp_size=2), 1, 2, 29500, 29501, secret=b"s" * 32)
    back = ctrl.spec_in(ctrl.unpack(ctrl.pack("spec", ctrl.spec_out(spec)))[1][0], RankSpec)
    assert back == RankSpec("pp", "/m", EngineConfig(), Parallel(pp_rank=1, pp_size=2), 1, 2, 29500, 29501)
    assert b"ssss" not in ctrl.pack("spec", ctrl.spec_out(spec))   # the secret never travels


@pytest.mark.parametrize("frame", [
    pickle.dumps(Boom()), pickle.dumps(("hello", 1)), b"", b"\x92\x91\x01\x80", b"\xc1",
    ctrl.pack("nope"), ctrl.pack("hello", "1", b"x" * 32), ctrl.pack("read_kv", 0, [1, "2"]),
    ctrl.pack("forward", [[[0, 1, 5, True]], 1, 2], None),
])
def test_bad_frames_are_protocol_errors(frame):
    with pytest.raises(ProtocolError):
        ctrl.unpack(frame)


def test_tensor_headers_are_checked():
    good = ctrl.pack("tensor", torch.zeros(2, 3))
    with pytest.raises(ProtocolError):
        ctrl.unpack(good[:-4])   # bytes short of the shape
    for head in (["float32", [-1]], ["object", [1]], ["float32", [1] * 9], ["float32", "3"]):
        import struct

        import msgpack
        h = msgpack.packb(head)
        ext = msgpack.ExtType(ctrl.TENSOR_EXT, struct.pack("<I", len(h)) + h + b"\0" * 4)
        with pytest.raises(ProtocolError):
            ctrl.unpack(msgpack.packb(["tensor", ext]))
    with pytest.raises(ProtocolError):
        ctrl.spec_in({"kind": "pp", "backend": "gloo", "engine": {"dtype": 5}, "par": {}}, RankSpec)


def test_handshake_macs_and_the_secret(monkeypatch):
    n = ctrl.nonce()
    assert ctrl.check_mac(b"k" * 16, b"head", 1, n, ctrl.mac(b"k" * 16, b"head", 1, n))
    assert not ctrl.check_mac(b"k" * 16, b"head", 1, n, ctrl.mac(b"k" * 16, b"stage", 1, n))
    assert not ctrl.check_mac(b"k" * 16, b"head", 2, n, ctrl.mac(b"k" * 16, b"head", 1, n))
    monkeypatch.delenv(ctrl.SECRET_ENV, raising=False)
    with pytest.raises(ConfigError, match="ATOMESH_PIPELINE_SECRET"):
        ctrl.pipeline_secret(required=True)
    monkeypatch.setenv(ctrl.SECRET_ENV, "short")
    with pytest.raises(ConfigError, match="at least 16"):
        ctrl.pipeline_secret(required=True)
