"""Plot ms/token against L for each weight format of a `bench/quant_decode.py` result, with each
format's floor (its bytes at the copy bandwidth).

    python -m bench.plot_quant_decode [bench/results/quant-decode-cuda.json] [-o docs/quant-decode-vs-L.png]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("result", nargs="?", default=str(ROOT / "bench/results/quant-decode-cuda.json"))
    ap.add_argument("-o", "--output", default=str(ROOT / "docs/quant-decode-vs-L.png"))
    args = ap.parse_args(argv)
    r = json.loads(Path(args.result).read_text())
    fig, ax = plt.subplots(figsize=(6.4, 5.0), dpi=120)
    for i, (fmt, rows) in enumerate(r["decode"].items()):
        L = [row["loops"] for row in rows]
        color = f"C{i}"
        ax.plot(L, [row["ms"] for row in rows], "o-", color=color, label=f"{fmt} (captured decode step)")
        ax.plot(L, [row["floor_ms"] for row in rows], "--", color=color, alpha=0.6, label=f"{fmt} floor")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    L = sorted({row["loops"] for rows in r["decode"].values() for row in rows})
    ax.set_xticks(L, [str(x) for x in L])
    ax.set_xlabel("loop depth L")
    ax.set_ylabel(f"ms / token (batch 1, {r.get('context', '?')} tokens of context)")
    hw = r["hardware"].get("gpu", r["hardware"]["device"])
    ax.set_title(f"{r.get('model', 'bench-285m')}: weight formats, {hw}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    fig.tight_layout()
    fig.savefig(args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
