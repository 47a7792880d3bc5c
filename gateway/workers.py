"""Creating the worker actors: one per GPU (num_gpus=1), or CPU workers on CPU-only clusters.

`max_restarts` brings a dead worker back (with a new epoch: its handles are lost, and say
so); `max_task_retries` stays 0, because replaying a generation would duplicate tokens."""
from __future__ import annotations

from dataclasses import dataclass, field

import ray

from tinyloop.worker.serving.actor import WorkerActor  # imports no torch at module level
from tinyloop.worker.serving.channel import ChannelOptions

NAMESPACE = "tinyloop"


@dataclass
class WorkerOptions:
    model_path: str | None = None
    lanes: int | None = None  # None: the worker's default (Model: 64 on a GPU, 8 on the CPU)
    max_seq_len: int = 2048
    device: str | None = None
    dtype: str | None = None
    handle_budget_bytes: int = 1 << 30
    handle_ttl_s: float = 600.0
    max_queue: int = 256
    coalesce_s: float = 0.05  # = worker.actor.DEFAULT_COALESCE_S
    max_hops_per_s: float = 640.0  # = worker.actor.DEFAULT_MAX_HOPS_PER_S
    gil_switch_s: float = 0.0005   # = worker.actor.DEFAULT_GIL_SWITCH_S
    first_token_wait_s: float = 0.002  # = worker.actor.DEFAULT_FIRST_TOKEN_WAIT_S
    num_cpus: float = 1.0
    torch_threads: int | None = None
    max_restarts: int = -1
    max_loops: int | None = None  # None: the checkpoint's
    init_scale: float = 1.0       # Huginn's initial latent state scale (0: zero state)
    step_tokens: int = 1024       # prompt tokens prefilled per scheduler step (= worker.serving.actor's default)
    prefill_together: bool = True  # a step's fresh prompts prefill together (SchedulerOptions)
    speculative_max_running: int = 4  # greedy speculative streams decode batched from this many (SchedulerOptions)
    speculative_share_from: int = 2  # chain speculative streams share their rounds from this many (SchedulerOptions)
    prefill_order: str = "arrival"  # which admitted prompts prefill first (SchedulerOptions.prefill_order)
    kv_mode: str | None = None    # the cache mode (worker.model.settings.KV_MODES); None: the worker's settings
    batch_invariant: bool | None = None  # batch-invariant kernels (Settings.batch_invariant); None: the worker's settings
    # the token channel (worker/serving/channel.py): streams over gRPC into the worker, not Ray
    channel: ChannelOptions = field(default_factory=ChannelOptions)


def cluster_gpus() -> int:
    return int(ray.cluster_resources().get("GPU", 0))


def placement(n: int | None, gpus: int, device: str | None) -> tuple[int, bool]:
    """How many workers, and whether each takes a GPU (num_gpus=1), given the GPUs the cluster
    has now. `device="cuda"` always takes GPUs: on Kubernetes the gateway can start before the
    GPU worker pods have joined the Ray cluster, and Ray then holds each actor until a GPU is
    there, where counting the GPUs now would have made CPU workers. With no device given, GPUs
    are used when there is one for every worker."""
    if n is None:
        n = gpus or 1
    if device == "cuda":
        return n, True
    return n, device is None and gpus >= n


def spawn(n: int | None, opts: WorkerOptions, name_prefix: str = "tinyloop-worker",
          detached: bool = False) -> list:
    """Start n worker actors (default: one per GPU, else one CPU worker). Detached workers
    outlive the gateway that made them (get_if_exists: a restarted gateway re-attaches)."""
    n, use_gpu = placement(n, cluster_gpus(), opts.device)
    actor_cls = ray.remote(WorkerActor)
    actors = []
    for i in range(n):
        actors.append(actor_cls.options(
            name=f"{name_prefix}-{i}", namespace=NAMESPACE, lifetime="detached" if detached else None,
            get_if_exists=detached,
            num_gpus=1 if use_gpu else 0, num_cpus=opts.num_cpus,
            max_restarts=opts.max_restarts, max_task_retries=0, max_concurrency=1000,
        ).remote(i, model_path=opts.model_path, lanes=opts.lanes, max_seq_len=opts.max_seq_len,
                 device=opts.device or ("cuda" if use_gpu else "cpu"), dtype=opts.dtype,
                 handle_budget_bytes=opts.handle_budget_bytes, handle_ttl_s=opts.handle_ttl_s,
                 max_queue=opts.max_queue, coalesce_s=opts.coalesce_s, torch_threads=opts.torch_threads,
                 max_loops=opts.max_loops, init_scale=opts.init_scale, step_tokens=opts.step_tokens,
                 max_hops_per_s=opts.max_hops_per_s, gil_switch_s=opts.gil_switch_s,
                 first_token_wait_s=opts.first_token_wait_s, kv_mode=opts.kv_mode,
                 batch_invariant=opts.batch_invariant,
                 prefill_together=opts.prefill_together,
                 speculative_max_running=opts.speculative_max_running,
                 speculative_share_from=opts.speculative_share_from,
                 prefill_order=opts.prefill_order,
                 channel=opts.channel))
    return actors


def attach(n: int, name_prefix: str = "tinyloop-worker", timeout_s: float = 300.0) -> list:
    """The n workers another gateway created (an extra gateway replica attaches by name)."""
    import time
    deadline = time.monotonic() + timeout_s
    actors = []
    for i in range(n):
        while True:
            try:
                actors.append(ray.get_actor(f"{name_prefix}-{i}", namespace=NAMESPACE))
                break
            except ValueError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"worker {name_prefix}-{i} not found in namespace {NAMESPACE}") from None
                time.sleep(1.0)
    return actors
