"""`tinyloop serve`: start (or join) Ray, create the worker actors, run the gateway."""
from __future__ import annotations

import argparse
import os

from tinyloop.worker.model.settings import KV_MODES  # torch-free: the mode names only
from tinyloop.worker.serving.options import PREFILL_ORDERS, ChannelOptions, SchedulerOptions, WorkerOptions

W, S = WorkerOptions, SchedulerOptions  # the flags' defaults are the options' own


def register(sub) -> None:
    s = sub.add_parser("serve", help="serve the model over gRPC (gateway + Ray worker actors)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=50051)
    s.add_argument("--model", default=None, help="a .tinyloop checkpoint or a Hugging Face model directory "
                                                 "(Ouro, Huginn; default: the embedded model)")
    s.add_argument("--max-loops", type=int, default=None,
                   help="the deepest loops a request may ask (default: the checkpoint's; a directory: 2x its default)")
    s.add_argument("--init-scale", type=float, default=W.init_scale,
                   help="scale of Huginn's random initial latent state (0: the zero state)")
    s.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start a local one)")
    s.add_argument("--workers", type=int, default=None, help="worker actors (default: one per GPU, else 1)")
    s.add_argument("--attach", action="store_true",
                   help="attach to the --workers N workers another gateway created (extra replicas)")
    s.add_argument("--lanes", type=int, default=None,
                   help="cache lanes (concurrent streams) per worker; default: 64 on a GPU, 8 on the CPU, "
                        "within half the free device memory")
    s.add_argument("--max-seq-len", type=int, default=W.max_seq_len)
    s.add_argument("--kv-mode", default=None, choices=KV_MODES,
                   help="what the KV cache stores (docs/kv-cache.md): kv (K and V), h (the layer input, K/V "
                        "rebuilt at read), h-int8 / h-int4 (h quantized per head), delta-int8 (h0 + int8 deltas "
                        "per iteration); default: the workers' TINYLOOP_KV_* environment, else kv")
    s.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                   help="batch-invariant kernels on the GPU: every stream's tokens bit for bit its run alone "
                        "(batched, speculative, resumed), greedy speculative rounds on the device; costs more "
                        "the more rows a step has (docs/performance.md); default: the workers' "
                        "TINYLOOP_BATCH_INVARIANT, else off")
    s.add_argument("--device", default=None,
                   help="cpu | cuda: every worker takes a GPU, waiting for one if the cluster has none free yet "
                        "(default: cuda when the cluster has a GPU for every worker, else cpu)")
    s.add_argument("--dtype", default=None)
    s.add_argument("--handle-budget-mb", type=float, default=W.handle_budget_bytes / (1 << 20), help="resume-handle bytes per worker")
    s.add_argument("--handle-ttl-s", type=float, default=W.handle_ttl_s, help="idle time before a handle expires")
    s.add_argument("--max-queue", type=int, default=S.max_queue, help="requests waiting for a lane, per worker")
    s.add_argument("--step-tokens", type=int, default=S.step_tokens,
                   help="prompt tokens prefilled per scheduler step beside the decode step: longer prompts "
                        "are prefilled in chunks of this many, so running streams keep a token per step")
    s.add_argument("--prefill-together", action=argparse.BooleanOptionalAction, default=S.prefill_together,
                   help="a step's fresh prompts that fit its budget whole prefill together: one padded pass "
                        "(on CUDA, multi-row prefill graphs) instead of one each")
    s.add_argument("--speculative-max-running", type=int, default=S.speculative_max_running,
                   help="a greedy speculative request decodes in the batched step instead (the same tokens) "
                        "when this many other streams run or wait on its worker, and one already speculating "
                        "moves into the batched step between two rounds (0: always speculative)")
    s.add_argument("--speculative-share-from", type=int, default=S.speculative_share_from,
                   help="chain speculative streams on a worker share their rounds (draft steps batched, "
                        "verifies one pass) once this many run; fewer step alone (0: never shared)")
    s.add_argument("--prefill-order", default=S.prefill_order, choices=PREFILL_ORDERS,
                   help="which admitted prompts take a step's prefill budget first: in arrival order, or "
                        "(longest) among the prompts admitted in one step the one with the most decode work "
                        "(depth x max_tokens) first, so that a burst at mixed depths finishes sooner")
    s.add_argument("--worker-channel", action=argparse.BooleanOptionalAction, default=ChannelOptions.enabled,
                   help="stream tokens from each worker to the gateway over gRPC (the worker channel) "
                        "instead of Ray streaming calls; Ray keeps placement and the unary calls")
    s.add_argument("--worker-channel-host", default=None,
                   help="where workers listen for the channel (default: 127.0.0.1 with a local Ray, "
                        "0.0.0.0 when joining a cluster, each worker advertising its node's IP)")
    s.add_argument("--worker-channel-port", type=int, default=ChannelOptions.port,
                   help="the channel's port on each worker (0: a free one; fix it where a network policy "
                        "must name it, one worker per node or pod)")
    s.add_argument("--coalesce-ms", type=float, default=round(W.coalesce_s * 1e3, 6),
                   help="after a stream's first token, tokens are sent per hop (a channel message or a Ray "
                        "item) at most this often")
    s.add_argument("--max-hops-per-s", type=float, default=W.max_hops_per_s,
                   help="hops per second a worker's streams share after their first tokens: with more "
                        "streams than this allows at --coalesce-ms, each stream's chunks come less often")
    s.add_argument("--gil-switch-ms", type=float, default=round(W.gil_switch_s * 1e3, 6),
                   help="the interpreter switch interval of this process and of each worker's: how long "
                        "a thread that has work (a worker's torch thread, an event loop with a token to "
                        "pass on, gRPC's poller) may wait for the GIL while another runs Python")
    s.add_argument("--first-token-wait-ms", type=float, default=round(W.first_token_wait_s * 1e3, 6),
                   help="how long at most a worker's torch thread waits for its event loop to pass a step's "
                        "first tokens on before it launches the decode step, when the new streams are at least "
                        "a quarter of the running ones (0: it never waits)")
    s.add_argument("--max-message-mb", type=float, default=4.0)
    s.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port (0: off)")
    s.add_argument("--auth-tokens", default=os.environ.get("TINYLOOP_AUTH_TOKENS"),
                   help="TOKEN=CALLER[,TOKEN=CALLER...] or @FILE with one per line; enables bearer auth "
                        "(default: $TINYLOOP_AUTH_TOKENS)")
    s.add_argument("--drain-grace-s", type=float, default=10.0)
    s.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve TLS (with --tls-key)")
    s.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    s.add_argument("--tls-client-ca", default=None,
                   help="PEM CA bundle: require client certificates signed by it (mutual TLS)")
    s.set_defaults(handler=_serve)


