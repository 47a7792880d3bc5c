"""`tinyloop generate` (in-process), `tinyloop init-model` and `tinyloop convert`."""
from __future__ import annotations

import sys


def register(sub) -> None:
    g = sub.add_parser("generate", help="generate text (in-process, or --server HOST:PORT over gRPC)")
    g.add_argument("--model", help="a .tinyloop checkpoint or a Hugging Face model directory (Ouro, Huginn; "
                                   "default: the embedded model)")
    g.add_argument("--prompt", required=True, help="prompt text")
    g.add_argument("--loops", type=int, default=None, help="loop depth L (default: the model's)")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=50)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--cache-window", type=int, default=0)
    g.add_argument("--l-warmup-tokens", type=int, default=0)
    g.add_argument("--l-warmup-L", type=int, default=None)
    g.add_argument("--device", default=None)
    g.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: bf16 on CUDA, fp32 on CPU)")
    g.add_argument("--max-loops", type=int, default=None,
                   help="the deepest loops allowed (default: the checkpoint's; a directory: 2x its default depth)")
    g.add_argument("--init-scale", type=float, default=1.0,
                   help="scale of Huginn's random initial latent state (0: the zero state)")
    g.add_argument("--server", default=None, help="HOST:PORT of a running `tinyloop serve`")
    g.set_defaults(handler=_generate)

    c = sub.add_parser("convert", help="write a Hugging Face model directory (Ouro, Huginn) as a .tinyloop file")
    c.add_argument("hf_dir", help="directory with config.json, model.safetensors[.index.json], tokenizer.json")
    c.add_argument("output", help="the .tinyloop file to write")
    c.add_argument("--dtype", default=None, choices=["float16", "bfloat16", "float32"],
                   help="the file's dtype (default: the directory's)")
    c.add_argument("--max-loops", type=int, default=None,
                   help="max_loops stored in the file (default: 2x the model's default depth)")
    c.set_defaults(handler=_convert)

    i = sub.add_parser("init-model", help="write a random-init .tinyloop checkpoint")
    i.add_argument("--preset", required=True, help="tiny | small | bench-285m | ouro-1.4b | ouro-2.6b | huginn-3.5b")
    i.add_argument("--seed", type=int, default=0)
    i.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    i.add_argument("-o", "--output", required=True)
    i.set_defaults(handler=_init_model)


def _generate(args) -> int:
    if args.server:
        from tinyloop.client.cli import generate_remote
        return generate_remote(args)
    from tinyloop.worker.api import Model
    with Model(args.model, device=args.device, dtype=args.dtype, max_loops=args.max_loops,
               init_scale=args.init_scale) as model:
        tok = model.tokenizer
        req = model.make_request(tok.encode(args.prompt), args.loops, args.max_tokens, args.temperature,
                                 args.top_k, args.top_p, args.repetition_penalty, args.seed,
                                 args.cache_window, args.l_warmup_tokens, args.l_warmup_L)
        decode = tok.decoder()
        sys.stdout.write(args.prompt)
        gen = model.stream(req)
        try:
            while True:
                sys.stdout.write(decode(next(gen)))
                sys.stdout.flush()
        except StopIteration as stop:
            finish = stop.value
        print(f"\n[finish: {finish.reason}, {finish.stats['completion_tokens']} tokens, "
              f"L={req.loops}]", file=sys.stderr)
    return 0


def _init_model(args) -> int:
    import torch

    from tinyloop.worker.model import checkpoint
    from tinyloop.worker.model.config import PRESETS
    if args.preset not in PRESETS:
        raise ValueError(f"unknown preset {args.preset!r}: choose from {sorted(PRESETS)}")
    cfg = PRESETS[args.preset]
    model = checkpoint.init_model(cfg, args.seed)
    checkpoint.save(model, args.output, dtype=getattr(torch, args.dtype))
    print(f"wrote {args.output}: preset {args.preset}, {cfg.n_params() / 1e6:.1f}M parameters, seed {args.seed}")
    return 0


def _convert(args) -> int:
    import os

    import torch
    from tqdm import tqdm

    from tinyloop.worker.model import checkpoint, hf
    if not os.path.isdir(args.hf_dir):
        raise ValueError(f"{args.hf_dir}: not a directory (convert reads a Hugging Face model directory)")
    dtype = None if args.dtype is None else getattr(torch, args.dtype)

    def bar(steps):
        return tqdm(steps, desc=f"converting {os.path.basename(os.path.normpath(args.hf_dir))}",
                    unit="tensor", file=sys.stderr)
    model, meta = hf.load(args.hf_dir, "cpu", dtype, args.max_loops, progress=bar)
    dtype = model.tok_embeddings.weight.dtype
    print(f"writing {args.output} ({dtype})", file=sys.stderr)
    checkpoint.save(model, args.output, dtype=dtype, tokenizer_json=meta.get("tinyloop.tokenizer"),
                    source=meta["tinyloop.source"])
    cfg = model.config
    print(f"wrote {args.output}: {cfg.n_params() / 1e6:.1f}M parameters, default loops {cfg.default_loops}, "
          f"max_loops {cfg.max_loops}")
    return 0
