"""Several speculative chain streams: their rounds shared (`SpecBatch`) against each stream's
own rounds taken in turn (what the worker's scheduler does for streams that step alone: one
`next` of each a step), and against the same streams decoding plainly in the batcher at
verify_loops, in the same run.

    python -m bench.spec_batch [--model PATH] [--device cuda] [--streams 2 4 8]

For each stream count N: N prompts (the built-in ones, repeated), greedy, chain at draft_loops /
verify_loops with draft_ahead drafts; each mode runs all N streams to max_tokens, untimed once
(graph captures), then `--repeat` times (the median). Every mode's tokens are checked equal
(greedy speculative output is generate's at verify_loops; on CUDA with the batch-invariant
kernels by default, as bench/speculative.py). tokens/s counts every stream's tokens over the
wall time of the whole run, prefills included.

Writes bench/results/spec-batch-<device>.json (another folder with --out-dir)."""
from __future__ import annotations

import argparse

import torch
from tqdm import tqdm

from bench.common import hardware, run_timed, write
from bench.speculative import PROMPTS
from tinyloop.worker import Model
from tinyloop.worker.generation.batcher import Batcher
from tinyloop.worker.generation.spec_batch import SpecBatch
from tinyloop.worker.model.settings import Settings


def _requests(m, n: int, args) -> list:
    prompts = [m.tokenizer.encode(PROMPTS[i % len(PROMPTS)]) for i in range(n)]
    spec = dict(draft_loops=args.draft_loops, verify_loops=args.verify_loops, draft_ahead=args.draft_ahead)
    return [m.make_request(p, max_tokens=args.max_tokens, speculative=spec) for p in prompts]


def _in_turn(m, reqs) -> list[list[int]]:
    """Each stream's own rounds, one `next` of each in turn until all end."""
    gens = {lane: m.stream(req, lane) for lane, req in enumerate(reqs)}
    out = {lane: [] for lane in gens}
    while gens:
        for lane, gen in list(gens.items()):
            try:
                out[lane].extend(next(gen))
            except StopIteration:
                del gens[lane]
    return [out[lane] for lane in range(len(reqs))]


def _shared(m, reqs) -> list[list[int]]:
    """Each stream's prefill token by its own `next`, then every round in one SpecBatch."""
    sb, out = SpecBatch(m.runner), {}
    for lane, req in enumerate(reqs):
        gen = m.stream(req, lane)
        out[lane] = list(next(gen))
        sb.add(gen)
    while sb:
        for lane, update in sb.step().items():
            if isinstance(update, Exception):
                raise update
            out[lane].extend(update[0])
    return [out[lane] for lane in range(len(reqs))]


def _plain(m, reqs) -> list[list[int]]:
    """The same streams decoding plainly at verify_loops in the batcher (no drafts)."""
    import dataclasses
    b, out = Batcher(m.runner), {}
    for lane, req in enumerate(reqs):
        plain = dataclasses.replace(req, speculative=None, loops=req.speculative["verify_loops"])
        out[lane] = list(b.join(m.start(plain, lane))[0])
    while b:
        for lane, (ids, _) in b.step().items():
            out[lane].extend(ids)
    return [out[lane] for lane in range(len(reqs))]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .tinyloop file (default: the embedded default model)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--streams", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--draft-loops", type=int, default=2)
    ap.add_argument("--verify-loops", type=int, default=8)
    ap.add_argument("--draft-ahead", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                    help="the batch-invariant kernels and device rounds (default: on CUDA)")
    ap.add_argument("--out-dir", default=None, help="default: bench/results")
    args = ap.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    invariant = device.type == "cuda" if args.batch_invariant is None else args.batch_invariant
    rows = []
    with Model(args.model, max_seq_len=512, device=device, n_slots=max(args.streams),
               settings=Settings.from_env().replace(batch_invariant=invariant)) as m:
        modes = {"in turn": _in_turn, "shared": _shared, "plain batched": _plain}
        for n in tqdm(args.streams, desc="streams"):
            reqs = _requests(m, n, args)
            row, tokens = {"streams": n}, {}
            for name, fn in modes.items():
                fn(m, reqs)  # untimed: captures, allocator
                s, got = run_timed(lambda: fn(m, reqs), m.device, args.repeat)
                tokens[name] = got
                row[name] = {"s": s, "tokens_per_s": sum(map(len, got)) / s}
            row["same_tokens"] = tokens["shared"] == tokens["in turn"] == tokens["plain batched"]
            row["shared_vs_in_turn"] = row["shared"]["tokens_per_s"] / row["in turn"]["tokens_per_s"]
            row["shared_vs_plain_batched"] = row["shared"]["tokens_per_s"] / row["plain batched"]["tokens_per_s"]
            rows.append(row)
            print(row)
        write(f"spec-batch-{m.device.type}", {
            "hardware": hardware(m.device), "model": m.path, "dtype": str(m.dtype).replace("torch.", ""),
            "batch_invariant": invariant, "device_rounds": m.runner.settings.device_rounds,
            "draft_loops": args.draft_loops, "verify_loops": args.verify_loops, "draft_ahead": args.draft_ahead,
            "max_tokens": args.max_tokens, "repeat": args.repeat, "rows": rows}, args.out_dir)


if __name__ == "__main__":
    main()
