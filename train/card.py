"""Render a training run's `model_card.json` into `docs/model-card.md`.

    python -m tinyloop.train.card OUT/model_card.json -o docs/model-card.md
"""
from __future__ import annotations

import argparse
import json
import sys

TEMPLATE = """# Model card: the embedded default model (`worker/assets/default.tinyloop`)

A small byte-level looped transformer, trained with a randomized depth so that one set of
weights is useful at every loop count L. `tinyloop generate` and `tinyloop serve` use it when
no model is given.

## Model

| | |
|---|---|
| architecture | embed -> {n_prelude} prelude -> ({n_loop_layers}-layer shared block) x L -> {n_coda} coda -> norm -> tied head |
| width | d_model {d_model}, {n_heads} heads of {head_dim}, {n_kv_heads} K/V head(s), SwiGLU {d_ff} |
| parameters | {n_params} |
| checkpoint | fp16 safetensors, {checkpoint_mb} MB |
| tokenizer | {tokenizer} |
| depth | default L = {default_loops}, max L = {max_loops}; trained with {depth_dist} per step |

## Training data

{training_data}

## Training

```
{command}
```

| | |
|---|---|
| hardware | {hardware} (torch {torch}) |
| training loop wall time | {train_wall_s} s (whole command {total_wall_s} s) |
| steps | {steps} |
| tokens seen | {tokens} ({tok_per_s} tokens/s) |
| batch | {batch_size} x {seq_len} bytes |
| optimizer | AdamW (0.9, 0.95), lr {lr}, {warmup_steps} warm-up steps, cosine to {min_lr_pct}%, weight decay {weight_decay}, clip {grad_clip}; bf16 autocast |
{kept_row}
## Held-out bits per byte

{eval_windows} windows of {eval_seq_len} bytes, evenly spaced over the held-out split; fp32
math on the shipped fp16 weights (`tinyloop eval-bpb --model worker/assets/default.tinyloop{root_flag}`
reproduces the table on {repro_where}).

| L | {loops_header} |
|---|{loops_rule}|
| bits/byte | {bpb_row} |

L beyond {max_train_loops} was never trained: the L = 16 column measures extrapolation.

## Tested properties

`tests/train/test_default_model.py` checks, on a held-out sample built from the CI machine's
own stdlib, that loss falls with depth (L = 1 > 4 > 8) and that greedy output for a code prompt
is not degenerate.
{notes}
## Limits

A {n_params_m}M-parameter model trained for minutes: it writes plausible-looking Python, not
correct programs. Trained on {seq_len}-byte windows; quality over longer contexts is untested.
"""


STDLIB_DATA = """The `.py` sources of the Python {python} standard library {corpus_where} ({n_files}
files{test_files}; site-packages excluded), byte-level, documents separated by byte
{doc_sep}. Held out: files whose sha1(relative path) falls in the lowest {heldout_pct}% of the
hash range ({n_heldout_files} files, {heldout_bytes} bytes); training: {n_train_files} files,
{train_bytes} bytes. See `train/corpus.py`."""

PACKAGE_DATA = """The `.py` sources of the Python {python} standard library ({stdlib_files} files,
{stdlib_bytes} bytes) and of installed packages, each capped at {package_mb} MB, documents
separated by byte {doc_sep}. Held out whole, never seen in training: {heldout_list}
({n_heldout_files} files, {heldout_bytes} bytes). Training: the stdlib and {train_list}
({n_train_files} files, {train_bytes} bytes). See `train/corpus.py` (`build_packages`).

| package | split | files | bytes |
|---|---|---|---|
{package_rows}"""


def _training_data(corpus: dict) -> str:
    if corpus.get("split") != "package":
        return STDLIB_DATA.format(
            python=corpus["python"], corpus_where=_corpus_where(corpus), n_files=f"{corpus['n_files']:,}",
            test_files=_test_files(corpus), doc_sep=corpus["doc_sep"],
            heldout_pct=f"{100 * corpus['heldout_frac']:g}", n_heldout_files=corpus["n_heldout_files"],
            heldout_bytes=f"{corpus['heldout_bytes']:,}", n_train_files=f"{corpus['n_train_files']:,}",
            train_bytes=f"{corpus['train_bytes']:,}")
    held = corpus["heldout_packages"]
    rows = "\n".join(f"| `{p}` | {'held out' if p in held else 'training'} | {v['files']:,} | {v['bytes']:,} |"
                     for p, v in corpus["packages"].items())
    return PACKAGE_DATA.format(
        python=corpus["python"], stdlib_files=f"{corpus['stdlib_files']:,}", stdlib_bytes=f"{corpus['stdlib_bytes']:,}",
        package_mb=f"{corpus['package_max_bytes'] / 1e6:g}", doc_sep=corpus["doc_sep"],
        heldout_list=", ".join(f"`{p}`" for p in held), n_heldout_files=f"{corpus['n_heldout_files']:,}",
        heldout_bytes=f"{corpus['heldout_bytes']:,}", train_list=", ".join(f"`{p}`" for p in corpus["train_packages"]),
        n_train_files=f"{corpus['n_train_files']:,}", train_bytes=f"{corpus['train_bytes']:,}", package_rows=rows)


