"""One-at-a-time streams for the TTFT trace (bench/ttft_trace/run.sh): probe.py ADDRESS MODE
(async | async-sleep: 10 ms idle between streams | sync: the blocking client)."""
import asyncio, sys, time, statistics
mode = sys.argv[2]
if "torch" in mode:
    import torch; torch.ones(10, device="cuda").sum().item()
from tinyloop.client import AsyncTinyLoopClient, TinyLoopClient
from tinyloop.worker._trace import tr
addr = sys.argv[1]
P = [[(7 * i + j) % 31000 + 1 for j in range(128)] for i in range(60)]
kw = dict(loops=8, max_tokens=128, stop_token_ids=[])
def fin(out, t0):
    print(mode, "ttft p50 ms %.3f" % (1e3 * statistics.median(out[5:])), "window", t0, time.perf_counter(), flush=True)
async def amain():
    async with AsyncTinyLoopClient(addr) as c:
        await c.model_info(); out = []; T = time.perf_counter()
        for p in P:
            if "sleep" in mode: await asyncio.sleep(0.01)
            t0 = time.perf_counter(); tr('C0'); first = None
            async for ch in c.generate(p, **kw):
                if first is None and ch.ids: first = time.perf_counter(); tr('C1')
            out.append(first - t0)
        fin(out, T)
def smain():
    with TinyLoopClient(addr) as c:
        c.model_info(); out = []; T = time.perf_counter()
        for p in P:
            if "sleep" in mode: time.sleep(0.01)
            t0 = time.perf_counter(); tr('C0'); first = None
            for ch in c.generate(p, **kw):
                if first is None and ch.ids: first = time.perf_counter(); tr('C1')
            out.append(first - t0)
        fin(out, T)
smain() if mode.startswith("sync") else asyncio.run(amain())
