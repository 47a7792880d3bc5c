"""Prometheus metrics of the gateway (exported by `tinyloop serve --metrics-port`)."""
from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter("tinyloop_requests_total", "RPCs received", ["method"])
ERRORS = Counter("tinyloop_errors_total", "RPCs that ended in an error status", ["method", "reason"])
TOKENS = Counter("tinyloop_generated_tokens_total", "tokens streamed to clients", ["worker"])
INFLIGHT = Gauge("tinyloop_inflight_requests", "requests in flight on a worker", ["worker"])
TTFT = Histogram("tinyloop_time_to_first_token_seconds", "gateway-side time to first token",
                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
LATENCY = Histogram("tinyloop_request_seconds", "RPC wall time", ["method"],
                    buckets=(0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300))
STARTUP = Gauge("tinyloop_worker_startup_seconds",
                "a worker's start-up before it served: model load and each part of its CUDA graph capture",
                ["worker", "part"])
