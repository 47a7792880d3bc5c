"""Per-hop medians of the TTFT trace (bench/ttft_trace/run.sh): report.py DIR [T_FROM T_TO]."""
import glob, statistics, sys
lo, hi = (float(sys.argv[2]), float(sys.argv[3])) if len(sys.argv) > 3 else (0, 1e18)
ev = []
for f in glob.glob(sys.argv[1] + "/*.log"):
    for line in open(f):
        t, label, *k = line.split()
        if lo <= float(t) <= hi:
            ev.append((float(t), label))
ev.sort()
order = ["C0", "GI", "G0", "G1", "G2", "W0", "W1", "W2", "W3", "W4", "W5", "W6", "G3", "G4", "C1", "G5"]
reqs, cur = [], None
for t, l in ev:
    if l == "C0":
        cur = {"C0": t}
        reqs.append(cur)
    elif cur is not None and l not in cur and l in order:
        if l == "W2" and "W1" not in cur:
            continue
        cur[l] = t
reqs = [r for r in reqs if all(l in r for l in order)][5:]
print("requests", len(reqs))
prev = "C0"
for l in order[1:]:
    d = [1e3 * (r[l] - r[prev]) for r in reqs]
    print(f"{prev}->{l}: p50 {statistics.median(d):.3f} ms")
    prev = l
d = [1e3 * (r["C1"] - r["C0"]) for r in reqs]
print(f"C0->C1 total p50 {statistics.median(d):.3f}")
