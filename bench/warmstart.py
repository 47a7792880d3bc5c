"""Warm-start resume vs fresh generate: the reference runtime's headline comparison.

    python -m bench.warmstart [--model PATH | --preset bench-285m] [--device cuda]

For each prefix length: fresh generate(L_new), build_resume_handle(L_mid), and
resume_generate(L_new) on that handle, greedy, `--decode` new tokens. Reference figure
(reference runtime docs): resume 4->8 is -32.5 % vs fresh, build 6.4 ms (H100, 407M INT4,
prefix 128, decode 16). The model is built as a worker builds it (every graph captured at load
on CUDA), with one cache lane: every call here runs on one lane at a time."""
from __future__ import annotations

import argparse
import tempfile

import torch
from tqdm import tqdm

from bench.common import hardware, timed, write
from tinyloop.worker import Model
from tinyloop.worker.model import checkpoint
from tinyloop.worker.model.config import PRESETS


def model_path(args) -> str | None:
    if args.model or not args.preset:
        return args.model
    path = f"{tempfile.gettempdir()}/{args.preset}-seed0.tinyloop"
    checkpoint.save(checkpoint.init_model(PRESETS[args.preset], 0), path, dtype=torch.bfloat16)
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .tinyloop file (default: the embedded model)")
    ap.add_argument("--preset", default=None, help="random-init a preset instead (e.g. bench-285m)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--prefix", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--l-mid", type=int, default=4)
    ap.add_argument("--l-new", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)

    with Model(model_path(args), max_seq_len=max(args.prefix) + args.decode, device=args.device, n_slots=1) as m:
        dev = m.device
        rows = []
        for T in tqdm(args.prefix, desc="prefix lengths"):
            g = torch.Generator().manual_seed(T)
            prompt = torch.randint(0, m.config.vocab_size, (T,), generator=g).tolist()
            kw = dict(max_tokens=args.decode, temperature=0.0)
            fresh = timed(lambda: m.generate(prompt, loops=args.l_new, **kw), dev, repeat=args.repeat)
            handles = []
            build = timed(lambda: handles.append(m.build_resume_handle(prompt, L_used=args.l_mid,
                                                                       max_loops=m.config.max_loops)),
                          dev, repeat=args.repeat)
            h = handles[-1]
            resume = timed(lambda: m.resume_generate(h, args.l_new, **kw), dev, repeat=args.repeat)
            assert m.resume_generate(h, args.l_new, **kw) == m.generate(prompt, loops=args.l_new, **kw)
            rows.append({"prefix": T, "decode": args.decode, "L_mid": args.l_mid, "L_new": args.l_new,
                         "fresh_ms": fresh, "build_ms": build, "resume_ms": resume,
                         "resume_vs_fresh_pct": 100.0 * (resume - fresh) / fresh,
                         "handle_mb": h.nbytes() / 2**20, "greedy_parity": True})
            print(f"prefix {T}: fresh {fresh:.2f} ms, build {build:.2f} ms, resume {resume:.2f} ms "
                  f"({rows[-1]['resume_vs_fresh_pct']:+.1f} %)")
        name = f"warmstart-{dev.type}"
        write(name, {"hardware": hardware(dev), "model": m.path, "config": m.config.to_json(),
                     "dtype": str(m.dtype), "backend": m.runner.ops.name, "rows": rows,
                     "reference": {"resume_vs_fresh_pct": -32.5, "build_ms": 6.4,
                                   "source": "reference runtime docs, H100, 407M GPTQ-INT4, prefix 128, decode 16"}},
              args.out_dir)


if __name__ == "__main__":
    main()