def parse_tokens(spec: str | None) -> dict[str, str]:
    if not spec:
        return {}
    if spec.startswith("@"):
        with open(spec[1:]) as f:
            items = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    else:
        items = [x.strip() for x in spec.split(",") if x.strip()]
    tokens = {}
    for item in items:
        token, sep, caller = item.partition("=")
        if not sep or not token or not caller:
            raise ValueError(f"auth token entry {item!r} is not TOKEN=CALLER")
        tokens[token] = caller
    return tokens


def _serve(args) -> int:
    import asyncio
    import logging
    import signal
    import sys

    import ray

    from tinyloop.gateway import workers
    from tinyloop.gateway.server import Gateway, GatewayOptions

    if args.model is not None:
        # a bad checkpoint is refused now, with the loader's message, before Ray or a worker starts
        from tinyloop.worker.model.hf import check
        check(args.model, args.max_loops)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.batch_invariant and args.device == "cpu":
        raise ValueError("--batch-invariant runs the Triton kernels: it needs the workers on a CUDA device, "
                         "not --device cpu")
    # every worker option checked here, before Ray starts (WorkerOptions: their defaults and checks)
    opts = WorkerOptions(model_path=args.model, lanes=args.lanes, max_seq_len=args.max_seq_len,
                         device=args.device, dtype=args.dtype,
                         handle_budget_bytes=int(args.handle_budget_mb * (1 << 20)),
                         handle_ttl_s=args.handle_ttl_s, coalesce_s=args.coalesce_ms / 1e3, max_loops=args.max_loops,
                         init_scale=args.init_scale, max_hops_per_s=args.max_hops_per_s,
                         gil_switch_s=args.gil_switch_ms / 1e3, first_token_wait_s=args.first_token_wait_ms / 1e3,
                         kv_mode=args.kv_mode, batch_invariant=args.batch_invariant,
                         channel=ChannelOptions(args.worker_channel,
                                                args.worker_channel_host or ("127.0.0.1" if args.ray_address is None
                                                                             else "0.0.0.0"),
                                                args.worker_channel_port),
                         scheduler=SchedulerOptions(max_queue=args.max_queue, step_tokens=args.step_tokens,
                                                    prefill_together=args.prefill_together,
                                                    speculative_max_running=args.speculative_max_running,
                                                    speculative_share_from=args.speculative_share_from,
                                                    prefill_order=args.prefill_order))
    tokens = parse_tokens(args.auth_tokens)
    sys.setswitchinterval(args.gil_switch_ms / 1e3)
    ray.init(address=args.ray_address, include_dashboard=False, namespace=workers.NAMESPACE,
             log_to_driver=True)
    if args.attach:
        actors = workers.attach(args.workers or 1)
    else:
        # Detached when joining a cluster, so extra gateway replicas outlive this one's restarts.
        actors = workers.spawn(args.workers, opts, detached=args.ray_address is not None)
    if args.metrics_port:
        from prometheus_client import start_http_server
        start_http_server(args.metrics_port, addr=args.host)

    async def main() -> None:
        gw = await Gateway.start(actors, GatewayOptions(
            host=args.host, port=args.port, max_message_bytes=int(args.max_message_mb * (1 << 20)),
            auth_tokens=tokens, drain_grace_s=args.drain_grace_s, tls_cert_file=args.tls_cert,
            tls_key_file=args.tls_key, tls_client_ca_file=args.tls_client_ca,
            worker_channel=args.worker_channel))
        print(f"tinyloop serve: listening on {args.host}:{gw.port} with {len(actors)} worker(s)", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        print("tinyloop serve: draining", flush=True)
        await gw.stop()

    try:
        asyncio.run(main())
    finally:
        if args.ray_address is None:  # a local Ray is ours: take the workers down with us
            for a in actors:
                ray.kill(a, no_restart=True)
        ray.shutdown()
    return 0
