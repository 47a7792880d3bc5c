"""KV cache modes: what each costs in quality, with the cache's write and read in the loop.

    python -m bench.kv_quality                  # CPU, the embedded model: bench/results/kv-quality-cpu.json
    python -m bench.kv_quality --device cuda --out-dir out

Per depth L and mode: held-out prompts (the default model's corpus holds its held-out files
out of training), each prefilled, then decoded teacher-forced for --decode-tokens steps (each
step feeds the true next token, so every mode sees the same sequence and every step writes
and reads its cache). At each of those positions the next-token distribution is compared with
the `kv` mode's at the same position:

    ppl      exp(mean NLL of the true next tokens)
    kl       mean KL(p_kv || p_mode)
    top1     share of positions where the mode's argmax is kv's
    top5     mean overlap of the two top-5 sets (|top5_kv ∩ top5_mode| / 5)
    wall_s   seconds of the mode's prefills and decode steps

plus the cache's measured bytes per token per cache layer in the mode.
"""
from __future__ import annotations

import argparse
import time

import torch

from bench.common import hardware, write

MODES = ("kv", "h", "h-int8", "h-int4", "delta-int8")


def heldout_prompts(n: int, length: int, offset: int = 256) -> list[list[int]]:
    """n windows of `length` bytes, one per held-out document long enough, from `offset` in
    (past the license headers most files open with)."""
    from train.corpus import heldout_docs
    out = []
    for _, doc in heldout_docs():
        if len(doc) >= offset + length:
            out.append(list(doc[offset:offset + length]))
            if len(out) == n:
                break
    if len(out) < n:
        raise ValueError(f"only {len(out)} held-out documents hold {offset + length} bytes, {n} asked")
    return out


@torch.no_grad()
def teacher_forced(model, seq: list[int], prompt_len: int, loops: int) -> torch.Tensor:
    """Log-probabilities (n, V) fp32 of positions prompt_len .. len(seq) - 1, each predicted
    from the tokens before it: a prefill, then one decode step per true token."""
    runner = model.runner
    with runner.lanes.hold() as lane:
        out = [runner.prefill(lane, seq[:prompt_len], loops).logits]
        for pos in range(prompt_len, len(seq) - 1):
            step = runner.decode([lane], [seq[pos]], [pos], [loops])
            out.append(step.logits.clone())
            runner.release(step)
    return torch.log_softmax(torch.cat(out).float(), -1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="'default' (the embedded model) or a model file")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--loops", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--modes", nargs="+", default=list(MODES))
    ap.add_argument("--torch-threads", type=int, default=2)
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.torch_threads)
    from tinyloop.worker.api import Model
    from tinyloop.worker.model.default_model import default_model_path
    path = default_model_path() if args.model == "default" else args.model
    n = args.prompt_tokens + args.decode_tokens
    seqs = heldout_prompts(args.prompts, n)
    max_loops = max(args.loops)
    rows = []
    for L in args.loops:
        ref = None
        for mode in ["kv"] + [m for m in args.modes if m != "kv"]:
            with Model(path, max_seq_len=n, device=args.device, n_slots=1, max_loops=max_loops,
                       kv_mode=mode, cuda_graphs=False) as m:
                t0 = time.perf_counter()
                lps = [teacher_forced(m, s, args.prompt_tokens, L) for s in seqs]
                wall = time.perf_counter() - t0
                bytes_tl = m.kv_bytes_per_token_layer
            lp = torch.stack(lps)                                        # (prompts, decode, V)
            if ref is None:
                ref = lp
            target = torch.tensor([s[args.prompt_tokens:] for s in seqs])  # (prompts, decode)
            nll = -lp.gather(-1, target[..., None].to(lp.device)).squeeze(-1)
            kl = (ref.exp() * (ref - lp)).sum(-1)
            top5_ref, top5 = ref.topk(5, -1).indices, lp.topk(5, -1).indices
            overlap = (top5_ref[..., :, None] == top5[..., None, :]).any(-1).float().mean(-1)
            rows.append({"loops": L, "mode": mode, "ppl": float(nll.mean().exp()), "kl": float(kl.mean()),
                         "kl_max": float(kl.max()), "top1": float((lp.argmax(-1) == ref.argmax(-1)).float().mean()),
                         "top5": float(overlap.mean()), "wall_s": wall, "bytes_per_token_layer": bytes_tl})
            r = rows[-1]
            print(f"L={L:2d} {mode:10s} ppl {r['ppl']:.4f}  kl {r['kl']:.3e}  top1 {r['top1']:.4f}  "
                  f"top5 {r['top5']:.4f}  {r['wall_s']:.1f} s  {bytes_tl:.1f} B/token/layer", flush=True)
    by = {(r["loops"], r["mode"]): r for r in rows}
    ratios = {str(L): by[(L, "delta-int8")]["kl"] / max(by[(L, "h-int8")]["kl"], 1e-30)
              for L in args.loops if (L, "delta-int8") in by and (L, "h-int8") in by}
    dev = torch.device(args.device)
    write(f"kv-quality-{dev.type}", {
        "hardware": hardware(dev),
        "workload": {"model": args.model, "prompts": args.prompts, "prompt_tokens": args.prompt_tokens,
                     "decode_tokens": args.decode_tokens, "teacher_forced": True, "max_loops": max_loops},
        "rows": rows,
        "kl_ratio_delta_over_h_int8": ratios,
    }, args.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
