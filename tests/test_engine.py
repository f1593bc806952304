"""The reference engine against Hugging Face `transformers` LlamaForCausalLM on the same weights (float64)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from workers.engine.checkpoint import generate, tiny_config
from workers.engine.config import EngineConfig, ModelConfig, partition
from workers.engine.engine import Engine
from workers.engine.kv_cache import BlockManager
from workers.engine.pp import PPEngine
from workers.engine.rank import RankDied
from workers.engine.sampling import SamplingParams
from workers.engine.tp import TPEngine

N_TOKENS = 32
BLOCK = 4
CHUNK = 16  # per-step token budget: several prompts are longer (chunked prefill)
PROMPTS = [b"a", b"Hello, mesh!", b"abcdefghijklmnopq", b"The quick brown fox jumps over the lazy dog.",
           b"0123456789" * 4 + b"x", "\u00e9t\u00e9 \u2014 \u65e5\u672c".encode(), b"short", b"z" * 23, b"!?" * 9]
GREEDY = SamplingParams(max_tokens=N_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # 6 layers (PP=3 uneven: 1,3,2), 4 heads / 2 KV heads (TP=2 splits the KV heads)
    return generate(tmp_path_factory.mktemp("ckpt"), tiny_config(num_hidden_layers=6), seed=7)


@pytest.fixture(scope="module")
def reference(ckpt):
    """HF's last-position logits and 32 greedy tokens for every prompt."""
    from transformers import LlamaForCausalLM

    m = LlamaForCausalLM.from_pretrained(str(ckpt), dtype=torch.float64, attn_implementation="sdpa").eval()
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([list(p)])
            logits = m(ids).logits[0, -1]
            g = m.generate(ids, max_new_tokens=N_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
                           attention_mask=torch.ones_like(ids))
            out.append((logits, g[0, ids.shape[1]:].tolist()))
    return out


def cfg() -> EngineConfig:
    return EngineConfig(dtype="float64", block_size=BLOCK, num_blocks=256, max_batch_tokens=CHUNK)


def check(engine: Engine, reference) -> None:
    engine.captured = {}
    outs = engine.generate([list(p) for p in PROMPTS], GREEDY)
    for i, ((ref_logits, ref_ids), got) in enumerate(zip(reference, outs)):
        diff = (engine.captured[f"gen-{i}"] - ref_logits).abs().max().item()
        assert diff < 1e-9, f"prompt {i}: logits differ by {diff}"
        assert got == ref_ids, f"prompt {i}: tokens differ"
    assert engine.blocks.free == engine.cfg.num_blocks  # every block back


def test_prompts_cover_the_edges():
    lens = [len(p) for p in PROMPTS]
    assert any(n > CHUNK for n in lens) and any(n % BLOCK for n in lens) and len(PROMPTS) >= 8


def test_monolithic(ckpt, reference):
    check(Engine(ckpt, cfg()), reference)


def test_decode_graph_buffers_keep_hf_parity(ckpt, reference):
    """The CUDA-graph decode path (workers/engine/graphs.py) run eagerly on the CPU: the same fixed
    buffers, buckets, padding rows and scratch block as on a GPU, and HF's tokens and logits."""
    import dataclasses

    eng = Engine(ckpt, dataclasses.replace(cfg(), graphs="eager"))
    assert eng.graphs is not None and eng.pool is not None
    assert eng.pool.layers[0].shape[0] == eng.cfg.num_blocks + 1   # the scratch block, never handed out
    check(eng, reference)
    assert eng.graphs.replays > 0
    assert {b for b, _ in eng.graphs._graphs} <= set(eng.graphs.buckets) and eng.graphs.buckets[:4] == [1, 2, 4, 8]


