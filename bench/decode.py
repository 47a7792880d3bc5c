"""Batch-1 decode on the GPU against the hardware floor, with same-run baselines.

    source bench/gpu_env.sh && python -m bench.decode --out-dir $OUT     # -> decode-cuda.json

Sections. Each is written to the JSON as it completes, so a partial run still reports.
  ceilings   copy bandwidth (device-to-device, bytes read + written) and the bf16 matmul rate.
  decode     ms/token at L = 4, 8, 16, 32 for three implementations:
               graph_ms              the engine: its captured batch-1 decode graph at L
                                     (`runner.graphs.decode[L]`) replayed in a loop, each replay
                                     fed its own greedy token, no host sync
               eager_torch_ms        the plain eager decoder of bench/baselines.py on the same
                                     weights, greedy, with each token read on the host (as a
                                     simple generator runs it)
               engine_torch_ops_ms   the engine through its torch reference ops, with no graphs
                                     (`Runner.decode`, each token read on the host)
             Also the achieved GB/s, and the ratio to the floor. The floor is the weight bytes
             plus the K/V bytes read per token, divided by the copy bandwidth. The step keeps
             part of the shared block in L2 between iterations (Settings.l2_keep_fraction,
             worker/model/modules.py Block.eviction): `l2_kept` names it, and hbm_floor_ms is
             the floor less those bytes in every iteration but the first (what the step must
             still read from HBM).
  generate   fresh generate (prefix 128, decode 16, L = 8) for the same three, and the
             engine's prefill alone (the prompt's stages and the state that decides the
             first token: graphs_prefill_ms).
  compiled   the plain decoder's step under torch.compile (fullgraph, dynamic=False) in the
             modes default (what a plain torch.compile(fn) gives), max-autotune-no-cudagraphs
             and reduce-overhead (with CUDA graphs). Each step
             is fed its own token on the device, as gpt-fast's loop does. Every L is its own
             compile, so this runs only at --compile-loops (default: L = 8, the issue's
             baseline). It records the compile seconds, ms/token, and at L = 8 the generate
             figure. A mode that fails records its error in place of figures.
             Skip it with --skip-compile.

The engine's model is built as a worker builds it (`Model(cuda_graphs=True)`, one cache lane):
every graph captured at load, `graph_capture_s` their seconds (`Model.startup`). Prefill is
bench/prefill.py. --device cpu --preset tiny runs every section on a CPU. The Ouro and Huginn shapes are
bench/families.py. There
the engine's figure is its eager step (`Runner.decode`), since CUDA graphs are CUDA only.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from torch._dynamo.utils import counters
from tqdm import tqdm

from bench.baselines import PlainDecoder, greedy
from bench.common import hardware, write
from tinyloop.worker import Model
from tinyloop.worker.model import checkpoint
from tinyloop.worker.model.config import PRESETS, LoopedConfig
from tinyloop.worker.runner.runner import Runner, RunnerSettings

COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", "reduce-overhead")
GEN_PREFIX, GEN_DECODE, GEN_LOOPS = 128, 16, 8


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_ms(fn, device: torch.device, repeat: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of fn(): between CUDA events on a GPU, by the wall clock elsewhere."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def graph_ms(call, calls: int, device: torch.device, repeat: int = 20) -> float:
    """GPU ms of one call(i): `calls` back-to-back calls (i = 0 .. calls - 1) captured in one
    graph and replayed, its median over `repeat` replays divided by `calls` (one launch alone
    would time the host's launch cost instead). Compile call's kernels first: a capture cannot."""
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            call(i)
    return device_ms(g.replay, device, repeat=repeat) / calls


def ceilings(device: torch.device) -> dict:
    """Copy bandwidth and bf16 matmul rate (GPU: 2 GiB copies, far past the L2, 60 MiB on the
    H200, and an 8192^3 matmul; CPU: small sizes, for a smoke run)."""
    n, size = (1 << 30, 8192) if device.type == "cuda" else (1 << 22, 512)
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = device_ms(lambda: dst.copy_(src), device, repeat=10)
    del src, dst
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    mm_ms = device_ms(lambda: a @ b, device, repeat=10)
    return {"copy_GBps": 2 * n * 2 / copy_ms / 1e6, "bf16_matmul_TFLOPs": 2 * size**3 / mm_ms / 1e9}


def layer_bytes(cfg: LoopedConfig, elem: int) -> int:
    hd = cfg.head_dim
    attn = cfg.d_model * hd * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    norms = (4 if cfg.norm == "sandwich" else 2) * cfg.d_model
    return (attn + 3 * cfg.d_model * cfg.d_ff + norms) * elem


def bytes_per_token(cfg: LoopedConfig, loops: int, context: int, elem: int = 2) -> dict:
    """The bytes one decode token reads: every weight it uses once per use (the shared block
    once per iteration), the embedding row, the head, and the K/V of `context` positions in
    every cache layer it attends to."""
    layers = cfg.n_prelude + loops * cfg.n_loop_layers + cfg.n_coda
    weights = layers * layer_bytes(cfg, elem) + cfg.vocab_size * cfg.d_model * elem + 2 * cfg.d_model * elem
    if cfg.inject:  # the adapter (2d -> d) runs before every iteration
        weights += loops * (2 * cfg.d_model * cfg.d_model + (cfg.d_model if cfg.adapter_bias else 0)) * elem
    if cfg.loop_final_norm:  # a norm at the end of every iteration (Ouro)
        weights += loops * cfg.d_model * elem
    kv = layers * 2 * cfg.n_kv_heads * cfg.head_dim * context * elem
    return {"weights": weights, "kv": kv, "total": weights + kv}


def l2_kept(model: Model) -> dict:
    """The shared block's projections the engine's decode step keeps in L2 (Block.eviction:
    "evict_last") and their bytes over the block's layers, read from HBM once rather than once
    per iteration; none off CUDA."""
    net, names, nbytes = model._module, set(), 0
    if model.device.type == "cuda":
        for block in net.loop:
            for name, w in block.projections().items():
                if block.eviction(name) == "evict_last":
                    names.add(name)
                    nbytes += w.numel() * w.element_size()
    return {"projections": sorted(names), "bytes_per_iteration": nbytes}


def random_checkpoint(name: str, cfg: LoopedConfig) -> str:
    path = f"{tempfile.gettempdir()}/{name}.tinyloop"
    checkpoint.save(checkpoint.init_model(cfg, 0), path, dtype=torch.bfloat16)
    return path


def graph_seconds(model: Model) -> float:
    """Seconds the model spent capturing graphs at load (`Model.startup`'s *_graphs_s parts)."""
    return sum(v for k, v in model.startup.items() if k.endswith("_graphs_s"))


def decode_runner(model: Model, loops) -> Runner:
    """A runner of the benchmark's own over the model's weights, ops and cache, with the batch-1
    decode graphs of the depths in `loops` alone (no prefill or verify graphs; no batch graphs
    on a model of one cache lane), captured now, so a figure times a graph captured for it and
    dropped after. CUDA only; it writes the first positions of lane 0, as any capture does."""
    r = model.runner
    runner = Runner(r.model, r.cache, r.ops, RunnerSettings(cuda_graphs=True, prefill_graph_len=0, verify_buckets=()))
    runner.capture(sorted(set(loops)))
    return runner


def decode_rate(runner: Runner, loops: int, context: int, steps: int, repeat: int = 5, lane: int = 0) -> float:
    """ms/token of the runner's batch-1 step at `loops` fed its own greedy token, no host sync
    inside, after a prefill of `context` random tokens on `lane`: its captured decode graph
    (`runner.graphs.decode[loops]`) replayed in a loop when it has one, its eager step
    (`Runner.decode` fed the step's device argmax) otherwise."""
    dev = runner.device
    prompt = torch.randint(0, runner.config.vocab_size, (context,)).tolist()
    first = runner.prefill(lane, prompt, loops).logits.argmax(-1)  # (1,) on the device
    g = runner.graphs.decode.get(loops) if runner.graphs is not None else None
    if g is not None:
        def run():
            g.load(lane, first, context)
            for i in range(steps):
                g.replay(lane, context + i)  # it feeds itself its greedy token, one position on
    else:
        def run():
            tok = first
            for i in range(steps):
                tok = runner.decode([lane], [tok], [context + i], [loops]).greedy

    return device_ms(run, dev, repeat=repeat, warmup=1) / steps


def engine_torch_ops_rate(runner: Runner, loops: int, context: int, steps: int, repeat: int = 3) -> float:
    """ms/token of the runner's eager step (a model without graphs: its ops run op by op),
    reading each token on the host."""
    dev = runner.device
    prompt = torch.randint(0, runner.config.vocab_size, (context,)).tolist()

    def run():
        tok = int(runner.prefill(0, prompt, loops).logits.argmax())
        sync(dev)
        t = time.perf_counter()
        for i in range(steps):
            tok = int(runner.decode([0], [tok], [context + i], [loops]).greedy)
        return (time.perf_counter() - t) * 1e3 / steps

    run()
    return statistics.median(run() for _ in range(repeat))


def plain_rate(dec: PlainDecoder, context: int, steps: int, host_sync: bool, repeat: int = 5) -> float:
    """ms/token of dec.step, greedy, after a prefill of `context` random tokens. host_sync:
    read each token on the host; otherwise feed it on the device."""
    dev = dec.device
    prompt = torch.randint(0, dec.config.vocab_size, (1, context), device=dev)
    first = dec.prefill(prompt).argmax(-1, keepdim=True)

    def run():
        tok, pos = first, torch.tensor([context], device=dev)
        for _ in range(steps):
            tok = dec.step(tok, pos).argmax(-1, keepdim=True)
            pos += 1
            if host_sync:
                int(tok)

    return device_ms(run, dev, repeat=repeat, warmup=1) / steps


def timed_generate(fn, device: torch.device, repeat: int = 5) -> dict:
    """Median ms of fn() -> tokens; every repeat must give the first run's tokens."""
    out = fn()
    sync(device)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        assert fn() == out
        sync(device)
        times.append((time.perf_counter() - t) * 1e3)
    return {"ms": statistics.median(times), "tokens": out}


def compiled_baseline(dec: PlainDecoder, mode: str, context: int, steps: int, repeat: int = 5,
                      gen_prompt=None) -> dict:
    """The decoder's step compiled in `mode`: compile seconds (with the warm-up calls in which
    reduce-overhead records its graphs), ms/token, and the generate figure if gen_prompt.
    cudagraph_skips > 0: inductor ran the step without the CUDA graphs the mode asked for."""
    torch._dynamo.reset()
    dev = dec.device
    skips = counters["inductor"]["cudagraph_skips"]
    t = time.perf_counter()
    c = dec.compiled(mode)
    greedy(c, [0] * 4, 4, host_sync=False)
    sync(dev)
    out = {"mode": mode, "compile_s": time.perf_counter() - t, "host_sync": False,
           "cudagraph_skips": counters["inductor"]["cudagraph_skips"] - skips,
           "ms": plain_rate(c, context, steps, host_sync=False, repeat=repeat)}
    if gen_prompt is not None:
        out["generate"] = timed_generate(lambda: greedy(c, gen_prompt, GEN_DECODE, host_sync=False), dev, repeat)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench-285m", help="random-init model preset")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--loops", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--context", type=int, default=128, help="tokens in the cache while decoding")
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed per run (graphs, compiled)")
    ap.add_argument("--eager-steps", type=int, default=16, help="decode steps timed per run (eager)")
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per figure (median)")
    ap.add_argument("--skip-compile", action="store_true")
    ap.add_argument("--compile-loops", type=int, nargs="+", default=[GEN_LOOPS])
    ap.add_argument("--compile-modes", nargs="+", default=list(COMPILE_MODES))
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = PRESETS[args.preset]
    result: dict = {"hardware": hardware(dev), "model": f"{args.preset} (random init, {str(dtype)[6:]})",
                    "config": cfg.to_json(),
                    "baseline": "bench/baselines.py PlainDecoder: plain PyTorch on the engine's weights "
                                "(fused q|k|v and gate|up where the engine fused them), static K/V cache, "
                                "F.scaled_dot_product_attention"}

    def save():
        write(f"decode-{dev.type}", result, args.out_dir)

    result["ceilings"] = c = ceilings(dev)
    print(f"copy {c['copy_GBps']:.0f} GB/s, bf16 matmul {c['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
    save()

    # The plain decoder attends over its whole cache, so it gets just what the runs need. The
    # engine keeps its served size on the GPU (its kernels skip the empty part); the CPU
    # reference ops read the whole cache, so there it gets the same short one. A multiple of
    # 64 keeps the attention mask aligned for the fused SDPA kernels.
    need = max(args.context + max(args.steps, args.eager_steps), GEN_PREFIX + GEN_DECODE)
    cache_len = -(-need // 64) * 64
    engine_len = 4096 if cuda else cache_len
    result["plain_cache_len"], result["engine_cache_len"] = cache_len, engine_len
    path = random_checkpoint(args.preset, cfg)
    # as a worker builds it (every graph captured at load on CUDA), with one cache lane
    fast = Model(path, max_seq_len=engine_len, device=dev, dtype=dtype, n_slots=1, cuda_graphs=cuda)
    torch_ops = Model(path, max_seq_len=engine_len, device=dev, dtype=dtype, n_slots=1, backend="torch",
                      cuda_graphs=False)
    weights = fast._module
    if cuda:
        result["graph_capture_s"] = graph_seconds(fast)
        result["graphs"] = fast.startup["graphs"]

    result["l2_kept"] = kept = l2_kept(fast)
    rows = {}
    for L in tqdm(args.loops, desc="decode"):
        b = bytes_per_token(cfg, L, args.context, dtype.itemsize)
        floor_ms = b["total"] / (c["copy_GBps"] * 1e6)
        hbm_floor_ms = (b["total"] - (L - 1) * kept["bytes_per_iteration"]) / (c["copy_GBps"] * 1e6)
        graph_ms = decode_rate(fast.runner, L, args.context, args.steps, args.repeat)
        eager_ms = plain_rate(PlainDecoder(weights, cache_len, L), args.context, args.eager_steps, True, args.repeat)
        ops_ms = engine_torch_ops_rate(torch_ops.runner, L, args.context, args.eager_steps, min(args.repeat, 3))
        rows[L] = {"loops": L, "context": args.context, "bytes_per_token": b, "floor_ms": floor_ms,
                   "graph_ms": graph_ms, "eager_torch_ms": eager_ms, "engine_torch_ops_ms": ops_ms,
                   "graph_GBps": b["total"] / graph_ms / 1e6, "graph_vs_floor": graph_ms / floor_ms,
                   "hbm_floor_ms": hbm_floor_ms, "graph_vs_hbm_floor": graph_ms / hbm_floor_ms,
                   "speedup_vs_eager": eager_ms / graph_ms, "speedup_vs_engine_torch_ops": ops_ms / graph_ms}
        print(f"L={L}: floor {floor_ms:.3f} ms (HBM {hbm_floor_ms:.3f}), engine {graph_ms:.3f} ms "
              f"({graph_ms / floor_ms:.2f}x floor, {graph_ms / hbm_floor_ms:.2f}x HBM floor), "
              f"eager torch {eager_ms:.2f} ms ({eager_ms / graph_ms:.1f}x), "
              f"engine torch ops {ops_ms:.2f} ms ({ops_ms / graph_ms:.1f}x)")
        result["decode"] = list(rows.values())
        save()

    prompt = torch.randint(0, cfg.vocab_size, (GEN_PREFIX,)).tolist()
    eager8 = PlainDecoder(weights, cache_len, GEN_LOOPS)
    gen = {"prefix": GEN_PREFIX, "decode": GEN_DECODE, "loops": GEN_LOOPS}
    gen["graphs"] = timed_generate(
        lambda: fast.generate(prompt, loops=GEN_LOOPS, max_tokens=GEN_DECODE)[GEN_PREFIX:], dev, args.repeat)
    req = fast.make_request(prompt, loops=GEN_LOOPS, max_tokens=GEN_DECODE)
    gen["graphs_prefill_ms"] = device_ms(lambda: fast.start(req), dev, repeat=args.repeat, warmup=1)  # of "graphs"
    gen["eager_torch"] = timed_generate(lambda: greedy(eager8, prompt, GEN_DECODE, host_sync=True), dev,
                                        args.repeat)
    gen["engine_torch_ops"] = timed_generate(
        lambda: torch_ops.generate(prompt, loops=GEN_LOOPS, max_tokens=GEN_DECODE)[GEN_PREFIX:], dev, args.repeat)
    for name in ("eager_torch", "engine_torch_ops"):
        gen[name]["same_tokens_as_graphs"] = gen[name]["tokens"] == gen["graphs"]["tokens"]
        gen[name]["speedup"] = gen[name]["ms"] / gen["graphs"]["ms"]
    gen["reference_runtime_ms"] = {"ms": 329.0, "source": "reference runtime docs: H100, 407M GPTQ-INT4"}
    result["generate_prefix128_decode16_L8"] = gen
    print(f"generate(prefix {GEN_PREFIX}, decode {GEN_DECODE}, L={GEN_LOOPS}): engine {gen['graphs']['ms']:.2f} ms, "
          f"eager torch {gen['eager_torch']['ms']:.2f} ms, engine torch ops {gen['engine_torch_ops']['ms']:.2f} ms")
    save()
    torch_ops.close()

    if not args.skip_compile:
        for L in args.compile_loops:
            dec = PlainDecoder(weights, cache_len, L)
            row = rows.get(L)
            res = {}
            for mode in args.compile_modes:
                try:
                    r = compiled_baseline(dec, mode, args.context, args.steps, args.repeat,
                                          prompt if L == GEN_LOOPS else None)
                except Exception as e:  # a failed baseline is a result, not the end of the run
                    r = {"mode": mode, "error": repr(e)}
                    print(f"compiled L={L} {mode}: {e!r}")
                finally:
                    torch._dynamo.reset()
                res[mode] = r
                if "error" in r:
                    continue
                print(f"compiled L={L} {mode}: {r['ms']:.3f} ms/token, compile {r['compile_s']:.0f} s")
                if row is not None:
                    r["speedup"] = r["ms"] / row["graph_ms"]
                if "generate" in r:
                    g = r.pop("generate")
                    g["same_tokens_as_graphs"] = g["tokens"] == gen["graphs"]["tokens"]
                    g["speedup"] = g["ms"] / gen["graphs"]["ms"]
                    gen[f"compiled_{mode}"] = g
            result.setdefault("compiled", []).append({"loops": L, "modes": res})
            ok = [r["ms"] for r in res.values() if "error" not in r]
            if row is not None:
                row["compiled"] = res
                if ok:
                    row["compiled_ms"] = min(ok)
                    row["speedup_vs_compiled"] = min(ok) / row["graph_ms"]
            result["decode"] = list(rows.values())
            save()
            del dec
    fast.close()
    if cuda:
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
