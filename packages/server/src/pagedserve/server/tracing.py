"""OpenTelemetry traces: one span per engine request, exported over OTLP/HTTP to
``--otlp-traces-endpoint``.

Off by default, and then nothing of OpenTelemetry is imported: app.py imports this module only
when the flag is given.

The span is vLLM's: named ``llm_request``, of kind SERVER, from the request's arrival in the
engine to its end, with vLLM's attribute names (``gen_ai.request.id``, ``gen_ai.usage.*``,
``gen_ai.latency.time_in_queue``, ``...time_to_first_token``, ``...e2e``, ``...time_in_model_*``)
and the semantic conventions' ``gen_ai.response.finish_reasons``; its events mark when the request
was first scheduled, gave its first token and finished. The times are the engine's own
(``RequestOutput.metrics``, monotonic seconds, placed on the wall clock when the span is made).

The span's parent is the caller's W3C trace context: ``TraceContextMiddleware`` reads the
``traceparent`` and ``tracestate`` headers into an OpenTelemetry context and makes it current for
the request's ASGI call; ``RequestTracer.start``, called where the route submits its engine
requests (streams.py), takes that context along. A request without the headers starts a trace
of its own.
"""

from __future__ import annotations

import os
import time

from opentelemetry import context as otel_context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedserve.engine import RequestOutput, RequestOutputKind, SamplingParams

SPAN_NAME = "llm_request"  # vLLM's
TRACE_HEADERS = (b"traceparent", b"tracestate")


class TraceContextMiddleware:
    """Makes the caller's trace context (W3C ``traceparent``/``tracestate``) current for the
    request's ASGI call (see the module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.propagator = TraceContextTextMapPropagator()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        carrier = {
            key.decode("latin-1"): value.decode("latin-1")
            for key, value in scope.get("headers", ())
            if key.lower() in TRACE_HEADERS
        }
        token = otel_context.attach(self.propagator.extract(carrier))
        try:
            await self.app(scope, receive, send)
        finally:
            otel_context.detach(token)


class RequestTracer:
    """Spans of engine requests, exported in the background (a BatchSpanProcessor) to the
    OTLP/HTTP ``endpoint`` (a full URL, such as http://collector:4318/v1/traces, as
    ``config.otlp_traces_url`` makes it). The exporter reads OpenTelemetry's own variables for
    the rest (``OTEL_EXPORTER_OTLP_TRACES_HEADERS``, ``..._TIMEOUT``, ``..._COMPRESSION``), and
    the batch processor its ``OTEL_BSP_*`` ones; ``OTEL_SERVICE_NAME`` names the service
    (default: pagedserve)."""

    def __init__(self, endpoint: str) -> None:
        service = os.environ.get("OTEL_SERVICE_NAME", "pagedserve")
        self.provider = TracerProvider(resource=Resource.create({"service.name": service}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer("pagedserve.server")

    def start(
        self, request_id: str, params: SamplingParams, model: str, num_prompt_tokens: int
    ) -> RequestTrace:
        """The trace of one engine request, in the current (the caller's) trace context."""
        return RequestTrace(self, request_id, params, model, num_prompt_tokens)

    def shutdown(self) -> None:
        """Export what is pending and stop (the server's shutdown)."""
        self.provider.shutdown()


class RequestTrace:
    """One engine request's span, made when its last output arrives (``observe``)."""

    def __init__(
        self,
        tracer: RequestTracer,
        request_id: str,
        params: SamplingParams,
        model: str,
        num_prompt_tokens: int,
    ) -> None:
        self.tracer = tracer
        self.context = otel_context.get_current()
        self.delta = params.output_kind is RequestOutputKind.DELTA
        self.completion_tokens = 0
        self.attributes = {
            "gen_ai.request.id": request_id,
            "gen_ai.response.model": model,
            "gen_ai.usage.prompt_tokens": num_prompt_tokens,
            "gen_ai.request.n": params.n,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
        }
        if params.max_tokens is not None:
            self.attributes["gen_ai.request.max_tokens"] = params.max_tokens

    def observe(self, output: RequestOutput) -> None:
        """Count the output's tokens (a DELTA stream's outputs add up); end the span with the
        request's last output."""
        tokens = sum(len(c.token_ids) for c in output.outputs)
        self.completion_tokens = self.completion_tokens + tokens if self.delta else tokens
        if output.finished:
            self._end(output)

    def _end(self, output: RequestOutput) -> None:
        metrics = output.metrics
        if metrics is None:
            return
        to_wall = time.time() - time.monotonic()  # engine times are monotonic seconds

        def ns(t: float) -> int:
            return int((t + to_wall) * 1e9)

        attributes = dict(self.attributes)
        attributes["gen_ai.usage.completion_tokens"] = self.completion_tokens
        reasons = [c.finish_reason for c in output.outputs if c.finish_reason]
        attributes["gen_ai.response.finish_reasons"] = reasons
        attributes.update(latencies(metrics))
        span = self.tracer.tracer.start_span(
            SPAN_NAME,
            context=self.context,
            kind=SpanKind.SERVER,
            attributes=attributes,
            start_time=ns(metrics.arrival_time),
        )
        for name, t in (
            ("scheduled", metrics.first_scheduled_time),
            ("first_token", metrics.first_token_time),
        ):
            if t is not None:
                span.add_event(name, timestamp=ns(t))
        end = metrics.finished_time or metrics.last_token_time or time.monotonic()
        span.add_event("finished", {"finish_reasons": reasons}, timestamp=ns(end))
        span.end(end_time=ns(end))


def latencies(metrics) -> dict[str, float]:
    """vLLM's latency attributes, in seconds, of those the request's timestamps allow."""
    arrival, scheduled = metrics.arrival_time, metrics.first_scheduled_time
    first, last = metrics.first_token_time, metrics.last_token_time
    end = metrics.finished_time or last
    spans = {
        "gen_ai.latency.time_in_queue": (arrival, scheduled),
        "gen_ai.latency.time_to_first_token": (arrival, first),
        "gen_ai.latency.e2e": (arrival, end),
        "gen_ai.latency.time_in_model_prefill": (scheduled, first),
        "gen_ai.latency.time_in_model_decode": (first, last),
        "gen_ai.latency.time_in_model_inference": (scheduled, last),
    }
    return {
        name: stop - start
        for name, (start, stop) in spans.items()
        if start is not None and stop is not None
    }
