"""Plot quality against compute from a `bench/early_exit.py` result: held-out bits per byte
(teacher forced, the rule active) and greedy agreement with full depth, against the mean
iterations per token, one line per criterion and cache policy.

    python -m bench.plot_early_exit [bench/results/early-exit-cpu.json] [-o docs/early-exit.png]
"""
from __future__ import annotations

from bench.plots import plt, result_and_output


def main(argv: list[str] | None = None) -> None:
    r, output = result_and_output(__doc__, "early-exit-cpu.json", "early-exit.png", argv)
    full = r["rows"][0]
    L = full["loops"]
    lines: dict[str, list[dict]] = {}
    for row in r["rows"][1:]:
        rule = row["rule"]
        lines.setdefault(f"{rule['criterion']} ({rule.get('cache', 'recompute')})", []).append(row)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6.4, 7.0), dpi=120, sharex=True)
    for name, rows in sorted(lines.items()):
        rows = sorted(rows, key=lambda x: x["iterations_per_token_tf"])
        top.plot([x["iterations_per_token_tf"] for x in rows], [x["bpb"] for x in rows], "o-", label=name)
        rows = sorted(rows, key=lambda x: x["iterations_per_token"])
        bottom.plot([x["iterations_per_token"] for x in rows], [x["agreement"] for x in rows], "o-", label=name)
    top.plot([L], [full["bpb"]], "k*", markersize=10)
    bottom.plot([L], [1.0], "k*", markersize=10)
    top.axhline(full["bpb"], color="k", ls="--", lw=1, label=f"full depth L = {L}")
    top.axhline(full["bpb"] * 1.01, color="k", ls=":", lw=1, label="+1 % bpb")
    top.set_ylabel("held-out bits per byte (teacher forced)")
    bottom.axhline(1.0, color="k", ls="--", lw=1)
    bottom.set_ylabel(f"greedy agreement with L = {L} ({r['workload']['tokens']} tokens)")
    bottom.set_xlabel("mean loop iterations per decoded token")
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
        ax.set_xlim(0, L + 0.5)
    hw = r["hardware"].get("gpu", r["hardware"]["device"])
    top.set_title(f"early exit on the {r['workload']['model']} model, {hw}")
    top.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(output)
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
