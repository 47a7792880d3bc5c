"""`tinyloop generate` (in-process), `tinyloop init-model`, `tinyloop convert` and `tinyloop quantize`."""
from __future__ import annotations

import sys

from tinyloop.worker.model.settings import KV_MODES  # torch-free: the mode names only


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
    g.add_argument("--kv-mode", default=None, choices=KV_MODES,
                   help="what the cache stores (docs/kv-cache.md; default: the TINYLOOP_KV_* variables, else kv); "
                        "with --server, the worker's mode, checked")
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

    q = sub.add_parser("quantize", help="write a .tinyloop file's projections as INT4 (docs/checkpoint.md)")
    q.add_argument("input", help="a float .tinyloop file or a Hugging Face model directory (Ouro, Huginn)")
    q.add_argument("output", help="the quantized .tinyloop file to write")
    q.add_argument("--bits", type=int, default=4, help="bits a weight (4)")
    q.add_argument("--group-size", type=int, default=128, help="columns sharing a scale and zero; divides every "
                                                            "projection's input dimension")
    q.add_argument("--method", default="rtn", help="rtn (round to nearest) | gptq (calibrated on the training corpus)")
    q.add_argument("--calib-tokens", type=int, default=65536, help="gptq: calibration tokens")
    q.add_argument("--calib-loops", type=int, default=None, help="gptq: calibration depth (default: the model's)")
    q.add_argument("--cancel-round", action="store_true",
                   help="store the shared block's sign channel (TINYLOOP_CANCEL_ROUND, TINYLOOP_CROSS_ITER_ROUND)")
    q.add_argument("--dual-bit", action="store_true", help="mark the file for dual-bit serving (needs --bits 4)")
    q.add_argument("--corpus-root", default=None, help="gptq: the stdlib tree to calibrate on (default: this Python's)")
    q.set_defaults(handler=_quantize)

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
               init_scale=args.init_scale, kv_mode=args.kv_mode) as model:
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
              f"L={req.loops}, kv_mode {model.kv_mode}]", file=sys.stderr)
    return 0


def _quantize(args) -> int:
    from tqdm import tqdm

    from tinyloop.worker.model.quant import QuantSpec
    from tinyloop.worker.model.quantize import quantize_file
    if args.dual_bit and args.bits != 4:
        raise ValueError(f"--dual-bit makes its INT2 copy from INT4 weights: it needs --bits 4, got --bits {args.bits}")
    spec = QuantSpec(args.bits, args.group_size, args.method, args.cancel_round,
                     args.calib_tokens if args.method == "gptq" else 0, args.dual_bit)

    def bar(steps, desc):
        return tqdm(steps, desc=desc, unit="step" if desc == "calibrating" else "weight", file=sys.stderr)
    out = quantize_file(args.input, args.output, spec, bar, args.calib_loops, args.corpus_root)
    print(f"wrote {args.output}: {out['format']}, {out['projections']} projections, "
          f"{out['bytes'] / 1e6:.1f} MB (from {out['source_bytes'] / 1e6:.1f} MB)")
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
