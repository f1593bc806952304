"""The reference engine honours the OpenAI parameters it advertises (stop strings, logprobs and
top_logprobs, echo, n with seeds, min_tokens) and refuses the ones it does not serve with a 400 naming
them. The client is the official openai SDK; the reference is HF transformers on the same weights
(float64): greedy tokens equal, logprobs within 1e-6. The worker is the real adapter
(`workers.server.EngineServer`) over a real engine, in this process."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import openai
import pytest
import torch

from mesh.app import bound_port, start_site
from workers.engine.checkpoint import generate, vllm_tiny_config, write_tokenizer
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.tokenizer import load as load_tokenizer
from workers.server import EngineServer

MODEL = "tiny-llama"
N = 12
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A Llama with a real BPE tokenizer (tokens are words and pieces, as a user's model)."""
    path = tmp_path_factory.mktemp("m") / MODEL
    write_tokenizer(path, 4096)
    return generate(path, vllm_tiny_config(), seed=13)


@pytest.fixture(scope="module")
def tok(ckpt):
    return load_tokenizer(ckpt, None, None)


@pytest.fixture(scope="module")
def hf(ckpt, tok):
    """HF greedy continuation of PROMPT: token ids and, per step, log_softmax over the vocabulary."""
    from transformers import LlamaForCausalLM

    m = LlamaForCausalLM.from_pretrained(str(ckpt), dtype=torch.float64, attn_implementation="sdpa").eval()
    ids = tok.encode(PROMPT)
    out, lps = [], []
    with torch.no_grad():
        for _ in range(N):
            lp = torch.log_softmax(m(torch.tensor([ids + out])).logits[0, -1], -1)
            t = int(lp.argmax())
            out.append(t)
            lps.append(lp)
    return out, lps


@pytest.fixture
async def worker(ckpt) -> AsyncIterator[tuple[openai.AsyncOpenAI, EngineServer]]:
    engine = await asyncio.to_thread(Engine, ckpt, EngineConfig(dtype="float64", block_size=4, num_blocks=256,
                                                                max_batch_tokens=32))
    server = EngineServer(engine, MODEL, "w0")
    runner = await start_site(server.app(), "127.0.0.1", 0)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{bound_port(runner)}/v1", api_key="x", max_retries=0)
    try:
        yield client, server
    finally:
        await client.close()
        await runner.cleanup()
    assert engine.blocks.free == 256 and not engine.seqs   # every block back, nothing left running


async def test_logprobs_and_top_logprobs_equal_transformers(worker, hf, tok):
    client, _ = worker
    ids, lps = hf
    r = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, logprobs=3,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
    ch = r.choices[0]
    assert ch.model_extra["token_ids"] == ids and ch.text == tok.decode(ids)
    for j, (t, lp) in enumerate(zip(ids, lps)):
        assert abs(ch.logprobs.token_logprobs[j] - lp[t].item()) < 1e-6
        top = torch.topk(lp, 3)
        want = {tok.decode([i]): v for i, v in zip(top.indices.tolist(), top.values.tolist())}
        got = ch.logprobs.top_logprobs[j]
        for k, v in want.items():
            assert abs(got[k] - v) < 1e-6, (j, k)
    # chat: the same numbers in chat's shape, streamed and not
    for stream in (False, True):
        kw: dict[str, Any] = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                  temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
        if not stream:
            c = (await client.chat.completions.create(**kw)).choices[0]
            content = c.logprobs.content
            text = c.message.content
        else:
            content, text = [], ""
            async for ev in await client.chat.completions.create(**kw, stream=True):
                for x in ev.choices:
                    text += x.delta.content or ""
                    content += (x.logprobs.content if x.logprobs else None) or []
        assert len(content) == 5 and all(len(e.top_logprobs) == 2 for e in content)
        assert "".join(e.token for e in content) == text
        assert all(e.top_logprobs[0].logprob >= e.logprob - 1e-9 for e in content)


async def test_stop_strings_cut_the_text_before_the_stop(worker, hf, tok):
    client, _ = worker
    ids, _ = hf
    full = tok.decode(ids)
    stop = full[4:6]                        # a string the greedy continuation reaches at character 4
    cut = full[:full.find(stop)]
    for stream in (False, True):
        if not stream:
            r = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, stop=[stop],
                                                extra_body={"ignore_eos": True})
            text, finish = r.choices[0].text, r.choices[0].finish_reason
        else:
            text, finish = "", None
            async for ev in await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0,
                                                            stop=stop, stream=True, extra_body={"ignore_eos": True}):
                for x in ev.choices:
                    text += x.text
                    finish = x.finish_reason or finish
        assert text == cut and finish == "stop", (stream, text, cut)
    # a stop string never reached: the whole text, finish "length"
    r = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, stop=["\x00never"],
                                        extra_body={"ignore_eos": True})
    assert r.choices[0].text == full and r.choices[0].finish_reason == "length"


