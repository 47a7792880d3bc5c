"""Plot ms/token vs L from a `bench/decode.py` result: the floor, this engine, eager torch and
the torch.compile baselines.

    python -m bench.plot_decode [bench/results/decode-cuda.json] [-o docs/decode-vs-L.png]
"""
from __future__ import annotations

from bench.plots import log_axes, plt, result_and_output, save


def main(argv: list[str] | None = None) -> None:
    r, output = result_and_output(__doc__, "decode-cuda.json", "decode-vs-L.png", argv)
    rows = r["decode"]
    L = [row["loops"] for row in rows]
    fig, ax = plt.subplots(figsize=(6.4, 5.0), dpi=120)
    ax.plot(L, [row["eager_torch_ms"] for row in rows], "s-", label="eager torch (same model, same run)")
    ax.plot(L, [row["graph_ms"] for row in rows], "o-", label="TinyLoop Serve (Triton + CUDA graphs)")
    ax.plot(L, [row["floor_ms"] for row in rows], "k--", label="floor: bytes read / copy bandwidth")
    for c in r.get("compiled", []):  # torch.compile baselines, measured at some depths only
        for mode, m in c["modes"].items():
            if "ms" in m:
                ax.plot([c["loops"]], [m["ms"]], "x" if "cudagraphs" in mode else "^", markersize=8,
                        label=f"torch.compile {mode} (same run)")
    hw = r["hardware"].get("gpu", r["hardware"]["device"])
    log_axes(ax, L, "loop depth L", "ms / token (batch 1, 128 tokens of context)", f"bench-285m decode, bf16, {hw}")
    save(fig, ax, output)

if __name__ == "__main__":
    main()
