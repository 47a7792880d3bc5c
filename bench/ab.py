"""Same-host A/B of the decode step: variants interleaved round by round in one process.

    source bench/gpu_env.sh && python -m bench.ab --rounds 3 --configs 8x128 8x3072 \
        --variant base --variant "stages1:tinyloop.kernels.decode_attention.SPLIT_STAGES=1"

A GPU's step time drifts between hosts and, on one host, between minutes (0.421 to 0.453 ms for
the same L = 8 step on the H200s of one session: docs/performance.md), more than most changes
move it, so two commits' full runs do not compare them. This runs every variant on one model,
alternating base / variant / base / variant, and records each config's figure per round:
`bench/decode.py`'s `decode_rate` (ms per token of the captured step fed its own greedy token,
min of `--best-of` runs) at L loops with CTX tokens in the cache. `--warmup-rounds` rounds (1 by
default) run first and are not recorded: on the H200 the first round read about 1 % slower
than the next ones for the first variants (e.g. 0.424 then 0.419 and 0.4186 ms,
bench/results/tilevar-ab-cuda.json, recorded before this option).

A variant is `NAME` or `NAME:module.attr=value[;module.attr=value...]`: the module-level
settings it runs with (values are Python literals), restored after it. Between variants the
step's graphs are dropped and captured anew, so each variant's settings reach its kernels'
launches; a setting read only when the model is built or a kernel is first compiled does not
change between variants of one process. On CPU (a smoke run) the steps run eagerly.
"""
from __future__ import annotations

import argparse
import ast
import importlib

import torch
from tqdm import tqdm

from bench.common import hardware, write
from bench.decode import ceilings, decode_rate, random_checkpoint
from tinyloop.worker import Model
from tinyloop.worker.model.config import PRESETS


def parse_variant(spec: str) -> tuple[str, list[tuple[str, str, object]]]:
    """'name:pkg.mod.attr=1;pkg.mod.other=(2, 3)' -> ('name', [(module, attr, value), ...])."""
    name, _, sets = spec.partition(":")
    if not name:
        raise ValueError(f"variant {spec!r}: no name before ':'")
    out = []
    for item in filter(None, (s.strip() for s in sets.split(";"))):
        target, eq, literal = item.partition("=")
        module, _, attr = target.strip().rpartition(".")
        if not eq or not module or not attr:
            raise ValueError(f"variant {spec!r}: {item!r} is not module.attr=value")
        try:
            value = ast.literal_eval(literal.strip())
        except (ValueError, SyntaxError) as e:
            raise ValueError(f"variant {spec!r}: {literal.strip()!r} is not a Python literal") from e
        out.append((module, attr, value))
    return name, out


def check_settings(sets: list[tuple[str, str, object]]) -> None:
    """Each setting names an existing module attribute: a typo would measure the base twice."""
    for module, attr, _ in sets:
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            raise ValueError(f"no module {module!r}") from e
        if not hasattr(mod, attr):
            raise ValueError(f"module {module} has no attribute {attr!r}")


class Settings:
    """Apply a variant's module settings (checked by check_settings); restore them on exit."""

    def __init__(self, sets: list[tuple[str, str, object]]):
        self.sets, self.saved = sets, []

    def __enter__(self):
        for module, attr, value in self.sets:
            mod = importlib.import_module(module)
            self.saved.append((mod, attr, getattr(mod, attr)))
            setattr(mod, attr, value)
        return self

    def __exit__(self, *exc):
        for mod, attr, value in reversed(self.saved):
            setattr(mod, attr, value)
        self.saved = []


