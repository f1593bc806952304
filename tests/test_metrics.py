"""mesh/metrics.py: the request path's tallies, folded into prometheus-client's metrics on a read of
the registry, expose exactly what prometheus-client's own `inc`/`observe` would have."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from mesh.metrics import LATENCY_BUCKETS, Metrics


def _samples(registry: CollectorRegistry, prefix: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for m in registry.collect() if m.name.startswith(prefix)
            for s in m.samples if not s.name.endswith("_created")}


def test_tallies_expose_what_prometheus_client_would() -> None:
    m = Metrics(lambda: ())
    ref = CollectorRegistry()
    req = Counter("atomesh_requests", "x", ["route", "status"], registry=ref)
    lat = Histogram("atomesh_request_duration_seconds", "x", ["route"], buckets=LATENCY_BUCKETS, registry=ref)
    leg = Histogram("atomesh_leg_duration_seconds", "x", ["leg"], buckets=LATENCY_BUCKETS, registry=ref)
    rel = Histogram("atomesh_kv_release_seconds", "x", buckets=LATENCY_BUCKETS, registry=ref)
    term = Counter("atomesh_kv_terminal", "x", ["state", "reason"], registry=ref)
    dup = Counter("atomesh_kv_duplicate_releases", "x", registry=ref)
    rng = random.Random(7)
    # values on the bounds themselves (`le` is inclusive), between them, past the last one
    values = list(LATENCY_BUCKETS) + [0.0, 1e-9, 200.0] + [rng.uniform(0, 3) for _ in range(500)]
    for round_ in range(3):   # read between rounds: a fold leaves nothing behind to count twice
        for i, v in enumerate(values):
            route = ("completions", "chat")[i % 2]
            status = (200, 503, 400)[i % 3]
            m.request_done(route, status, v)
            req.labels(route, str(status)).inc()
            lat.labels(route).observe(v)
            m.leg(("prefill", "decode")[i % 2], v / 2)
            leg.labels(("prefill", "decode")[i % 2]).observe(v / 2)
            m.kv_terminal("released", "decode_done", v if i % 4 else None)
            term.labels("released", "decode_done").inc()
            if i % 4:
                rel.observe(v)
            if i % 7 == 0:
                m.duplicate_release()
                dup.inc()
        for prefix in ("atomesh_requests", "atomesh_request_duration", "atomesh_leg_duration",
                       "atomesh_kv_release_seconds", "atomesh_kv_terminal", "atomesh_kv_duplicate"):
            got, want = _samples(m.registry, prefix), _samples(ref, prefix)
            assert got.keys() == want.keys(), prefix
            for k in want:
                assert abs(got[k] - want[k]) <= 1e-9 * max(1.0, abs(want[k])), (round_, k, got[k], want[k])
    text = generate_latest(m.registry).decode()
    assert 'atomesh_request_duration_seconds_bucket{le="0.001",route="chat"}' in text
    n = sum(1 for i in range(len(values)) if i % 6 == 0)   # completions (i even) with status 200 (i % 3 == 0)
    assert 'atomesh_requests_total{route="completions",status="200"} %s' % float(3 * n) in text
