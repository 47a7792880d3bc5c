"""Decode speed per KV cache mode against the context length, one stream, same run as `kv`.

    python -m bench.kv_decode --out-dir out          # H200: bench-285m, bf16, L = 8, captured decode
    python -m bench.kv_decode --device cpu --preset tiny --contexts 128 512   # a CPU smoke run

Per context length and mode: a prompt of that many tokens prefilled, then --max-tokens greedy
tokens, the per-token time of the steps after the first (the captured decode graph on CUDA).
Beside each time, what the step must move and compute in its attention, per cache layer:
`kv` reads 2·Hkv·hd values per position; the store-h modes read the stored h (D values, or
D / 2 bytes and D / 16 scales at int4) and rebuild K and V from it, 2·Hkv·hd·D multiply-adds per
position (`rebuild_gmac`): at long context the rebuild, not the read, is the step's cost.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time

import torch

from bench.common import hardware, write

MODES = ("kv", "h", "h-int8", "h-int4", "delta-int8")


def per_token_ms(model, prompt, loops, max_tokens) -> float:
    req = model.make_request(prompt, loops=loops, max_tokens=max_tokens)
    gen = model.stream(req)
    next(gen)  # the prefill and its token
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    t0, n = time.perf_counter(), 0
    for ids in gen:
        n += len(ids)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return 1e3 * (time.perf_counter() - t0) / max(1, n)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="bench-285m", help="random-init model preset")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 4096, 16384])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--modes", nargs="+", default=list(MODES))
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    from tinyloop.worker.api import Model
    from tinyloop.worker.model import checkpoint
    from tinyloop.worker.model.config import PRESETS
    S = max(args.contexts) + args.max_tokens + 1
    # the preset's tables reach max_seq_len: raised to hold the longest context
    cfg = dataclasses.replace(PRESETS[args.preset], max_seq_len=max(S, PRESETS[args.preset].max_seq_len))
    rows = []
    dev = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{args.preset}.tinyloop")
        checkpoint.save(checkpoint.init_model(cfg, 0, std=0.02), path,
                        dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)
        for mode in args.modes:
            # decode graphs of depths up to L only; prefill eager (a 16k prompt is no graph bucket)
            with Model(path, max_seq_len=S, device=args.device, dtype=args.dtype, n_slots=1, max_loops=args.loops,
                       prefill_graph_len=0, kv_mode=mode) as m:
                bpl = m.kv_bytes_per_token_layer
                for C in args.contexts:
                    prompt = [(7 * i + 3) % cfg.vocab_size for i in range(C)]
                    per_token_ms(m, prompt, args.loops, 4)  # warm-up
                    ms = min(per_token_ms(m, prompt, args.loops, args.max_tokens) for _ in range(args.repeat))
                    layers = cfg.n_prelude + args.loops * cfg.n_loop_layers + cfg.n_coda
                    kvd = cfg.n_kv_heads * cfg.head_dim
                    rows.append({"mode": mode, "context": C, "per_token_ms": ms, "bytes_per_token_layer": bpl,
                                 "cache_mb_read_per_token": bpl * C * layers / 2**20,
                                 "rebuild_gmac_per_token": 0.0 if mode == "kv" else 2 * kvd * cfg.d_model * C * layers / 1e9})
                    r = rows[-1]
                    print(f"{mode:10s} context {C:6d}: {ms:8.3f} ms/token  cache {r['cache_mb_read_per_token']:8.1f} MB  "
                          f"rebuild {r['rebuild_gmac_per_token']:8.1f} GMAC", flush=True)
    base = {r["context"]: r["per_token_ms"] for r in rows if r["mode"] == "kv"}
    for r in rows:
        r["vs_kv"] = r["per_token_ms"] / base[r["context"]] if r["context"] in base else None
    write(f"kv-decode-{dev.type}", {
        "hardware": hardware(dev),
        "workload": {"preset": args.preset, "loops": args.loops, "max_tokens": args.max_tokens, "lanes": 1,
                     "greedy": True, "max_seq_len": S, "dtype": str(args.dtype or "model default")},
        "rows": rows,
    }, args.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
