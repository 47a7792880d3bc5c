"""Batch-1 decode and prefill on the GPU against the hardware floor, with same-run baselines.

    source bench/gpu_env.sh && python -m bench.decode --out-dir $OUT

Sections (each written to the JSON as it completes, so a partial run still reports):
  ceilings    copy bandwidth (device-to-device, bytes read + written) and the bf16 matmul rate
  decode      ms/token at L = 4, 8, 16, 32 for the CUDA-graph engine and for eager torch (the
              same model through the torch reference ops, no graphs); achieved GB/s and the
              ratio to the floor = (weight bytes + K/V bytes read per token) / copy bandwidth
  generate    fresh generate (prefix 128, decode 16, L = 8): graphs vs eager torch
  prefill     128 / 512 / 2048 tokens at L = 8: TFLOP/s against the measured matmul rate
  ouro        the Ouro-1.4B shapes (24-layer block looped 4x) decode at L = 4
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from tqdm import tqdm

from bench.common import hardware, write
from tinyloop.worker import Model, checkpoint
from tinyloop.worker.config import PRESETS, LoopedConfig
from tinyloop.worker.generate import prefill


def cuda_ms(fn, repeat: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of fn() between CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def ceilings() -> dict:
    n = 1 << 30  # 2 GiB of bf16: far past the 50 MB L2
    src, dst = torch.randn(n, device="cuda", dtype=torch.bfloat16), torch.empty(n, device="cuda", dtype=torch.bfloat16)
    copy_ms = cuda_ms(lambda: dst.copy_(src), repeat=10)
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = cuda_ms(lambda: a @ b, repeat=10)
    return {"copy_GBps": 2 * n * 2 / copy_ms / 1e6, "bf16_matmul_TFLOPs": 2 * 8192**3 / mm_ms / 1e9}


def layer_bytes(cfg: LoopedConfig, elem: int) -> int:
    hd = cfg.head_dim
    attn = cfg.d_model * hd * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    norms = (4 if cfg.norm == "sandwich" else 2) * cfg.d_model
    return (attn + 3 * cfg.d_model * cfg.d_ff + norms) * elem


def bytes_per_token(cfg: LoopedConfig, loops: int, context: int, elem: int = 2) -> dict:
    """The fewest bytes one decode token must read: every weight it uses once per use (the
    shared block once per iteration: at these sizes it does not stay in L2), the embedding
    row, the head, and the K/V of `context` positions in every cache layer it attends to."""
    layers = cfg.n_prelude + loops * cfg.n_loop_layers + cfg.n_coda
    weights = layers * layer_bytes(cfg, elem) + cfg.vocab_size * cfg.d_model * elem + 2 * cfg.d_model * elem
    kv = layers * 2 * cfg.n_kv_heads * cfg.head_dim * context * elem
    return {"weights": weights, "kv": kv, "total": weights + kv}


def random_checkpoint(name: str, cfg: LoopedConfig) -> str:
    path = f"{tempfile.gettempdir()}/{name}.tinyloop"
    checkpoint.save(checkpoint.init_model(cfg, 0), path, dtype=torch.bfloat16)
    return path


def decode_rate(model: Model, loops: int, context: int, steps: int) -> float:
    """ms/token of the captured step, fed its own greedy token, no host sync inside."""
    g = model.engine.graphs.capture(loops)
    prompt = torch.randint(0, model.config.vocab_size, (context,)).tolist()
    logits, _ = prefill(model.engine, 0, prompt, loops, 0)
    g.tokens.copy_(logits.argmax(-1).view(1, 1))
    g.positions.fill_(context)

    def run():
        for _ in range(steps):
            g.graph.replay()
            g.tokens.copy_(g.greedy.view(1, 1))
            g.positions.add_(1)
        g.positions.fill_(context)

    return cuda_ms(run, repeat=5, warmup=1) / steps


def eager_rate(model: Model, loops: int, context: int, steps: int) -> float:
    """ms/token of the same step run op by op, reading each token on the host (as a loop that
    streams tokens must)."""
    e = model.engine
    prompt = torch.randint(0, model.config.vocab_size, (context,)).tolist()

    def run():
        logits, _ = prefill(e, 0, prompt, loops, 0)
        tok = int(logits.argmax())
        torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(steps):
            pos = context + i
            p = e.make_pass(slice(0, 1), torch.tensor([[pos]], device="cuda"), pos + 1)
            tok = int(e.forward(torch.tensor([[tok]], device="cuda"), p, loops)[0, -1].argmax())
        return (time.perf_counter() - t) * 1e3 / steps

    run()
    return statistics.median(run() for _ in range(3))


def prefill_flops(cfg: LoopedConfig, loops: int, T: int) -> float:
    """Matmul FLOPs of a prefill: 2·params·T for every layer run, the head on the last token,
    and causal attention (QK^T and PV over T²/2 pairs)."""
    layers = cfg.n_prelude + loops * cfg.n_loop_layers + cfg.n_coda
    dense = 2 * T * layers * layer_bytes(cfg, 1)
    attn = layers * 2 * 2 * cfg.n_heads * cfg.head_dim * T * T / 2
    return dense + attn + 2 * cfg.vocab_size * cfg.d_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loops", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--context", type=int, default=128, help="tokens in the cache while decoding")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prefill", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--skip-ouro", action="store_true")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    result: dict = {"hardware": hardware(dev), "model": "bench-285m (random init, bf16)",
                    "config": PRESETS["bench-285m"].to_json()}

    def save():
        write("decode-cuda", result, args.out_dir)

    result["ceilings"] = c = ceilings()
    print(f"copy {c['copy_GBps']:.0f} GB/s, bf16 matmul {c['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
    save()

    cfg = PRESETS["bench-285m"]
    path = random_checkpoint("bench-285m", cfg)
    fast = Model(path, max_seq_len=4096, device="cuda", dtype="bfloat16", cuda_graphs=False)
    eager = Model(path, max_seq_len=4096, device="cuda", dtype="bfloat16", backend="torch", cuda_graphs=False)
    t = time.perf_counter()
    fast.capture_graphs(args.loops)
    result["graph_capture_s"] = time.perf_counter() - t

    rows = []
    for L in tqdm(args.loops, desc="decode"):
        b = bytes_per_token(cfg, L, args.context)
        floor_ms = b["total"] / (c["copy_GBps"] * 1e6)
        graph_ms = decode_rate(fast, L, args.context, args.steps)
        eager_ms = eager_rate(eager, L, args.context, 16)
        rows.append({"loops": L, "context": args.context, "bytes_per_token": b, "floor_ms": floor_ms,
                     "graph_ms": graph_ms, "eager_torch_ms": eager_ms,
                     "graph_GBps": b["total"] / graph_ms / 1e6, "graph_vs_floor": graph_ms / floor_ms,
                     "speedup_vs_eager": eager_ms / graph_ms})
        print(f"L={L}: floor {floor_ms:.3f} ms, graphs {graph_ms:.3f} ms ({graph_ms / floor_ms:.2f}x floor), "
              f"eager torch {eager_ms:.2f} ms ({eager_ms / graph_ms:.1f}x slower)")
        result["decode"] = rows
        save()

    prompt = torch.randint(0, cfg.vocab_size, (128,)).tolist()
    gen = {}
    for name, m in (("graphs", fast), ("eager_torch", eager)):
        out = m.generate(prompt, loops=8, max_tokens=16)
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            t = time.perf_counter()
            assert m.generate(prompt, loops=8, max_tokens=16) == out
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
        gen[name] = {"ms": statistics.median(times), "tokens": out[128:]}
    gen["same_tokens"] = gen["graphs"]["tokens"] == gen["eager_torch"]["tokens"]
    gen["reference_runtime_ms"] = {"ms": 329.0, "source": "reference runtime docs: H100, 407M GPTQ-INT4"}
    result["generate_prefix128_decode16_L8"] = gen
    print(f"generate(prefix 128, decode 16, L=8): graphs {gen['graphs']['ms']:.2f} ms, "
          f"eager {gen['eager_torch']['ms']:.2f} ms, same tokens: {gen['same_tokens']}")
    save()

    pre = []
    for T in args.prefill:
        toks = torch.randint(0, cfg.vocab_size, (T,)).tolist()
        ms = cuda_ms(lambda: prefill(fast.engine, 0, toks, 8, 0), repeat=5)
        tf = prefill_flops(cfg, 8, T) / ms / 1e9
        pre.append({"tokens": T, "loops": 8, "ms": ms, "TFLOPs": tf, "of_matmul_rate": tf / c["bf16_matmul_TFLOPs"]})
        print(f"prefill {T}: {ms:.2f} ms, {tf:.0f} TFLOP/s ({100 * tf / c['bf16_matmul_TFLOPs']:.0f} % of matmul)")
    result["prefill"] = pre
    save()
    fast.close()
    eager.close()
    torch.cuda.empty_cache()

    if not args.skip_ouro:
        ocfg = PRESETS["ouro-1.4b"]
        opath = random_checkpoint("ouro-1.4b", ocfg)
        with Model(opath, max_seq_len=1024, device="cuda", dtype="bfloat16", cuda_graphs=False) as om:
            om.capture_graphs([4])
            b = bytes_per_token(ocfg, 4, args.context)
            floor_ms = b["total"] / (c["copy_GBps"] * 1e6)
            ms = decode_rate(om, 4, args.context, 32)
            result["ouro_1.4b_shapes"] = {"loops": 4, "floor_ms": floor_ms, "graph_ms": ms,
                                          "graph_vs_floor": ms / floor_ms, "bytes_per_token": b}
            print(f"Ouro-1.4B shapes L=4: floor {floor_ms:.3f} ms, graphs {ms:.3f} ms ({ms / floor_ms:.2f}x)")
        save()


if __name__ == "__main__":
    main()