def parse_config(text: str) -> tuple[int, int]:
    loops, x, ctx = text.partition("x")
    if not x or not loops.isdigit() or not ctx.isdigit() or int(loops) < 1:
        raise ValueError(f"config {text!r}: expected LOOPSxCONTEXT, e.g. 8x128")
    return int(loops), int(ctx)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", required=True,
                    help="NAME or NAME:module.attr=value[;...] (repeat; two or more)")
    ap.add_argument("--configs", nargs="+", default=["8x128"], help="LOOPSxCONTEXT, e.g. 8x128 8x3072")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup-rounds", type=int, default=1, help="unrecorded rounds first")
    ap.add_argument("--steps", type=int, default=64, help="decode steps per timed run")
    ap.add_argument("--best-of", type=int, default=3, help="timed runs per figure (the minimum)")
    ap.add_argument("--preset", default="bench-285m")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--name", default="decode-ab", help="the JSON's name: NAME-<device>.json")
    args = ap.parse_args(argv)
    variants = [parse_variant(v) for v in args.variant]
    if len(variants) < 2 or len({n for n, _ in variants}) != len(variants):
        raise ValueError(f"need two or more variants with distinct names, got {[n for n, _ in variants]}")
    for _, sets in variants:
        check_settings(sets)
    configs = [parse_config(c) for c in args.configs]
    if args.rounds < 1 or args.best_of < 1 or args.steps < 1:
        raise ValueError("--rounds, --best-of and --steps must be >= 1")
    if args.warmup_rounds < 0:
        raise ValueError("--warmup-rounds must be >= 0")
    for L, ctx in configs:
        if ctx + args.steps + 1 > args.max_seq_len:
            raise ValueError(f"config {L}x{ctx}: {ctx} + {args.steps} steps pass --max-seq-len {args.max_seq_len}")

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    result = {"hardware": hardware(dev), "model": f"{args.preset} (random init)",
              "variants": {n: [f"{m}.{a}={v!r}" for m, a, v in s] for n, s in variants},
              "configs": [f"{L}x{ctx}" for L, ctx in configs], "warmup_rounds": args.warmup_rounds,
              "rounds": [], "ceilings": ceilings(dev)}
    path = random_checkpoint(args.preset, PRESETS[args.preset])
    with Model(path, max_seq_len=args.max_seq_len, device=dev, dtype="bfloat16" if cuda else "float32",
               cuda_graphs=False) as m:
        bar = tqdm(total=(args.warmup_rounds + args.rounds) * len(variants) * len(configs), desc="a/b",
                   unit="figure")
        for r in range(-args.warmup_rounds, args.rounds):  # r < 0: warm-up, not recorded
            for name, sets in variants:
                row = {"round": r, "variant": name, "ms": {}}
                with Settings(sets):
                    if cuda:
                        from tinyloop.worker.runner.graphs import DecodeGraphs
                        m.engine.graphs = DecodeGraphs(m.engine, m.prefill_graph_len)
                    for L, ctx in configs:
                        row["ms"][f"{L}x{ctx}"] = min(decode_rate(m, L, ctx, args.steps, repeat=3)
                                                      for _ in range(args.best_of))
                        bar.update()
                    m.engine.graphs = None
                    if cuda:
                        torch.cuda.synchronize(dev)
                        torch.cuda.empty_cache()
                gemv = importlib.import_module("tinyloop.kernels.gemv")
                if cuda and gemv.autotuning():  # the autotuned tiles (TINYLOOP_AUTOTUNE=1: per process)
                    result["gemv_tiles"] = {repr(k[:7]): str(v) for k, v in gemv._gemv_tuned.cache.items()}
                label = f"round {r}" if r >= 0 else "warm-up"
                tqdm.write(f"{label} {name}: " + ", ".join(f"{k} {v:.4f} ms" for k, v in row["ms"].items()))
                if r >= 0:
                    result["rounds"].append(row)
                    write(f"{args.name}-{dev.type}", result, args.out_dir)
        bar.close()
    best = {n: {c: min(row["ms"][c] for row in result["rounds"] if row["variant"] == n) for c in result["configs"]}
            for n, _ in variants}
    base = variants[0][0]
    result["best_ms"] = best
    result["vs_first_pct"] = {n: {c: 100 * (best[n][c] / best[base][c] - 1) for c in result["configs"]}
                              for n, _ in variants[1:]}
    for n, pct in result["vs_first_pct"].items():
        print(f"{n} vs {base}: " + ", ".join(f"{c} {p:+.1f} %" for c, p in pct.items()))
    write(f"{args.name}-{dev.type}", result, args.out_dir)


if __name__ == "__main__":
    main()
