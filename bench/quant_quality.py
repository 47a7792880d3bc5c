"""Quality of quantized weights on the embedded default model (CPU): held-out bits per byte at
L = 1, 4, 8, 16 (train/evaluate.py's windows) and greedy agreement with the float model over
128 tokens, for fp32 (the float model), RTN-4, GPTQ-4, GPTQ-4 + cancel and GPTQ-4 dual-bit
(an INT2 copy of the shared block for iterations 0..3); --rtn-cancel adds RTN-4 + cancel,
--bf16 the float model in bf16 (slow on a CPU). GPTQ is calibrated on the training corpus at the model's default
depth, its shared block's Hessian summed over every iteration. Writes
bench/results/quant-quality-cpu.json.

    python -m bench.quant_quality [--group-size 64] [--calib-tokens 16384] [--windows 16] [--prompts 2]
"""
from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import torch

from bench.common import hardware, write
from tinyloop.train import corpus
from tinyloop.train.evaluate import bpb_table, heldout_for, windows
from tinyloop.worker import Model
from tinyloop.worker.model import checkpoint, quant_checkpoint
from tinyloop.worker.model.default_model import default_model_path
from tinyloop.worker.model.quant import QuantSpec
from tinyloop.worker.model.quantize import quantize_file
from tinyloop.worker.model.settings import Settings

LOOPS = [1, 4, 8, 16]
GREEDY_TOKENS = 128


def agreement(model: Model, ref_outputs: list[list[int]], prompts: list[list[int]], loops: int) -> dict:
    """Greedy tokens against the float model's: the share of positions equal, and where the first
    divergence falls (GREEDY_TOKENS when none), averaged over the prompts."""
    same, first = 0, []
    for p, want in zip(prompts, ref_outputs):
        got = model.generate(p, loops=loops, max_tokens=GREEDY_TOKENS)[len(p):]
        same += sum(a == b for a, b in zip(got, want))
        first.append(next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), GREEDY_TOKENS))
    return {"token_agreement": round(same / (GREEDY_TOKENS * len(prompts)), 4),
            "mean_first_divergence": round(sum(first) / len(first), 1)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--calib-tokens", type=int, default=16384)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--rtn-cancel", action="store_true", help="add RTN-4 + cancel")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    src = default_model_path()
    cfg, meta = checkpoint.read_config(src)
    held = corpus.heldout_bytes()
    tokens, bpt = heldout_for(meta, held, cfg)
    win = windows(tokens, args.windows, args.seq_len)
    prompts = [tokens[s:s + 64].tolist() for s in range(0, len(tokens) - 64, len(tokens) // args.prompts)][:args.prompts]
    rows, timings = {}, {}
    with tempfile.TemporaryDirectory() as d:
        files = {"rtn": Path(d) / "rtn.tinyloop", "gptq": Path(d) / "gptq.tinyloop"}
        for method, path in files.items():
            t = time.perf_counter()
            quantize_file(src, path, QuantSpec(4, args.group_size, method, cancel_round=True,
                                               calib_tokens=args.calib_tokens if method == "gptq" else 0))
            timings[f"quantize_{method}_s"] = round(time.perf_counter() - t, 1)
        variants = {"fp32": (src, Settings(), torch.float32),
                    **({"bf16": (src, Settings(), torch.bfloat16)} if args.bf16 else {}),
                    "rtn-4": (files["rtn"], Settings(), torch.float32),
                    **({"rtn-4+cancel": (files["rtn"], Settings(cancel_round=True), torch.float32)}
                       if args.rtn_cancel else {}),
                    "gptq-4": (files["gptq"], Settings(), torch.float32),
                    "gptq-4+cancel": (files["gptq"], Settings(cancel_round=True), torch.float32),
                    "gptq-4+dual-bit": (files["gptq"], Settings(dual_bit=True), torch.float32)}
        with Model(src, n_slots=1) as ref:
            ref_out = [ref.generate(p, loops=cfg.default_loops, max_tokens=GREEDY_TOKENS)[len(p):] for p in prompts]
        for name, (path, settings, dtype) in variants.items():
            t = time.perf_counter()
            model, meta = checkpoint.load(path, "cpu", dtype)
            fmt = quant_checkpoint.use_settings(model, meta, str(path), settings, dtype)
            bpb = bpb_table(model, win, LOOPS, bpt, batch_size=8)
            row = {"weights": fmt, "bpb": {str(L): round(v, 4) for L, v in bpb.items()}}
            if name != "fp32":
                with Model(path, n_slots=1, dtype=dtype, settings=settings) as m:
                    row["greedy"] = agreement(m, ref_out, prompts, cfg.default_loops)
            rows[name] = row
            timings[f"{name}_s"] = round(time.perf_counter() - t, 1)
            print(name, row, flush=True)
    base = rows["fp32"]["bpb"]
    for name, row in rows.items():
        row["bpb_vs_fp32_pct"] = {L: round(100 * (v / base[L] - 1), 2) for L, v in row["bpb"].items()}
    at8 = rows["gptq-4"]["bpb_vs_fp32_pct"]["8"]
    payload = {
        "model": "default (embedded)", "group_size": args.group_size, "calib_tokens": args.calib_tokens,
        "calib_loops": cfg.default_loops, "heldout": {"windows": args.windows, "seq_len": args.seq_len,
                                                       "bytes_per_token": bpt},
        "greedy": {"prompts": len(prompts), "prompt_tokens": 64, "tokens": GREEDY_TOKENS,
                   "loops": cfg.default_loops},
        "results": rows, "goal": {"gptq4_vs_fp32_at_8_pct": at8, "met": at8 <= 3.0 and not math.isnan(at8)},
        "seconds": timings, "hardware": hardware(torch.device("cpu")),
    }
    write("quant-quality-cpu", payload, args.out)


if __name__ == "__main__":
    main()