def test_decode_graph_buffers_sample_as_the_plain_path(ckpt):
    """Seeded sampling, logprobs and stop tokens through the graph path equal the plain path's."""
    import dataclasses

    sp = SamplingParams(max_tokens=20, temperature=0.9, top_k=20, seed=3, logprobs=2, ignore_eos=True)
    got = {}
    for mode in ("off", "eager"):
        eng = Engine(ckpt, dataclasses.replace(cfg(), graphs=mode))
        for i, p in enumerate(PROMPTS[:5]):
            eng.add(f"s{i}", list(p), sp)
        outs: dict[str, list] = {}
        while eng.scheduler.has_work():
            for o in eng.step():
                outs.setdefault(o.seq_id, []).append((o.new_tokens, o.logprobs))
        got[mode] = outs
        assert eng.blocks.free == eng.cfg.num_blocks
    assert got["off"].keys() == got["eager"].keys()
    for k in got["off"]:
        a, b = got["off"][k], got["eager"][k]
        assert [t for t, _ in a] == [t for t, _ in b]
        for (_, la), (_, lb) in zip(a, b):
            assert abs(la[0][0] - lb[0][0]) < 1e-9 and [x for x, _ in la[0][1]] == [x for x, _ in lb[0][1]]


def test_pp2(ckpt, reference):
    eng = PPEngine(ckpt, cfg(), 2)
    try:
        assert eng.parts == [(0, 3), (3, 6)]
        check(eng, reference)
    finally:
        eng.close()


def test_pp3_uneven_partition(ckpt, reference):
    eng = PPEngine(ckpt, cfg(), 3, "1,3,2")
    try:
        assert eng.parts == [(0, 1), (1, 4), (4, 6)]
        check(eng, reference)
        assert eng.max_inflight > 1  # micro-batches overlapped in the pipeline
    finally:
        eng.close()


def test_tp2(ckpt, reference):
    eng = TPEngine(ckpt, cfg(), 2)
    try:
        assert eng.model is not None and eng.model.kv_heads == 1 and eng.model.heads == 2
        check(eng, reference)
    finally:
        eng.close()


def test_pp2_prefill_then_tp2_decode_from_first_token(ckpt, reference):
    """PD in-process: PP=2 prefill holds its blocks; their KV is copied (sliced by KV head) into
    a TP=2 decode engine, which continues from the prefill's first token."""
    pre, dec = PPEngine(ckpt, cfg(), 2), TPEngine(ckpt, cfg(), 2)
    try:
        layers = ModelConfig.load(ckpt).num_hidden_layers
        for i, p in enumerate(PROMPTS):
            seq = pre.add(f"p{i}", list(p), GREEDY, hold=True)
            while pre.scheduler.has_work():
                pre.step()
            assert seq.finish_reason == "hold" and len(seq.output) == 1
            first = seq.output[0]
            dst = dec.blocks.allocate(len(seq.blocks))
            dec.blocks.release(dst)  # chosen here, taken by add_from_kv
            for layer in range(layers):
                dec.write_kv(layer, dst, pre.read_kv(layer, seq.blocks))
            assert pre.release(f"p{i}") and not pre.release(f"p{i}")  # released once, the second is a no-op
            dec.add_from_kv(f"d{i}", list(p), first, dst, GREEDY)
            toks = [first]
            while dec.scheduler.has_work():
                for o in dec.step():
                    toks += o.new_tokens
            assert toks == reference[i][1], f"prompt {i}"
        assert pre.blocks.free == pre.cfg.num_blocks and dec.blocks.free == dec.cfg.num_blocks
    finally:
        pre.close()
        dec.close()


def test_sampling_seeded_and_stops(ckpt):
    eng = Engine(ckpt, cfg())
    sp = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, top_k=50, seed=3, ignore_eos=True)
    a = eng.generate([list(b"seeded")], sp)
    b = eng.generate([list(b"seeded")], sp)
    assert a == b and len(a[0]) == 20
    greedy = eng.generate([list(b"stop here")], GREEDY)[0]
    stop_at = greedy[5]
    got = eng.generate([list(b"stop here")], SamplingParams(max_tokens=32, stop_token_ids=(stop_at,), ignore_eos=True))[0]
    assert eng.generate([list(b"stop here")], SamplingParams(max_tokens=32))[0] == greedy[:1]  # 257 is eos
    assert got == greedy[:greedy.index(stop_at) + 1]


