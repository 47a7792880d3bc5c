"""`tinyloop train` and `tinyloop eval-bpb`. Nothing heavy at import time (torch loads inside
the handlers), like every module in tinyloop.cli's COMMAND_MODULES."""
from __future__ import annotations

import json
import os
import sys

DIMS = ("d_model", "n_heads", "n_kv_heads", "d_ff", "n_prelude", "n_loop_layers", "n_coda",
        "default_loops", "max_loops", "max_seq_len")
CARD_PROMPTS = ("def fibonacci(n):\n", "import os\n", "class Stack:\n")
DEFAULT_CORPUS_DIR = os.path.join(os.path.expanduser("~"), ".cache", "tinyloop", "corpus")
CORPUS_ROOT_HELP = ("build the corpus from the stdlib tree at DIR (its .py files) instead of this "
                    "interpreter's stdlib")


def register(sub) -> None:
    t = sub.add_parser("train", help="train a looped model on the Python stdlib (randomized depth)")
    t.add_argument("--preset", default="default", help="default | bench-100m | tiny | small | ...")
    for name in DIMS:
        t.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                       help=f"override the preset's {name}")
    t.add_argument("--init", default=None, metavar="CKPT",
                   help="start from this .tinyloop's weights, config and tokenizer (continue a run past one "
                        "GPU call's budget; the preset is not used, and dimension flags must agree or be left out)")
    t.add_argument("--tokenizer", choices=["byte", "bpe"], default="byte")
    t.add_argument("--vocab-size", type=int, default=16384, help="BPE vocabulary size (--tokenizer bpe)")
    t.add_argument("--bpe-sample-mb", type=float, default=None,
                   help="learn the BPE merges from an evenly strided sample of this many MB of the train split")
    t.add_argument("--minutes", type=float, default=None, help="wall-time budget of the training loop")
    t.add_argument("--steps", type=int, default=None, help="step budget (the first budget reached ends)")
    t.add_argument("--batch-size", type=int, default=64)
    t.add_argument("--seq-len", type=int, default=512)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--warmup-steps", type=int, default=200)
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--max-train-loops", type=int, default=12, help="L is drawn from [1, this] per step")
    t.add_argument("--depth-weighting", choices=["uniform", "deep"], default="uniform",
                   help="how L is drawn: uniform, or deep (P(L) proportional to L)")
    t.add_argument("--eval-every", type=int, default=250, help="steps between held-out evals (0: end only)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--compile", action="store_true", help="torch.compile each layer (optional)")
    t.add_argument("--device", default=None, help="default: cuda when available")
    t.add_argument("--corpus-dir", default=DEFAULT_CORPUS_DIR, help="where the built corpus is cached")
    t.add_argument("--corpus-mb", type=float, default=40.0, help="cap on corpus source bytes (MB)")
    t.add_argument("--corpus-root", default=None, metavar="DIR", help=CORPUS_ROOT_HELP)
    _package_args(t)
    t.add_argument("--out", required=True, help="output .tinyloop (fp16)")
    t.add_argument("--log", default=None, help="JSON-lines loss log")
    t.add_argument("--card", default=None, help="write a model-card JSON here (evaluates the saved file)")
    t.add_argument("--card-loops", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    t.add_argument("--card-windows", type=int, default=256)
    t.add_argument("--card-prompts", nargs="+", default=list(CARD_PROMPTS),
                   help="the card's greedy samples start from these prompts")
    t.add_argument("--card-sample-loops", type=int, nargs="+", default=[2, 8, 16])
    t.add_argument("--card-sample-tokens", type=int, default=64)
    t.add_argument("--no-progress", action="store_true")
    t.set_defaults(handler=_train)

    e = sub.add_parser("eval-bpb", help="held-out bits per byte of a checkpoint at several depths")
    e.add_argument("--model", required=True, help="a .tinyloop checkpoint or a Hugging Face model directory (Ouro, Huginn)")
    e.add_argument("--loops", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    e.add_argument("--windows", type=int, default=256)
    e.add_argument("--seq-len", type=int, default=512)
    e.add_argument("--corpus-mb", type=float, default=40.0)
    e.add_argument("--corpus-root", default=None, metavar="DIR", help=CORPUS_ROOT_HELP)
    _package_args(e)
    e.add_argument("--device", default=None)
    e.add_argument("--json", default=None, help="also write the table here")
    e.set_defaults(handler=_eval_bpb)


def _package_args(p) -> None:
    p.add_argument("--packages", nargs="+", default=None, metavar="PKG",
                   help="train on these installed packages' sources beside the stdlib (needs --heldout-packages)")
    p.add_argument("--heldout-packages", nargs="+", default=None, metavar="PKG",
                   help="hold these installed packages out whole (the held-out split)")
    p.add_argument("--site-packages", default=None, metavar="DIR", help="where the packages are (default: this "
                   "interpreter's site-packages)")
    p.add_argument("--package-mb", type=float, default=40.0, help="cap on each package's source bytes (MB)")


def _build_corpus(args):
    from tinyloop.train import corpus
    if args.packages is not None or args.heldout_packages is not None:
        if args.corpus_root is not None:
            raise ValueError("--corpus-root builds a stdlib corpus; with --packages the stdlib is this interpreter's")
        return corpus.build_packages(args.packages or [], args.heldout_packages or [], args.corpus_dir,
                                     site=args.site_packages, package_max_bytes=int(args.package_mb * 1e6),
                                     stdlib_max_bytes=int(args.corpus_mb * 1e6), verbose=True)
    return corpus.build(args.corpus_dir, root=args.corpus_root, max_bytes=int(args.corpus_mb * 1e6), verbose=True)


def _device(name: str | None) -> str:
    import torch
    return name or ("cuda" if torch.cuda.is_available() else "cpu")


def _config(args, vocab_size: int):
    import dataclasses

    from tinyloop.train.presets import get_preset
    cfg = get_preset(args.preset)
    overrides = {k: getattr(args, k) for k in DIMS if getattr(args, k) is not None}
    return dataclasses.replace(cfg, vocab_size=vocab_size, **overrides)


def _init_config(args, cfg):
    """The --init checkpoint's config; a dimension flag that disagrees with it is refused."""
    bad = {k: getattr(args, k) for k in DIMS if getattr(args, k) is not None and getattr(args, k) != getattr(cfg, k)}
    if bad:
        raise ValueError(f"--init {args.init}: its config disagrees with {', '.join(f'--{k.replace(chr(95), chr(45))} {v}' for k, v in bad.items())}")
    return cfg


def _train(args) -> int:
    import platform
    import time

    import torch

    from tinyloop.train import corpus, evaluate, trainer
    from tinyloop.worker.model import checkpoint
    t_start = time.time()
    device = _device(args.device)
    corp = _build_corpus(args)
    if not corp.info["n_train_files"] or not corp.info["n_heldout_files"]:
        raise ValueError(f"corpus too small: {corp.info['n_train_files']} train and "
                         f"{corp.info['n_heldout_files']} held-out files under --corpus-mb {args.corpus_mb}; "
                         f"raise --corpus-mb")
    tokenizer_json, bytes_per_token = None, 1.0
    init_cfg = init_tok = None
    if args.init:
        init_cfg, meta = checkpoint.read_config(args.init)
        init_tok = meta.get("tinyloop.tokenizer")
        if (init_tok is not None) != (args.tokenizer == "bpe"):
            raise ValueError(f"--init {args.init}: its tokenizer is {'BPE' if init_tok else 'bytes'}, "
                             f"not --tokenizer {args.tokenizer}")
    if init_tok is not None:
        from tinyloop.train import bpe
        sep = bpe.separator(init_cfg)
        train_tok, held_tok, tokenizer_json = (bpe.encode(init_tok, corp.train, sep),
                                               bpe.encode(init_tok, corp.heldout, sep), init_tok)
        bytes_per_token = corp.heldout.size / held_tok.size
    elif args.tokenizer == "bpe":
        from tinyloop.train import bpe
        sample = int(args.bpe_sample_mb * 1e6) if args.bpe_sample_mb else None
        train_tok, held_tok, tokenizer_json = bpe.build(corp, args.vocab_size, args.corpus_dir, sample)
        vocab = bpe.vocab_size_of(tokenizer_json)
        bytes_per_token = corp.heldout.size / held_tok.size
        print(f"bpe: vocab {vocab}, {train_tok.size / 1e6:.1f}M train tokens, "
              f"{bytes_per_token:.2f} bytes/token", file=sys.stderr)
    else:
        train_tok, held_tok, vocab = corp.train, corp.heldout, 256
    cfg = _config(args, vocab) if init_cfg is None else _init_config(args, init_cfg)
    print(f"model: {cfg.n_params() / 1e6:.2f}M parameters, {cfg.to_json()}", file=sys.stderr)
    targs = trainer.TrainArgs(
        steps=args.steps, minutes=args.minutes, batch_size=args.batch_size, seq_len=args.seq_len,
        lr=args.lr, warmup_steps=args.warmup_steps, weight_decay=args.weight_decay,
        max_train_loops=args.max_train_loops, depth_weighting=args.depth_weighting, eval_every=args.eval_every,
        seed=args.seed, init_from=args.init,
        compile=args.compile, progress=not args.no_progress,
        # The best checkpoint is the one with the lowest held-out loss at the deepest trained L.
        eval_loops=tuple(sorted({1, min(4, cfg.max_loops), min(8, cfg.max_loops), args.max_train_loops})))
    model, summary = trainer.train(cfg, train_tok, held_tok, targs, device, args.log)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    checkpoint.save(model, args.out, dtype=torch.float16, tokenizer_json=tokenizer_json)
    size = os.path.getsize(args.out)
    print(f"wrote {args.out} ({size / 1e6:.2f} MB): {summary['steps']} steps, "
          f"{summary['tokens'] / 1e6:.1f}M tokens in {summary['train_wall_s']:.0f} s", file=sys.stderr)
    if args.card:
        # Evaluate what ships: the saved fp16 file, loaded back, in fp32 math.
        saved, _ = checkpoint.load(args.out, device, torch.float32)
        win = evaluate.windows(held_tok, args.card_windows, args.seq_len)
        loops = [L for L in args.card_loops if L <= cfg.max_loops]
        bpb = evaluate.bpb_table(saved, win, loops, bytes_per_token)
        info = {k: v for k, v in corp.info.items() if k != "heldout_files"}
        card = {
            "command": "tinyloop " + " ".join(sys.argv[1:]),
            "preset": args.preset, "config": json.loads(cfg.to_json()), "n_params": cfg.n_params(),
            "checkpoint_bytes": size, "tokenizer": args.tokenizer,
            "hardware": torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or "cpu",
            "torch": torch.__version__, "python": platform.python_version(),
            "corpus": {**info, "heldout_files": corp.info["heldout_files"]},
            "train": summary,
            "eval": {"windows": args.card_windows, "seq_len": args.seq_len,
                     "bytes_per_token": bytes_per_token, "dtype": "fp32 math on the fp16 checkpoint"},
            "bpb": {str(L): round(v, 4) for L, v in bpb.items()},
            "samples": _samples(args.out, "cpu", args.card_prompts,
                                [L for L in args.card_sample_loops if L <= cfg.max_loops], args.card_sample_tokens),
            "total_wall_s": round(time.time() - t_start, 1),
        }
        with open(args.card, "w") as f:
            json.dump(card, f, indent=1)
        print("held-out bits/byte: " + "  ".join(f"L={L}: {v:.3f}" for L, v in bpb.items()), file=sys.stderr)
    return 0


def _samples(path: str, device: str, prompts: list[str], loops: list[int], max_tokens: int) -> list[dict]:
    """Greedy continuations of the saved checkpoint (fp32 math on the CPU, as `make run`), one per
    prompt and depth."""
    from tinyloop.worker.api import Model
    out = []
    with Model(path, device=device, dtype="float32", max_seq_len=512) as m:
        for prompt in prompts:
            ids = m.tokenizer.encode(prompt)
            for L in loops:
                gen = list(m.generate(ids, loops=L, max_tokens=max_tokens))
                out.append({"prompt": prompt, "loops": L, "text": m.tokenizer.decode(gen[len(ids):])})
    return out


def _eval_bpb(args) -> int:
    from tinyloop.train import evaluate
    res = evaluate.eval_checkpoint(args.model, args.loops, args.windows, args.seq_len, _device(args.device),
                                   max_bytes=int(args.corpus_mb * 1e6), root=args.corpus_root,
                                   heldout_packages=args.heldout_packages, site=args.site_packages,
                                   package_max_bytes=int(args.package_mb * 1e6))
    for L, v in res["bpb"].items():
        print(f"L={L:>3}  bpb={v:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0
