"""Per-hop medians of the TTFT trace (bench/ttft_trace/run.sh):

    report.py DIR [T_FROM T_TO] [--run NAME --json PATH]

DIR holds the traced processes' logs; T_FROM / T_TO bound one probe run (probe.py prints them).
With --json the run's medians are added to PATH under NAME (the file run.sh writes)."""
import argparse
import glob
import json
import os
import statistics

ORDER = ["C0", "GI", "G0", "G1", "G2", "W0", "W1", "W2", "W3", "W4", "W5", "W6", "G3", "G4", "C1", "G5"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("window", nargs="*", type=float)
    ap.add_argument("--run")
    ap.add_argument("--json")
    args = ap.parse_args()
    lo, hi = args.window if len(args.window) == 2 else (0, 1e18)
    ev = []
    for f in glob.glob(args.dir + "/*.log"):
        for line in open(f):
            t, label, *_ = line.split()
            if lo <= float(t) <= hi:
                ev.append((float(t), label))
    ev.sort()
    reqs, cur = [], None
    for t, label in ev:
        if label == "C0":
            cur = {"C0": t}
            reqs.append(cur)
        elif cur is not None and label not in cur and label in ORDER:
            if label == "W2" and "W1" not in cur:  # the step thread's wake for this request's job
                continue
            cur[label] = t
    reqs = [r for r in reqs if all(label in r for label in ORDER)][5:]  # the first five: warming up
    print("requests", len(reqs))
    hops = {}
    for a, b in zip(ORDER, ORDER[1:-1]):  # up to C1 (G5, after it, is the send's return)
        hops[f"{a}->{b}"] = round(statistics.median(1e3 * (r[b] - r[a]) for r in reqs), 3)
        print(f"{a}->{b}: p50 {hops[f'{a}->{b}']:.3f} ms")
    hops["total"] = round(statistics.median(1e3 * (r["C1"] - r["C0"]) for r in reqs), 3)
    print(f"C0->C1 total p50 {hops['total']:.3f}")
    if args.json:
        out = json.load(open(args.json)) if os.path.exists(args.json) else {}
        out.setdefault("runs_ms_p50", {})[args.run or "run"] = hops
        json.dump(out, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
