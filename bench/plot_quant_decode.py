"""Plot ms/token against L for each weight format of a `bench/quant_decode.py` result, with each
format's floor (its bytes at the copy bandwidth).

    python -m bench.plot_quant_decode [bench/results/quant-decode-cuda.json] [-o docs/quant-decode-vs-L.png]
"""
from __future__ import annotations

from bench.plots import log_axes, plt, result_and_output, save


def main(argv: list[str] | None = None) -> None:
    r, output = result_and_output(__doc__, "quant-decode-cuda.json", "quant-decode-vs-L.png", argv)
    fig, ax = plt.subplots(figsize=(6.4, 5.0), dpi=120)
    for i, (fmt, rows) in enumerate(r["decode"].items()):
        L = [row["loops"] for row in rows]
        color = f"C{i}"
        ax.plot(L, [row["ms"] for row in rows], "o-", color=color, label=f"{fmt} (captured decode step)")
        ax.plot(L, [row["floor_ms"] for row in rows], "--", color=color, alpha=0.6, label=f"{fmt} floor")
    hw = r["hardware"].get("gpu", r["hardware"]["device"])
    log_axes(ax, [row["loops"] for rows in r["decode"].values() for row in rows], "loop depth L",
             f"ms / token (batch 1, {r.get('context', '?')} tokens of context)",
             f"{r.get('model', 'bench-285m')}: weight formats, {hw}", title_size=9)
    save(fig, ax, output)

if __name__ == "__main__":
    main()