def test_preemption_and_rejection_when_the_pool_runs_out(ckpt, reference):
    small = EngineConfig(dtype="float64", block_size=BLOCK, num_blocks=24, max_batch_tokens=CHUNK)
    eng = Engine(ckpt, small)
    outs = eng.generate([list(p) for p in PROMPTS[:6]], GREEDY)  # needs more blocks than 24 at once
    assert outs == [r[1] for r in reference[:6]] and eng.scheduler.preemptions > 0
    with pytest.raises(RuntimeError, match="needs more KV blocks than the pool"):
        eng.generate([[1] * (24 * BLOCK + 1)])
    assert eng.blocks.free == 24


def test_block_manager_refcounts():
    bm = BlockManager(4)
    b = bm.allocate(2)
    bm.retain(b)
    bm.release(b)
    assert bm.free == 2
    bm.release(b)
    assert bm.free == 4
    with pytest.raises(ValueError, match="released twice"):
        bm.release(b)
    with pytest.raises(MemoryError):
        bm.allocate(5)


def test_partition_errors():
    assert partition(6, 4) == [(0, 2), (2, 4), (4, 5), (5, 6)]
    with pytest.raises(ValueError):
        partition(6, 2, "2,3")
    with pytest.raises(ValueError):
        partition(2, 3)


def test_crashed_rank_is_reported_not_waited_on(ckpt):
    eng = TPEngine(ckpt, cfg(), 2)
    try:
        os.kill(eng.ranks.procs[0].pid, signal.SIGKILL)
        eng.ranks.procs[0].join(10)
        t0 = time.monotonic()
        with pytest.raises(RankDied, match="died"):
            eng.generate([list(b"anyone there?")])
        assert time.monotonic() - t0 < 10
    finally:
        eng.close()


def test_tied_embeddings_match_transformers(tmp_path):
    from transformers import LlamaForCausalLM

    d = generate(tmp_path / "tied", tiny_config(tie_word_embeddings=True, num_hidden_layers=2), seed=11)
    m = LlamaForCausalLM.from_pretrained(str(d), dtype=torch.float64, attn_implementation="sdpa").eval()
    eng = Engine(d, cfg())
    eng.captured = {}
    prompt = list(b"tied weights")
    got = eng.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    with torch.no_grad():
        ids = torch.tensor([prompt])
        ref = m(ids).logits[0, -1]
        g = m.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0,
                       attention_mask=torch.ones_like(ids))
    assert (eng.captured["gen-0"] - ref).abs().max().item() < 1e-9
    assert got == g[0, len(prompt):].tolist()


