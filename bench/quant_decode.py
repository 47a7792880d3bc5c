"""Batch-1 decode of INT4 weights against bf16 in the same run, on the GPU.

    source bench/gpu_env.sh && python -m bench.quant_decode --out-dir $OUT   # -> quant-decode-cuda.json

bench-285m with random weights, bf16, and the same weights as RTN INT4 (group size 128, every
projection quantized; embeddings and head stay bf16), and the INT4 file served dual-bit (an
INT2 copy of the shared block for iterations 0..3). For each format at L = 4, 8, 16, 32: the
engine's captured batch-1 decode graph replayed in a loop, fed its own greedy token
(bench/decode.py's `decode_rate`), beside its floors: bytes a token reads over the copy
bandwidth, and the HBM floor, less the shared block's bytes the step keeps in L2
(`Block.eviction`: "evict_last") in every iteration but the first. The slope is the least-
squares ms per extra iteration over the depths; the goal compares it with the bf16 HBM floor
of one iteration (the block read from HBM every time), and INT4 at L = 8 with half the bf16
time of the same run. --device cpu --preset tiny runs it on a CPU (eager steps, a smoke run).

--batch B... adds the batched step for each format: B streams with their own random prompts
stepped together by the worker's Batcher (bench/batch.py's `batched`: captured batched stages,
sampling and the step's host sync included) at L = --batch-loops, on a model built as a worker
builds it (every graph captured at load), so that INT4 is measured where a loaded server runs
it as well as at batch 1: ms per step, tokens/s, and INT4 over bf16 at each B.

--tiles PATH (a bench/int4_tiles.py JSON) adds the INT4 formats again on the sweep's tiles
(`int4-tuned`, `int4-dual-bit-tuned`: Settings.int4_tiles, taken before kernels/int4_gemv.py's
tables) beside the same formats on the code's tables (`int4`: untabled shapes take
`default_tile`), in one run against one bf16 baseline; --formats picks the formats.
"""
from __future__ import annotations

import argparse
import importlib
import tempfile

import torch
from tqdm import tqdm

from bench.common import hardware, write
from bench.batch import batched, prompts
from bench.decode import bytes_per_token, ceilings, decode_rate, decode_runner, random_checkpoint
from tinyloop.worker import Model
from tinyloop.worker.model.config import PRESETS
from tinyloop.worker.model.quant import QuantSpec
from tinyloop.worker.model.quantize import quantize_file
from tinyloop.worker.model.settings import Settings

q4 = importlib.import_module("tinyloop.kernels.int4_gemv")  # its tables (the package exports the launchers)


def layer_bytes(block) -> int:
    """Bytes of a layer's seven projection weights (float or quantized: `nbytes` either way)."""
    att, ffn = block.attention, block.feed_forward
    return sum(m.weight.nbytes for m in (att.wq, att.wk, att.wv, att.wo, ffn.w1, ffn.w2, ffn.w3))


def kept_bytes(block) -> int:
    """Bytes of a layer's fused projections the decode step keeps in L2 (`Block.eviction`:
    "evict_last"; CUDA only, after the model's fast path)."""
    return sum(w.nbytes for name, w in block.projections().items() if block.eviction(name) == "evict_last")


def token_bytes(model: Model, loops: int, context: int) -> tuple[int, int]:
    """(bytes a decode token reads, of those the HBM need not serve): each layer's projections
    (iteration i's weight set of the shared block, `loop_variants`), the head, the embedding
    row, the K/V of `context` positions per layer; the second, every use of a set's L2-kept
    projections but its first."""
    net, cfg = model._module, model.config
    sets = [net.loop_variants[i % len(net.loop_variants)] if net.loop_variants else net.loop for i in range(loops)]
    weights = sum(layer_bytes(b) for b in [*net.prelude, *net.coda]) + sum(layer_bytes(b) for v in sets for b in v)
    cached = 0
    if model.device.type == "cuda":
        distinct = {id(v): v for v in sets}.values()
        cached = sum(kept_bytes(b) for v in sets for b in v) - sum(kept_bytes(b) for v in distinct for b in v)
    head = net.tok_embeddings.weight if net.output is None else net.output.weight
    elem = head.element_size()
    layers = cfg.n_prelude + loops * cfg.n_loop_layers + cfg.n_coda
    kv = layers * 2 * cfg.n_kv_heads * cfg.head_dim * context * elem
    return weights + head.nbytes + cfg.d_model * elem + kv, cached


