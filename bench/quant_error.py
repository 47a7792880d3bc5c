"""Error growth of quantized weights against depth: ||h_L(quant) - h_L(ref)|| / ||h_L(ref)||, the
residual after L iterations of the shared block, for L = 1..max_loops, on held-out windows of
the embedded default model (CPU, fp32), for three roundings of the same RTN-4 file:

- naive: round to nearest at every iteration (the same error each time);
- stochastic: an independent draw per iteration from the sign channel (TINYLOOP_CROSS_ITER_ROUND);
- cancel: the codes at even iterations, codes + sign channel at odd ones (TINYLOOP_CANCEL_ROUND).

Only the shared block is quantized (the prelude is the float model's), so the curves show the
loop's own accumulation: at L = 1 one application of the quantized block, then L of them. Writes bench/results/quant-error-cpu.json and
docs/quant-error-vs-L.png.

    python -m bench.quant_error [--group-size 64] [--windows 8] [--seq-len 256]
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import hardware, write
from tinyloop.kernels.rope import apply_rope_ref
from tinyloop.worker.model import checkpoint, quant_checkpoint
from tinyloop.worker.model.default_model import default_model_path
from tinyloop.worker.model.quant import QuantSpec
from tinyloop.worker.model.quantize import quantize_file

PLOT = Path(__file__).resolve().parents[1] / "docs" / "quant-error-vs-L.png"


@torch.no_grad()
def loop_states(model, tokens: torch.Tensor, loops: int) -> list[torch.Tensor]:
    """The residual (B, T, D) after each of iterations 0..loops-1 (LoopedTransformer.forward's
    path up to the coda)."""
    B, T = tokens.shape
    pos = torch.arange(T)
    cos, sin = model.rope_rows(pos.expand(B, T), T)

    def attend(q, k, v):
        q, k = apply_rope_ref(q, cos, sin), apply_rope_ref(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])

    x = model.embedded(model.tok_embeddings(tokens))
    for layer in model.prelude:
        x = layer(x, attend)
    x = model.loop_input(x, None, pos.expand(B, T))
    out = []
    for i in range(loops):
        x = model.iteration(x, [attend] * len(model.loop), i)
        out.append(model.state(x))
    return out


def heldout_windows(n: int, seq_len: int) -> torch.Tensor:
    from tinyloop.train import corpus
    from tinyloop.train.evaluate import windows
    return windows(corpus.heldout_bytes(max_bytes=4_000_000), n, seq_len - 1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    src = default_model_path()
    ref, _ = checkpoint.load(src)
    L = ref.config.max_loops
    win = heldout_windows(args.windows, args.seq_len)
    want = loop_states(ref, win, L)
    curves = {}
    with tempfile.TemporaryDirectory() as d:
        q = Path(d) / "q.tinyloop"
        quantize_file(src, q, QuantSpec(4, args.group_size, "rtn", cancel_round=True))
        for rounding, name in (("nearest", "naive"), ("stochastic", "stochastic"), ("cancel", "cancel")):
            model, _ = checkpoint.load(q)
            quant_checkpoint.use_rounding(model, rounding)
            model = quant_checkpoint.dequantized(model)
            model.prelude = ref.prelude
            got = loop_states(model, win, L)
            curves[name] = [round(((g - w).norm() / w.norm()).item(), 6) for g, w in zip(got, want)]
            print(name, " ".join(f"{e:.4f}" for e in curves[name]))
    at = lambda name, n: curves[name][n - 1]  # noqa: E731
    payload = {
        "model": "default (embedded)", "weights": f"int4-g{args.group_size}-rtn, shared block only", "windows": args.windows,
        "seq_len": args.seq_len, "loops": list(range(1, L + 1)), "relative_error": curves,
        "goal": {"cancel_at_16": at("cancel", 16), "naive_at_2": at("naive", 2),
                 "met": at("cancel", 16) <= at("naive", 2)},
        "hardware": hardware(torch.device("cpu")),
    }
    write("quant-error-cpu", payload, args.out)
    plot(curves, PLOT)


def plot(curves: dict[str, list[float]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, ys in curves.items():
        ax.plot(range(1, len(ys) + 1), ys, marker="o", ms=3, label=name)
    ax.set_xlabel("iterations L")
    ax.set_ylabel("||h_L(int4) - h_L(fp32)|| / ||h_L(fp32)||")
    ax.set_title("Quantization error vs depth (default model, RTN-4)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
