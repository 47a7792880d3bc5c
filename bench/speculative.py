"""Self-speculative decoding vs plain generate at the same verify_loops.

    python -m bench.speculative [--model PATH] [--device cuda] [--max-tokens 128]

For every prompt and every (draft_loops, draft_ahead, K_branches) setting: greedy
generate(loops=verify_loops) (the baseline, measured in the same run), generate_speculative
(K = 1) and generate_tree_speculative (K > 1); tokens/s, speedup, accepted tokens per verify,
acceptance rate and loop-block work. Each call is made once untimed first (autotuning of new
shapes), then timed `--repeat` times (the median). Greedy parity with the baseline is checked on
every run and recorded (greedy_parity; diverged_at: the first differing generated token of each
prompt that differs). In fp32 it is exact (tests/worker/test_speculative.py); in bf16 the
verify's chunk kernels round differently from the decode step's, so a near tie can flip.
Acceptance depends on real weights: run it on the trained default model (the default) for
figures that mean anything; a random model accepts ~1/vocab of its drafts.
Reference anchors: 2.77x (reference runtime, H100, 407M INT4, draft 2 / verify 8);
LayerSkip 2.16x, Draft & Verify 1.99x.

The model is built as a worker builds it (every graph captured at load on CUDA: the verify
stages included), with one cache lane: every call here runs on one lane at a time.

Writes bench/results/speculative-<device>[-<tag>].json (another folder with --out-dir)."""
from __future__ import annotations

import argparse

import torch

from bench.common import hardware, run_timed, write
from tinyloop.worker import Model
from tinyloop.worker.model.settings import Settings
from tinyloop.worker.generation.scoring import first_divergence

PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv=None):\n    ",
    "class Queue:\n    \"\"\"A FIFO queue.\"\"\"\n\n    def __init__(self, maxsize=0):\n        self.",
    "    for i, line in enumerate(lines):\n        if line.startswith('#'):\n            ",
    "def _check_arg(name, value):\n    if not isinstance(value, int):\n        raise TypeError(",
]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .tinyloop file (default: the embedded default model)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--verify-loops", type=int, default=8)
    ap.add_argument("--draft-loops", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--draft-ahead", type=int, nargs="+", default=[4])
    ap.add_argument("--k-branches", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many of the built-in prompts")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8],
                    help="sampling temperatures (0: greedy, the parity check); seeded, top_k 50")
    ap.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                    help="the batch-invariant kernels and device rounds (default: on CUDA)")
    ap.add_argument("--out-dir", default=None, help="default: bench/results")
    ap.add_argument("--tag", default=None, help="file name suffix: speculative-<device>-<tag>.json")
    args = ap.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    invariant = device.type == "cuda" if args.batch_invariant is None else args.batch_invariant
    with Model(args.model, max_seq_len=512, device=device, n_slots=1,
               settings=Settings.from_env().replace(batch_invariant=invariant)) as m:
        dev = m.device
        Lv = min(args.verify_loops, m.config.max_loops)
        prompts = [m.tokenizer.encode(p) for p in PROMPTS[:args.prompts]]
        m.generate(prompts[0], loops=Lv, max_tokens=4)  # warm-up (allocator, kernels)
        by_temperature = {}
        for temperature in args.temperatures:
            by_temperature[str(temperature)] = _sweep(m, args, prompts, Lv, temperature)
        write(f"speculative-{dev.type}" + (f"-{args.tag}" if args.tag else ""), {
            "hardware": hardware(dev), "model": m.path, "dtype": str(m.dtype).replace("torch.", ""),
            "backend": m.runner.ops.name, "batch_invariant": invariant,
            "device_rounds": m.runner.settings.device_rounds, "prompts": len(prompts),
            "max_tokens": args.max_tokens, "repeat": args.repeat,
            **by_temperature.get("0.0", {}), "temperatures": by_temperature}, args.out_dir)


def _sweep(m, args, prompts, Lv, temperature) -> dict:
    """The baseline and every setting at one temperature (seeded; greedy at 0)."""
    dev = m.device
    kw = dict(max_tokens=args.max_tokens, temperature=temperature, seed=0)
    greedy = temperature == 0

    def plain():
        secs, tok, work, outs = 0.0, 0, 0, []
        for p in prompts:
            s, out = run_timed(lambda: m.generate(p, loops=Lv, **kw), dev, args.repeat, warmup=1)
            secs, tok, work = secs + s, tok + out.stats["completion_tokens"], work + out.stats["loop_token_iterations"]
            outs.append(out)
        return {"verify_loops": Lv, "tokens_per_s": tok / secs, "seconds": secs,
                "completion_tokens": tok, "loop_token_iterations": work}, outs

    baseline, want = plain()
    print(f"generate(loops={Lv}): {baseline['tokens_per_s']:.1f} tok/s")

    rows = []
    for Ld in args.draft_loops:
        if not 1 <= Ld < Lv:
            continue
        for ahead in args.draft_ahead:
            for K in args.k_branches:
                secs = tok = work = drafted = accepted = verifies = 0
                diverged = []  # per prompt that differs from generate: its first differing token
                for p, ref in zip(prompts, want):
                    if K == 1:
                        fn = lambda: m.generate_speculative(p, draft_loops=Ld, verify_loops=Lv,  # noqa: E731
                                                            draft_ahead=ahead, **kw)
                    else:
                        fn = lambda: m.generate_tree_speculative(p, draft_loops=Ld, verify_loops=Lv,  # noqa: E731
                                                                 draft_ahead=ahead, K_branches=K, **kw)
                    s, out = run_timed(fn, dev, args.repeat, warmup=1)
                    if greedy and out != ref:
                        diff = first_divergence(out, ref)
                        diverged.append(diff - len(p))
                        print(f"PARITY: Ld={Ld} ahead={ahead} K={K}: greedy output differs from generate "
                              f"at generated token {diff - len(p)}")
                    st = out.stats
                    secs, tok = secs + s, tok + st["completion_tokens"]
                    work += st["loop_token_iterations"]
                    drafted += st["drafted_tokens"]
                    accepted += st["accepted_tokens"]
                    verifies += st["verify_steps"]
                row = {"mode": "chain" if K == 1 else "tree", "draft_loops": Ld, "verify_loops": Lv,
                       "draft_ahead": ahead, "k_branches": K, "tokens_per_s": tok / secs,
                       "speedup_vs_generate": (tok / secs) / baseline["tokens_per_s"],
                       "accepted_per_verify": accepted / verifies, "acceptance_rate": accepted / drafted,
                       "tokens_per_verify": (tok - len(prompts)) / verifies,
                       "loop_token_iterations": work, "temperature": temperature,
                       **({"greedy_parity": not diverged, "diverged_at": diverged} if greedy else {})}
                rows.append(row)
                print(f"{row['mode']:5s} Ld={Ld} ahead={ahead} K={K}: {row['tokens_per_s']:.1f} tok/s "
                      f"({row['speedup_vs_generate']:.2f}x), accepted/verify {row['accepted_per_verify']:.2f}, "
                      f"acceptance {row['acceptance_rate']:.2f}")

    # measured again after the speculative runs: the spread shows how noisy the machine was
    baseline_after, _ = plain()
    print(f"generate(loops={Lv}) again: {baseline_after['tokens_per_s']:.1f} tok/s")
    return {"baseline": baseline, "baseline_after": baseline_after, "results": rows}

if __name__ == "__main__":
    main()
