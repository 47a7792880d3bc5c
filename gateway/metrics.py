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
TPOT = Histogram("tinyloop_time_per_output_token_seconds",
                 "gateway-side time per output token after the first, per finished stream",
                 buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1))
DEPTH = Counter("tinyloop_requests_by_depth_total", "streams by the depth (loops) they asked for",
                ["method", "loops"])
QUEUED = Gauge("tinyloop_worker_queued_requests", "requests waiting for a cache lane", ["worker"])
UP = Gauge("tinyloop_worker_up", "1 while the worker takes new work, 0 while it is out of placement "
           "(a failed call or a health poll it did not answer in time) until it answers again", ["worker"])
LEFT = Counter("tinyloop_worker_left_placement_total", "times a worker was taken out of placement, by cause",
               ["worker", "cause"])
RUNNING = Gauge("tinyloop_worker_running_lanes", "cache lanes held by a stream or a call", ["worker"])


class WorkerSteps:
    """The workers' step histograms (rows of the batched decode step; prompt tokens prefilled per
    step; the step's wall time; iterations per early-exit decode token; the worker-side time to
    first tokens), as each worker last reported them: cumulative counts kept by the worker,
    exported as Prometheus histograms."""

    def __init__(self):
        self.latest: dict[str, dict] = {}

    def update(self, worker: str, steps: dict) -> None:
        self.latest[worker] = steps

    def collect(self):
        from prometheus_client.core import HistogramMetricFamily
        batch = HistogramMetricFamily("tinyloop_worker_batch_rows", "rows of a worker's batched decode step",
                                      labels=["worker"])
        prefill = HistogramMetricFamily("tinyloop_worker_prefill_tokens_per_step",
                                        "prompt tokens a worker prefilled per scheduler step", labels=["worker"])
        seconds = HistogramMetricFamily("tinyloop_worker_step_seconds", "a worker's scheduler step, wall time",
                                        labels=["worker"])
        iterations = HistogramMetricFamily("tinyloop_worker_iterations_per_token",
                                           "loop iterations an early-exit decode token ran", labels=["worker"])
        ttft = HistogramMetricFamily("tinyloop_worker_time_to_first_token_seconds",
                                     "worker-side time from a stream's arrival to its first tokens handed to the "
                                     "gateway's call (queue, prefill, hand-over)", labels=["worker"])
        for worker, s in sorted(self.latest.items()):
            for fam, key in ((batch, "batch"), (prefill, "prefill"), (seconds, "seconds"), (iterations, "iterations"),
                             (ttft, "ttft")):
                if f"{key}_counts" not in s:  # a worker from before the counts existed
                    continue
                acc, buckets = 0, []
                for bound, n in zip([*s[f"{key}_bounds"], "+Inf"], s[f"{key}_counts"]):
                    acc += n
                    buckets.append((str(bound) if bound == "+Inf" else f"{float(bound)}", acc))
                fam.add_metric([worker], buckets, s[f"{key}_sum"])
        yield batch
        yield prefill
        yield seconds
        yield iterations
        yield ttft
        from prometheus_client.core import CounterMetricFamily
        step_cpu = CounterMetricFamily("tinyloop_worker_step_cpu_seconds",
                                       "CPU time of a worker's step thread in its scheduler steps", labels=["worker"])
        process_cpu = CounterMetricFamily("tinyloop_worker_process_cpu_seconds",
                                          "CPU time of a worker's process, all its threads", labels=["worker"])
        from prometheus_client.core import GaugeMetricFamily
        clock = GaugeMetricFamily("tinyloop_worker_stats_clock_seconds",
                                  "the worker's monotonic clock when it reported these counts", labels=["worker"])
        together = CounterMetricFamily("tinyloop_worker_prompts_prefilled_together",
                                       "prompts a worker prefilled in a pass shared with others", labels=["worker"])
        not_spec = CounterMetricFamily("tinyloop_worker_speculative_batched",
                                       "greedy speculative requests a busy worker decoded in its batched step "
                                       "instead (the same tokens)", labels=["worker"])
        handed = CounterMetricFamily("tinyloop_worker_speculative_handed_to_batch",
                                     "greedy speculative streams a worker moved from their draft-and-verify "
                                     "rounds to its batched step once it became busy (the same tokens)",
                                     labels=["worker"])
        shared = CounterMetricFamily("tinyloop_worker_speculative_rounds_shared",
                                     "speculative rounds a worker ran with other streams' rounds (their draft "
                                     "steps batched, their verifies one pass)", labels=["worker"])
        for worker, s in sorted(self.latest.items()):
            together.add_metric([worker], s.get("prefilled_together", 0))
            shared.add_metric([worker], s.get("speculative_rows", 0))
            not_spec.add_metric([worker], s.get("batched_not_speculative", 0))
            handed.add_metric([worker], s.get("handed_to_batch", 0))
            step_cpu.add_metric([worker], s.get("cpu_seconds_sum", 0.0))
            process_cpu.add_metric([worker], s.get("process_cpu_seconds", 0.0))
            clock.add_metric([worker], s.get("clock_s", 0.0))
        yield step_cpu
        yield process_cpu
        yield clock
        yield together
        yield not_spec
        yield handed
        yield shared


STEPS = WorkerSteps()
try:
    from prometheus_client import REGISTRY
    REGISTRY.register(STEPS)
except ValueError:  # registered already (a re-import)
    pass
