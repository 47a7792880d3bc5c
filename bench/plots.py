"""What the benches' plots share: their command line (a result file, the PNG to write, both with
defaults), matplotlib on the Agg backend (no display), and for the log-log ones a log2 x axis
ticked at the measured points, a log y axis, a grid, the legend below the axes (so that it hides
no point), and the file written."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402,F401  (re-exported: the plot scripts draw with it)

ROOT = Path(__file__).resolve().parents[1]


def result_and_output(doc: str, result: str, output: str, argv: list[str] | None = None) -> tuple[dict, str]:
    """A plot script's command line (`[RESULT] [-o OUTPUT]`, `doc` its help): the result file's
    JSON (default bench/results/`result`) and the PNG path (default docs/`output`)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("result", nargs="?", default=str(ROOT / "bench/results" / result))
    ap.add_argument("-o", "--output", default=str(ROOT / "docs" / output))
    args = ap.parse_args(argv)
    return json.loads(Path(args.result).read_text()), args.output


def log_axes(ax, xs, xlabel: str, ylabel: str, title: str, title_size: float | None = None) -> None:
    """x log2 ticked at xs, y log, the labels, the title and a grid."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    xs = sorted(set(xs))
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=title_size)
    ax.grid(True, which="both", alpha=0.3)


def save(fig, ax, output: str, legend_size: float = 7, ncol: int = 2) -> None:
    """The legend below the axes, a tight layout, the figure written to `output`."""
    ax.legend(fontsize=legend_size, ncol=ncol, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    fig.tight_layout()
    fig.savefig(output)
    print(f"wrote {output}")
