"""A worker's options: one typed, torch-free object per worker (`WorkerOptions`, the scheduler's
policy in it as `SchedulerOptions`), built by `tinyloop serve` (gateway/cli.py) or a program,
handed to each worker actor whole (gateway/workers.py `spawn`), and read by the actor and its
scheduler. Every default and every check of a value lives here, once; the CLI's flags take
their defaults from these fields. Plain dataclasses: the gateway's CLI imports them with nothing
else."""
from __future__ import annotations

from dataclasses import dataclass, field



@dataclass(frozen=True)
class ChannelOptions:
    """Where a worker listens for its gateways' streams (worker/serving/channel.py). `host`
    "0.0.0.0" listens on every interface and advertises the node's IP (as Ray sees it), for
    gateways on other nodes or pods; port 0 picks a free port. `enabled=False`: no channel, the
    streams go through Ray."""
    enabled: bool = True
    host: str = "0.0.0.0"
    port: int = 0

    def __post_init__(self):
        if not 0 <= self.port < 65536:
            raise ValueError(f"the channel's port must be in [0, 65535] (tinyloop serve --worker-channel-port), "
                             f"got {self.port}")

PREFILL_ORDERS = ("arrival", "longest")


@dataclass(frozen=True)
class SchedulerOptions:
    """max_queue: jobs that may wait for a lane (more are refused, `QueueFull`). step_tokens:
    prompt tokens prefilled per step beside the decode step (the chunk size of a long prompt).
    prefill_together: the fresh prompts of a step that fit it whole prefill in one pass
    (`Runner.prefill_many`, right-padded to the longest, at most 2·step_tokens padded tokens)
    instead of one pass each (on CUDA, the runner's multi-row prefill graphs: one eager pass
    for all loses to a captured graph per prompt there, bench/results/load-policies-ab-cuda.json).
    speculative_max_running: the worker is busy while this many streams other than a given
    one hold lanes or wait for one. A job with a batched alternative (`Job.batched`: a greedy
    speculative stream) starts speculative only while the worker is not busy, and otherwise
    decodes in the batched step; a greedy speculative stream already stepping alone is handed
    over to the batched step between two rounds once the worker becomes busy
    (`SpeculativeStream.handoff`: plain decoding at verify_loops from where its rounds left
    it, the same tokens, nothing recomputed) and stays there. A speculative stream steps alone,
    one draft-and-verify after the other, each stalling the batched step, and under load the
    shared step serves its tokens for less (the policy of vLLM's
    speculative_disable_by_batch_size). 0: always speculative.
    speculative_share_from: chain speculative streams share their rounds (`SpecBatch`: their
    draft steps batched, their verifies one pass) once this many would; fewer step alone. 0:
    never shared (bench/spec_batch.py measures shared rounds against rounds in turn).
    prefill_order: which admitted prompts take a step's budget first. "arrival": in arrival
    order. "longest": the prompts midway through their chunks first, then the fresh ones step
    of admission by step of admission, and among those admitted in one step the one with the
    most decode work (`Job.work`: depth x max_tokens) first, ties in arrival order. Requests
    that arrive together at mixed depths then all finish sooner: the deepest streams, whose
    iterations no batching shortens, start decoding first, and the shallow ones fill the batch
    beside them (the longest-processing-time-first rule for the makespan). A prompt is never
    passed by one admitted in a later step, so none waits on later arrivals."""
    max_queue: int = 256
    step_tokens: int = 1024
    prefill_together: bool = True
    speculative_max_running: int = 4
    speculative_share_from: int = 2
    prefill_order: str = "arrival"

    def __post_init__(self):
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0 (tinyloop serve --max-queue), got {self.max_queue}")
        if self.step_tokens < 1:
            raise ValueError(f"step_tokens must be >= 1 (tinyloop serve --step-tokens), got {self.step_tokens}")
        if self.speculative_max_running < 0:
            raise ValueError(f"speculative_max_running must be >= 0 (tinyloop serve --speculative-max-running), "
                             f"got {self.speculative_max_running}")
        if self.speculative_share_from < 0:
            raise ValueError(f"speculative_share_from must be >= 0 (tinyloop serve --speculative-share-from), "
                             f"got {self.speculative_share_from}")
        if self.prefill_order not in PREFILL_ORDERS:
            raise ValueError(f"prefill_order must be one of {PREFILL_ORDERS}, got {self.prefill_order!r}")


@dataclass(frozen=True)
class WorkerOptions:
    """model_path: the checkpoint (a `.tinyloop` file or a Hugging Face directory; None: the
    embedded default model). lanes: cache lanes (None: the Model's default, 64 on a GPU and 8
    on the CPU, within the memory budget). device / dtype: None picks the Model's (the spawner
    sets the device from the placement). handle_budget_bytes / handle_ttl_s / max_handles: the
    resume-handle table's bounds (worker/serving/handles.py). coalesce_s: after a stream's first
    token its tokens leave at most this often, per hop (a channel message or a Ray item).
    max_hops_per_s: the hops per second a worker's streams share after their first tokens: each
    hop costs the worker's one interpreter, and so its step thread, about as much as a stream's
    step does; past it, each stream's hops come less often. gil_switch_s: the worker process's
    interpreter switch interval (`sys.setswitchinterval`): the step thread waits on the GPU with
    the interpreter lock released and needs it back at once, while the event loop thread
    streams tokens; at Python's 5 ms every such hand-back can cost the step up to 5 ms.
    first_token_wait_s: how long at most the step thread waits for the event loop to pass a
    step's first tokens on before it launches the decode step (the actor's `_post`). num_cpus /
    max_restarts: the Ray actor's (max_restarts -1: always restarted). torch_threads: the
    worker's torch threads (None: torch's). max_loops / init_scale / kv_mode / batch_invariant:
    the Model's (None: the checkpoint's or the worker's settings). channel: the token channel
    (worker/serving/channel.py). scheduler: the step loop's policy."""
    model_path: str | None = None
    lanes: int | None = None
    max_seq_len: int = 2048
    device: str | None = None
    dtype: str | None = None
    handle_budget_bytes: int = 1 << 30
    handle_ttl_s: float = 600.0
    max_handles: int = 4096
    coalesce_s: float = 0.05
    max_hops_per_s: float = 640.0
    gil_switch_s: float = 0.0005
    first_token_wait_s: float = 0.002
    num_cpus: float = 1.0
    torch_threads: int | None = None
    max_restarts: int = -1
    max_loops: int | None = None
    init_scale: float = 1.0
    kv_mode: str | None = None
    batch_invariant: bool | None = None
    channel: ChannelOptions = field(default_factory=ChannelOptions)
    scheduler: SchedulerOptions = field(default_factory=SchedulerOptions)

    def __post_init__(self):
        if self.coalesce_s < 0:
            raise ValueError(f"coalesce_s must be >= 0 (tinyloop serve --coalesce-ms), got {self.coalesce_s}")
        if not self.max_hops_per_s > 0:
            raise ValueError(f"max_hops_per_s must be > 0 (tinyloop serve --max-hops-per-s), got {self.max_hops_per_s}")
        if not self.gil_switch_s > 0:
            raise ValueError(f"gil_switch_s must be > 0 (tinyloop serve --gil-switch-ms), got {self.gil_switch_s}")
        if self.first_token_wait_s < 0:
            raise ValueError(f"first_token_wait_s must be >= 0 (tinyloop serve --first-token-wait-ms), "
                             f"got {self.first_token_wait_s}")
