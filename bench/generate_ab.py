"""Same-host A/B of two source trees' generate: each tree's own code, alternated round by round.

    python -m bench.generate_ab --tree base=../old-checkout --tree head=. --out-dir $OUT
        # -> generate-ab-<device>.json

bench/ab.py compares variants of one tree inside one process; a change of the runner's host
code (what `Model.generate` does around the captured decode step) needs the other tree's code
itself. Here every round runs each tree in a process of its own (its packages mapped onto the
`tinyloop` namespace as bench/gpu_env.sh does), in the order given, and each process times
`Model.generate` of --tokens greedy tokens on the embedded default model (or --model) at each
--loops after a warm-up generate: tokens/s, the best of --repeat; and a generate of one token
(the prefill, the first token and what a call costs around them), the best of --repeat, so
that a difference splits into what every call pays once and what each further token pays
(`decode_us_per_token`: the whole generate less the one-token generate, over the tokens after
the first); and on CUDA the step's device time alone (`graph_us_per_token`: the depth's captured
decode graph replayed back to back, each replay fed its own greedy token, no host read), so
that a decode difference splits further into the device's step and the host's work around it
(where the host's work per token outlasts the step, the generate is host-bound). The JSON keeps
every round's figures per tree and depth, their medians over the rounds, and each tree's
medians over the first's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

PACKAGES = ("cli", "worker", "kernels", "client", "gateway", "train")

# what one tree's process runs: argv = model, device, tokens, repeat, loops...
CHILD = r"""
import json, sys, time
import torch
from tinyloop.worker.api import Model
from tinyloop.worker.model.default_model import default_model_path
model, device, tokens, repeat, *loops = sys.argv[1:]
tokens, repeat, loops = int(tokens), int(repeat), [int(x) for x in loops]
m = Model(default_model_path() if model == "default" else model, max_seq_len=512, device=device, n_slots=2)
m.capture_graphs(loops) if device == "cuda" else None
prompt = m.tokenizer.encode("def fibonacci(n):\n    ")
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
out, first, graph = {}, {}, {}
for L in loops:
    m.generate(prompt, loops=L, max_tokens=8)
    best, one = 0.0, float("inf")
    for _ in range(repeat):
        sync()
        t = time.perf_counter()
        g = m.generate(prompt, loops=L, max_tokens=tokens)
        sync()
        best = max(best, (len(g) - len(prompt)) / (time.perf_counter() - t))
        t = time.perf_counter()
        m.generate(prompt, loops=L, max_tokens=1)
        sync()
        one = min(one, time.perf_counter() - t)
    out[str(L)], first[str(L)] = best, one * 1e3
    g = m.runner.graphs.decode.get(L) if device == "cuda" else None
    if g is not None:
        pos, steps, dev_best = len(prompt), 64, float("inf")
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(repeat + 1):  # the first a warm-up
            g.load(0, 0, pos)
            sync()
            start.record()
            for i in range(steps):
                g.replay(0, pos + i)  # it feeds itself its greedy token, one position on
            end.record()
            end.synchronize()
            dev_best = min(dev_best, start.elapsed_time(end) * 1e3 / steps)
        graph[str(L)] = dev_best
m.close()
import tinyloop.worker
print("RESULT " + json.dumps({"tok_s": out, "first_ms": first, "graph_us": graph,
                             "source": tinyloop.worker.__path__[0]}))
"""


def tree_env(tree: Path, scratch: Path) -> dict:
    """The environment of a process that imports `tinyloop` from `tree`'s folders."""
    ns = scratch / tree.name / "tinyloop"
    ns.mkdir(parents=True, exist_ok=True)
    for d in PACKAGES:
        link = ns / d
        if not link.exists() and (tree / d).exists():
            link.symlink_to(tree / d)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ns.parent), str(tree)])
    return env


def run_tree(tree: Path, scratch: Path, args) -> dict:
    """One process on `tree`'s code (which it checks it imported): {"tok_s", "first_ms",
    "graph_us"}, each by depth (graph_us: CUDA only)."""
    cmd = [sys.executable, "-c", CHILD, args.model, args.device, str(args.tokens), str(args.repeat),
           *map(str, args.loops)]
    p = subprocess.run(cmd, cwd=tree, env=tree_env(tree, scratch), capture_output=True, text=True)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if p.returncode != 0 or line is None:
        raise RuntimeError(f"tree {tree} failed (rc {p.returncode}):\n{p.stderr[-3000:]}")
    r = json.loads(line[len("RESULT "):])
    if Path(r["source"]).resolve() != (tree / "worker").resolve():
        raise RuntimeError(f"the process for {tree} imported tinyloop.worker from {r['source']}")
    return {"tok_s": r["tok_s"], "first_ms": r["first_ms"], "graph_us": r["graph_us"]}


def decode_us(tok_s: float, first_ms: float, tokens: int) -> float:
    """The microseconds each token after the first adds to a generate of `tokens` tokens at
    tok_s, whose one-token generate took first_ms."""
    return (tokens / tok_s - first_ms / 1e3) / max(1, tokens - 1) * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", required=True, help="NAME=PATH, two or more, the first the base")
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--loops", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    trees = {}
    for item in args.tree:
        name, sep, path = item.partition("=")
        if not sep or not name or not Path(path).is_dir():
            raise ValueError(f"--tree takes NAME=PATH with PATH a directory, got {item!r}")
        trees[name] = Path(path).resolve()
    if len(trees) < 2:
        raise ValueError("--tree: at least two trees to compare")
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory() as scratch:
        for _ in tqdm(range(args.rounds), desc="rounds"):
            for name, tree in trees.items():
                runs[name].append(run_tree(tree, Path(scratch) / name, args))
    loops = [str(L) for L in args.loops]
    rounds = {name: [r["tok_s"] for r in rs] for name, rs in runs.items()}
    firsts = {name: [r["first_ms"] for r in rs] for name, rs in runs.items()}
    decodes = {name: [{L: decode_us(r["tok_s"][L], r["first_ms"][L], args.tokens) for L in loops} for r in rs]
               for name, rs in runs.items()}

    def medians(per_round: dict) -> dict:
        return {name: {L: statistics.median(r[L] for r in rs) for L in loops} for name, rs in per_round.items()}
    median, median_first, median_decode = medians(rounds), medians(firsts), medians(decodes)
    graphs = {name: [r["graph_us"] for r in rs] for name, rs in runs.items()}
    median_graph = medians(graphs) if all(r["graph_us"] for rs in runs.values() for r in rs) else None
    base = next(iter(trees))
    ratio = {name: {L: v / median[base][L] for L, v in m.items()} for name, m in median.items()}
    import torch

    from bench.common import hardware, write
    write(f"generate-ab-{'cuda' if args.device == 'cuda' else 'cpu'}", {
        "hardware": hardware(torch.device(args.device)),
        "workload": {"model": args.model, "loops": args.loops, "tokens": args.tokens, "repeat": args.repeat,
                     "rounds": args.rounds},
        "trees": {name: str(t) for name, t in trees.items()},
        "rounds_tok_s": rounds, "median_tok_s": median, "over_base": ratio,
        "rounds_first_ms": firsts, "median_first_ms": median_first,
        "rounds_decode_us_per_token": decodes, "median_decode_us_per_token": median_decode,
        "rounds_graph_us_per_token": graphs, "median_graph_us_per_token": median_graph,
    }, args.out_dir)
    print(json.dumps({"median_tok_s": median, "over_base": ratio, "median_first_ms": median_first,
                      "median_decode_us_per_token": median_decode, "median_graph_us_per_token": median_graph},
                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