def test_tokenizers(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from workers.engine import tokenizer as tok

    byte = tok.load(tmp_path, 256, 257)
    assert byte.encode("hé") == [104, 195, 169] and byte.decode([104, 195, 169, 257]) == "hé"
    t = Tokenizer(models.WordLevel({"hello": 0, "mesh": 1, "[UNK]": 2}, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.save(str(tmp_path / "tokenizer.json"))
    hf = tok.load(tmp_path, None, 2)
    assert hf.encode("hello mesh") == [0, 1] and hf.decode([0, 1]) == "hello mesh"


def test_group_backend_is_nccl_only_for_distinct_gpus():
    from workers.engine.group import group_backend

    assert group_backend(["cuda:0", "cuda:1", "cuda:2", "cuda:3"]) == "nccl"
    for devs in (["cuda:0", "cuda:0"], ["cuda", "cuda"], ["cpu", "cpu"], ["cuda:0"], ["cuda:0", "cpu"]):
        assert group_backend(devs) == "gloo", devs


def test_one_device_per_rank(ckpt, reference):
    tp = TPEngine(ckpt, cfg(), 2, devices=["cpu", "cpu"])
    try:
        assert tp.ranks.backend == "gloo" and not tp.ranks.wire.direct
        check(tp, reference)
    finally:
        tp.close()
    with pytest.raises(ValueError, match="one device per rank"):
        TPEngine(ckpt, cfg(), 2, devices=["cpu"])


def test_device_flag_lists_one_device_or_one_per_rank():
    from contract.errors import ConfigError
    from workers.launch import devices

    assert devices("cuda", 3) == ("cuda",) * 3
    assert devices("cuda:0,cuda:1", 2) == ("cuda:0", "cuda:1")
    with pytest.raises(ConfigError, match="one per stage/rank"):
        devices("cuda:0,cuda:1", 4)


def test_whole_prompts_of_one_length_share_one_attention_call(ckpt, monkeypatch):
    """Prefill of several whole prompts of one length runs one batched causal attention per layer
    (`LlamaStage._whole_prompts`); tokens and logits still equal HF's, prompt by prompt."""
    from transformers import LlamaForCausalLM

    import workers.engine.model as model

    prompts = [b"abcdef", b"ghijkl", b"mnopqr", b"xy", b"stuvwx", b"0123456789"]
    hf = LlamaForCausalLM.from_pretrained(str(ckpt), dtype=torch.float64, attn_implementation="sdpa").eval()
    batched: list[int] = []
    sdpa = model.F.scaled_dot_product_attention

    def spy(q, *a, **kw):
        if q.dim() == 4 and q.shape[2] > 1:   # [b, heads, n, hd]: batched prompts (one prompt's
            batched.append(q.shape[0])          # call is 3-d; a decode step's has n = 1)
        return sdpa(q, *a, **kw)

    monkeypatch.setattr(model.F, "scaled_dot_product_attention", spy)
    eng = Engine(ckpt, EngineConfig(dtype="float64", block_size=BLOCK, num_blocks=256, max_batch_tokens=256))
    eng.captured = {}
    outs = eng.generate([list(p) for p in prompts], SamplingParams(max_tokens=8, ignore_eos=True))
    monkeypatch.setattr(model.F, "scaled_dot_product_attention", sdpa)
    assert batched and set(batched) == {4}   # the four 6-byte prompts, in every layer's prefill
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ids = torch.tensor([list(p)])
            assert (eng.captured[f"gen-{i}"] - hf(ids).logits[0, -1]).abs().max().item() < 1e-9
            want = hf.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0,
                               attention_mask=torch.ones_like(ids))[0, len(p):].tolist()
            assert outs[i] == want, i
    assert eng.blocks.free == eng.cfg.num_blocks


def _run(eng: Engine, plan: dict[int, list[tuple[str, list[int], SamplingParams]]],
         fences: list[int] | None = None) -> dict[str, tuple[list[int], str]]:
    """Step an engine to the end, adding sequences at the steps `plan` names; every step, every
    block is free, in a sequence, or fenced for the step in flight (`fences`: each step's count)."""
    toks: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    k = 0
    while k <= max(plan) or eng.scheduler.has_work():
        for sid, prompt, sp in plan.get(k, []):
            eng.add(sid, prompt, sp)
        for o in eng.step():
            assert o.error is None and o.seq_id not in reasons
            toks.setdefault(o.seq_id, []).extend(o.new_tokens)
            if o.finished:
                reasons[o.seq_id] = o.finish_reason or ""
        live, held = eng.scheduler.census()
        assert eng.blocks.free + live + held + eng.fenced == eng.cfg.num_blocks
        if fences is not None:
            fences.append(eng.fenced)
        k += 1
    assert eng.blocks.free == eng.cfg.num_blocks and eng.fenced == 0
    return {s: (toks[s], reasons[s]) for s in toks}


def test_decode_one_step_ahead_keeps_hf_parity(ckpt, reference):
    """Greedy decode steps launched before the host has seen the last one's tokens (the next
    step's inputs taken on the device): HF's tokens, and every step after the first ran ahead."""
    import dataclasses

    eng = Engine(ckpt, dataclasses.replace(cfg(), graphs="eager"))
    assert eng.ahead
    outs = eng.generate([list(p) for p in PROMPTS], GREEDY)
    assert outs == [ids for _, ids in reference]
    assert eng.ahead_steps > N_TOKENS // 2 and eng.blocks.free == eng.cfg.num_blocks


def test_decode_one_step_ahead_stops_as_the_step_by_step_engine(ckpt):
    """Stop tokens, lengths (1 token too), min_tokens and sequences that arrive mid-decode: the
    same tokens and finish reasons with the engine one step ahead as step by step; a sequence that
    stops while its next row is in flight gives that row up, and its blocks come back after it."""
    import dataclasses

    base = Engine(ckpt, dataclasses.replace(cfg(), graphs="off"))
    probe = base.generate([list(PROMPTS[1]), list(PROMPTS[3])], SamplingParams(max_tokens=24, ignore_eos=True))
    # stops late enough that the prompts are in and the engine runs ahead when they come
    i1 = next(i for i in range(12, 24) if probe[0][i] not in probe[0][:i])
    i2 = next(i for i in range(14, 24) if probe[1][i] not in probe[1][:i])
    stop1, stop2 = probe[0][i1], probe[1][i2]
    plan: dict[int, list[tuple[str, list[int], SamplingParams]]] = {
        0: [("a", list(PROMPTS[1]), SamplingParams(max_tokens=24, stop_token_ids=(stop1,), ignore_eos=True)),
            ("b", list(PROMPTS[3]), SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=(stop2,))),
            ("c", list(PROMPTS[0]), SamplingParams(max_tokens=1)),
            ("d", list(PROMPTS[2]), SamplingParams(max_tokens=2, ignore_eos=True))],
        3: [("e", list(PROMPTS[4]), SamplingParams(max_tokens=9, ignore_eos=True)),
            ("f", list(PROMPTS[1]), SamplingParams(max_tokens=12, min_tokens=8, stop_token_ids=(stop1,)))],
        9: [("g", list(PROMPTS[7]), SamplingParams(max_tokens=5, ignore_eos=True))],
    }
    got = {}
    for mode in ("off", "eager"):
        eng = Engine(ckpt, dataclasses.replace(cfg(), graphs=mode))
        fences: list[int] = []
        got[mode] = _run(eng, plan, fences)
        if mode == "eager":
            assert eng.ahead_steps > 0 and max(fences) > 0   # a stop came while its next row was in flight
    assert got["eager"] == got["off"]
    assert got["off"]["a"] == (probe[0][:i1 + 1], "stop") and got["off"]["b"][1] == "stop"
    assert len(got["off"]["c"][0]) == 1 and got["off"]["c"][1] == "length"
    assert got["off"]["f"][1] == "length" or len(got["off"]["f"][0]) >= 8


def test_abort_while_a_step_is_in_flight_fences_the_blocks(ckpt):
    """An abort of a sequence in the step in flight: no more outputs for it, its blocks stay taken
    (fenced) until that step is done, then every block is back."""
    import dataclasses

    eng = Engine(ckpt, dataclasses.replace(cfg(), graphs="eager"))
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    for i in range(3):
        eng.add(f"s{i}", list(PROMPTS[i]), sp)
    while eng._ahead is None:
        eng.step()
    assert eng.abort("s1")
    assert eng.fenced > 0
    live, _ = eng.scheduler.census()
    assert eng.blocks.free + live + eng.fenced == eng.cfg.num_blocks
    seen = []
    while eng.scheduler.has_work():
        seen += [o.seq_id for o in eng.step()]
    assert "s1" not in seen and seen.count("s0") > 0
    assert eng.fenced == 0 and eng.blocks.free == eng.cfg.num_blocks


def test_the_last_sequence_leaving_a_step_in_flight_leaves_no_block_behind(ckpt):
    """When the last running sequence stops (a stop token) or is aborted while its next row is in
    flight, nobody steps the engine again: that step is waited for then, and every block is back."""
    import dataclasses

    probe = Engine(ckpt, dataclasses.replace(cfg(), graphs="off")).generate(
        [list(PROMPTS[3])], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    i = next(i for i in range(8, 24) if probe[i] not in probe[:i])
    eng = Engine(ckpt, dataclasses.replace(cfg(), graphs="eager"))
    eng.add("s", list(PROMPTS[3]), SamplingParams(max_tokens=24, stop_token_ids=(probe[i],), ignore_eos=True))
    got: list[int] = []
    while eng.scheduler.has_work():
        got += [t for o in eng.step() for t in o.new_tokens]
    assert got == probe[:i + 1] and eng.ahead_steps > 0
    assert eng._ahead is None and eng.fenced == 0 and eng.blocks.free == eng.cfg.num_blocks

    eng.add("t", list(PROMPTS[3]), SamplingParams(max_tokens=24, ignore_eos=True))
    while eng._ahead is None:
        eng.step()
    assert eng.abort("t")
    assert eng._ahead is None and eng.fenced == 0 and eng.blocks.free == eng.cfg.num_blocks
    assert not eng.scheduler.has_work()
