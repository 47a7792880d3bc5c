"""The benchmarks' baseline decoder equals the engine, and the bench commands run end to end
(on a CPU here, on the tiny preset; the GPU runs the same code at full size)."""
from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest
import torch
from torch._dynamo.utils import counters

from bench import batch, decode, prefill
from bench.baselines import PlainDecoder, greedy
from tinyloop.worker import Model
from tinyloop.worker.model import checkpoint
from tinyloop.worker.model.config import PRESETS

PROMPT = [200, 1, 1, 5, 9, 31, 64, 128, 250, 11, 12]
FED = [5, 77, 140, 2, 19, 33]


def engine_logits(m: Model, loops: int) -> torch.Tensor:
    """The prompt's prefill on lane 0, then one decode step per fed token (the runner's stages)."""
    r = m.runner
    out = [r.prefill(0, PROMPT, loops).logits[0]]
    for i, t in enumerate(FED):
        out.append(r.decode([0], [t], [len(PROMPT) + i], [loops]).logits[0])
    return torch.stack(out)


def plain_logits(dec: PlainDecoder) -> torch.Tensor:
    out = [dec.prefill(torch.tensor([PROMPT]))[0]]
    for i, t in enumerate(FED):
        out.append(dec.step(torch.tensor([[t]]), torch.tensor([len(PROMPT) + i]))[0])
    return torch.stack(out)


