"""Prefill at L = 8 against the bf16 matmul rate measured in the same run.

    source bench/gpu_env.sh && python -m bench.prefill --out-dir $OUT    # -> prefill-cuda.json

Two implementations run 128 / 512 / 2048 tokens on the same weights. The engine runs as a
Model serves it (`Runner.prefill`): Triton ops, plus the prefill stage graphs a worker's model
captures at load for prompts up to its prefill_graph_len (`engine_prefill_graphs`: whether it
has any). The baseline is the plain eager decoder of
bench/baselines.py, with causal F.scaled_dot_product_attention. TFLOP/s counts the matmul
FLOPs of the prefill. `same_argmax` says whether both gave the same next token.
--device cpu --preset tiny runs it on a CPU.
"""
from __future__ import annotations

import argparse

import torch

from bench.baselines import PlainDecoder
from bench.common import hardware, write
from bench.decode import ceilings, device_ms, layer_bytes, random_checkpoint
from tinyloop.worker import Model
from tinyloop.worker.model.config import PRESETS, LoopedConfig


def prefill_flops(cfg: LoopedConfig, loops: int, T: int) -> float:
    """Matmul FLOPs of a prefill: 2·params·T for every layer run, the head on the last token,
    and causal attention (QK^T and PV over T²/2 pairs)."""
    layers = cfg.n_prelude + loops * cfg.n_loop_layers + cfg.n_coda
    dense = 2 * T * layers * layer_bytes(cfg, 1)
    attn = layers * 2 * 2 * cfg.n_heads * cfg.head_dim * T * T / 2
    return dense + attn + 2 * cfg.vocab_size * cfg.d_model


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench-285m", help="random-init model preset")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = PRESETS[args.preset]
    result: dict = {"hardware": hardware(dev), "model": f"{args.preset} (random init, {str(dtype)[6:]})",
                    "config": cfg.to_json(), "loops": args.loops}
    result["ceilings"] = c = ceilings(dev)
    rate = c["bf16_matmul_TFLOPs"]
    print(f"bf16 matmul {rate:.0f} TFLOP/s")

    path = random_checkpoint(args.preset, cfg)
    S = max(args.tokens)
    # as served: every graph captured at load on CUDA (prefill replays the stage graphs of its bucket)
    with Model(path, max_seq_len=S, device=dev, dtype=dtype, n_slots=1, cuda_graphs=dev.type == "cuda") as m:
        g = m.runner.graphs
        result["engine_prefill_graphs"] = g is not None and any(kind == "prefill" for kind, _, _ in g.stages)
        plain = PlainDecoder(m._module, S, args.loops)

        def engine(toks):
            return m.runner.prefill(0, toks, args.loops).logits

        rows = []
        for T in args.tokens:
            toks = torch.randint(0, cfg.vocab_size, (T,)).tolist()
            t = torch.tensor([toks], device=dev)
            row = {"tokens": T, "loops": args.loops, "flops": prefill_flops(cfg, args.loops, T)}
            for name, fn in (("engine", lambda: engine(toks)),
                             ("eager_torch", lambda: plain.prefill(t))):
                ms = device_ms(fn, dev, repeat=args.repeat)
                tf = row["flops"] / ms / 1e9
                row[name] = {"ms": ms, "TFLOPs": tf, "of_matmul_rate": tf / rate}
            row["speedup_vs_eager"] = row["eager_torch"]["ms"] / row["engine"]["ms"]
            with torch.no_grad():
                row["same_argmax"] = int(engine(toks).argmax()) == int(plain.prefill(t).argmax())
            rows.append(row)
            e, p = row["engine"], row["eager_torch"]
            print(f"prefill {T}: engine {e['ms']:.2f} ms, {e['TFLOPs']:.1f} TFLOP/s "
                  f"({100 * e['of_matmul_rate']:.0f} % of matmul); eager torch {p['ms']:.2f} ms "
                  f"({100 * p['of_matmul_rate']:.0f} %)")
            result["prefill"] = rows
            write(f"prefill-{dev.type}", result, args.out_dir)


if __name__ == "__main__":
    main()
