"""Same-host A/B of the decode step: variants interleaved round by round in one process.

    source bench/gpu_env.sh && python -m bench.ab --rounds 3 --configs 8x128 8x3072 \
        --variant base --variant "keep0:settings.l2_keep_fraction=0.0"

A GPU's step time drifts between hosts and, on one host, between minutes, by more than most
changes move it, so two commits' full runs do not compare them. This runs every variant on one model,
alternating base / variant / base / variant, and records each config's figure per round:
`bench/decode.py`'s `decode_rate` (ms per token of the captured step fed its own greedy token,
min of `--best-of` runs) at L loops with CTX tokens in the cache. `--warmup-rounds` rounds (1 by
default) run first and are not recorded: the first round reads slower than the next ones for
the first variants (clocks and caches settling).

A variant is `NAME` or `NAME:settings.FIELD=value[;settings.FIELD=value...]` (values are Python
literals), each FIELD a field of the model's `Settings` (worker/model/settings.py: fused_rows,
l2_keep_fraction, l2_stream, pdl, gemv_tiles, ...): the variant runs on a model of its own,
built with those settings over Settings.from_env() (as every variant's model), e.g.
settings.l2_keep_fraction=0.0. What a variant changes is an explicit option its model carries to
the kernels' launches, never a module global. Variants with the same settings share one model
(one cache lane, no graphs of its own). For each variant in each round the step's graphs are
captured anew (`bench.decode.decode_runner`: a runner of the benchmark's own with the decode
graph of each config's depth) and dropped after. On CPU (a smoke run) the steps run eagerly.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib

import torch
from tqdm import tqdm

from bench.common import hardware, write
from bench.decode import ceilings, decode_rate, decode_runner, random_checkpoint
from tinyloop.worker import Model
from tinyloop.worker.model.config import PRESETS
from tinyloop.worker.model.settings import Settings

SETTINGS = "settings"  # the one target prefix: a Settings field
OWN_FIELDS = ("cuda_graphs",)  # the benchmark's to set: it captures its own decode graphs
VARIANT_FORM = "NAME or NAME:settings.FIELD=value[;settings.FIELD=value...]"


def parse_variant(spec: str) -> tuple[str, list[tuple[str, object]]]:
    """'name:settings.fused_rows=2;settings.l2_stream=""' -> ('name', [('fused_rows', 2),
    ('l2_stream', '')]). Anything but VARIANT_FORM (a module attribute among them) -> ValueError
    naming the form."""
    name, _, sets = spec.partition(":")
    if not name:
        raise ValueError(f"variant {spec!r}: no name before ':' (a variant is {VARIANT_FORM})")
    out = []
    for item in filter(None, (s.strip() for s in sets.split(";"))):
        target, eq, literal = item.partition("=")
        prefix, dot, field = target.strip().partition(".")
        if not eq or prefix != SETTINGS or not dot or not field.isidentifier():
            raise ValueError(f"variant {spec!r}: {item!r} is not settings.FIELD=value (a variant is "
                             f"{VARIANT_FORM}, FIELD a field of worker/model/settings.py's Settings)")
        try:
            value = ast.literal_eval(literal.strip())
        except (ValueError, SyntaxError) as e:
            raise ValueError(f"variant {spec!r}: {literal.strip()!r} is not a Python literal") from e
        out.append((field, value))
    return name, out


def check_settings(sets: list[tuple[str, object]]) -> None:
    """Each setting names a Settings field a variant may set (a typo would measure the base twice)."""
    fields = {f.name for f in dataclasses.fields(Settings)}
    for field, _ in sets:
        if field not in fields or field in OWN_FIELDS:
            raise ValueError(f"Settings has no field {field!r} a variant may set "
                             f"(one of {sorted(fields - set(OWN_FIELDS))})")


def model_settings(sets: list[tuple[str, object]], base: Settings) -> Settings:
    """The Settings of a variant's model: `base` with the variant's values, never capturing at
    load (the benchmark captures its own step). ValueError: an invalid value."""
    fields = dict(sets)
    try:
        return dataclasses.replace(base, **fields, cuda_graphs=False)
    except TypeError as e:  # a value of the wrong type (Settings checks the ranges: ValueError)
        raise ValueError(f"settings {fields}: {e}") from None


def parse_config(text: str) -> tuple[int, int]:
    loops, x, ctx = text.partition("x")
    if not x or not loops.isdigit() or not ctx.isdigit() or int(loops) < 1:
        raise ValueError(f"config {text!r}: expected LOOPSxCONTEXT, e.g. 8x128")
    return int(loops), int(ctx)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", required=True,
                    help=f"{VARIANT_FORM} (repeat; two or more)")
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
    env = Settings.from_env()
    for _, sets in variants:
        check_settings(sets)
    settings = {name: model_settings(sets, env) for name, sets in variants}  # ValueError: a bad value
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
              "variants": {n: [f"{SETTINGS}.{f}={v!r}" for f, v in s] for n, s in variants},
              "settings": {n: dataclasses.asdict(settings[n]) for n, _ in variants},
              "configs": [f"{L}x{ctx}" for L, ctx in configs], "warmup_rounds": args.warmup_rounds,
              "rounds": [], "ceilings": ceilings(dev)}
    path = random_checkpoint(args.preset, PRESETS[args.preset])
    models: dict[Settings, Model] = {}  # one per distinct Settings, shared by the variants that have them
    for name, _ in variants:
        if settings[name] not in models:
            models[settings[name]] = Model(path, max_seq_len=args.max_seq_len, device=dev,
                                           dtype="bfloat16" if cuda else "float32", n_slots=1,
                                           settings=settings[name])
    try:
        bar = tqdm(total=(args.warmup_rounds + args.rounds) * len(variants) * len(configs), desc="a/b",
                   unit="figure")
        for r in range(-args.warmup_rounds, args.rounds):  # r < 0: warm-up, not recorded
            for name, _ in variants:
                row = {"round": r, "variant": name, "ms": {}}
                m = models[settings[name]]
                runner = decode_runner(m, [L for L, _ in configs]) if cuda else m.runner
                for L, ctx in configs:
                    row["ms"][f"{L}x{ctx}"] = min(decode_rate(runner, L, ctx, args.steps, repeat=3)
                                                  for _ in range(args.best_of))
                    bar.update()
                del runner
                if cuda:
                    torch.cuda.synchronize(dev)
                    torch.cuda.empty_cache()
                if cuda and settings[name].autotune:  # the autotuned tiles (per process: every autotuning variant's)
                    gemv = importlib.import_module("tinyloop.kernels.gemv")
                    result["gemv_tiles"] = {repr(k[:7]): str(v) for k, v in gemv._gemv_tuned.cache.items()}
                label = f"round {r}" if r >= 0 else "warm-up"
                tqdm.write(f"{label} {name}: " + ", ".join(f"{k} {v:.4f} ms" for k, v in row["ms"].items()))
                if r >= 0:
                    result["rounds"].append(row)
                    write(f"{args.name}-{dev.type}", result, args.out_dir)
        bar.close()
    finally:
        for m in models.values():
            m.close()
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