def _depth_dist(args: dict) -> str:
    if args.get("depth_weighting", "uniform") == "deep":
        return f"P(L) ∝ L over [1, {args['max_train_loops']}]"
    return f"L ~ uniform[1, {args['max_train_loops']}]"


def _corpus_where(corpus: dict) -> str:
    if corpus.get("corpus_root"):
        return f"in the tree given by `--corpus-root {corpus['corpus_root']}`"
    return "on the training machine"


def _test_files(corpus: dict) -> str:
    n = corpus.get("n_test_files")
    if n is None:
        return "; test suites included where the installation ships them"
    return f", {n:,} of them in test suites" if n else ", no test suites: the installation ships none"


def _repro_flags(corpus: dict) -> str:
    if corpus.get("split") == "package":
        return " --heldout-packages " + " ".join(corpus["heldout_packages"])
    return " --corpus-root DIR" if corpus.get("corpus_root") else ""


def _repro_where(corpus: dict) -> str:
    if corpus.get("split") == "package":
        return "a machine with the same versions of the held-out packages installed"
    where = "the same stdlib tree at DIR" if corpus.get("corpus_root") else "the training machine's stdlib"
    return f"{where}; another Python version gives a slightly different held-out split"


def _kept_row(tr: dict) -> str:
    if tr.get("best_step") is None:
        return ""
    L = tr.get("selected_by_loops", 8)
    loss = tr["best_eval_loss"][str(L)]
    last = tr["final_eval_loss"][str(L)]
    every = tr["args"]["eval_every"]
    evals = f"evals every {every:,} steps and at the end" if every else "one eval, at the end"
    return (f"| kept checkpoint | step {tr['best_step']:,} of {tr['steps']:,}: the lowest held-out loss at L = {L} "
            f"({loss:.4f} nats/token on {tr['args']['eval_windows']} windows of the held-out split; "
            f"last eval {last:.4f}), {evals} |\n")


def render(card: dict) -> str:
    cfg, tr, args, corpus = card["config"], card["train"], card["train"]["args"], card["corpus"]
    bpb = card["bpb"]
    return TEMPLATE.format(
        **{k: cfg[k] for k in ("n_prelude", "n_loop_layers", "n_coda", "d_model", "n_heads", "n_kv_heads",
                               "d_ff", "default_loops", "max_loops")},
        head_dim=cfg["d_model"] // cfg["n_heads"], n_params=f"{card['n_params']:,}",
        n_params_m=f"{card['n_params'] / 1e6:.1f}", checkpoint_mb=f"{card['checkpoint_bytes'] / 1e6:.2f}",
        tokenizer="bytes (vocab 256)" if card["tokenizer"] == "byte" else f"BPE (vocab {cfg['vocab_size']})",
        max_train_loops=args["max_train_loops"], depth_dist=_depth_dist(args), training_data=_training_data(corpus),
        root_flag=_repro_flags(corpus), repro_where=_repro_where(corpus), kept_row=_kept_row(tr),
        command=card["command"], hardware=card["hardware"], torch=card["torch"],
        train_wall_s=tr["train_wall_s"], total_wall_s=card["total_wall_s"], steps=f"{tr['steps']:,}",
        tokens=f"{tr['tokens']:,}", tok_per_s=f"{tr['tok_per_s']:,}", batch_size=args["batch_size"],
        seq_len=args["seq_len"], lr=args["lr"], warmup_steps=args["warmup_steps"],
        min_lr_pct=f"{100 * args['min_lr_frac']:g}", weight_decay=args["weight_decay"],
        grad_clip=args["grad_clip"], eval_windows=card["eval"]["windows"], eval_seq_len=card["eval"]["seq_len"],
        loops_header=" | ".join(bpb), loops_rule="|".join("---" for _ in bpb),
        bpb_row=" | ".join(f"{v:.3f}" for v in bpb.values()),
        notes=f"\n{card['notes']}\n" if card.get("notes") else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tinyloop.train.card", description=__doc__.splitlines()[0])
    p.add_argument("card", help="model_card.json written by `tinyloop train --card`")
    p.add_argument("-o", "--output", default=None, help="markdown file (default: stdout)")
    a = p.parse_args(argv)
    with open(a.card) as f:
        text = render(json.load(f))
    if a.output:
        with open(a.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
