"""The decode attention's split-kernel tile on the GPU: kernels/decode_attention.py's
rope_decode_attention (the split launch and the merge) at bench-285m's attention shapes, for
each (BLOCK_N, num_stages) of --tiles, at each batch size and context.

    source bench/gpu_env.sh && python -m bench.attention_tiles --out-dir $OUT   # -> attention-tiles-cuda.json

A decode step's attention reads each row's cached K / V once, so the calls cycle through
--layers layers' caches (more bytes than the L2 holds) and run back to back in one captured
graph, as in a step. Per (B, context): µs per call of each tile, the K / V bytes a call reads
and the bandwidth that makes, and each tile's largest difference from the default tile's
output (the launcher's own choice at that batch size: a tile changes only the order in which a
row's slots are summed, its stages nothing)."""
from __future__ import annotations

import argparse

import torch
from tqdm import tqdm

from bench.common import hardware, write
from bench.decode import graph_ms
from tinyloop.kernels.decode_attention import _block_d, _block_n, _split_stages, rope_decode_attention
from tinyloop.worker.model.config import PRESETS

TILES = [(128, 3), (128, 2), (128, 1), (64, 3), (64, 2), (64, 1), (32, 2)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench-285m")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--context", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--layers", type=int, default=4, help="caches cycled through (past the L2)")
    ap.add_argument("--calls", type=int, default=16, help="calls a captured graph")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    cfg = PRESETS[args.preset]
    H, Hkv, hd, S = cfg.n_heads, cfg.n_kv_heads, cfg.d_model // cfg.n_heads, cfg.max_seq_len
    g = torch.Generator(device=dev).manual_seed(0)
    angles = torch.arange(S, device=dev, dtype=torch.float32)[:, None] * torch.rand(hd // 2, device=dev, generator=g)
    cos, sin = angles.cos(), angles.sin()
    rows = []
    for B in tqdm(args.batch, desc="batch sizes"):
        caches = [(torch.randn(B, Hkv, S, hd, device=dev, dtype=torch.bfloat16, generator=g),
                   torch.randn(B, Hkv, S, hd, device=dev, dtype=torch.bfloat16, generator=g))
                  for _ in range(args.layers)]
        q = torch.randn(B, 1, H, hd, device=dev, dtype=torch.bfloat16, generator=g)
        k = torch.randn(B, 1, Hkv, hd, device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.randn_like(k)
        slots = torch.arange(B, device=dev)
        default = (_block_n(_block_d(hd)), _split_stages(B, Hkv, dev, True))  # the launcher's tile at this B
        for ctx in args.context:
            positions = torch.full((B,), ctx, dtype=torch.long, device=dev)

            def call(i, tile):
                kc, vc = caches[i % args.layers]
                return rope_decode_attention(q, k, v, cos, sin, positions, kc, vc, hd ** -0.5, slots=slots,
                                             tile=tile)
            want = call(0, default).float()
            row = {"B": B, "context": ctx, "default_tile": list(default),
                   "kv_bytes": 2 * B * Hkv * (ctx + 1) * hd * 2, "tiles": []}
            for tile in TILES:
                diff = (call(0, tile).float() - want).abs().max().item()  # compiled, outside the capture
                us = graph_ms(lambda i, tile=tile: call(i, tile), args.calls, dev, args.repeat) * 1e3
                row["tiles"].append({"tile": list(tile), "us": us, "GBps": row["kv_bytes"] / us / 1e3,
                                     "max_abs_diff": diff})
            best = min(row["tiles"], key=lambda t: t["us"])
            row["best"] = best["tile"]
            row["default_us"] = next(t["us"] for t in row["tiles"] if tuple(t["tile"]) == default)
            rows.append(row)
            tqdm.write(f"B={B:3d} ctx={ctx:5d}: default {row['default_us']:.1f} us, best {best['tile']} "
                       f"{best['us']:.1f} us ({best['GBps']:.0f} GB/s)")
        del caches
        torch.cuda.empty_cache()
    write("attention-tiles-cuda", {"preset": args.preset, "heads": H, "kv_heads": Hkv, "head_dim": hd,
                              "max_seq_len": S, "layers": args.layers,
                              "calls": args.calls, "hardware": hardware(dev), "rows": rows}, args.out_dir)


if __name__ == "__main__":
    main()
