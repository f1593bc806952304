"""OpenTelemetry spans through the mesh (an in-memory exporter, no global state)."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from mesh.app import TRACING, bound_port, create_app, start_site
from mesh.config import MeshConfig, Timeouts
from workers.mock import FleetSpec, MockFaults, MockFleet

BODY = {"model": "mock-model", "prompt": "trace me", "max_tokens": 4}


@pytest.fixture
async def traced():
    made = []

    async def make(spec: FleetSpec, **kw):
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        fleet = MockFleet(spec)
        await fleet.start()
        pre, dec = fleet.mesh_workers()
        app = create_app(MeshConfig(port=0, prefill=pre, decode=dec, timeouts=Timeouts(decode_first_byte=5), **kw),
                         tracer_provider=provider)
        runner = await start_site(app, "127.0.0.1", 0)
        made.append((runner, fleet))
        return f"http://127.0.0.1:{bound_port(runner)}", exporter, fleet

    yield make
    for runner, fleet in made:
        await runner.cleanup()
        await fleet.close()


def by_name(exporter) -> dict:
    return {s.name: s for s in exporter.get_finished_spans()}


@pytest.mark.parametrize("stream", [False, True])
async def test_request_and_leg_spans_share_a_trace_with_the_request_id(traced, http, stream):
    url, exporter, fleet = await traced(FleetSpec(prefill=1, decode=1, tp_size=2))
    async with http.post(url + "/v1/completions", json={**BODY, "stream": stream},
                         headers={"X-Request-Id": "trace-req-1"}) as r:
        assert r.status == 200
        await r.read()
    spans = by_name(exporter)
    assert set(spans) == {"atomesh.request", "atomesh.prefill", "atomesh.kv_pull", "atomesh.decode"}
    root = spans["atomesh.request"]
    assert root.kind == SpanKind.SERVER and root.attributes["http.response.status_code"] == 200
    for name, s in spans.items():
        assert s.attributes["atomesh.request_id"] == "trace-req-1", name
        assert s.context.trace_id == root.context.trace_id, name
        if name != "atomesh.request":
            assert s.parent.span_id == root.context.span_id, name
    pre, pull, dec = spans["atomesh.prefill"], spans["atomesh.kv_pull"], spans["atomesh.decode"]
    assert pre.kind == dec.kind == SpanKind.CLIENT
    assert pre.attributes["atomesh.worker"] == fleet.prefills[0].id and dec.attributes["atomesh.worker"] == fleet.decodes[0].id
    assert dec.attributes["atomesh.kv.blocks"] >= 1 and dec.attributes["atomesh.kv.transfer_id"]
    assert pre.end_time <= dec.start_time <= pull.start_time < pull.end_time <= dec.end_time


async def test_legs_carry_traceparent_to_the_workers(traced, http):
    url, exporter, fleet = await traced(FleetSpec(prefill=1, decode=1))
    seen = {}
    for w in (fleet.prefills[0], fleet.decodes[0]):
        orig = w.handle

        async def spy(request, gen, body, orig=orig, w=w):
            seen[w.role] = request.headers.get("traceparent")
            return await orig(request, gen, body)

        w.handle = spy
    async with http.post(url + "/v1/completions", json=BODY) as r:
        assert r.status == 200
    spans = by_name(exporter)
    for role in ("prefill", "decode"):
        span = spans[f"atomesh.{role}"]
        assert seen[role].startswith(f"00-{span.context.trace_id:032x}-{span.context.span_id:016x}-")


async def test_a_failed_request_has_error_spans(traced, http):
    url, exporter, fleet = await traced(FleetSpec(prefill=1, decode=1), retries=0)
    fleet.prefills[0].faults = MockFaults(status=500)
    async with http.post(url + "/v1/completions", json=BODY) as r:
        assert r.status == 502
    spans = by_name(exporter)
    assert spans["atomesh.request"].attributes["http.response.status_code"] == 502
    assert spans["atomesh.request"].status.status_code == StatusCode.ERROR
    assert spans["atomesh.prefill"].status.status_code == StatusCode.ERROR
    assert "atomesh.decode" not in spans


async def test_no_provider_means_no_tracing(make_pd):
    pd = await make_pd()
    assert pd.app[TRACING] is None and pd.state.proxy.tracing is None