@pytest.mark.parametrize("loops", [1, 3])
def test_plain_decoder_logits_equal_the_engine(config_path, loops):
    with Model(config_path, max_seq_len=64) as m:
        want = engine_logits(m, loops)
        got = plain_logits(PlainDecoder(m._module, 64, loops))
    assert got.shape == (len(FED) + 1, m.config.vocab_size) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_plain_decoder_reads_fused_weights(config_path):
    """On CUDA the engine fuses q|k|v and gate|up (the other weights become views into them):
    the decoder then runs the fused projections, with the same result."""
    model, _ = checkpoint.load(config_path)
    want = plain_logits(PlainDecoder(model, 64, 3))
    model.use_fast_path(None)  # fuse; None keeps the torch RMSNorm
    assert hasattr(model.loop[0].attention, "wqkv")
    torch.testing.assert_close(plain_logits(PlainDecoder(model, 64, 3)), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("loops", [1, 3])
def test_plain_greedy_equals_generate(config_path, loops):
    with Model(config_path, max_seq_len=64) as m:
        want = m.generate(PROMPT, loops=loops, max_tokens=8)[len(PROMPT):]
        dec = PlainDecoder(m._module, 64, loops)
        assert greedy(dec, PROMPT, 8, host_sync=True) == want
        assert greedy(dec, PROMPT, 8, host_sync=False) == want  # also a run over a used cache


def fake_compile(calls):
    def compile(fn, **kw):
        calls.append(kw)
        return fn
    return compile


def test_compiled_runs_the_same_step(tiny_path, monkeypatch):
    """compiled() asks for a static, whole-graph compile; the compiled step shares the cache."""
    calls = []
    monkeypatch.setattr(torch, "compile", fake_compile(calls))
    with Model(tiny_path, max_seq_len=64) as m:
        dec = PlainDecoder(m._module, 64, 2)
        want = greedy(dec, PROMPT, 6)
        c = dec.compiled("reduce-overhead")
        assert calls == [{"mode": "reduce-overhead", "fullgraph": True, "dynamic": False}]
        assert greedy(c, PROMPT, 6, host_sync=False) == want
        assert c.k is dec.k and c.k[0] is dec.k[0]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", decode.COMPILE_MODES)
def test_compiled_plain_decoder_on_cuda(tiny_path, mode):
    with Model(tiny_path, max_seq_len=64, device="cuda", dtype="float32", cuda_graphs=False) as m:
        want = m.generate(PROMPT, loops=3, max_tokens=12)[len(PROMPT):]
        dec = PlainDecoder(m._module, 64, 3)
        assert greedy(dec, PROMPT, 12) == want
        torch._dynamo.reset()
        skips = counters["inductor"]["cudagraph_skips"]
        c = dec.compiled(mode)
        for _ in range(3):  # reduce-overhead: warm-up, record, replay
            assert greedy(c, PROMPT, 12, host_sync=False) == want
        assert counters["inductor"]["cudagraph_skips"] == skips  # reduce-overhead did use graphs
        torch._dynamo.reset()


# -- the bench commands, end to end on a CPU ----------------------------------------------

def test_prefill_bench_cpu(tmp_path):
    prefill.main(["--device", "cpu", "--preset", "tiny", "--tokens", "8", "32", "--repeat", "1",
                  "--out-dir", str(tmp_path)])
    r = json.loads((tmp_path / "prefill-cpu.json").read_text())
    assert r["ceilings"]["bf16_matmul_TFLOPs"] > 0
    assert [row["tokens"] for row in r["prefill"]] == [8, 32]
    for row in r["prefill"]:
        assert row["same_argmax"]
        for name in ("engine", "eager_torch"):
            assert row[name]["ms"] > 0 and row[name]["TFLOPs"] > 0


def test_batch_bench_cpu(tmp_path):
    """Batched streams through the Batcher: on CPU each one's tokens are its stream's alone."""
    batch.main(["--device", "cpu", "--preset", "tiny", "--batch", "1", "3", "--context", "8", "--steps", "4",
                "--repeat", "1", "--out-dir", str(tmp_path)])
    r = json.loads((tmp_path / "batch-cpu.json").read_text())
    assert r["lanes"] == 3 and r["alone_ms_per_token"] > 0  # streams on lanes 0..B-1
    assert [row["streams"] for row in r["rows"]] == [1, 3]
    for row in r["rows"]:
        assert row["eager"]["streams_equal_alone"] == row["streams"] and row["eager"]["tokens_per_s"] > 0


def test_batch_bench_mixed_depths_cpu(tmp_path):
    """--mixed-depths: each batch of B > 1 streams again with stream i at depth d[i % n], written
    under --name: its step time and the depth-weighted tokens/s over the plain batch's; and the
    sustained run, interleaved and in whole-token steps."""
    batch.main(["--device", "cpu", "--preset", "tiny", "--batch", "1", "4", "--context", "8", "--steps", "3",
                "--repeat", "1", "--loops", "2", "--mixed-depths", "1", "1", "1", "4", "--name", "batch-mixed",
                "--sustained", "12", "--out-dir", str(tmp_path)])
    r = json.loads((tmp_path / "batch-mixed-cpu.json").read_text())
    one, four = r["rows"]
    assert "mixed" not in one
    mx = four["mixed"]
    assert mx["depths"] == [1, 1, 1, 4] and mx["eager"]["ms_per_step"] > 0
    weighted = 4 * (7 / 4 / 2) * 1e3 / mx["eager"]["ms_per_step"]  # 4 streams at mean depth 7/4 over --loops 2
    assert mx["eager"]["depth_weighted_tokens_per_s"] == pytest.approx(weighted)
    assert mx["eager"]["vs_plain"] == pytest.approx(
        mx["eager"]["depth_weighted_tokens_per_s"] / four["eager"]["tokens_per_s"])
    # the sustained run: every stream decodes until the first (a depth-1 one) has 12 tokens;
    # in whole-token steps every stream has as many, interleaved the depth-4 one falls behind
    # (the tiny model's launch costs about 2.4 passes: the depth-1 rows do not wait for it)
    whole, inter = mx["eager"]["sustained_whole_token"], mx["eager"]["sustained_interleaved"]
    assert whole["tokens_by_depth"] == {"1": 36, "4": 12} and whole["launches"] == 11
    assert inter["tokens_by_depth"]["1"] == 36 and inter["tokens_by_depth"]["4"] < 12
    for run in (whole, inter):
        assert run["depth_weighted_tokens_per_s"] > 0 and run["vs_plain"] > 0


def test_service_bench_cpu(tmp_path):
    """bench/service.py end to end, in a subprocess (it starts and stops its own Ray). In fp32 the
    speculative streams equal the plain greedy ones, in-process and through the service, and the
    service's usage is the in-process stream's."""
    pytest.importorskip("ray")
    out = tmp_path / "service-cpu.json"
    proc = subprocess.run([sys.executable, "-m", "bench.service", "--preset", "tiny", "--loops", "4",
                           "--prompt-tokens", "8", "--max-tokens", "12", "--reps", "1", "--concurrency", "1", "2",
                           "--out", str(out)], cwd=pathlib.Path(__file__).parents[1], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["in_process"]["tokens_per_s"] > 0 and r["service"]["per_token_ms"] > 0
    assert sorted(r["service"]["throughput"]) == ["1", "2"] and "per_token_ratio" in r["overhead"]
    s = r["speculative"]
    assert (s["mode"], s["draft_loops"], s["verify_loops"], s["draft_ahead"]) == ("chain", 2, 4, 4)
    for row in (s["in_process"], s["service"]):
        assert row["greedy_parity"] and row["diverged_at"] is None
        assert row["ttft_ms"] > 0 and row["per_token_ms"] > 0 and row["generate"]["tokens_per_s"] > 0
        assert row["speedup_vs_generate"] == pytest.approx(row["tokens_per_s"] / row["generate"]["tokens_per_s"])
        assert 0 < row["accepted_per_verify"] <= 4 and 0 < row["acceptance_rate"] <= 1
    for k in ("accepted_per_verify", "acceptance_rate"):
        assert s["service"][k] == pytest.approx(s["in_process"][k], rel=1e-6)


DECODE_ARGS = ["--device", "cpu", "--preset", "tiny", "--loops", "1", "8", "--context", "8", "--steps", "3",
               "--eager-steps", "2", "--repeat", "1"]


def run_decode(tmp_path, *extra) -> dict:
    decode.main([*DECODE_ARGS, "--out-dir", str(tmp_path), *extra])
    return json.loads((tmp_path / "decode-cpu.json").read_text())


def test_decode_bench_cpu(tmp_path, monkeypatch):
    """Every section, with torch.compile stubbed out (a real compile is the GPU run's)."""
    calls = []
    monkeypatch.setattr(torch, "compile", fake_compile(calls))
    r = run_decode(tmp_path)
    rows = {row["loops"]: row for row in r["decode"]}
    assert sorted(rows) == [1, 8]
    for row in rows.values():
        for k in ("floor_ms", "graph_ms", "eager_torch_ms", "engine_torch_ops_ms"):
            assert row[k] > 0
        assert row["speedup_vs_eager"] == pytest.approx(row["eager_torch_ms"] / row["graph_ms"])
        assert row["hbm_floor_ms"] == row["floor_ms"]  # no L2 plan off CUDA
    assert r["l2_kept"] == {"projections": [], "bytes_per_iteration": 0}
    assert [c["mode"] for c in calls] == list(decode.COMPILE_MODES)
    assert "compiled" not in rows[1]
    row = rows[8]
    assert set(row["compiled"]) == set(decode.COMPILE_MODES)
    for res in row["compiled"].values():
        assert res["ms"] > 0 and res["compile_s"] >= 0 and res["speedup"] > 0 and res["cudagraph_skips"] == 0
    assert row["speedup_vs_compiled"] == pytest.approx(row["compiled_ms"] / row["graph_ms"])
    gen = r["generate_prefix128_decode16_L8"]
    for name in ("graphs", "eager_torch", "engine_torch_ops", *(f"compiled_{m}" for m in decode.COMPILE_MODES)):
        assert gen[name]["ms"] > 0 and len(gen[name]["tokens"]) == 16
    # fp32 on a CPU: every implementation gives the engine's tokens
    runs = [v for k, v in gen.items() if isinstance(v, dict) and "tokens" in v and k != "graphs"]
    assert len(runs) == 2 + len(decode.COMPILE_MODES) and all(v["same_tokens_as_graphs"] for v in runs)
    assert r["compiled"][0]["loops"] == 8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_l2_kept_names_the_plan_of_the_engine_on_cuda():
    """bench-285m on the GPU: the projections the decode bench counts as kept in L2 are those
    the step loads evict_last, with their bytes (on the H200: q|k|v and wo, 33.6 MB)."""
    cfg = PRESETS["bench-285m"]
    with Model(decode.random_checkpoint("bench-285m", cfg), max_seq_len=256, device="cuda",
               dtype="bfloat16", cuda_graphs=False) as m:
        kept = decode.l2_kept(m)
        block, = m._module.loop
        want = sorted(n for n in block.projections() if block.eviction(n) == "evict_last")
        assert kept["projections"] == want
        assert kept["bytes_per_iteration"] == sum(block.projections()[n].nbytes for n in want)
        if torch.cuda.get_device_name(0) == "NVIDIA H200":
            assert kept == {"projections": ["wo", "wqkv"], "bytes_per_iteration": 33554432}


def test_decode_bench_records_a_failed_compile(tmp_path, monkeypatch):
    def broken(fn, **kw):
        raise RuntimeError("no compiler here")
    monkeypatch.setattr(torch, "compile", broken)
    r = run_decode(tmp_path, "--loops", "8", "--compile-modes", "reduce-overhead")
    row = r["decode"][0]
    assert row["compiled"]["reduce-overhead"]["error"] == repr(RuntimeError("no compiler here"))
    assert "speedup_vs_compiled" not in row
    assert "compiled_reduce-overhead" not in r["generate_prefix128_decode16_L8"]


def test_decode_bench_skip_compile(tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "compile", None)  # never called
    r = run_decode(tmp_path, "--skip-compile", "--loops", "2")
    assert "compiled" not in r and "compiled" not in r["decode"][0]


def test_replay_critical_path_arithmetic():
    """profile_decode's attribution of a replayed step: with overlapping (PDL) kernels each adds
    its end minus the latest end before it, the additions sum to the step, and the replays are
    told apart by their kernel count."""
    from bench.profile_decode import critical_path
    # one step: a (0-10), b starts early at 8 and ends 15, c starts at 9 and ends 14 (inside b),
    # d 15-20; four replays 30 us apart, the third one slower in b
    kernels = []
    for r in range(4):
        t, slow = 30.0 * r, 3.0 if r == 2 else 0.0
        kernels += [(t, t + 10, "a"), (t + 8, t + 15 + slow, "b"), (t + 9, t + 14, "c"), (t + 15 + slow, t + 20 + slow, "d")]
    out = critical_path(kernels[::-1], reps=4, skip=1)  # any order in
    assert out["kernels_per_step"] == 4
    assert [k["kernel"] for k in out["one_step"]] == ["a", "b", "c", "d"]
    assert out["critical_path_us"] == {"a": 10.0, "b": 5.0, "d": 5.0, "c": 0.0}  # medians of 3 replays
    assert out["step_us"] == 20.0 and out["gap_between_steps_us"] == 10.0
    assert sum(out["critical_path_us"].values()) == out["step_us"]
    with pytest.raises(ValueError, match="7 kernels over 4 replays"):
        critical_path(kernels[:7], reps=4)


def test_replay_per_layer():
    """profile_decode's per-layer figures: each layer's kernels labelled by their offset from its
    attention kernel and averaged over the layers; the last layer as long as the one before (the
    head after it is left out)."""
    from bench.profile_decode import per_layer
    layer = [("proj", 1.0), ("attn", 2.0), ("out", 3.0)]
    step = [("embed", 0.5)] + [(k, us * (n + 1)) for n in range(3) for k, us in layer] + [("head", 9.0)]
    out = per_layer([{"kernel": k, "adds_us": us} for k, us in step], "attn")
    assert out == {"layers": 3, "adds_us": {"-1 proj": 2.0, "+0 attn": 4.0, "+1 out": 6.0}}
    with pytest.raises(ValueError, match="1 launches of attn"):
        per_layer([{"kernel": "attn", "adds_us": 1.0}], "attn")


def test_ab_bench_cpu(tmp_path, monkeypatch):
    """bench/ab.py: variants interleaved round by round, a variant's Settings fields on a model
    built with them (over the environment's), variants of equal Settings on one model; the JSON
    has every round's figures and each variant's best against the first."""
    from bench import ab
    from tinyloop.worker.api import Model as ApiModel
    from tinyloop.worker.model.settings import Settings
    built = []
    monkeypatch.setattr(ab, "Model", lambda *a, settings, **kw: built.append(settings) or ApiModel(
        *a, settings=settings, **kw))
    monkeypatch.setenv("TINYLOOP_L2_STREAM", "")
    default = Settings()
    ab.main(["--device", "cpu", "--preset", "tiny", "--configs", "2x8", "1x4", "--rounds", "2", "--steps", "2",
             "--best-of", "1", "--max-seq-len", "32", "--out-dir", str(tmp_path), "--variant", "base",
             "--variant", f"rows_default:settings.fused_rows={default.fused_rows}",
             "--variant", "rows2:settings.fused_rows=2;settings.l2_keep_fraction=0.5"])
    r = json.loads((tmp_path / "decode-ab-cpu.json").read_text())
    assert r["warmup_rounds"] == 1  # the default: one round of each variant first, not recorded
    assert [(row["round"], row["variant"]) for row in r["rounds"]] == [
        (0, "base"), (0, "rows_default"), (0, "rows2"), (1, "base"), (1, "rows_default"), (1, "rows2")]
    assert r["variants"] == {"base": [], "rows_default": [f"settings.fused_rows={default.fused_rows}"],
                             "rows2": ["settings.fused_rows=2", "settings.l2_keep_fraction=0.5"]}
    # base and rows_default (the default's value) share a model; rows2 has its own, each with the
    # environment's l2_stream
    assert len(built) == 2 and built[0] == built[1].replace(fused_rows=default.fused_rows,
                                                            l2_keep_fraction=default.l2_keep_fraction)
    assert (built[1].fused_rows, built[1].l2_keep_fraction, built[1].l2_stream, built[1].cuda_graphs) == (
        2, 0.5, "", False)
    assert r["settings"]["rows2"]["fused_rows"] == 2 and r["settings"]["base"] == r["settings"]["rows_default"]
    for row in r["rounds"]:
        assert sorted(row["ms"]) == ["1x4", "2x8"] and all(v > 0 for v in row["ms"].values())
    assert r["best_ms"]["base"]["2x8"] == min(row["ms"]["2x8"] for row in r["rounds"] if row["variant"] == "base")
    assert set(r["vs_first_pct"]) == {"rows_default", "rows2"}


@pytest.mark.parametrize("spec", ["tinyloop.kernels.decode_attention.SPLIT_STAGES=1", "SPLIT_STAGES=1",
                                  "settings.fused_rows=2;tinyloop.kernels.gemv.TILES={}", "settings=1",
                                  "settings.fused_rows"])
def test_ab_bench_refuses_what_is_not_a_settings_field(spec):
    """A variant sets Settings fields alone: a module attribute (or anything but
    settings.FIELD=value) is refused with the form a variant takes."""
    from bench import ab
    form = "a variant is NAME or NAME:settings.FIELD=value[;settings.FIELD=value...]"
    with pytest.raises(ValueError, match=re.escape(form)):
        ab.parse_variant(f"b:{spec}")
    with pytest.raises(ValueError, match="no name before ':'"):
        ab.parse_variant(":settings.fused_rows=2")


@pytest.mark.parametrize("argv, match", [
    (["--variant", "a", "--variant", "a"], "distinct names"),
    (["--variant", "a"], "two or more"),
    (["--variant", "a", "--variant", "b:tinyloop.kernels.decode_attention.SPLIT_STAGES=1"],
     "is not settings.FIELD=value"),
    (["--variant", "a", "--variant", "b:settings.fused_rows=one"], "not a Python literal"),
    (["--variant", "a", "--variant", "b:settings.no_such=1"], "Settings has no field 'no_such'"),
    (["--variant", "a", "--variant", "b:settings.cuda_graphs=True"], "Settings has no field 'cuda_graphs' a variant"),
    (["--variant", "a", "--variant", "b:settings.fused_rows=99"], "fused_rows must be in"),
    (["--variant", "a", "--variant", "b:settings.fused_rows='two'"], "settings {'fused_rows': 'two'}"),
    (["--variant", "a", "--variant", "b", "--configs", "8by128"], "expected LOOPSxCONTEXT"),
    (["--variant", "a", "--variant", "b", "--configs", "8x62"], "pass --max-seq-len 64"),
    (["--variant", "a", "--variant", "b", "--warmup-rounds", "-1"], "--warmup-rounds must be >= 0"),
])
def test_ab_bench_rejects_bad_arguments(tmp_path, argv, match):
    from bench import ab
    with pytest.raises(ValueError, match=match):
        ab.main(["--device", "cpu", "--preset", "tiny", "--rounds", "1", "--steps", "2", "--best-of", "1",
                 "--max-seq-len", "64", "--out-dir", str(tmp_path), *argv])


def test_tiles_sweep_candidates_and_refusals():
    """bench/tiles.py: a projection's candidates are the kernel's configs, its default tile and
    its one-chunk tiles whose K tile fits the padded K; without a GPU, or with an unknown model,
    it refuses."""
    from bench import tiles
    from tinyloop.kernels.gemv import default_tile
    for K in (320, 704, 2048, 5632):
        c = tiles.candidates(K)
        assert default_tile(K) in c and len(c) == len(set(c)) >= 4
        assert all(bk <= max(16, 2 ** (K - 1).bit_length()) for _, bk, _, _ in c)
    assert (2, 1024, 4, 3) not in tiles.candidates(320) and (2, 1024, 4, 3) in tiles.candidates(2048)
    # one-chunk tiles: bench-285m's wo / head and w2 picks among them, none past 32 KB a matrix
    assert (4, 2048, 4, 1) in tiles.candidates(2048) and (1, 8192, 4, 1) in tiles.candidates(5632)
    assert (4, 8192, 4, 1) not in tiles.candidates(5632)
    assert all(bn * bk * 2 <= 32768 for K in (2048, 5632) for bn, bk, _, _ in tiles.candidates(K) if bk >= K)
    with pytest.raises(SystemExit):
        tiles.main(["--model", "no-such-model"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            tiles.main(["--model", "tiny"])


def test_tiles_sweep_hands_its_tiles_to_the_launches(tmp_path, tiny_path, monkeypatch):
    """bench/tiles.py tries tiles through gemv's explicit `tables` argument: `use_tiles` points
    the model's fused projections at gemv bound to the sweep's table (and autotune), with the
    model's own pdl; `Lookups` records the keys a launch asks for; the chosen tiles are written
    as a tiles file that kernels/gemv.py `load_tables` (Settings.gemv_tiles) reads back. The
    module's TILES are never touched."""
    import copy
    import importlib

    from bench import tiles
    from tinyloop.worker import Model
    from tinyloop.worker.model.settings import Settings
    gemv_mod = importlib.import_module("tinyloop.kernels.gemv")
    code_tables = copy.deepcopy(gemv_mod.TILES)
    seen = []
    real = gemv_mod.gemv
    monkeypatch.setattr(gemv_mod, "gemv", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    key = (448, 320, True, False, False, True)
    table = tiles.Lookups({key: (8, 64, 4, 1)})
    assert key in table and (1, 2) not in table and table.asked == [key, (1, 2)]
    with Model(tiny_path, max_seq_len=32, n_slots=1, dtype="float32", backend="triton", cuda_graphs=False,
               settings=Settings(pdl=False)) as m:
        tables = (table, {})
        tiles.use_tiles(m, tables, autotune=True)
        m.generate([3, 17, 42], loops=2, max_tokens=2)
    assert seen and all(kw["tables"] is tables and kw["autotune"] and kw["pdl"] is False for kw in seen)
    assert gemv_mod.TILES == code_tables
    path = tmp_path / "tiles-tiny-cuda.json"
    path.write_text(json.dumps({"sweep": [], "tiles": tiles.tiles_file({key: (8, 64, 4, 1)})}))
    assert gemv_mod.load_tables(str(path)) == ({key: (8, 64, 4, 1)}, {})


def test_startup_bench_cpu(tmp_path):
    """bench/startup.py on CPU (a smoke run: nothing is captured there): one record per lane
    count (the model's cache lanes) with the model's start-up parts, and its refusals."""
    from bench import startup
    startup.main(["--preset", "tiny", "--lanes", "1", "2", "--max-seq-len", "64", "--device", "cpu",
                  "--out-dir", str(tmp_path)])
    r = json.loads((tmp_path / "startup-tiny-cpu.json").read_text())
    assert r["model"] == "tiny" and r["max_seq_len"] == 64
    assert [run["lanes"] for run in r["runs"]] == [1, 2] and [run["cache_lanes"] for run in r["runs"]] == [1, 2]
    for run in r["runs"]:
        assert run["wall_s"] >= run["load_s"] > 0 and run["graphs"] == run["graph_bytes"] == 0
        assert run["graphs_by_kind"] == {} and run["batch_buckets"] == [] and run["graphs_less_lanes"] == 0
    assert r["same_graphs_but_lanes"]
    for bad in (["--preset", "nope"], ["--lanes", "0"]):
        with pytest.raises(SystemExit):
            startup.main(bad + ["--device", "cpu"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_startup_bench_graphs_do_not_grow_with_lanes_on_cuda(tmp_path):
    """On the GPU every lane count captures the same graphs but the rows' stages: the batched
    ones, whose buckets are the powers of two below the lane count and the count itself, and
    the multi-row prefills of row counts up to the lane count."""
    from bench import startup
    startup.main(["--preset", "tiny", "--lanes", "1", "5", "--max-seq-len", "64", "--device", "cuda",
                  "--out-dir", str(tmp_path)])
    one, five = json.loads((tmp_path / "startup-tiny-cuda.json").read_text())["runs"]
    assert (one["batch_buckets"], five["batch_buckets"]) == ([], [2, 4, 5])
    assert one["graphs_by_kind"]["batch"] == 0 < five["graphs_by_kind"]["batch"]
    assert "prefill2" not in one["graphs_by_kind"] and five["graphs_by_kind"]["prefill4"] > 0
    assert "prefill8" not in five["graphs_by_kind"]
    assert {k: v for k, v in one["graphs_by_kind"].items() if not startup.by_lanes(k)} == \
        {k: v for k, v in five["graphs_by_kind"].items() if not startup.by_lanes(k)}
    assert one["graphs_less_lanes"] == five["graphs_less_lanes"] == one["graphs"] > 0
    assert five["graph_bytes"] > 0 and five["decode_graphs_s"] > 0


def test_warmstart_bench_cpu(tmp_path):
    """bench/warmstart.py on a random tiny preset: fresh, build and resume figures, greedy
    parity (asserted by the bench itself)."""
    from bench import warmstart
    warmstart.main(["--preset", "tiny", "--device", "cpu", "--prefix", "8", "--decode", "4", "--repeat", "1",
                    "--out-dir", str(tmp_path)])
    r = json.loads((tmp_path / "warmstart-cpu.json").read_text())
    assert r["backend"] == "torch" and [row["prefix"] for row in r["rows"]] == [8]
    row, = r["rows"]
    assert row["greedy_parity"] and row["fresh_ms"] > 0 and row["build_ms"] > 0 and row["resume_ms"] > 0


def test_speculative_bench_cpu(tmp_path):
    """bench/speculative.py on the embedded model: a chain and a tree setting against generate;
    in fp32 both keep greedy parity."""
    from bench import speculative
    speculative.main(["--device", "cpu", "--max-tokens", "6", "--prompts", "1", "--repeat", "1",
                      "--verify-loops", "4", "--draft-loops", "2", "--k-branches", "1", "2",
                      "--out-dir", str(tmp_path)])
    r = json.loads((tmp_path / "speculative-cpu.json").read_text())
    assert r["backend"] == "torch" and r["baseline"]["tokens_per_s"] > 0
    assert [(row["mode"], row["k_branches"]) for row in r["results"]] == [("chain", 1), ("tree", 2)]
    for row in r["results"]:
        assert row["greedy_parity"] and row["tokens_per_s"] > 0 and 0 <= row["acceptance_rate"] <= 1


def test_spec_batch_bench_cpu(tmp_path):
    """bench/spec_batch.py on the embedded model: shared rounds, rounds in turn and plain
    batched decoding of the same streams give the same tokens."""
    from bench import spec_batch
    spec_batch.main(["--device", "cpu", "--streams", "2", "--max-tokens", "6", "--repeat", "1",
                     "--verify-loops", "4", "--draft-loops", "2", "--out-dir", str(tmp_path)])
    r = json.loads((tmp_path / "spec-batch-cpu.json").read_text())
    row, = r["rows"]
    assert row["streams"] == 2 and row["same_tokens"] and row["shared_vs_in_turn"] > 0
    assert all(row[mode]["tokens_per_s"] > 0 for mode in ("in turn", "shared", "plain batched"))


def test_families_runs_parse_and_refuse_what_does_not_exist():
    from bench.families import parse_runs
    assert parse_runs(["ouro-1.4b:4,8", "huginn-3.5b"]) == [("ouro-1.4b", (4, 8)), ("huginn-3.5b", (32,))]
    with pytest.raises(ValueError, match="unknown preset 'ouro-9b'"):
        parse_runs(["ouro-9b:4"])
    with pytest.raises(ValueError, match="depths must be integers"):
        parse_runs(["ouro-1.4b:four"])
    with pytest.raises(ValueError, match="depths must be >= 1"):
        parse_runs(["ouro-1.4b:0"])


def test_int4_tiles_sweep_candidates_and_refusals(tmp_path):
    """bench/int4_tiles.py: every candidate is a tile int4_gemv takes (the mma kernel's only for
    INT4), the default is among the timed, the shapes are bench-285m's fused projections, and a
    sweep JSON reads back as the tables' entries; without a GPU it refuses."""
    import json

    from bench import int4_tiles
    from tinyloop.kernels import int4_gemv as q4
    names = [(s["name"], s["rows"], s["K"]) for s in int4_tiles.shapes("bench-285m")]
    assert names == [("wqkv", 6144, 2048), ("wo", 2048, 2048), ("w13", 11264, 2048), ("w2", 2048, 5632)]
    for K, bits in ((2048, 4), (5632, 4), (2048, 2)):
        c = int4_tiles.gemv_candidates(K, 128, bits)
        assert len(c) == len(set(c)) > 10 and all(q4.as_tile(t) == t for t in c)
        assert any(t[0] == "mma" for t in c) == (bits == 4)
    for M in (4, 16, 64):
        c = int4_tiles.matmul_candidates(M, 2048)
        assert q4.default_matmul_tile(M, 2048) in c and all(q4.as_matmul_tile(t) == t for t in c)
    key = (2048, 2048, 128, 4, False, False, True, True)
    path = tmp_path / "int4-tiles-cuda.json"
    path.write_text(json.dumps({"tiles": [[list(key), ["mma", 32, 2, 4, 1]]],
                                "matmul_tiles": [[[4, 2048, 2048, 128, 4, False, False, True], [16, 32, 128, 4, 3]]]}))
    gemv_tiles, mm_tiles = q4.load_tables(str(path))
    assert gemv_tiles == {key: ("mma", 32, 2, 4, 1)}
    assert mm_tiles == {(4, 2048, 2048, 128, 4, False, False, True): (16, 32, 128, 4, 3)}
    # a sweep's entry comes before the code's table, which still serves the keys it lacks
    code = {"NVIDIA H200": {key: ("pairs", 256, 1, 8, 1, 16), (1, 2): ("bytes", 4, 8, 4, 2, 1)}}
    if torch.cuda.is_available() and torch.cuda.get_device_name() == "NVIDIA H200":
        gpu = torch.device("cuda")
        assert q4.table_entry(code, 0, (gemv_tiles, mm_tiles), gpu, key) == ("mma", 32, 2, 4, 1)
        assert q4.table_entry(code, 0, (gemv_tiles, mm_tiles), gpu, (1, 2)) == ("bytes", 4, 8, 4, 2, 1)
    cpu = torch.device("cpu")  # (no code table: those are per GPU name)
    assert q4.table_entry(code, 0, (gemv_tiles, mm_tiles), cpu, key) == ("mma", 32, 2, 4, 1)
    assert q4.table_entry(code, 0, (gemv_tiles, mm_tiles), cpu, (1, 2)) is None
    assert q4.table_entry(code, 0, None, cpu, key) is None
    for bad in ("[1, 2]", "not json", '{"tiles": [[1, 2]]}'):
        path.write_text(bad)
        with pytest.raises(ValueError, match="not a bench/int4_tiles.py result"):
            q4.load_tables(str(path))
    # a candidate's call and its check against the reference, as the sweep makes them (tiny shape)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tiny = {"name": "w13", "rows": 32, "K": 64, "norm": True, "swiglu": True, "residual": False}
    w, x, nw, res = int4_tiles.make_weight(tiny, 32, 4, dev)
    for tile, M in ((("mma", 16, 1, 4, 1, 2), 1), (("bytes", 4, 2, 4, 1, 1), 1), ((16, 16, 64, 4, 1), 3)):
        fn = int4_tiles.call(tiny, w, x, nw, res, 32, 4, tile, M)
        assert int4_tiles.check(fn, tiny, w, x, nw, res, 32, 4, M) is None
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            int4_tiles.main([])


def test_early_exit_bench_cpu(tmp_path, tiny_path):
    """bench/early_exit.py on a random tiny model: full depth first (agreement 1 with itself),
    then each rule's iterations, tokens/s, agreement and teacher-forced bpb."""
    from bench import early_exit
    early_exit.main(["--model", tiny_path, "--loops", "4", "--criteria", "latent", "argmax",
                     "--sweep", "latent=0.5", "argmax=1", "--cache", "copy", "--prompts", "1", "--streams", "2",
                     "--prompt-tokens", "8", "--tokens", "6", "--bpb-seqs", "2", "--bpb-prompt", "8",
                     "--bpb-tokens", "6", "--out-dir", str(tmp_path)])
    r = json.loads((tmp_path / "early-exit-cpu.json").read_text())
    full, *rules = r["rows"]
    assert full["rule"] is None and full["agreement"] == 1 and full["iterations_per_token"] == 4
    assert [row["rule"]["criterion"] for row in rules] == ["latent", "argmax"]
    for row in r["rows"]:
        assert 1 <= row["iterations_per_token"] <= 4 and row["tok_s_b1"] > 0 and row["tok_s_batched"] > 0
        assert 0 <= row["agreement"] <= 1 and row["bpb"] > 0
        assert sum(row["iterations_histogram"]) == 5  # 6 tokens: 5 decode steps


def test_ray_hop_bench(tmp_path):
    """bench/ray_hop.py on a local Ray cluster: a plain call's round trip and, through Ray and
    through the worker channel, a stream's first and next items, all positive; the bare gRPC hop
    and the whole path through the real gateway in front of the worker, whose first item costs at
    least the gRPC hop's; bad counts refused."""
    from bench import ray_hop
    with pytest.raises(ValueError, match="--items >= 2"):
        ray_hop.main(["--items", "1", "--out-dir", str(tmp_path)])
    ray_hop.main(["--calls", "3", "--items", "3", "--out-dir", str(tmp_path)])
    r = json.loads((tmp_path / "ray-hop-cpu.json").read_text())["results"]
    assert r["calls"] == 3 and r["items_per_stream"] == 3
    assert r["plain_call_ms"] > 0 and r["stream_first_item_ms"] > 0 and r["stream_next_item_ms"] > 0
    assert r["channel_first_item_ms"] > 0 and r["channel_next_item_ms"] > 0
    assert r["grpc_first_item_ms"] > 0 and r["grpc_next_item_ms"] > 0 and r["gateway_next_item_ms"] > 0
    assert r["gateway_first_item_ms"] > r["grpc_first_item_ms"]
    assert r["gateway_own_first_item_ms"] == pytest.approx(
        r["gateway_first_item_ms"] - r["grpc_first_item_ms"] - r["channel_first_item_ms"], abs=2e-3)


def test_quant_decode_bench_cpu(tmp_path):
    """bench/quant_decode.py's CPU smoke run: batch 1 and the batched step per format, INT4 over
    bf16 at each stream count of the same run."""
    from bench import quant_decode
    quant_decode.main(["--device", "cpu", "--preset", "tiny", "--group-size", "32", "--loops", "1", "2", "--steps",
                       "2", "--repeat", "1", "--batch", "1", "3", "--batch-loops", "2", "--formats", "bf16", "int4",
                       "--out-dir", str(tmp_path)])
    r = json.loads((tmp_path / "quant-decode-cpu.json").read_text())
    assert [x["loops"] for x in r["decode"]["int4"]] == [1, 2]
    for fmt in ("bf16", "int4"):
        assert [x["streams"] for x in r["batched"][fmt]] == [1, 3]
        assert all(x["ms_per_step"] > 0 and x["tokens_per_s"] > 0 for x in r["batched"][fmt])
    assert all(x["over_bf16"] > 0 for x in r["batched"]["int4"]) and "over_bf16" not in r["batched"]["bf16"][0]


def test_generate_ab_bench_cpu(tmp_path, tiny_path):
    """bench/generate_ab.py: each tree's generate in a process of its own on that tree's code
    (two copies of this one here), every round's tokens/s and each over the first; bad trees refused."""
    from bench import generate_ab
    root = str(pathlib.Path(__file__).resolve().parents[1])
    with pytest.raises(ValueError, match="NAME=PATH"):
        generate_ab.main(["--tree", "a=/no/such/dir", "--tree", f"b={root}"])
    with pytest.raises(ValueError, match="at least two"):
        generate_ab.main(["--tree", f"a={root}"])
    generate_ab.main(["--tree", f"base={root}", "--tree", f"head={root}", "--model", tiny_path, "--device", "cpu",
                      "--loops", "1", "2", "--tokens", "4", "--repeat", "1", "--rounds", "2", "--out-dir", str(tmp_path)])
    r = json.loads((tmp_path / "generate-ab-cpu.json").read_text())
    assert set(r["rounds_tok_s"]) == {"base", "head"} and all(len(v) == 2 for v in r["rounds_tok_s"].values())
    assert all(x > 0 for rs in r["rounds_tok_s"].values() for row in rs for x in row.values())
    assert r["over_base"]["base"] == {"1": 1.0, "2": 1.0} and r["over_base"]["head"]["2"] > 0
    # the one-token generate and the per-token remainder, every round, each tree and depth
    assert all(len(r[k][t]) == 2 for k in ("rounds_first_ms", "rounds_decode_us_per_token") for t in ("base", "head"))
    assert all(r["median_first_ms"][t][L] > 0 for t in ("base", "head") for L in ("1", "2"))
    # the graph replay's device time is CUDA's alone
    assert r["median_graph_us_per_token"] is None and r["rounds_graph_us_per_token"]["head"] == [{}, {}]
    row = r["rounds_decode_us_per_token"]["head"][0]["2"]
    assert row == pytest.approx(generate_ab.decode_us(r["rounds_tok_s"]["head"][0]["2"],
                                                      r["rounds_first_ms"]["head"][0]["2"], 4))


def test_gpu_busy_ms_counts_overlapping_spans_once():
    """bench.common.gpu_busy_ms: the union of the GPU events' intervals (a PDL kernel that starts
    inside the one before it adds only its tail), host events left out."""
    from types import SimpleNamespace

    import torch

    from bench.common import gpu_busy_ms
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    spans = [(0, 10, cuda), (5, 12, cuda), (20, 25, cuda), (30, 40, cpu), (21, 22, cuda)]
    prof = SimpleNamespace(events=lambda: [SimpleNamespace(device_type=d, time_range=SimpleNamespace(start=a, end=b))
                                           for a, b, d in spans])
    assert gpu_busy_ms(prof) == (12 + 5) / 1e3
