"""docs/performance.md, generated from the newest result file of each benchmark in bench/results/.

    python -m bench.report            # rewrite docs/performance.md
    python -m bench.report --check    # exit 1, with a diff summary, when the doc is not what this writes

Every figure in the doc is read from a JSON file here, so none can drift from its file. The hand-
written parts (what the benchmarks measure, how to run them) are the templates below; the rest is
tables. A file's benchmark is its name's prefix before the device (`decode-cuda-l8-b3ebbfe.json`:
`decode` on `cuda`; `startup-bench-285m-cuda.json`: `startup-bench-285m`); which file of a benchmark
is the newest is decided from what the file records, never from its name: the run's `date`
(bench/common.py's provenance stamps every result with it), else the commit time of the file's last
change in git (`git log -1 --format=%ct -- FILE`); ties go to the later git time, then the name. A
field a table wants that the newest file lacks prints as "—". Files of other prefixes (same-host
A/Bs, sweeps) and files that call themselves an `experiment` are no current figure and stay out,
as do a benchmark's older runs: the doc shows the current figures only, the history is the files
and git.
Standard library only: the report runs where torch is not installed.
"""
from __future__ import annotations

import argparse
import difflib
import json
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DOC = ROOT / "docs" / "performance.md"
PLOT = ROOT / "docs" / "decode-vs-L.png"
QUANT_PLOT = ROOT / "docs" / "quant-decode-vs-L.png"
GEMV_INV_PLOT = ROOT / "docs" / "gemv-invariant-vs-M.png"
DASH = "—"
DEVICES = ("cuda", "gpu", "cpu")
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", "reduce-overhead")  # bench/decode.py's

# -- reading the files ------------------------------------------------------------------------------


@dataclass
class Result:
    path: Path
    data: dict
    run_ts: float | None  # the run's `date`, seconds since the epoch (UTC)
    git_ts: float | None  # the commit time of the file's last change
    prefix: str = ""
    device: str = ""

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def commit(self) -> str | None:
        return self.data.get("commit") if isinstance(self.data.get("commit"), str) else None

    def sort_key(self) -> tuple:
        ts = self.run_ts if self.run_ts is not None else self.git_ts
        return (ts if ts is not None else float("-inf"),
                self.git_ts if self.git_ts is not None else float("-inf"), self.name)


def parse_date(value) -> float | None:
    """'2026-11-30T01:49:04Z' or '2026-11-29' (UTC) -> seconds since the epoch; None otherwise."""
    if not isinstance(value, str) or not value:
        return None
    try:
        d = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    if d.tzinfo is None:
        d = d.replace(tzinfo=timezone.utc)
    return d.timestamp()


def git_time(path: Path) -> float | None:
    """The commit time of path's last change in git, or None (no git, not tracked)."""
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%ct", "--", path.name], cwd=path.parent,
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    s = out.stdout.strip()
    return float(s) if out.returncode == 0 and s.isdigit() else None


def split_name(stem: str) -> tuple[str, str] | None:
    """'decode-cuda-l8-b3ebbfe' -> ('decode', 'cuda'); None when no part names a device."""
    parts = stem.split("-")
    for i, p in enumerate(parts):
        if i and p in DEVICES:
            return "-".join(parts[:i]), p
    return None