def batched_rows(path, settings: Settings, dev, dtype, cfg, args) -> list[dict]:
    """The batched step of one format at each --batch B: ms per step and tokens/s, on a model
    with max(B) lanes and every graph captured at load (as a worker builds it)."""
    lanes = max(args.batch)
    model = Model(path, max_seq_len=args.context + args.steps + 64, device=dev, dtype=dtype, n_slots=lanes,
                  cuda_graphs=dev.type == "cuda", settings=settings.replace(prefill_graph_len=args.context))
    ps = prompts(lanes, args.context, cfg.vocab_size)
    out = []
    for B in tqdm(args.batch, desc="batched"):
        ms = min(batched(model, ps[:B], args.batch_loops, args.steps)[0] for _ in range(max(1, args.repeat // 2)))
        out.append({"streams": B, "loops": args.batch_loops, "ms_per_step": ms, "tokens_per_s": B * 1e3 / ms})
        print(f"batched B={B} L={args.batch_loops}: {ms:.3f} ms/step, {B * 1e3 / ms:,.0f} tok/s")
    model.close()
    return out


def slope(xs: list[int], ys: list[float]) -> float:
    """Least-squares dy/dx."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench-285m")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--loops", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--batch", type=int, nargs="*", default=[], help="streams of the batched step (none: batch 1 only)")
    ap.add_argument("--batch-loops", type=int, default=8, help="L of the batched step")
    ap.add_argument("--tiles", default=None, help="a bench/int4_tiles.py JSON: add the INT4 formats on its tiles")
    ap.add_argument("--formats", nargs="+", default=None,
                    help="of bf16 int4 int4-dual-bit (and int4-tuned int4-dual-bit-tuned with --tiles); default all")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    known = ["bf16", "int4", "int4-dual-bit"] + (["int4-tuned", "int4-dual-bit-tuned"] if args.tiles else [])
    chosen = args.formats or known
    if bad := [f for f in chosen if f not in known]:
        ap.error(f"--formats: of {known}, got {bad}" + ("" if args.tiles else " (the -tuned ones need --tiles)"))
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = PRESETS[args.preset]
    result: dict = {"hardware": hardware(dev), "model": f"{args.preset} (random init)", "context": args.context,
                    "weights": {"bf16": str(dtype)[6:], "int4": f"int4-g{args.group_size}-rtn"}}

    def save():
        write(f"quant-decode-{dev.type}", result, args.out_dir)

    result["ceilings"] = c = ceilings(dev)
    gbps = c["copy_GBps"] * 1e6  # bytes per ms
    src = random_checkpoint(args.preset, cfg)
    qpath = f"{tempfile.gettempdir()}/{args.preset}-int4.tinyloop"
    quantize_file(src, qpath, QuantSpec(4, args.group_size, "rtn"))
    bf16_layer = bytes_per_token(cfg, 1, 0, 2)["weights"] - bytes_per_token(cfg, 0, 0, 2)["weights"]
    per_iteration_floor = bf16_layer / gbps  # the bf16 block read from HBM once an iteration
    rows: dict[str, list] = {}
    if args.tiles:
        tuned = q4.load_tables(args.tiles)
        result["tiles"] = {"file": args.tiles, "gemv": [[list(k), list(t)] for k, t in tuned[0].items()],
                           "matmul": [[list(k), list(t)] for k, t in tuned[1].items()]}
    env = Settings.from_env()  # every row's model: the environment's settings (TINYLOOP_PDL, ...) and its own
    formats = [("bf16", src, env), ("int4", qpath, env),
               ("int4-dual-bit", qpath, env.replace(dual_bit=True))]
    if args.tiles:
        # the sweep's tiles before the code's tables (Settings.int4_tiles), the same file
        formats += [("int4-tuned", qpath, env.replace(int4_tiles=args.tiles)),
                    ("int4-dual-bit-tuned", qpath, env.replace(dual_bit=True, int4_tiles=args.tiles))]
    formats = [f for f in formats if f[0] in chosen]
    for fmt, path, settings in formats:
        # no prefill graphs: the benchmark times decode only (bench/decode.py's decode_runner)
        model = Model(path, max_seq_len=1024, device=dev, dtype=dtype, n_slots=1,
                      settings=settings.replace(cuda_graphs=False, prefill_graph_len=0))
        runner = decode_runner(model, args.loops) if cuda else model.runner
        blocks = {"bytes": sum(layer_bytes(b) for b in model._module.loop), "format": model.weight_format}
        if cuda:
            blocks["l2_kept_bytes"] = sum(kept_bytes(b) for b in model._module.loop)
        result.setdefault("block", {})[fmt] = blocks
        rows[fmt] = []
        for L in tqdm(args.loops, desc=f"decode {fmt}"):
            b, cached = token_bytes(model, L, args.context)
            ms = decode_rate(runner, L, args.context, args.steps, args.repeat)
            floor = b / gbps
            hbm_floor = (b - cached) / gbps
            rows[fmt].append({"loops": L, "ms": ms, "bytes_per_token": b, "floor_ms": floor,
                              "hbm_floor_ms": hbm_floor, "vs_floor": ms / floor, "vs_hbm_floor": ms / hbm_floor})
            print(f"{fmt} L={L}: {ms:.3f} ms/token (floor {floor:.3f}, HBM floor {hbm_floor:.3f})")
        result["decode"] = rows
        save()
        model.close()
        del runner, model
        if args.batch:
            result.setdefault("batched", {})[fmt] = batched_rows(path, settings, dev, dtype, cfg, args)
            save()
        if cuda:
            torch.cuda.empty_cache()
    ms = {fmt: {r["loops"]: r["ms"] for r in rs} for fmt, rs in rows.items()}
    slopes = {fmt: slope(list(m), list(m.values())) for fmt, m in ms.items()}
    result["slope_ms_per_iteration"] = slopes
    result["bf16_hbm_floor_ms_per_iteration"] = per_iteration_floor
    goals = {}
    for fmt in ms:
        if fmt.startswith("int4") and 8 in ms[fmt] and 8 in ms.get("bf16", {}):
            ratio = ms[fmt][8] / ms["bf16"][8]
            goals[fmt] = {"int4_over_bf16_at_8": ratio, "ratio_met": ratio <= 0.5,
                          "slope_met": slopes[fmt] < per_iteration_floor}
    if "int4" in goals:
        result["goal"] = goals["int4"]
    base = {r["streams"]: r["ms_per_step"] for r in (result.get("batched") or {}).get("bf16", [])}
    for fmt, rs in (result.get("batched") or {}).items():
        for r in rs:
            if fmt != "bf16" and r["streams"] in base:
                r["over_bf16"] = r["ms_per_step"] / base[r["streams"]]
    result["goals"] = goals
    print(f"slopes {slopes} ms/iteration; bf16 HBM floor {per_iteration_floor:.4f} ms/iteration; "
          f"goals {goals}")
    save()


if __name__ == "__main__":
    main()
