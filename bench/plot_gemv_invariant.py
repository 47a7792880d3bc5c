"""Plot microseconds a call against the rows M for each projection of a `bench/gemv_invariant.py`
result: the batch-invariant call, today's path (the batched tl.dot kernel up to its row limit) and
cuBLAS (F.linear), one colour a projection.

    python -m bench.plot_gemv_invariant [bench/results/gemv-invariant-cuda.json] [-o docs/gemv-invariant-vs-M.png]
"""
from __future__ import annotations

from bench.plots import log_axes, plt, result_and_output, save

PATHS = (("invariant_ms", "-", "batch-invariant"), ("today_ms", "--", "today's path"),
         ("torch_linear_ms", ":", "cuBLAS"))


def main(argv: list[str] | None = None) -> None:
    r, output = result_and_output(__doc__, "gemv-invariant-cuda.json", "gemv-invariant-vs-M.png", argv)
    by: dict[str, list[dict]] = {}
    for row in r["rows"]:
        by.setdefault(row["name"], []).append(row)
    fig, ax = plt.subplots(figsize=(6.4, 5.0), dpi=120)
    for i, (name, rows) in enumerate(by.items()):
        rows = sorted(rows, key=lambda row: row["M"])
        for key, style, label in PATHS:
            pts = [(row["M"], row[key] * 1e3) for row in rows if row.get(key)]
            if pts:
                ax.plot(*zip(*pts), style, marker="o" if key == "invariant_ms" else None, color=f"C{i}",
                        label=f"{name}: {label}")
    hw = r["hardware"].get("gpu", r["hardware"]["device"])
    log_axes(ax, [row["M"] for row in r["rows"]], "rows M a call", "µs a call",
             f"projections with their fused options, {hw} (commit {r.get('commit', '?')})", title_size=9)
    save(fig, ax, output, legend_size=6, ncol=3)

if __name__ == "__main__":
    main()