def load(results: Path) -> list[Result]:
    out = []
    for path in sorted(results.glob("*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict):
            out.append(Result(path, data, parse_date(data.get("date")), git_time(path)))
    return out


# The current benchmarks, (name prefix, device): every other file is an experiment. startup-* is one
# benchmark per model preset (startup-bench-285m-cuda.json, ...), shown in one table.
CURRENT = [
    ("decode", "cuda"), ("profile-decode", "cuda"), ("gemv", "cuda"), ("batch", "cuda"),
    ("prefill", "cuda"), ("warmstart", "cuda"), ("speculative", "cuda"), ("service", "gpu"),
    ("startup-*", "cuda"), ("service", "cpu"), ("speculative", "cpu"), ("warmstart", "cpu"),
    ("context", "cpu"), ("load", "cuda"), ("load", "cpu"), ("families", "cuda"),
    ("recover", "cpu"), ("kv-decode", "cuda"), ("kv-quality", "cpu"), ("quant-decode", "cuda"),
    ("quant-error", "cpu"), ("quant-quality", "cpu"), ("early-exit", "cuda"), ("early-exit", "cpu"),
    ("early-exit-ouro", "cuda"), ("early-exit-ouro", "cpu"),
    ("gemv-invariant", "cuda"), ("profile-speculative", "cuda"),
    ("sampling", "cuda"), ("profile-exit", "cuda"), ("profile-exit-batch", "cuda"), ("profile-batch", "cuda"),
    ("batch-fused", "cuda"), ("batch-interleave", "cuda"),
    ("spec-batch", "cuda"), ("spec-batch", "cpu"),
]


def is_current(prefix: str, device: str) -> bool:
    return any((p == prefix or (p.endswith("*") and prefix.startswith(p[:-1]))) and d == device
               for p, d in CURRENT)


def classify(results: list[Result]) -> dict[tuple[str, str], Result]:
    """The newest file of each current benchmark (experiments and older runs are not current)."""
    groups: dict[tuple[str, str], list[Result]] = {}
    for r in results:
        split = split_name(r.path.stem)
        if split and is_current(*split) and "experiment" not in r.data:
            r.prefix, r.device = split
            groups.setdefault(split, []).append(r)
    return {key: max(rs, key=Result.sort_key) for key, rs in groups.items()}


# -- formatting -------------------------------------------------------------------------------------


def get(d, *keys):
    """d[k0][k1]...; None where a level is missing."""
    for k in keys:
        if isinstance(d, dict) and k in d:
            d = d[k]
        elif isinstance(d, list) and isinstance(k, int) and -len(d) <= k < len(d):
            d = d[k]
        else:
            return None
    return d


def isnum(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def num(x, fmt: str = ".3f", unit: str = "", scale: float = 1.0) -> str:
    if not isnum(x):
        return DASH
    s = format(x * scale, fmt) + unit
    return s.replace("-", "−", 1) if s.startswith("-") else s


def ms(x, nd: int = 3) -> str:
    return num(x, f",.{nd}f", " ms")


def us(x_ms) -> str:  # milliseconds in, microseconds out
    return num(x_ms, ".1f", " µs", 1e3)


def times(x, nd: int = 2) -> str:
    return num(x, f".{nd}f", "×")


def pct(x, nd: int = 1) -> str:
    if not isnum(x):
        return DASH
    s = format(x, f"+.{nd}f") + " %"
    return "−" + s[1:] if s.startswith("-") else s


def share(x) -> str:  # a fraction in, a percentage out
    return num(x, ".1f", " %", 100)


def count(x) -> str:
    return num(x, ",.0f")


def yesno(x) -> str:
    return DASH if not isinstance(x, bool) else ("yes" if x else "no")


def text(x) -> str:
    if x is None or x == "":
        return DASH
    if isinstance(x, bool):
        return yesno(x)
    if isinstance(x, list):
        return ", ".join(text(v) for v in x) if x else "none"
    return str(x)


def code(x) -> str:
    return DASH if x is None or x == "" else f"`{x}`"


def model_name(x) -> str:
    """A model path as its file name; a preset name as it is."""
    return DASH if not isinstance(x, str) or not x else f"`{x.rsplit('/', 1)[-1]}`"


def table(headers: list[str], rows: list[list[str]]) -> str:
    esc = lambda c: str(c).replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(esc(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(esc(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def iso(ts: float | None) -> str:
    return DASH if ts is None else datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def hardware(h) -> str:
    if not isinstance(h, dict) or not h:
        return DASH
    parts = []
    if h.get("gpu"):
        parts.append(str(h["gpu"]))
    elif h.get("device") in ("cuda", "gpu"):
        parts.append(f"{h['device']} (GPU model not recorded)")
    cpu = h.get("cpu") or h.get("processor") or h.get("machine")
    cores = h.get("cores") or h.get("cpu_count")
    if not h.get("gpu") and cpu:
        parts.append(f"CPU {cpu}" + (f", {cores} cores" if cores else ""))
    for k, label in (("torch", "torch"), ("triton", "triton"), ("python", "Python")):
        if h.get(k):
            parts.append(f"{label} {h[k]}")
    if "torch_threads" in h:
        parts.append(f"torch threads {h['torch_threads']}")
    if "TINYLOOP_PDL" in h:
        parts.append(f"TINYLOOP_PDL={h['TINYLOOP_PDL']}")
    return ", ".join(parts)


def provenance(r: Result, extra: list[str] = ()) -> str:
    d = r.data
    when = d.get("date") if r.run_ts is not None else f"{DASH} (not recorded; committed to git {iso(r.git_ts)})"
    lines = [f"- File `{r.name}`, commit {code(r.commit)}, run {when}",
             f"- Command: {code(d.get('command'))}",
             f"- Hardware: {hardware(d.get('hardware'))}"]
    c = d.get("ceilings")
    if isinstance(c, dict):
        lines.append(f"- Ceilings measured in the same run: copy {num(c.get('copy_GBps'), ',.0f', ' GB/s')} "
                     f"(device to device, bytes read plus written), bf16 matmul "
                     f"{num(c.get('bf16_matmul_TFLOPs'), ',.0f', ' TFLOP/s')}")
    lines += [f"- {e}" for e in extra]
    return "\n".join(lines)


def section(title: str, intro: str, r: Result | None, body, extra=lambda r: [], after: str = "") -> str:
    head = f"## {title}\n\n{intro.strip()}\n\n"
    if r is None:
        return head + "No result file on record.\n"
    return head + provenance(r, extra(r)) + "\n\n" + body(r).strip() + "\n" + after


# -- the benchmarks ---------------------------------------------------------------------------------


def row_at(rows, loops: int):
    for row in rows or []:
        if isinstance(row, dict) and row.get("loops") == loops:
            return row
    return None


def decode_extra(r: Result) -> list[str]:
    d = r.data
    out = [f"Model: {text(d.get('model'))}; baseline: {text(d.get('baseline'))}"]
    kept = d.get("l2_kept")
    if isinstance(kept, dict):
        out.append(f"Kept in L2 from one iteration to the next: {text(kept.get('projections'))} "
                   f"({num(kept.get('bytes_per_iteration'), '.1f', ' MB', 1e-6)} an iteration); the HBM "
                   "floor is the floor less those bytes in every iteration but the first")
    else:
        out.append(f"Kept in L2 from one iteration to the next: {DASH} (not recorded)")
    return out


def compiled_cell(row, mode: str) -> str:
    m = get(row, "compiled", mode)
    if isinstance(m, dict) and "error" in m and "ms" not in m:
        return "failed"
    if not isinstance(m, dict):
        return DASH
    return f"{ms(m.get('ms'))} ({times(m.get('speedup'), 1)})"


def decode_body(r: Result) -> str:
    d = r.data
    rows = [row for row in d.get("decode") or [] if isinstance(row, dict)]
    floor = table(
        ["L", "context", "floor", "HBM floor", "TinyLoop Serve", "× floor", "× HBM floor", "achieved"],
        [[text(row.get("loops")), text(row.get("context")), ms(row.get("floor_ms")), ms(row.get("hbm_floor_ms")),
          ms(row.get("graph_ms")), times(row.get("graph_vs_floor")), times(row.get("graph_vs_hbm_floor")),
          num(row.get("graph_GBps"), ",.0f", " GB/s")] for row in rows] or [[DASH] * 8])
    base = table(
        ["L", "TinyLoop Serve", "eager torch", "engine, torch ops"] + [f"torch.compile {m}" for m in COMPILE_MODES],
        [[text(row.get("loops")), ms(row.get("graph_ms")),
          f"{ms(row.get('eager_torch_ms'), 2)} ({times(row.get('speedup_vs_eager'), 1)})",
          f"{ms(row.get('engine_torch_ops_ms'), 2)} ({times(row.get('speedup_vs_engine_torch_ops'), 1)})"]
         + [compiled_cell(row, m) for m in COMPILE_MODES] for row in rows] or [[DASH] * 7])
    gen = d.get("generate_prefix128_decode16_L8")
    g = gen if isinstance(gen, dict) else {}

    def gen_row(label, key):
        v = g.get(key)
        v = v if isinstance(v, dict) else {}
        return [label, ms(v.get("ms"), 2), times(v.get("speedup"), 1), yesno(v.get("same_tokens_as_graphs"))]

    gen_rows = [["TinyLoop Serve (CUDA graphs)", ms(get(g, "graphs", "ms"), 2), DASH, DASH],
                ["its prefill alone (128 tokens)", ms(g.get("graphs_prefill_ms"), 2), DASH, DASH],
                gen_row("eager torch", "eager_torch"), gen_row("engine, torch ops", "engine_torch_ops")]
    gen_rows += [gen_row(f"torch.compile {m}", f"compiled_{m}") for m in COMPILE_MODES]
    ref = g.get("reference_runtime_ms") if isinstance(g.get("reference_runtime_ms"), dict) else {}
    gen_rows.append([f"reference runtime, not measured here ({text(ref.get('source'))})", ms(ref.get("ms"), 1),
                     DASH, DASH])
    gen_t = table(["fresh generate, prefix 128, decode 16, L = 8", "wall", "TinyLoop Serve × faster",
                   "same tokens as TinyLoop Serve"], gen_rows)
    return (f"Batch-1 decode, ms per token:\n\n{floor}\n\nThe same steps against the same run's baselines "
            f"(ms per token; in brackets how many times faster TinyLoop Serve is):\n\n{base}\n\n{gen_t}\n")


def families_extra(r: Result) -> list[str]:
    return [f"Context: {text(r.data.get('context'))} tokens"]


def families_body(r: Result) -> str:
    rows = []
    for name, m in (r.data.get("models") or {}).items():
        if not isinstance(m, dict):
            continue
        for L, row in (m.get("depths") or {}).items():
            rows.append([code(name), num(m.get("params"), ".2f", "B", 1e-9), text(L), ms(get(row, "floor_ms")),
                         ms(get(row, "graph_ms")), times(get(row, "vs_floor")),
                         num(get(row, "achieved_GBps"), ",.0f", " GB/s")])
    return table(["shapes", "parameters", "L", "floor", "TinyLoop Serve", "× floor", "achieved"],
                 rows or [[DASH] * 7]) + "\n"


def recover_extra(r: Result) -> list[str]:
    w = r.data.get("workload") if isinstance(r.data.get("workload"), dict) else {}
    return [f"Workload: {text(w.get('workers'))} workers of {text(w.get('lanes'))} lanes, {text(w.get('streams'))} "
            f"greedy streams of {text(w.get('max_tokens'))} tokens at L = {text(w.get('loops'))} on "
            f"{text(w.get('model'))}; {text(r.data.get('killed'))} killed "
            f"{text(w.get('kill_after_first_tokens_s'))} s after every stream had its first tokens"]


def recover_body(r: Result) -> str:
    d = r.data
    rows = [[code(w), text(v.get("streams")), text(v.get("completed")),
             ", ".join(f"{k}: {n}" for k, n in (v.get("outcomes") or {}).items())]
            for w, v in sorted((d.get("per_worker") or {}).items()) if isinstance(v, dict)]
    streams = table(["worker", "streams", "completed", "outcomes"], rows or [[DASH] * 4])
    rec = d.get("recovery") if isinstance(d.get("recovery"), dict) else {}
    handles = ", ".join(f"{code(w)}: {text(o)}" for w, o in sorted((d.get("handles_after_kill") or {}).items()))
    return (f"{streams}\n\nSurvivors' tokens equal to their standalone runs: {yesno(d.get('survivors_exact'))}. "
            f"Handles built before the kill, resumed after it: {handles or DASH}.\n\n"
            + table(["from the kill to", "seconds"],
                    [["the restarted actor answering (model loaded)", num(rec.get("actor_back_s"), ".1f")],
                     ["the gateway placing work on it", num(rec.get("placed_again_s"), ".1f")],
                     ["the first request it serves", num(rec.get("serving_again_s"), ".1f")]]) + "\n")


def kv_decode_body(r: Result) -> str:
    w = r.data.get("workload") if isinstance(r.data.get("workload"), dict) else {}
    rows = [[code(x.get("mode")), text(x.get("context")), ms(x.get("per_token_ms")), times(x.get("vs_kv")),
             num(x.get("bytes_per_token_layer"), ",.0f", " B"), num(x.get("cache_mb_read_per_token"), ",.1f", " MB"),
             num(x.get("rebuild_gmac_per_token"), ",.1f")]
            for x in r.data.get("rows") or [] if isinstance(x, dict)]
    return (f"{code(w.get('preset'))}, L = {text(w.get('loops'))}, one stream, greedy.\n\n"
            + table(["mode", "context", "per token", "× kv", "bytes / token / layer", "cache read / token",
                     "K/V rebuild GMAC / token"], rows or [[DASH] * 7]) + "\n")


def kv_quality_body(r: Result) -> str:
    rows = [[text(x.get("loops")), code(x.get("mode")), num(x.get("bytes_per_token_layer"), ",.1f"),
             num(x.get("ppl"), ".4f"), num(x.get("kl"), ".2e"), share(x.get("top1")), share(x.get("top5"))]
            for x in r.data.get("rows") or [] if isinstance(x, dict)]
    ratio = r.data.get("kl_ratio_delta_over_h_int8")
    extra = "" if not isinstance(ratio, dict) else "KL of h-int8 over delta-int8's: " + ", ".join(
        f"L = {L}: {times(1 / v if isnum(v) and v else None, 0)}" for L, v in ratio.items()) + ".\n"
    return table(["L", "mode", "bytes / token / layer", "PPL", "KL(kv ‖ mode)", "top-1 vs kv", "top-5 vs kv"],
                 rows or [[DASH] * 7]) + "\n\n" + extra


def quant_decode_body(r: Result) -> str:
    d = r.data
    rows = []
    for fmt, xs in (d.get("decode") or {}).items():
        for x in xs if isinstance(xs, list) else []:
            rows.append([code(fmt), text(x.get("loops")), ms(x.get("ms")), ms(x.get("floor_ms")),
                         ms(x.get("hbm_floor_ms")), times(x.get("vs_floor"))])
    slope = d.get("slope_ms_per_iteration") if isinstance(d.get("slope_ms_per_iteration"), dict) else {}
    g = d.get("goal") if isinstance(d.get("goal"), dict) else {}
    return (table(["weights", "L", "per token", "floor", "HBM floor", "× floor"], rows or [[DASH] * 6])
            + "\n\nms per extra iteration: " + ", ".join(f"{code(k)} {ms(v)}" for k, v in slope.items())
            + f"; one iteration of the bf16 block from HBM: {ms(d.get('bf16_hbm_floor_ms_per_iteration'))}. "
            + f"INT4 at L = 8 over bf16: {times(g.get('int4_over_bf16_at_8'))}"
            + "".join(f"; `{k}` {times(v.get('int4_over_bf16_at_8'))}" for k, v in (d.get("goals") or {}).items()
                      if isinstance(v, dict) and k != "int4")
            + ". The goals: at most 0.5× bf16 at L = 8, and a slope below the bf16 HBM floor's per iteration.\n"
            + quant_batched(d)
            + ("\n![ms/token vs L per weight format](quant-decode-vs-L.png)\n\n`python -m bench.plot_quant_decode "
               "[RESULT]` draws `docs/quant-decode-vs-L.png` from a quant_decode result, by default "
               f"`quant-decode-cuda.json` (commit {code(r.commit)}).\n" if QUANT_PLOT.exists() else ""))


def quant_batched(d: dict) -> str:
    """The batched step per weight format (quant_decode --batch), where the run has it."""
    rows = [[code(fmt), text(x.get("streams")), text(x.get("loops")), ms(x.get("ms_per_step")),
             count(x.get("tokens_per_s")), times(x.get("over_bf16")) if "over_bf16" in x else DASH]
            for fmt, xs in (d.get("batched") or {}).items() if isinstance(xs, list) for x in xs]
    if not rows:
        return ""
    return ("\nThe batched step (the worker's Batcher on its captured stages, B streams):\n\n"
            + table(["weights", "streams", "L", "per step", "tokens/s", "over bf16"], rows) + "\n")


def quant_error_body(r: Result) -> str:
    loops = r.data.get("loops") or []
    errs = r.data.get("relative_error") if isinstance(r.data.get("relative_error"), dict) else {}
    show = [i for i, L in enumerate(loops) if L in (1, 2, 4, 8, 16)]
    rows = [[text(name)] + [num(v[i], ".3f") if i < len(v) else DASH for i in show] for name, v in errs.items()]
    return (f"Relative error of the residual after L iterations, ‖h_L(quantized) − h_L(float)‖ / ‖h_L(float)‖, "
            f"model {text(r.data.get('model'))}, weights {text(r.data.get('weights'))}.\n\n"
            + table(["rounding"] + [f"L = {loops[i]}" for i in show], rows or [[DASH]]) + "\n\n"
            + "![error against L](quant-error-vs-L.png)\n")


def quant_quality_body(r: Result) -> str:
    res = r.data.get("results") if isinstance(r.data.get("results"), dict) else {}
    depths = sorted({L for v in res.values() if isinstance(v, dict) for L in (v.get("bpb") or {})}, key=int)
    rows = [[code(name)] + [f"{num(get(v, 'bpb', L), '.4f')} ({num(get(v, 'bpb_vs_fp32_pct', L), '+.1f', ' %')})"
                            for L in depths]
            + [share(get(v, "greedy", "token_agreement"))] for name, v in res.items() if isinstance(v, dict)]
    return ("Held-out bits per byte (change against fp32) and greedy tokens equal to fp32's.\n\n"
            + table(["weights"] + [f"L = {L}" for L in depths] + ["greedy tokens equal"], rows or [[DASH]]) + "\n")


def early_exit_body(r: Result) -> str:
    w = r.data.get("workload") if isinstance(r.data.get("workload"), dict) else {}
    rows = []
    for x in r.data.get("rows") or []:
        rule = x.get("rule")
        crit = rule.get("criterion") if rule else None
        # a gate rule exits once the cumulative exit probability reaches its threshold
        name = ("full depth" if not rule else
                f"argmax, patience {rule.get('patience', rule.get('threshold'))}" if crit == "argmax" else
                f"gate ≥ {rule.get('threshold')}" if crit == "gate" else f"{crit} < {rule.get('threshold')}")
        rows.append([text(name), text(rule.get("cache") if rule else None), num(x.get("iterations_per_token"), ".2f"),
                     f"{num(x.get('tok_s_b1'), ',.1f')} ({times(x.get('speedup_b1', 1.0))})",
                     f"{num(x.get('tok_s_batched'), ',.1f')} ({times(x.get('speedup_batched', 1.0))})",
                     f"{num(x.get('tok_s_batched_decode'), ',.1f')} ({times(x.get('speedup_batched_decode'))})"
                     if "tok_s_batched_decode" in x else DASH,
                     num(x.get("agreement"), ".3f"), num(x.get("bpb"), ".4f"), num(x.get("bpb_delta_pct"), "+.2f", " %")])
    return (f"Model {text(w.get('model'))}, full depth L = {text(w.get('loops') or get(r.data, 'rows', 0, 'loops'))}; "
            "tokens/s at batch 1 and batched against full depth in the same run (batched: the whole "
            "`generate_batch`, prefill included, and its decode alone, from its first batched step); greedy "
            "agreement with full depth; held-out bits per byte under teacher forcing with the rule active.\n\n"
            + table(["rule", "cache", "iterations / token", "tok/s batch 1", "tok/s batched", "tok/s batched, decode",
                     "greedy agreement", "bpb", "bpb vs full depth"], rows or [[DASH] * 9]) + "\n")


def _span_rows(us: dict) -> list[list[str]]:
    """The graphs' rows, the solo spans (one per length) in one where there are several: the
    shortest, the longest and the GPU time each further iteration adds."""
    spans = sorted((int(k.rsplit(" ", 1)[1]), v) for k, v in us.items()
                   if k.startswith("solo span ") and k.rsplit(" ", 1)[1].isdigit() and isinstance(v, (int, float)))
    (a, ta), (b, tb) = (spans[0], spans[-1]) if len(spans) > 1 else ((None, None), (None, None))
    rows = []
    for k, v in us.items():
        if a is None or not k.startswith("solo span "):
            rows.append([text(k), num(v, ".1f")])
        elif not rows or not rows[-1][0].startswith("solo span "):
            rows.append([f"solo span {a} … {b}", f"{ta:.1f} … {tb:.1f} (+{(tb - ta) / (b - a):.1f} an iteration)"])
    return rows


def profile_exit_body(r: Result) -> str:
    w = r.data.get("workload") if isinstance(r.data.get("workload"), dict) else {}
    g = r.data.get("generate") if isinstance(r.data.get("generate"), dict) else {}
    us = r.data.get("graphs_us") if isinstance(r.data.get("graphs_us"), dict) else {}
    rule = w.get("rule") if isinstance(w.get("rule"), dict) else {}
    steps = g.get("solo_steps") if isinstance(g.get("solo_steps"), dict) else {}
    return (f"Model {text(w.get('model'))}, L = {text(w.get('loops'))}, rule {text(rule.get('criterion'))} < "
            f"{text(rule.get('threshold'))}, one stream, {text(w.get('tokens'))} greedy tokens: "
            f"{num(g.get('full_tok_s'), ',.0f')} tok/s at full depth, {num(g.get('exit_tok_s'), ',.0f')} tok/s with "
            f"the rule ({times(g.get('speedup'))}) at {num(g.get('iterations_per_token'), '.2f')} iterations per "
            "token.\n\n"
            + table(["graph", "GPU µs per replay"], _span_rows(us) or [[DASH] * 2])
            + "\n\n`batch` graphs are the 2-row batch bucket's stages (the batched exit step), `solo` the one-row "
              "exit step's (span n: a whole token's step of n iterations, each with its check, then the coda, the "
              "greedy token and the copy fill; iteration: one iteration and its check, for a token that goes on "
              "past its span; end: the coda and the greedy token after one that did)."
            + (f" Of {text(steps.get('steps'))} one-row exit steps, {text(steps.get('went_on'))} went on past "
               "their span." if steps else "")
            + (f" {text(steps.get('ahead'))} were launched before the step before them had ended (the stream's "
               f"steps run back to back on the device), {text(steps.get('relaunched'))} of them again because "
               "that step went on." if "ahead" in steps else "") + "\n")


SECTIONS_SHOWN = 12  # the timed calls of a profile-exit-batch run the doc lists (the JSON has every one)


def profile_exit_batch_body(r: Result) -> str:
    w = r.data.get("workload") if isinstance(r.data.get("workload"), dict) else {}
    run = r.data.get("run") if isinstance(r.data.get("run"), dict) else {}
    med = r.data.get("steady_launch_median") if isinstance(r.data.get("steady_launch_median"), dict) else {}
    prof = r.data.get("profiled") if isinstance(r.data.get("profiled"), dict) else {}
    full = r.data.get("full_depth") if isinstance(r.data.get("full_depth"), dict) else {}
    fprof = full.get("profiled") if isinstance(full.get("profiled"), dict) else {}
    rule = w.get("rule") if isinstance(w.get("rule"), dict) else {}

    def share(p):
        b, wall = p.get("gpu_busy_ms"), p.get("wall_ms")
        return f"{b / wall:.0%}" if isinstance(b, (int, float)) and isinstance(wall, (int, float)) and wall else DASH
    rows = [[f"{text(rule.get('criterion'))} < {text(rule.get('threshold'))}", num(run.get("tok_s"), ",.0f"),
             num(run.get("decode_tok_s"), ",.0f"), num(run.get("iterations_per_token"), ".2f"),
             ms(prof.get("wall_ms")), ms(prof.get("gpu_busy_ms")), share(prof)],
            ["full depth", num(full.get("tok_s"), ",.0f"), num(full.get("decode_tok_s"), ",.0f"), text(w.get("loops")),
             ms(fprof.get("wall_ms")), ms(fprof.get("gpu_busy_ms")), share(fprof)]]
    body = (f"Model {text(w.get('model'))}, L = {text(w.get('loops'))}, {text(w.get('streams'))} streams, "
            f"{text(w.get('tokens'))} tokens each, prompts of {text(w.get('prompt_tokens'))} tokens.\n\n"
            + table(["run", "tok/s", "tok/s, decode", "iterations / token", "profiled: wall", "GPU busy",
                     "GPU busy share"], rows)
            + f"\n\nThe rule's {text(run.get('launches'))} interleaved launches, median of the {text(w.get('streams'))}-row "
            f"ones: {text(med.get('passes'))} passes, {text(med.get('ended'))} tokens ended, "
            f"{num(med.get('host_us'), '.0f')} µs of host time inside `Runner.interleave`, "
            f"{num(med.get('wait_us'), '.0f')} µs waiting for its ends.\n")
    sections = r.data.get("sections") if isinstance(r.data.get("sections"), dict) else {}
    ex, fd = (sections.get(k) if isinstance(sections.get(k), dict) else {} for k in ("exit", "full_depth"))
    if ex or fd:
        calls_e, calls_f = ex.get("calls") or {}, fd.get("calls") or {}

        def per(calls, k):
            c = calls.get(k) if isinstance(calls.get(k), dict) else {}
            n, t = c.get("calls"), c.get("ms")
            return (f"{t:.1f} ms, {n} calls ({t * 1e3 / n:.0f} µs each)" if isinstance(t, (int, float)) and n
                    else DASH)
        names = sorted(set(calls_e) | set(calls_f), key=lambda k: -max(get(calls_e, k, "ms") or 0,
                                                                       get(calls_f, k, "ms") or 0))[:SECTIONS_SHOWN]
        body += (f"\nThe host's {SECTIONS_SHOWN} costliest calls in one run of each (each call timed by a "
                 "wrapper; a call's time "
                 f"includes the calls it makes; runs of {ms(ex.get('wall_ms'))} and {ms(fd.get('wall_ms'))} so timed):\n\n"
                 + table(["call", "rule", "full depth"], [[code(k), per(calls_e, k), per(calls_f, k)] for k in names])
                 + "\n")
    return body


def decode_plot(results: list[Result]) -> str:
    """The plot of ms/token vs L, where docs/ has it (bench/plot_decode.py draws it)."""
    if not PLOT.exists():
        return ""
    src = next((r for r in results if r.name == "decode-cuda.json"), None)
    return ("\n![ms/token vs L](decode-vs-L.png)\n\n`python -m bench.plot_decode [RESULT]` draws "
            "`docs/decode-vs-L.png` from a decode result, by default `decode-cuda.json` "
            f"(commit {code(src.commit if src else None)}).\n")


def profile_body(r: Result) -> str:
    d = r.data
    tl = d.get("replay_timeline") if isinstance(d.get("replay_timeline"), dict) else {}
    summary = table(["L", "context", "floor", "replayed step (graph)", "replayed step (timeline)", "kernels a step",
                     "gap between steps", "kernels' sum, run op by op"],
                    [[text(d.get("loops")), text(d.get("context")), ms(d.get("floor_ms")), ms(d.get("graph_ms")),
                      num(tl.get("step_us"), ".1f", " µs"), text(tl.get("kernels_per_step")),
                      num(tl.get("gap_between_steps_us"), ".1f", " µs"), ms(d.get("kernel_sum_ms"))]])
    cp = tl.get("critical_path_us") if isinstance(tl.get("critical_path_us"), dict) else {}
    crit = table(["kernel", "adds to the step (all its launches)"],
                 [[code(k), num(v, ".1f", " µs")] for k, v in cp.items()] or [[DASH, DASH]])
    pl = get(tl, "per_layer", "adds_us")
    pl = pl if isinstance(pl, dict) else {}
    layer = table(["offset from the attention split", "kernel", "adds per layer"],
                  [[k.split(" ", 1)[0].replace("-", "−"), code(k.split(" ", 1)[-1]), num(v, ".1f", " µs")]
                   for k, v in pl.items()] or [[DASH, DASH, DASH]])
    wall = get(d, "generate", "wall_by_tokens")
    wall_t = table(["generate, max tokens", "wall"],
                   [[text(w.get("tokens")), ms(w.get("ms"), 2)] for w in wall if isinstance(w, dict)]
                   if isinstance(wall, list) and wall else [[DASH, DASH]])
    return (f"{summary}\n\nWhat each kernel adds to the replayed step's end (its end minus the latest end "
            f"before it; with PDL a kernel starts before the one ahead of it ends), summed per kernel:\n\n{crit}\n\n"
            f"The same per layer, averaged over the step's {text(get(tl, 'per_layer', 'layers'))} layers "
            f"(offset −1 is the q|k|v projection before the attention):\n\n{layer}\n\n"
            f"Fresh generate at the same L and context, by max_tokens:\n\n{wall_t}\n")


def gemv_body(r: Result) -> str:
    rows = [row for row in r.data.get("rows") or [] if isinstance(row, dict)]
    return table(["projection", "N × K", "fused", "MB", "floor", "torch (cuBLAS)", "GEMV", "GEMV + fusion",
                  "GEMV + fusion + PDL"],
                 [[code(row.get("name")), f"{text(row.get('N'))} × {text(row.get('K'))}", text(row.get("fusion")),
                   num(row.get("weight_MB"), ".1f"), us(row.get("floor_ms")), us(row.get("torch_linear_ms")),
                   us(row.get("gemv_ms")), us(row.get("gemv_fused_ms")), us(row.get("gemv_fused_pdl_ms"))]
                  for row in rows] or [[DASH] * 9]) + "\n"


def batch_extra(r: Result) -> list[str]:
    d = r.data
    return [f"Model: {text(d.get('model'))}; L = {text(d.get('loops'))}, {text(d.get('context'))} tokens of "
            f"context, {text(d.get('steps'))} steps, {text(d.get('lanes'))} lanes, batch buckets "
            f"{text(d.get('batch_buckets'))} (captured in {num(d.get('graph_capture_s'), '.1f', ' s')})"]


def batch_body(r: Result) -> str:
    d = r.data
    alone = d.get("alone_ms_per_token")
    alone_rate = 1e3 / alone if isnum(alone) and alone else None
    inv = "invariant_alone_ms_per_token" in d
    rows = [["one stream alone (pipelined batch-1 decode)", ms(alone), count(alone_rate), "1.00×", DASH, DASH, DASH,
             *([ms(d.get("invariant_alone_ms_per_token")), pct(100 * d["invariant_alone_cost"])
                if isnum(d.get("invariant_alone_cost")) else DASH, DASH] if inv else [])]]
    for row in d.get("rows") or []:
        if not isinstance(row, dict):
            continue
        gr, ea, iv = row.get("graphs") or {}, row.get("eager") or {}, row.get("invariant") or {}
        cost = row.get("invariant_cost")
        rows.append([text(row.get("streams")), ms(gr.get("ms_per_step")), count(gr.get("tokens_per_s")),
                     times(row.get("speedup_vs_alone")), text(gr.get("streams_equal_alone")),
                     ms(ea.get("ms_per_step"), 2), count(ea.get("tokens_per_s")),
                     *([ms(iv.get("ms_per_step")), pct(100 * cost) if isnum(cost) else DASH,
                        text(iv.get("streams_equal_alone"))] if inv else [])])
    return table(["streams", "ms per step", "tokens/s", "× one stream alone", "streams with the alone tokens",
                  "eager: ms per step", "eager: tokens/s",
                  *(["batch-invariant: ms per step", "its cost", "batch-invariant: streams with the alone tokens"]
                    if inv else [])], rows) + "\n"


def batch_fused_body(r: Result) -> str:
    return batch_fused_table(r.data) or table(["streams"], [[DASH]]) + "\n"


def batch_fused_table(d: dict) -> str:
    """The --fused-rows variant beside the graphs, and the --mixed-depths runs of both."""
    rows = [row for row in d.get("rows") or [] if isinstance(row, dict) and isinstance(row.get("fused"), dict)]
    if not rows:
        return ""
    base, fused = text(d.get("fused_rows")), text(d.get("variant_fused_rows"))
    body = []
    for row in rows:
        mx = row.get("mixed") or {}
        g, f = mx.get("graphs") or {}, mx.get("fused") or {}
        body.append([text(row.get("streams")), ms(row["graphs"].get("ms_per_step")),
                     ms(row["fused"].get("ms_per_step")), times(row.get("fused_speedup")),
                     text(row["fused"].get("streams_equal_alone")), ms(g.get("ms_per_step")), times(g.get("vs_plain")),
                     ms(f.get("ms_per_step")), times(f.get("vs_plain"))])
    depths = next((r["mixed"]["depths"] for r in rows if isinstance(r.get("mixed"), dict)), None)
    note = (f"\n\nMixed depths: stream i at depth ({text(sorted(set(depths)))})[i mod {len(set(depths))}]; "
            "\"× plain\" is the depth-weighted tokens/s (tokens × depth / L) over the plain batch's tokens/s, "
            "same projections.\n" if depths else "")
    return table(["streams", f"fused_rows = {base}: ms per step", f"fused_rows = {fused}: ms per step", "speedup",
                  "fused: streams with the alone tokens", "mixed depths: ms per step", "× plain",
                  "mixed, fused: ms per step", "× plain"], body) + (note or "\n")


def by_depth(counts) -> str:
    """{depth: tokens} as "L = 4: 640, L = 8: 640, ..."."""
    if not isinstance(counts, dict) or not counts:
        return DASH
    return ", ".join(f"L = {k}: {count(v)}" for k, v in sorted(counts.items(), key=lambda kv: int(kv[0])))


def batch_interleave_body(r: Result) -> str:
    """The sustained mixed-depth run, interleaved against whole-token steps, beside the plain step."""
    rows = []
    for row in r.data.get("rows") or []:
        mx = (row.get("mixed") or {}).get("graphs") if isinstance(row, dict) else None
        if not isinstance(mx, dict):
            continue
        inter, whole = mx.get("sustained_interleaved") or {}, mx.get("sustained_whole_token") or {}
        rows.append([text(row.get("streams")), count(get(row, "graphs", "tokens_per_s")),
                     times(mx.get("vs_plain")), count(whole.get("depth_weighted_tokens_per_s")),
                     times(whole.get("vs_plain")), count(inter.get("depth_weighted_tokens_per_s")),
                     times(inter.get("vs_plain")),
                     times(inter["depth_weighted_tokens_per_s"] / whole["depth_weighted_tokens_per_s"])
                     if isnum(inter.get("depth_weighted_tokens_per_s")) and isnum(
                         whole.get("depth_weighted_tokens_per_s")) else DASH,
                     by_depth(inter.get("tokens_by_depth")), by_depth(whole.get("tokens_by_depth"))])
    depths = next((row["mixed"]["depths"] for row in r.data.get("rows") or []
                   if isinstance(row, dict) and isinstance(row.get("mixed"), dict)), None)
    note = (f"\n\nStream i at depth ({text(sorted(set(depths)))})[i mod {len(set(depths))}], plain at "
            f"L = {text(r.data.get('loops'))}. \"× plain\": depth-weighted tokens/s (tokens × depth / L) over the "
            "plain step's tokens/s. The sustained runs decode every stream until the first has "
            f"{text(r.data.get('sustained'))} tokens; tokens by depth are the streams' totals.\n" if depths else "\n")
    return table(["streams", "plain: tokens/s", "whole-token steps, burst: × plain",
                  "sustained, whole-token: depth-weighted tok/s", "× plain",
                  "sustained, interleaved: depth-weighted tok/s", "× plain", "interleaved over whole-token",
                  "interleaved: tokens by depth", "whole-token: tokens by depth"], rows or [[DASH] * 10]) + note


def prefill_extra(r: Result) -> list[str]:
    d = r.data
    return [f"Model: {text(d.get('model'))}; L = {text(d.get('loops'))}; captured prefill graphs: "
            f"{yesno(d.get('engine_prefill_graphs'))}"]


def prefill_body(r: Result) -> str:
    rows = []
    for row in r.data.get("prefill") or []:
        if not isinstance(row, dict):
            continue
        e, t = row.get("engine") or {}, row.get("eager_torch") or {}
        rows.append([text(row.get("tokens")), ms(e.get("ms"), 2), num(e.get("TFLOPs"), ".0f"),
                     num(e.get("of_matmul_rate"), ".0f", " %", 100), ms(t.get("ms"), 2), num(t.get("TFLOPs"), ".0f"),
                     times(row.get("speedup_vs_eager"), 1), yesno(row.get("same_argmax"))])
    return table(["tokens", "TinyLoop Serve", "TFLOP/s", "of the matmul rate", "eager torch", "eager TFLOP/s",
                  "× eager", "same argmax"], rows or [[DASH] * 8]) + "\n"


def warmstart_extra(r: Result) -> list[str]:
    d = r.data
    return [f"Model: {model_name(d.get('model'))}, {text(d.get('dtype'))}, backend {text(d.get('backend'))}"]


def warmstart_body(r: Result) -> str:
    d = r.data
    rows = [[text(row.get("prefix")), text(row.get("decode")), f"{text(row.get('L_mid'))} → {text(row.get('L_new'))}",
             ms(row.get("fresh_ms"), 2), ms(row.get("build_ms"), 2), ms(row.get("resume_ms"), 2),
             pct(row.get("resume_vs_fresh_pct")), num(row.get("handle_mb"), ",.1f", " MiB"),
             yesno(row.get("greedy_parity"))]
            for row in d.get("rows") or [] if isinstance(row, dict)]
    t = table(["prefix", "decode", "L_mid → L_new", "fresh generate", "build resume handle", "resume generate",
               "resume vs fresh", "handle", "same tokens"], rows or [[DASH] * 9])
    ref = d.get("reference") if isinstance(d.get("reference"), dict) else {}
    return (f"{t}\n\nThe reference runtime's figure (not measured here): resume vs fresh "
            f"{pct(ref.get('resume_vs_fresh_pct'))}, "
            f"build {ms(ref.get('build_ms'), 1)} ({text(ref.get('source'))}).\n")


def speculative_extra(r: Result) -> list[str]:
    d = r.data
    inv = (f"; batch-invariant kernels {yesno(d.get('batch_invariant'))}, device rounds {yesno(d.get('device_rounds'))}"
           if "batch_invariant" in d else "")
    return [f"Model: {model_name(d.get('model'))}, {text(d.get('dtype'))}, backend {text(d.get('backend'))}{inv}; "
            f"{text(d.get('prompts'))} prompts, {text(d.get('max_tokens'))} tokens each, median of "
            f"{text(d.get('repeat'))}"]


def speculative_body(r: Result) -> str:
    temps = r.data.get("temperatures")
    if not isinstance(temps, dict) or not temps:
        return speculative_table(r.data)
    out = []
    for t in sorted(temps, key=lambda k: float(k) if k.replace(".", "", 1).isdigit() else 0.0):
        label = "Greedy" if t in ("0", "0.0") else f"Sampled at temperature {t} (top-k 50, seeded)"
        out.append(f"{label}:\n\n{speculative_table(temps[t])}")
    return "\n".join(out)


def speculative_table(d: dict) -> str:
    rows = []
    for key, label in (("baseline", "plain generate"), ("baseline_after", "plain generate, again after")):
        b = d.get(key) if isinstance(d.get(key), dict) else {}
        rows.append([label, DASH, text(b.get("verify_loops")), DASH, DASH, count(b.get("tokens_per_s")),
                     "1.00×" if key == "baseline" and b else DASH, DASH, DASH, DASH, DASH])
    for x in d.get("results") or []:
        if isinstance(x, dict):
            rows.append([text(x.get("mode")), text(x.get("draft_loops")), text(x.get("verify_loops")),
                         text(x.get("k_branches")), text(x.get("draft_ahead")), count(x.get("tokens_per_s")),
                         times(x.get("speedup_vs_generate")), num(x.get("accepted_per_verify"), ".2f"),
                         num(x.get("acceptance_rate"), ".2f"), yesno(x.get("greedy_parity")),
                         text(x.get("diverged_at"))])
    return table(["mode", "draft L", "verify L", "branches K", "draft ahead", "tokens/s", "vs plain generate",
                  "accepted / verify", "acceptance", "greedy parity", "diverged at token"], rows) + "\n"


def gemv_invariant_body(r: Result) -> str:
    by: dict = {}
    for x in r.data.get("rows") or []:
        if isinstance(x, dict):
            by.setdefault(x.get("name"), {})[x.get("M")] = x
    top = max((M for m in by.values() for M in m if isinstance(M, int)), default=64)  # the run's most rows
    Ms = tuple(dict.fromkeys((1, 8, top)))
    rows = [[text(name), *(us(get(m, M, "invariant_ms")) for M in Ms), text(get(m, 8, "rows_per_program")),
             us(get(m, 8, "today_ms")), us(get(m, top, "torch_linear_ms")),
             yesno(all(x.get("rows_bitwise") and all(v.get("rows_bitwise") for v in (x.get("variants") or {}).values())
                       for x in m.values()))]
            for name, m in by.items()]
    out = table(["projection", *(f"batch-invariant, M = {M}" for M in Ms), "its rows a program, M = 8",
                 "today's path, M = 8", f"cuBLAS, M = {top}", "every invariant row = its M = 1 call"],
                rows or [[DASH] * (len(Ms) + 5)]) + "\n"
    labels = list(dict.fromkeys(lbl for m in by.values() for x in m.values() for lbl in (x.get("variants") or {})))
    if labels:
        vrows = [[text(name), text(M), us(x.get("invariant_ms")),
                  *(us(get(x, "variants", lbl, "ms")) for lbl in labels)]
                 for name, m in by.items() for M, x in sorted(m.items()) if M in (1, 8)]
        out += ("\nThe invariant call at other rows per program (`rows=R`), on the plain call's tile that loops over "
                "K (`loop BNxBK`: the weights read again for each row) and on other one-chunk tiles (`one-chunk BN`: "
                "BLOCK_N = BN, the weights held in registers for every row); at M = 1 what that tile costs "
                "the invariant batch-1 step:\n\n" + table(["projection", "M", "default", *labels], vrows) + "\n")
    if GEMV_INV_PLOT.exists():
        out += ("\n![µs a call vs rows M per projection](gemv-invariant-vs-M.png)\n\n`python -m "
                f"bench.plot_gemv_invariant bench/results/{r.path.name}` draws `docs/gemv-invariant-vs-M.png` from "
                f"this result (commit {code(r.commit)}).\n")
    return out


def profile_speculative_body(r: Result) -> str:
    d = r.data
    parts = d.get("parts") if isinstance(d.get("parts"), dict) else {}
    rows = [[k.replace("_ms", "").replace("_", " "), ms(v)] for k, v in parts.items()]
    runs = d.get("runs") if isinstance(d.get("runs"), dict) else {}
    gen = [[name, ms(get(x, "wall_ms"), 2), ms(get(x, "gpu_busy_ms_profiled"), 2), text(get(x, "tokens")),
            text(get(x, "verify_steps"))] for name, x in runs.items()]
    kernels = d.get("kernels") if isinstance(d.get("kernels"), dict) else {}
    names = {"verify": "the verify", "decode_at_verify_loops": "one plain step at verify L",
             "round": "a greedy device round", "round_sampled": "a sampled device round"}
    krows = []
    for key, ks in kernels.items():
        ks = [k for k in ks if isinstance(k, dict)] if isinstance(ks, list) else []
        top = sorted(ks, key=lambda k: -(k.get("us_per_call") or 0))[:4]
        krows.append([names.get(key, key), num(sum(k.get("per_call") or 0 for k in ks), ".0f"),
                      num(sum(k.get("us_per_call") or 0 for k in ks), ".0f", " µs"),
                      "; ".join(f"`{str(k.get('kernel'))[:40]}` {num(k.get('per_call'), '.0f')}" for k in top)])
    ktable = ("" if not krows else
              f"\n\nKernels a call (PDL {yesno(d.get('pdl'))}: with PDL a kernel's span includes its wait on the one "
              f"before, so the sums overlap):\n\n"
              + table(["call", "launches", "kernels' spans summed", "most time (launches)"], krows))
    return (f"Draft L {text(d.get('draft_loops'))}, verify L {text(d.get('verify_loops'))}, draft ahead "
            f"{text(d.get('draft_ahead'))}; batch-invariant kernels {yesno(d.get('batch_invariant'))}, device rounds "
            f"{yesno(d.get('device_rounds'))}.\n\n"
            + table(["part (median, synchronised)", "time"], rows or [[DASH] * 2]) + ktable + "\n\nOne generate:\n\n"
            + table(["run", "wall", "GPU busy", "tokens", "rounds"], gen or [[DASH] * 5]) + "\n")


def sampling_body(r: Result) -> str:
    d = r.data
    B = text(d.get("batch"))
    runs = [("one stream, greedy", "alone_greedy", "ms_per_token"), ("one stream, sampled", "alone_sampled", "ms_per_token"),
            (f"{B} streams, greedy", "batched_greedy", "ms_per_step"),
            (f"{B} streams, one sampler", "batched_sampled", "ms_per_step"),
            (f"{B} streams, a sampler each", "batched_mixed", "ms_per_step")]
    rows = []
    fused = isinstance(d.get("fused_sampler"), dict)
    for label, key, unit in runs:
        g, e, f = get(d, "sampler_graphs", key), get(d, "sampler_eager", key), get(d, "fused_sampler", key)
        rows.append([label, ms(get(g, unit)), count(get(g, "tokens_per_s")), ms(get(e, unit)),
                     count(get(e, "tokens_per_s")), yesno(get(d, "equal", key))]
                    + ([ms(get(f, unit)), count(get(f, "tokens_per_s")), yesno(get(d, "fused_equal", key))]
                       if fused else []))
    def over_greedy(name, key, greedy):
        s, g = get(d, name, key, "tokens_per_s"), get(d, name, greedy, "tokens_per_s")
        return s / g if isnum(s) and isnum(g) and g else None
    fused_line = (f" With the fused launches: {num(over_greedy('fused_sampler', 'alone_sampled', 'alone_greedy'), '.2f', '×')}"
                  f" alone, {num(over_greedy('fused_sampler', 'batched_sampled', 'batched_greedy'), '.2f', '×')} batched, "
                  f"{num(over_greedy('fused_sampler', 'batched_mixed', 'batched_greedy'), '.2f', '×')} with a sampler "
                  "each." if fused else "")
    return (f"L = {text(d.get('loops'))}, prompts of {text(d.get('context'))} tokens, {text(d.get('tokens'))} tokens "
            f"generated; sampled: temperature 0.8, top-k 50, top-p 0.95. Sampled against greedy with the sampler "
            f"graphs: {num(d.get('sampled_vs_greedy_alone'), '.2f', '×')} alone, "
            f"{num(d.get('sampled_vs_greedy_batched'), '.2f', '×')} batched, "
            f"{num(d.get('mixed_vs_greedy_batched'), '.2f', '×')} with a sampler each.{fused_line}\n\n"
            + table(["run", "sampler graphs: ms", "tokens/s", "ops one by one: ms", "tokens/s", "same tokens"]
                    + (["fused launches: ms", "tokens/s", "same tokens as the graphs"] if fused else []), rows)
            + "\n")


PROFILE_BATCH_KERNELS = 8  # the kernels of the largest batch the doc lists (the JSON has every one)


def profile_batch_body(r: Result) -> str:
    d = r.data
    runs = [("one stream alone", d.get("alone"))] + [(f"{text(x.get('streams'))} streams", x)
                                                     for x in (d.get("rows") or []) if isinstance(x, dict)]
    rows = []
    for label, x in runs:
        x = x if isinstance(x, dict) else {}
        wall, idle = x.get("wall_ms"), x.get("gpu_idle_ms")
        rows.append([label, ms(wall), ms(x.get("gpu_busy_ms")), ms(idle),
                     share(idle / wall) if isnum(idle) and isnum(wall) and wall else DASH, count(x.get("launches_per_step"))])
    last = runs[-1][1] if isinstance(runs[-1][1], dict) else {}
    kernels = [[code(k.get("kernel", "")[:80]), num(get(k, "ms_per_step"), ".1f", scale=1e3),
                num(get(k, "launches_per_step"), ".0f")] for k in (last.get("kernels") or [])[:PROFILE_BATCH_KERNELS]]
    host = [[code(f.get("function", "")[:80]), num(get(f, "own_ms"), ".1f", scale=1e3), num(get(f, "cum_ms"), ".1f", scale=1e3)]
            for f in (last.get("host_functions") or [])[:PROFILE_BATCH_KERNELS]]
    return (f"Model {text(d.get('model'))}, L = {text(d.get('loops'))}, {text(d.get('context'))} tokens of context, "
            f"greedy; {text(d.get('steps'))} steps timed, {text(d.get('profiled'))} profiled.\n\n"
            + table(["run", "wall per step", "GPU busy", "GPU idle", "idle share", "launches"], rows)
            + f"\n\nThe kernels and copies of a step of {runs[-1][0]} (GPU µs summed over the launches; with PDL "
              "a kernel's time overlaps the one before it):\n\n"
            + table(["kernel", "µs per step", "launches"], kernels or [[DASH] * 3])
            + ("\n\nThe host functions with the most time of their own in that step (cProfile's overhead "
               "included):\n\n" + table(["function", "own µs per step", "cumulative µs"], host) if host else "")
            + "\n")


def service_extra(r: Result) -> list[str]:
    w = r.data.get("workload") if isinstance(r.data.get("workload"), dict) else {}
    model = w.get("model")
    what = (f"model {code(model)}" if isinstance(model, str) and not model.startswith("preset")
            else f"{text(model) if model else 'preset ' + code(w.get('preset'))}, random weights")
    inv = f", batch-invariant kernels {yesno(w.get('batch_invariant'))}" if w.get("batch_invariant") is not None else ""
    return [f"Workload: {what}{inv}, L = {text(w.get('loops'))}, prompt of "
            f"{text(w.get('prompt_tokens'))} tokens, {text(w.get('max_tokens'))} tokens generated, greedy: "
            f"{yesno(w.get('greedy'))}, {text(w.get('reps'))} repetitions"]


def service_body(r: Result) -> str:
    d = r.data
    ip, sv, ov = (d.get(k) if isinstance(d.get(k), dict) else {} for k in ("in_process", "service", "overhead"))
    one = table(["one stream", "first token", "per token", "tokens/s"],
                [["in-process (`Model.stream`)", ms(ip.get("ttft_ms"), 2), ms(ip.get("per_token_ms")),
                  count(ip.get("tokens_per_s"))],
                 ["through the service (gRPC, gateway, Ray worker)", ms(sv.get("ttft_ms"), 2),
                  ms(sv.get("per_token_ms")), DASH],
                 ["the service's overhead", ms(ov.get("ttft_ms"), 2), f"{ms(ov.get('per_token_ms'))} "
                  f"({times(ov.get('per_token_ratio'))})", DASH]])
    thr = sv.get("throughput") if isinstance(sv.get("throughput"), dict) else {}
    keys = sorted(thr, key=lambda k: (int(k) if str(k).isdigit() else 10**9, str(k)))
    conc = table(["concurrent streams", "tokens", "wall", "tokens/s", "median first token"],
                 [[text(get(thr, k, "streams")), count(get(thr, k, "tokens")), num(get(thr, k, "wall_s"), ".3f", " s"),
                   count(get(thr, k, "tokens_per_s")), ms(get(thr, k, "median_ttft_ms"), 1)] for k in keys]
                 or [[DASH] * 5])
    out = f"{one}\n\nThrough the service, by concurrency:\n\n{conc}\n"
    sp = d.get("speculative")
    if isinstance(sp, dict):
        rows = []
        for path in ("in_process", "service"):
            x = sp.get(path) if isinstance(sp.get(path), dict) else {}
            rows.append([path.replace("_", "-"), count(x.get("tokens_per_s")),
                         count(get(x, "generate", "tokens_per_s")), times(x.get("speedup_vs_generate")),
                         num(x.get("accepted_per_verify"), ".2f"), num(x.get("acceptance_rate"), ".2f"),
                         yesno(x.get("greedy_parity")), text(x.get("diverged_at"))])
        out += (f"\nSelf-speculative decoding on the same path in the same run: {text(sp.get('mode'))}, draft at "
                f"{text(sp.get('draft_loops'))}, verify at {text(sp.get('verify_loops'))}, draft_ahead "
                f"{text(sp.get('draft_ahead'))}, against plain greedy generate:\n\n"
                + table(["path", "tokens/s", "plain generate tokens/s", "vs plain generate", "accepted / verify",
                         "acceptance", "greedy parity", "diverged at token"], rows) + "\n")
    return out


def context_extra(r: Result) -> list[str]:
    w = r.data.get("workload") if isinstance(r.data.get("workload"), dict) else {}
    return [f"Model: {code(w.get('model'))}, L = {text(w.get('loops'))}, prompt of {text(w.get('prompt_tokens'))} "
            f"tokens, {text(w.get('max_tokens'))} tokens generated, greedy; slowest row / fastest: "
            f"{times(r.data.get('spread'))}"]


def context_body(r: Result) -> str:
    rows = [[text(x.get("max_seq_len")), ms(x.get("per_token_ms")), text(x.get("batch_streams")),
             count(x.get("batch_tokens_per_s"))] for x in r.data.get("rows") or [] if isinstance(x, dict)]
    return table(["allocated positions per lane", "one stream, per token", "batched streams",
                  "batched tokens/s"], rows or [[DASH] * 4]) + "\n"


def load_extra(r: Result) -> list[str]:
    w = r.data.get("workload") if isinstance(r.data.get("workload"), dict) else {}
    srv = r.data.get("server") if isinstance(r.data.get("server"), dict) else {}
    return [f"Workload: preset {code(w.get('preset'))}, {text(w.get('weights'))} weights, L = {text(w.get('loops'))}, "
            f"prompts of {text(w.get('prompt_tokens'))} tokens, {text(w.get('max_tokens'))} tokens each, greedy; "
            f"{text(w.get('lanes'))} lanes of {text(w.get('max_seq_len'))} positions, step_tokens "
            f"{text(w.get('step_tokens'))}, coalesce {text(w.get('coalesce_ms'))} ms",
            f"Server: {code(srv.get('command'))}; {text(srv.get('process'))}"]


def _load_row(label, x, weighted=False) -> list[str]:
    return [label, text(x.get("streams")), count(x.get("depth_weighted_tokens_per_s" if weighted else "tokens_per_s")),
            count(x.get("ceiling_tokens_per_s")), times(x.get("of_ceiling")) if isnum(x.get("of_ceiling")) else DASH,
            ms(x.get("ttft_ms_p50"), 1), ms(x.get("ttft_ms_p99"), 1), ms(x.get("tpot_ms_p50"), 2),
            ms(x.get("tpot_ms_p99"), 2), ms(get(x, "worker", "step_ms_mean"), 2), num(get(x, "worker", "batch_rows_mean"), ".1f"),
            text(x.get("errors"))]


def load_body(r: Result) -> str:
    d = r.data
    svc = d.get("service") if isinstance(d.get("service"), dict) else {}
    keys = sorted(svc, key=lambda k: int(k) if str(k).isdigit() else 10**9)
    rows = [_load_row("plain", svc[k]) for k in keys if isinstance(svc[k], dict)]
    for name, label in (("mixed", "mixed depths, a tenth speculative (depth-weighted tok/s)"),
                        ("mixed_depths_only", "the same depths, none speculative (depth-weighted tok/s)")):
        if isinstance(d.get(name), dict):
            rows.append(_load_row(label, d[name], weighted=True))
    closed = d.get("closed_loop") if isinstance(d.get("closed_loop"), dict) else {}
    for name, label in (("plain", "closed loop, plain"),
                        ("mixed", "closed loop, mixed depths, a tenth speculative (depth-weighted tok/s)")):
        if isinstance(closed.get(name), dict):
            rows.append(_load_row(label, {**closed[name], "streams": closed[name].get("users")}, weighted=True))
    out = table(["streams of", "concurrent", "tokens/s", "ceiling tokens/s", "of the ceiling", "TTFT p50", "TTFT p99",
                 "TPOT p50", "TPOT p99", "worker step (mean)", "batch rows (mean)", "errors"], rows or [[DASH] * 12])
    one, alone = svc.get("1") or {}, d.get("in_process_one_stream") or {}
    s64, s128 = svc.get("64") or {}, svc.get("128") or {}
    mixed = d.get("mixed") or {}
    ratio = get(d, "one_stream_vs_in_process", "tokens_per_s_ratio")
    # the probes' median over many one-token requests where the run has them; else the one-stream
    # run's first token (one sample per run)
    probes = d.get("ttft_probes") if isinstance(d.get("ttft_probes"), dict) else None
    alone_d = d.get("in_process_one_stream") or {}
    base = alone_d.get("scheduler_probe_ttft_ms_p50") or alone_d.get("probe_ttft_ms_p50")
    ovh = (probes["ttft_ms_p50"] - base if probes and base is not None
           else get(d, "one_stream_vs_in_process", "ttft_overhead_ms"))
    goals = [["64 streams: ≥ 60 % of the ceiling's tok/s", times(s64.get("of_ceiling")),
              met(s64.get("of_ceiling"), lambda v: v >= 0.6)],
             ["64 streams: TTFT p99 ≤ 100 ms", ms(s64.get("ttft_ms_p99"), 1), met(s64.get("ttft_ms_p99"), lambda v: v <= 100)],
             ["1 stream: ≥ 90 % of in-process tok/s", times(ratio), met(ratio, lambda v: v >= 0.9)],
             ["1 stream: TTFT overhead ≤ 2 ms" + (" (probes, p50)" if probes else ""), ms(ovh, 2),
              met(ovh, lambda v: v <= 2)],
             ["128 streams: no error", text(s128.get("errors")), met(s128.get("errors"), lambda v: v == 0)],
             ["128 streams: TPOT p99 ≤ 3× p50", times(s128.get("tpot_p99_over_p50")),
              met(s128.get("tpot_p99_over_p50"), lambda v: v <= 3)],
             ["mixed run, all streams at once: within 25 % of the plain 64 (depth-weighted)",
              times(mixed.get("vs_plain")), met(mixed.get("vs_plain"), lambda v: v >= 0.75)]]
    if closed.get("vs_plain") is not None:
        goals.append([f"mixed run, closed loop of {text(get(closed, 'mixed', 'users'))} callers: within 25 % of the "
                      "plain closed loop (depth-weighted)", times(closed.get("vs_plain")),
                      met(closed.get("vs_plain"), lambda v: v >= 0.75)])
    out += (f"\n\nIn-process, one stream alone: {count(alone.get('tokens_per_s'))} tokens/s, first token "
            f"{ms(alone.get('ttft_ms'), 2)}.\n")
    one = (r.data.get("service") or {}).get("1") or {}
    w1 = one.get("worker") or {}
    if w1.get("worker_ttft_ms_mean"):
        out += (f"\nWhere one stream's first token goes: the client sees it after "
                f"{ms(one.get('ttft_ms_p50'), 2)}, the gateway's call after {ms(w1.get('gateway_ttft_ms_mean'), 2)}, "
                f"the worker hands it over {ms(w1.get('worker_ttft_ms_mean'), 2)} after the stream reached it (means "
                f"of the gateway's and the worker's own histograms); "
                f"in-process {ms(alone.get('ttft_ms'), 2)}.\n")
    if probes:
        out += (f"\nThe time to first token of {count(probes.get('requests'))} streams, one at a time over one "
                f"client channel (`--probes`): p50 {ms(probes.get('ttft_ms_p50'), 2)}, p99 "
                f"{ms(probes.get('ttft_ms_p99'), 2)} at the client; the gateway's call "
                f"{ms(probes.get('gateway_ttft_ms_mean'), 2)}, the worker's {ms(probes.get('worker_ttft_ms_mean'), 2)} "
                f"(means); in-process p50 {ms(alone.get('probe_ttft_ms_p50'), 2)} (`Model.stream`), "
                f"{ms(alone.get('scheduler_probe_ttft_ms_p50'), 2)} through the worker's scheduler alone. The service's "
                f"overhead over the scheduler alone: {ms(ovh, 2)}.\n")
    if r.device != "cuda":  # the goals are the GPU worker's
        return out
    return out + "\nGoals:\n\n" + table(["goal", "figure", "met"], goals) + "\n"


def _gb(n):
    return None if n is None else n / 1e9


STARTUP_PARTS = ("load_s", "decode_graphs_s", "prefill_graphs_s", "verify_graphs_s", "batch_graphs_s")


def startup_section(rs: list[Result]) -> str:
    head = ("## Worker start-up (`bench/startup.py`)\n\n"
            "A worker reports healthy, and the gateway listens, once its model is loaded and every graph captured; "
            "`Model.startup` times each part and counts the graphs (which depend on the (bucket, depth) grid, and "
            "the row counts of the batched steps and multi-row prefills on the lanes) and the bytes the captures "
            "took. One file per model preset, the newest of each:\n\n")
    if not rs:
        return head + "No result file on record.\n"
    rows = []
    for r in rs:
        for run in r.data.get("runs") or []:
            if isinstance(run, dict):
                rows.append([code(r.data.get("model")), text(run.get("lanes")), text(run.get("cache_lanes")),
                             text(r.data.get("max_seq_len")), num(run.get("wall_s"), ".1f", " s")]
                            + [num(run.get(k), ".1f", " s") for k in STARTUP_PARTS]
                            + [count(run.get("graphs")), num(_gb(run.get("graph_bytes")), ".2f", " GB"),
                               num(run.get("memory_allocated_GB"), ".1f", " GB"), code(r.commit)])
    t = table(["model", "lanes", "cache lanes", "max seq len", "wall", "load", "decode graphs", "prefill graphs",
               "speculative (verify) graphs", "batched graphs", "graphs", "graph memory", "GPU memory allocated",
               "commit"],
              rows or [[DASH] * 14])
    prov = "\n\n".join(provenance(r) for r in rs)
    return head + t + "\n\n" + prov + "\n"


# -- the targets ------------------------------------------------------------------------------------


def met(value, ok) -> str:
    return DASH if not isnum(value) else ("yes" if ok(value) else "no")


def speculative_targets(sp: Result | None, batch: Result | None, svc: Result | None) -> list[list[str]]:
    """The bit-exactness and self-speculation targets: greedy parity in every row, chain at
    draft 2 / verify 8 >= 1.8x plain generate, the service's speculative speedup >= 90 % of the
    in-process one, and the batch-invariant kernels' cost at batch 1 (<= 3 %) and on the batched
    step (<= 10 %, at B = 8)."""
    name = lambda r: f"`{r.name}` ({code(r.commit)})" if r else DASH  # noqa: E731
    res = [x for x in ((sp.data.get("results") if sp else None) or []) if isinstance(x, dict)]
    parity = [x.get("greedy_parity") for x in res]
    all_parity = all(parity) if parity else None
    chain = next((x.get("speedup_vs_generate") for x in res if x.get("mode") == "chain"
                  and x.get("draft_loops") == 2 and x.get("verify_loops") == 8), None)
    ip, sv = (get(svc.data, "speculative", k, "speedup_vs_generate") if svc else None for k in ("in_process", "service"))
    share = sv / ip if isnum(sv) and isnum(ip) and ip else None
    b8 = next((x for x in ((batch.data.get("rows") if batch else None) or [])
               if isinstance(x, dict) and x.get("streams") == 8), None)
    c1 = get(batch.data, "invariant_alone_cost") if batch else None
    c8 = get(b8, "invariant_cost")
    return [
        ["greedy speculative parity with generate in every row (bf16)",
         DASH if all_parity is None else f"{sum(map(bool, parity))} of {len(parity)} rows",
         met(None if all_parity is None else float(all_parity), lambda v: v == 1.0),
         name(sp)],
        ["chain speculative, draft 2 / verify 8, ≥ 1.8× plain generate", times(chain), met(chain, lambda v: v >= 1.8),
         name(sp)],
        ["a speculative Generate through the service keeps ≥ 90 % of the in-process speedup",
         num(100 * share, ".0f", " %") if isnum(share) else DASH, met(share, lambda v: v >= 0.9), name(svc)],
        ["batch-invariant kernels at batch 1 cost ≤ 3 % (the same launches: the figure is the run's spread)",
         pct(100 * c1) if isnum(c1) else DASH,
         met(c1, lambda v: v <= 0.03), name(batch)],
        ["batch-invariant kernels on the batched step (B = 8) cost ≤ 10 %", pct(100 * c8) if isnum(c8) else DASH,
         met(c8, lambda v: v <= 0.10), name(batch)],
    ]


def targets_section(newest: dict) -> str:
    dec = newest.get(("decode", "cuda"))
    ws = newest.get(("warmstart", "cuda"))
    row8 = row_at(dec.data.get("decode"), 8) if dec else None
    src = f"`{dec.name}` ({code(dec.commit)})" if dec else DASH
    vf, ve = get(row8, "graph_vs_floor"), get(row8, "speedup_vs_eager")
    vc = get(row8, "compiled", "default", "speedup")
    gen = get(dec.data, "generate_prefix128_decode16_L8", "graphs", "ms") if dec else None
    ws_row = next((x for x in (ws.data.get("rows") or []) if isinstance(x, dict) and x.get("prefix") == 128),
                  None) if ws else None
    ref = get(ws.data, "reference", "resume_vs_fresh_pct") if ws else None
    wv = get(ws_row, "resume_vs_fresh_pct")
    rows = [
        ["batch-1 decode, L = 8, ≤ 1.5× the floor", f"{ms(get(row8, 'graph_ms'))}, {times(vf)}",
         met(vf, lambda v: v <= 1.5), src],
        ["≥ 10× eager torch, same run", times(ve, 1), met(ve, lambda v: v >= 10), src],
        ["≥ 5× torch.compile (default mode), same run", times(vc, 1), met(vc, lambda v: v >= 5), src],
        ["fresh generate, prefix 128, decode 16, L = 8, ≤ 8 ms", ms(gen, 2), met(gen, lambda v: v <= 8), src],
        [f"resume vs fresh at prefix 128 beats the reference's {pct(ref)}", pct(wv),
         met(wv if isnum(ref) else None, lambda v: v < ref), f"`{ws.name}` ({code(ws.commit)})" if ws else DASH],
        *speculative_targets(newest.get(("speculative", "cuda")), newest.get(("batch", "cuda")),
                             newest.get(("service", "gpu"))),
    ]
    return ("## Targets at a glance\n\nThe GPU fast path's targets against the newest files' figures (the "
            "sections below have the rest):\n\n"
            + table(["target", "figure", "met", "file"], rows) + "\n")


# -- the document -----------------------------------------------------------------------------------

HEAD = """\
# Performance

<!-- Generated by `python -m bench.report` from bench/results/*.json: do not edit by hand. The prose
is the template in bench/report.py; `python -m bench.report --check` (tests/test_report.py) fails
when docs/performance.md is not what the script writes. -->

Every figure below is read from a JSON file in `bench/results/`, the newest of its benchmark. Each
section names that file, the command that wrote it, its commit and its hardware; the baselines in a
section come from the same file, measured in the same run. Other runs stay in `bench/results/` and
in git history. A file's benchmark is its name's prefix before the device (`decode-cuda-….json`);
the newest is the one whose run is latest by its recorded `date`, or, for a file without one, by the
time of the newest git commit that changed it. "—" marks a figure the file does not record.

What the benchmarks measure:

- `bench/decode.py`: batch-1 decode, ms per token of the engine's captured CUDA-graph step fed its
  own greedy token (no host sync in the timed loop), at several loop depths L, against the floor
  (the bytes a token reads: each weight once per use, the shared block once per iteration, the head
  and the context's K/V, over the measured copy bandwidth) and the HBM floor (the same less the bytes
  the step keeps in L2 between iterations). Same-run baselines: `bench/baselines.py`'s
  `PlainDecoder` (plain PyTorch on the same weights, static K/V cache, SDPA) eagerly and under
  `torch.compile` in three modes, and the engine through its torch reference ops. Also a fresh
  generate.
- `bench/families.py`: the same batch-1 decode at the shapes of Ouro-1.4B, Ouro-2.6B and
  Huginn-0125 (random bf16 weights in the layouts the Hugging Face loader builds), against the floor.
- `bench/profile_decode.py`: where the decode step's time goes, from the replayed graph's kernel
  timeline; and a fresh generate by max_tokens.
- `bench/gemv.py`: each projection's GEMV alone, reading its weights from HBM, against the floor and
  cuBLAS.
- `bench/batch.py`: B streams stepped together by the worker's batcher against one stream alone.
- `bench/prefill.py`: a prompt's prefill against the bf16 matmul rate and eager torch.
- `bench/warmstart.py`: resuming from a handle built at a middle depth against a fresh generate.
- `bench/speculative.py`: self-speculative decoding (chain and tree rounds) against plain generate
  at the same L.
- `bench/service.py`: the whole path (gRPC client, gateway, Ray worker) against in-process, per
  concurrency.
- `bench/startup.py`: a worker's start-up, load and graph capture by part.
- `bench/load.py`: many concurrent streams through `tinyloop serve` against the same run's batched step
  alone, and a mixed-depth run.
- `bench/context.py`: a decode step's cost against the cache's allocated length (the step should
  follow the context it holds, not the allocation).

How to run them, from the repository root on the GPU host (offline image: `bench/gpu_env.sh` maps
the project onto the `tinyloop.*` namespace instead of installing it):

```sh
bash bench/run_h200.sh                  # every GPU test and benchmark, each step time-limited and logged -> $OUT
bash bench/run_h200.sh decode profile   # some of: tests gemv profile decode batch prefill warmstart speculative startup
source bench/gpu_env.sh && python -m bench.decode --out-dir bench/results   # one benchmark by hand
python -m bench.report                  # then docs/performance.md, from the newest results
```

`TINYLOOP_COMMIT=<commit>` stamps the results where the host's copy of `.git` may be stale. The
service benchmark needs Ray and grpcio (its recorded command is in its section). Figures of two
files compare only roughly: one GPU's step time moves between hosts, and the host-bound baselines
(eager torch, torch.compile) move more; two settings compare in a same-host interleaved A/B
(`bench/ab.py`, whose JSON stays in `bench/results/`).
"""

DECODE_INTRO = "`bench/decode.py` (sections `decode`, `generate_prefix128_decode16_L8`, `compiled`)."
KV_DECODE_INTRO = ("`bench/kv_decode.py`: per KV cache mode (docs/kv-cache.md) and context length, a prompt "
                   "prefilled then greedy tokens from the captured decode graph; the store-h modes rebuild K and V "
                   "from the stored h for every position they read.")
KV_QUALITY_INTRO = ("`bench/kv_quality.py`: held-out prompts, 16 teacher-forced decode tokens each with the cache "
                    "written and read in the mode, against `kv`.")
QUANT_DECODE_INTRO = ("`bench/quant_decode.py`: bench-285m (random weights) in bf16 and as RTN INT4 (and INT4 served "
                      "dual-bit), batch-1 decode from the captured graphs, same run; floors from each format's bytes.")
QUANT_ERROR_INTRO = ("`bench/quant_error.py`: the shared block quantized, the rest float; the error of the residual "
                     "against the float model by depth, for each rounding across iterations (docs/quantization.md).")
EARLY_EXIT_INTRO = ("`bench/early_exit.py`: per-token early exit (docs/early-exit.md) on the embedded default model, "
                    "a sweep of rules and thresholds against full depth.")
SPEC_BATCH_INTRO = ("`bench/spec_batch.py`: N greedy chain speculative streams of the embedded default model, their "
                    "rounds shared (`SpecBatch`: draft step i of every stream one decode, their verifies one "
                    "eager pass, as the worker runs them from `--speculative-share-from` streams) against "
                    "each stream's own rounds taken in turn (what the worker does for fewer streams) and "
                    "against the same streams decoding plainly in the batcher at the verify depth, same run; "
                    "tokens/s over every stream's tokens, prefills included.")


def spec_batch_body(r: Result) -> str:
    d = r.data
    head = (f"Draft L {text(d.get('draft_loops'))}, verify L {text(d.get('verify_loops'))}, draft ahead "
            f"{text(d.get('draft_ahead'))}, {text(d.get('max_tokens'))} tokens a stream, median of "
            f"{text(d.get('repeat'))}; batch-invariant kernels {yesno(d.get('batch_invariant'))}, device rounds "
            f"{yesno(d.get('device_rounds'))}.\n\n")
    rows = []
    for row in d.get("rows") or []:
        if not isinstance(row, dict):
            continue
        tps = lambda mode: (row.get(mode) or {}).get("tokens_per_s")  # noqa: E731
        rows.append([count(row.get("streams")), count(tps("in turn")), count(tps("shared")),
                     times(row.get("shared_vs_in_turn")), count(tps("plain batched")),
                     times(row.get("shared_vs_plain_batched")), yesno(row.get("same_tokens"))])
    return head + table(["streams", "rounds in turn: tokens/s", "rounds shared: tokens/s", "shared over in turn",
                         "plain batched: tokens/s", "shared over plain batched", "same tokens"], rows)


EARLY_EXIT_OURO_INTRO = ("`bench/early_exit.py --preset ouro-2.6b --criteria gate --tag ouro`: the gate rule's cost on a "
                         "random model of Ouro's shape (its width, heads and early-exit gate), against full depth in the "
                         "same run; at threshold 1.0 the gate is read at every iteration and no token leaves before the "
                         "last, so the difference is the gate path's own cost. Random weights: the quality columns mean "
                         "nothing but equality.")
PROFILE_EXIT_INTRO = ("`bench/profile_exit.py`: one stream with and without an exit rule, and the GPU time of each "
                      "captured graph an exit step replays (CUDA events around back-to-back replays).")
PROFILE_EXIT_BATCH_INTRO = ("`bench/profile_exit_batch.py`: a batch of streams with an exit rule (interleaved "
                            "launches) and the same batch at full depth (batched whole-token steps): tokens/s, and the "
                            "share of a profiled run's wall time in which the GPU ran anything.")
QUANT_QUALITY_INTRO = "`bench/quant_quality.py`: the embedded default model's held-out split, per weight format."
RECOVER_INTRO = ("`bench/recover.py`: a real local Ray cluster and gateway; one worker killed as a crash kills it "
                 "while every worker runs streams; Ray restarts it with a new epoch.")
FAMILIES_INTRO = ("`bench/families.py`: batch-1 decode of random bf16 models at the published shapes of the looped "
                  "model families, served as a worker serves them (captured decode graphs, one lane), fed their own "
                  "greedy tokens; the floor counts every weight byte a token reads (the loop block and Huginn's "
                  "adapter once per iteration) and the K/V of the context.")
PROFILE_INTRO = ("`bench/profile_decode.py`: the replayed decode step's kernels, traced one by one (CUPTI); "
                 "a kernel's cost is how far it moves the step's end.")
GEMV_INTRO = ("`bench/gemv.py`: each projection of bench-285m at batch 1, back-to-back calls in one graph, weights "
              "read from HBM.")
BATCH_INTRO = ("`bench/batch.py`: B streams on B lanes, each with its own random prompt, stepped together by the "
               "worker's `Batcher` from captured batched stages, pipelined; the figure includes the sampling and "
               "the host sync. \"Alone\" is one stream's pipelined batch-1 decode on the same model in the same run.")
BATCH_FUSED_INTRO = ("`bench/batch.py --fused-rows N --mixed-depths ...`: the batched step as above with its "
                     "projections on cuBLAS and the unfused ops (`Settings.fused_rows` at the base) against the fused "
                     "projections, same run; and a batch of mixed depths on each, its rows deepest first so that "
                     "each iteration runs the smallest captured bucket holding the rows still going.")
BATCH_INTERLEAVE_INTRO = ("`bench/batch.py --mixed-depths ... --sustained N`: streams at several depths that all "
                          "keep decoding, through the batcher's interleaved launches (`Runner.interleave`: every "
                          "row of a pass at its own iteration, so a shallow stream decodes its next token while "
                          "a deep one still iterates) and through whole-token steps (every row's step lasts the "
                          "deepest row's iterations), same run, same graphs.")
PREFILL_INTRO = ("`bench/prefill.py`: a prompt's prefill through captured stage graphs, against the eager "
                 "`PlainDecoder`.")
WARM_INTRO = ("`bench/warmstart.py`: greedy; `build_resume_handle` runs the prompt to L_mid, `resume_generate` goes on "
              "to L_new from the handle's residual; fresh generate runs at L_new from scratch.")
SPEC_INTRO = ("`bench/speculative.py`: drafts at the draft L, verified at the verify L; chain rounds draft one "
              "token at a time, tree rounds K branches a position. Plain generate runs at the verify L in the "
              "same run, before and after the speculative modes. `diverged at token`: where a prompt's tokens part "
              "from plain generate's (bf16 near ties, which the batch-invariant kernels round as plain decoding "
              "does).")
PROFILE_SPEC_INTRO = ("`bench/profile_speculative.py`: a speculative round's parts timed alone on the embedded "
                      "default model, and one greedy generate of each kind against the GPU's busy time (the gap is "
                      "the GPU waiting on the host).")
GEMV_INV_INTRO = ("`bench/gemv_invariant.py`: the projections of bench-285m (weights read from HBM) and of the "
                  "embedded default model (weights in L2) with their fused options, M rows a call: the "
                  "batch-invariant path (every row through the M = 1 kernel, a few rows a program), the default "
                  "path of the run's commit (the M = 1 kernel, the batched tl.dot kernel for more rows) and "
                  "cuBLAS, microseconds a call.")
PROFILE_BATCH_INTRO = ("`bench/profile_batch.py`: streams stepped together by the worker's Batcher on the "
                       "captured graphs, and one stream alone: the wall time of a step against the GPU's busy time "
                       "in it (the union of its kernels and copies); the rest is the device waiting on the host "
                       "or on the gaps between a graph's kernels.")
SAMPLING_INTRO = ("`bench/sampling.py`: sampled decoding against greedy on the embedded default model, one stream "
                  "alone and a batch whose streams sample together (all on one sampler, or each on its own "
                  "temperature, top-k, top-p and penalty), with the sampler replayed as one graph per row bucket "
                  "(the default) and with its ops launched one by one, same run.")
LOAD_INTRO = ("`bench/load.py`: concurrent streams, all started at once, each its own prompt, through `tinyloop serve` "
              "(gateway process, one Ray worker) from asyncio clients; the ceiling is the runner's batched step alone "
              "at the same B (sampling and host sync included), measured in the same run before the service starts. "
              "\"worker step\": the worker's own scheduler step, from its metrics. The closed loop: as many callers, "
              "each sending its next request when its last one ends, counted over a window after a warm-up (the "
              "steady load of a population of callers: a shallow request that ends early is followed by the next); "
              "its \"concurrent\" column is the callers.")
CONTEXT_INTRO = ("`bench/context.py`: the same prompt and outputs on lanes allocated for 128, 512 and 2048 "
                 "positions (`tinyloop serve`'s default); one stream alone, then every lane in one batch.")
SERVICE_INTRO = ("`bench/service.py`: the same model file and thread count in-process and behind the service, "
                 "in the same run.")


def render(results: Path = RESULTS) -> str:
    all_results = load(results)
    newest = classify(all_results)
    n = newest.get
    startups = sorted((r for (p, dev), r in newest.items() if p.startswith("startup-") and dev == "cuda"),
                      key=lambda r: r.name)
    parts = [
        HEAD,
        targets_section(newest),
        section("Batch-1 decode vs the floor", DECODE_INTRO, n(("decode", "cuda")), decode_body, decode_extra,
                decode_plot(all_results) if results.resolve() == RESULTS.resolve() else ""),
        section("The published looped models' shapes", FAMILIES_INTRO, n(("families", "cuda")), families_body,
                families_extra),
        section("Where the decode step's time goes", PROFILE_INTRO, n(("profile-decode", "cuda")), profile_body),
        section("The projections alone", GEMV_INTRO, n(("gemv", "cuda")), gemv_body),
        section("Batched decode", BATCH_INTRO, n(("batch", "cuda")), batch_body, batch_extra),
        section("Batched decode: fused projections and mixed depths", BATCH_FUSED_INTRO, n(("batch-fused", "cuda")),
                batch_fused_body, batch_extra),
        section("Interleaved decode of mixed depths", BATCH_INTERLEAVE_INTRO, n(("batch-interleave", "cuda")),
                batch_interleave_body, batch_extra),
        section("Where a batched step's time goes", PROFILE_BATCH_INTRO, n(("profile-batch", "cuda")),
                profile_batch_body),
        section("Prefill", PREFILL_INTRO, n(("prefill", "cuda")), prefill_body, prefill_extra),
        section("Warm-start resume vs fresh", WARM_INTRO, n(("warmstart", "cuda")), warmstart_body, warmstart_extra),
        section("Self-speculative decoding", SPEC_INTRO, n(("speculative", "cuda")), speculative_body,
                speculative_extra),
        section("A speculative round's parts", PROFILE_SPEC_INTRO, n(("profile-speculative", "cuda")),
                profile_speculative_body),
        section("Speculative streams' rounds shared, on the GPU", SPEC_BATCH_INTRO, n(("spec-batch", "cuda")),
                spec_batch_body),
        section("Batch-invariant projections", GEMV_INV_INTRO, n(("gemv-invariant", "cuda")), gemv_invariant_body),
        section("Sampled decoding", SAMPLING_INTRO, n(("sampling", "cuda")), sampling_body),
        section("The service on the GPU", SERVICE_INTRO, n(("service", "gpu")), service_body, service_extra),
        section("The service under load on the GPU", LOAD_INTRO, n(("load", "cuda")), load_body, load_extra),
        startup_section(startups),
        section("The service on a CPU", SERVICE_INTRO, n(("service", "cpu")), service_body, service_extra),
        section("Self-speculative decoding on a CPU", SPEC_INTRO, n(("speculative", "cpu")), speculative_body,
                speculative_extra),
        section("Speculative streams' rounds shared, on a CPU", SPEC_BATCH_INTRO, n(("spec-batch", "cpu")),
                spec_batch_body),
        section("Warm-start resume vs fresh on a CPU", WARM_INTRO, n(("warmstart", "cpu")), warmstart_body,
                warmstart_extra),
        section("The service under load on a CPU", LOAD_INTRO, n(("load", "cpu")), load_body, load_extra),
        section("KV cache modes: decode on the GPU", KV_DECODE_INTRO, n(("kv-decode", "cuda")), kv_decode_body),
        section("KV cache modes: quality on a CPU", KV_QUALITY_INTRO, n(("kv-quality", "cpu")), kv_quality_body),
        section("Quantized weights: decode on the GPU", QUANT_DECODE_INTRO, n(("quant-decode", "cuda")),
                quant_decode_body),
        section("Quantized weights: error across iterations on a CPU", QUANT_ERROR_INTRO, n(("quant-error", "cpu")),
                quant_error_body),
        section("Quantized weights: quality on a CPU", QUANT_QUALITY_INTRO, n(("quant-quality", "cpu")),
                quant_quality_body),
        section("Early exit on the GPU", EARLY_EXIT_INTRO, n(("early-exit", "cuda")), early_exit_body),
        section("Early exit on a CPU", EARLY_EXIT_INTRO, n(("early-exit", "cpu")), early_exit_body),
        section("Early exit's gate on an Ouro shape, on the GPU", EARLY_EXIT_OURO_INTRO, n(("early-exit-ouro", "cuda")),
                early_exit_body),
        section("Early exit's gate on an Ouro shape, on a CPU", EARLY_EXIT_OURO_INTRO, n(("early-exit-ouro", "cpu")),
                early_exit_body),
        section("Where an early-exit step's time goes, on the GPU", PROFILE_EXIT_INTRO, n(("profile-exit", "cuda")),
                profile_exit_body),
        section("Where a batch of early-exit streams' time goes, on the GPU", PROFILE_EXIT_BATCH_INTRO,
                n(("profile-exit-batch", "cuda")), profile_exit_batch_body),
        section("Losing a worker under load on a CPU", RECOVER_INTRO, n(("recover", "cpu")), recover_body,
                recover_extra),
        section("Decode cost against the allocated cache length on a CPU", CONTEXT_INTRO, n(("context", "cpu")),
                context_body, context_extra),
    ]
    return "\n".join(p.rstrip() + "\n" for p in parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 when the doc differs from what this would write")
    ap.add_argument("--results", type=Path, default=RESULTS, help="folder of result JSONs (default bench/results)")
    ap.add_argument("--doc", type=Path, default=DOC,
                    help="the document to write or check (default docs/performance.md)")
    args = ap.parse_args(argv)
    new = render(args.results)
    if not args.check:
        args.doc.write_text(new, encoding="utf-8")
        print(f"wrote {args.doc}")
        return 0
    old = args.doc.read_text(encoding="utf-8") if args.doc.exists() else ""
    if old == new:
        print(f"{args.doc} is current")
        return 0
    diff = list(difflib.unified_diff(old.splitlines(), new.splitlines(), str(args.doc), "bench.report",
                                     lineterm="", n=1))
    changed = sum(1 for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---")))
    print(f"{args.doc} is stale: {changed} lines differ from what `python -m bench.report` writes; run it.")
    print("\n".join(diff[:60]) + ("\n..." if len(diff) > 60 else ""))
    return 1


if __name__ == "__main__":
    sys.exit(main())
