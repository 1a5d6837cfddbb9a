"""Prometheus metrics, served at ``GET /metrics`` (text exposition format).

HTTP side (recorded by :class:`MetricsMiddleware` and the routes):
  shoal_http_requests_total{route,method,status}, shoal_http_request_duration_seconds{route},
  shoal_time_to_first_audio_seconds{route}, shoal_requests_in_flight,
  shoal_audio_seconds_total (audio sent, after prosody).
Engine side (read from the engine when scraped):
  shoal_queue_depth, shoal_running_requests, shoal_preparing_requests, shoal_max_running,
  shoal_frames_total (rate() = frames/s), shoal_kv_cache_usage_ratio,
  shoal_prefix_cache_hit_tokens_total, shoal_prefix_cache_queried_tokens_total,
  shoal_prefix_cache_copied_tokens_total,
  shoal_prefix_cache_hit_rate, shoal_ready,
  shoal_memory_bytes{part} (model_weights, codec_weights, kv_cache; codec_streamer on CUDA:
  stream slots, graph pools and workspaces of the codec, reserved memory after its warm-up).
Codec (streaming audio; from the audio worker's counters, percentiles over its recent calls):
  shoal_codec_calls_total, shoal_codec_frames_total (stream-frames decoded),
  shoal_codec_first_chunk_queue_seconds{quantile} (a complete first chunk's wait for its call),
  shoal_codec_call_seconds{quantile} (a call's launch to delivery).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.types import ASGIApp, Message, Receive, Scope, Send

TTFA_BUCKETS = (0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0)
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _EngineCollector:
    def __init__(self, snapshot: Callable[[], dict[str, float]]) -> None:
        self._snapshot = snapshot

    def collect(self):
        s = self._snapshot()
        yield GaugeMetricFamily("shoal_queue_depth", "Requests waiting for an engine slot",
                                value=s["waiting"])
        yield GaugeMetricFamily("shoal_running_requests", "Requests in the engine's running batch",
                                value=s["running"])
        yield GaugeMetricFamily("shoal_preparing_requests",
                                "Requests encoding references / building prompts", value=s["preparing"])
        yield GaugeMetricFamily("shoal_max_running", "Engine slot count", value=s["max_running"])
        yield CounterMetricFamily("shoal_frames", "Audio frames generated (rate() gives frames/s)",
                                  value=s["frames_total"])
        yield GaugeMetricFamily("shoal_kv_cache_usage_ratio", "Fraction of KV blocks in use",
                                value=s["kv_usage"])
        yield CounterMetricFamily("shoal_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                                  value=s["prefix_hit_tokens"])
        yield CounterMetricFamily("shoal_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache",
                                  value=s["prefix_queried_tokens"])
        yield CounterMetricFamily("shoal_prefix_cache_copied_tokens",
                                  "Of the hit tokens, those served by copying a partially shared KV page",
                                  value=s["prefix_copied_tokens"])
        yield GaugeMetricFamily("shoal_prefix_cache_hit_rate", "Prefix cache hit tokens / queried tokens",
                                value=s["prefix_hit_rate"])
        yield GaugeMetricFamily("shoal_ready", "1 once warm-up is done", value=s["ready"])
        parts = sorted(k for k in s if k.startswith("memory_bytes."))
        if parts:
            g = GaugeMetricFamily("shoal_memory_bytes", "Device memory by part, measured at start "
                                  "(model_weights, codec_weights, codec_streamer, kv_cache)", labels=["part"])
            for k in parts:
                g.add_metric([k.split(".", 1)[1]], s[k])
            yield g
        if "codec_calls_total" in s:
            yield CounterMetricFamily("shoal_codec_calls", "Streaming codec calls", value=s["codec_calls_total"])
            yield CounterMetricFamily("shoal_codec_frames", "Stream-frames decoded by the streaming codec",
                                      value=s["codec_frames_total"])
            for name, key, doc in (
                    ("shoal_codec_first_chunk_queue_seconds", "codec_first_chunk_queue",
                     "A stream's complete first chunk waiting for its codec call (recent calls)"),
                    ("shoal_codec_call_seconds", "codec_call", "A codec call from launch to delivery (recent calls)")):
                g = GaugeMetricFamily(name, doc, labels=["quantile"])
                g.add_metric(["0.5"], s[f"{key}_p50_s"])
                g.add_metric(["0.99"], s[f"{key}_p99_s"])
                yield g


class Metrics:
    def __init__(self, snapshot: Callable[[], dict[str, float]]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.requests = Counter("shoal_http_requests", "HTTP requests by route, method and status",
                                ["route", "method", "status"], registry=r)
        self.duration = Histogram("shoal_http_request_duration_seconds", "HTTP request duration "
                                  "(streamed responses: until the last byte)", ["route"],
                                  buckets=DURATION_BUCKETS, registry=r)
        self.ttfa = Histogram("shoal_time_to_first_audio_seconds", "Request arrival to first audio bytes",
                              ["route"], buckets=TTFA_BUCKETS, registry=r)
        self.in_flight = Gauge("shoal_requests_in_flight", "Synthesis requests being served", registry=r)
        self.audio_seconds = Counter("shoal_audio_seconds", "Seconds of audio sent", registry=r)
        # --- live TTS (shoal/server/live.py): WS /v1/tts/live, first `text` -> first `audio` frame
        self.live_ttfa = Histogram("shoal_live_time_to_first_audio_seconds", "WS /v1/tts/live: first "
                                   "text event to first audio frame", buckets=TTFA_BUCKETS, registry=r)
        r.register(_EngineCollector(snapshot))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def route_label(scope: Scope) -> str:
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"


class MetricsMiddleware:
    """Pure ASGI (no buffering, streaming and disconnects untouched): counts every response."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 0

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except BaseException:
            if status == 0:
                status = 500
            raise
        finally:
            route = route_label(scope)
            self.metrics.requests.labels(route, scope.get("method", ""), str(status or 499)).inc()
            self.metrics.duration.labels(route).observe(time.perf_counter() - t0)



router = APIRouter()


@router.head("/metrics", include_in_schema=False)
@router.get("/metrics", summary="Prometheus metrics", include_in_schema=False)
async def metrics_endpoint(request: Request) -> Response:
    body, ctype = request.app.state.shoal.metrics.render()
    return Response(body, media_type=ctype)