async def test_echo_n_seed_and_min_tokens(worker, hf, tok):
    client, _ = worker
    ids, _ = hf
    r = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, echo=True,
                                        extra_body={"ignore_eos": True})
    assert r.choices[0].text == PROMPT + tok.decode(ids)
    text = ""
    async for ev in await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, echo=True,
                                                    stream=True, extra_body={"ignore_eos": True}):
        text += "".join(x.text for x in ev.choices)
    assert text == PROMPT + tok.decode(ids)
    # n with a seed: reproducible, the choices differ, usage counts the prompt once
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=1.0, seed=7, n=3, extra_body={"ignore_eos": True})
    a, b = await client.completions.create(**kw), await client.completions.create(**kw)
    ta, tb = [c.text for c in sorted(a.choices, key=lambda c: c.index)], [c.text for c in sorted(b.choices,
                                                                                                   key=lambda c: c.index)]
    assert ta == tb and len(set(ta)) == 3
    assert a.usage.prompt_tokens == len(tok.encode(PROMPT)) and a.usage.completion_tokens == 3 * N
    got: dict[int, str] = {}
    async for ev in await client.completions.create(**kw, stream=True):
        for x in ev.choices:
            got[x.index] = got.get(x.index, "") + x.text
    assert [got[i] for i in range(3)] == ta
    # min_tokens: EOS is masked until then (the checkpoint's EOS made the likeliest first token)
    r = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                        extra_body={"min_tokens": 4, "stop_token_ids": [ids[0]],
                                                    "return_token_ids": True})
    assert ids[0] not in r.choices[0].model_extra["token_ids"][:4] and r.choices[0].finish_reason == "length"


def param_of(e: openai.APIStatusError) -> str:
    body = e.body if isinstance(e.body, dict) else {}
    return body.get("error", body).get("param")


@pytest.mark.parametrize("field,value", [("tools", [{"type": "function", "function": {"name": "f"}}]),
                                         ("response_format", {"type": "json_object"}),
                                         ("logit_bias", {"5": 10}), ("presence_penalty", 0.5), ("best_of", 2),
                                         ("suffix", "tail"), ("echo", "yes"), ("logprobs", 21)])
async def test_unserved_parameters_are_a_400_naming_them(worker, field, value):
    client, _ = worker
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={field: value})
    assert param_of(e.value) == field and "Traceback" not in str(e.value.body)


async def test_echo_with_logprobs_and_chat_top_logprobs_without_logprobs(worker):
    client, _ = worker
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, echo=True, logprobs=1)
    assert param_of(e.value) == "echo"
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                             top_logprobs=2)
    assert param_of(e.value) == "top_logprobs"


async def test_a_prompt_longer_than_the_model_names_the_prompt(worker):
    """issue 17: a 2 MB prompt was refused naming `max_tokens` (on a PD prefill leg, the mesh's own 1)."""
    client, _ = worker
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(model=MODEL, prompt="x" * 3000, max_tokens=1)
    assert e.value.body["param"] == "prompt" and "3000 tokens" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(model=MODEL, prompt="x" * 2000, max_tokens=100)
    assert e.value.body["param"] == "max_tokens"


async def test_token_ids_outside_the_vocabulary_are_a_400_naming_the_prompt(worker):
    """The range check runs once, where a request is parsed (`workers.openai_io.parse`); the engine
    then takes the ids as checked (`Engine.add(checked=True)`): a bad id still never reaches the model."""
    client, server = worker
    vocab = server.engine.model_cfg.vocab_size
    for bad in ([1, 2, vocab], [-1, 5]):
        with pytest.raises(openai.BadRequestError) as e:
            await client.completions.create(model=MODEL, prompt=bad, max_tokens=2)
        assert param_of(e.value) == "prompt" and f"[0, {vocab})" in e.value.body["message"]
    ok = await client.completions.create(model=MODEL, prompt=[1, 2, vocab - 1], max_tokens=2)
    assert ok.usage.prompt_tokens == 3 and ok.usage.completion_tokens == 2
    with pytest.raises(ValueError, match="out of the vocabulary"):   # unchecked: the engine's own check
        server.engine.add("direct", [0, vocab + 3])
    assert "direct" not in server.engine.seqs
