"""`tinyloop generate` (in-process) and `tinyloop init-model`."""
from __future__ import annotations

import sys


def register(sub) -> None:
    g = sub.add_parser("generate", help="generate text (in-process, or --server HOST:PORT over gRPC)")
    g.add_argument("--model", help="path to a .tinyloop checkpoint (default: the embedded model)")
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
    g.add_argument("--server", default=None, help="HOST:PORT of a running `tinyloop serve`")
    g.set_defaults(handler=_generate)

    i = sub.add_parser("init-model", help="write a random-init .tinyloop checkpoint")
    i.add_argument("--preset", required=True, help="tiny | small | bench-285m | ouro-1.4b")
    i.add_argument("--seed", type=int, default=0)
    i.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    i.add_argument("-o", "--output", required=True)
    i.set_defaults(handler=_init_model)


def _generate(args) -> int:
    if args.server:
        from tinyloop.client.cli import generate_remote
        return generate_remote(args)
    from tinyloop.worker.api import Model
    with Model(args.model, device=args.device) as model:
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
