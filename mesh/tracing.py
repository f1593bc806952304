"""OpenTelemetry spans for a request and its legs, when `opentelemetry` is installed and configured.

Spans (all carry `atomesh.request_id`):
- `atomesh.request` (SERVER): route, model, stream, the final HTTP status;
- `atomesh.prefill` (CLIENT): the pipeline, its dialect, `kv.transfer_id`, `kv.blocks`;
- `atomesh.kv_pull`: the decode engine's pull of the KV, as it reports it (`X-Atomesh-KV-Pull-Ms`
  on its answer; Atomesh workers and the mock fleet send it);
- `atomesh.decode` (CLIENT): the decode engine, from the leg's start to the stream's end.
The legs carry W3C `traceparent` so an instrumented engine joins the trace.

"Configured" means a tracer provider was given (`create_app(..., tracer_provider=)`), or the
process has a global SDK provider (`opentelemetry-instrument`, or `mesh serve --otel` which sets one
up from the standard `OTEL_*` variables). Otherwise `Tracing.from_env()` is None and the request
path pays nothing.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator


class Tracing:
    def __init__(self, provider: Any) -> None:
        from opentelemetry import propagate, trace

        self.trace = trace
        self.tracer = provider.get_tracer("atomesh")
        self._inject = propagate.inject

    @classmethod
    def from_env(cls, provider: Any = None) -> "Tracing | None":
        """A Tracing for `provider`, or for the global provider when it is an SDK one; else None."""
        try:
            from opentelemetry import trace
        except ImportError:
            return None
        if provider is None:
            provider = trace.get_tracer_provider()
            if type(provider).__name__ in ("ProxyTracerProvider", "NoOpTracerProvider"):
                return None  # nobody configured tracing: stay off the request path
        return cls(provider)

    @contextlib.contextmanager
    def request(self, request_id: str, route: str, model: str, stream: bool) -> Iterator[Any]:
        with self.tracer.start_as_current_span(
                "atomesh.request", kind=self.trace.SpanKind.SERVER, record_exception=False, set_status_on_exception=False,
                attributes={"atomesh.request_id": request_id, "http.route": route, "gen_ai.request.model": model,
                            "atomesh.stream": stream}) as span:
            yield span

    def start_leg(self, name: str, request_id: str, worker: Any, headers: dict[str, str]) -> Any:
        """A leg's span (a child of the request's); `headers` get its trace context for the worker."""
        span = self.tracer.start_span(
            f"atomesh.{name}", kind=self.trace.SpanKind.CLIENT,
            attributes={"atomesh.request_id": request_id, "atomesh.worker": worker.id,
                        "server.address": worker.host, "server.port": worker.port,
                        "atomesh.dialect": worker.record.dialect})
        self._inject(headers, context=self.trace.set_span_in_context(span))
        return span

    def end(self, span: Any, error: BaseException | None = None) -> None:
        if error is not None:
            self.end_error(span, error)
        span.end()

    def end_error(self, span: Any, error: BaseException) -> None:
        """Mark a span failed (it is ended by its owner)."""
        span.record_exception(error)
        span.set_status(self.trace.Status(self.trace.StatusCode.ERROR, str(error)[:200]))

    def kv_pull(self, request_id: str, worker: Any, start_ns: int, pull_ms: str | None) -> None:
        """The decode's KV pull as a span of its own, timed from what the engine reported."""
        try:
            ms = float(pull_ms) if pull_ms is not None else None
        except ValueError:
            ms = None
        if ms is None or ms < 0:
            return
        span = self.tracer.start_span("atomesh.kv_pull", start_time=start_ns,
                                      attributes={"atomesh.request_id": request_id, "atomesh.worker": worker.id})
        span.end(end_time=start_ns + int(ms * 1e6))


def setup_sdk() -> None:
    """`mesh serve --otel`: a global SDK provider exporting as `OTEL_TRACES_EXPORTER` says
    (`otlp` needs opentelemetry-exporter-otlp-proto-http; `console` prints spans)."""
    import os

    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    provider = TracerProvider(resource=Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME",
                                                                                       "atomesh-mesh")}))
    kind = os.environ.get("OTEL_TRACES_EXPORTER", "otlp")
    if kind == "console":
        exporter: Any = ConsoleSpanExporter()
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
