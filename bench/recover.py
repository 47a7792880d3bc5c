"""Losing a worker under load: what is lost, what goes on, and how long until it serves again.

    python -m bench.recover                    # CPU: writes bench/results/recover-cpu.json
    python -m bench.recover --device cuda      # one worker per GPU (needs --workers GPUs)

A real local Ray cluster, --workers worker actors and a gateway on loopback (as the service
tests run them). --streams-per-worker greedy streams of --max-tokens tokens are placed by the
gateway's load-based placement; once every stream has its first tokens and a --kill-after-s
pause has passed, worker-0 is killed as a crash kills it (`ray.kill(no_restart=False)`: Ray
restarts it, with a new epoch). Recorded:

- per worker, the streams it ran, how many completed with all their tokens and how many ended
  with UNAVAILABLE / WORKER_UNAVAILABLE; a survivor's tokens must equal its standalone
  in-process run (greedy, same model file), and `survivors_exact` says whether they all did;
- the handles built before the kill: the victim's answer NOT_FOUND / HANDLE_LOST afterwards,
  the others resume;
- recovery, in seconds from the kill: the restarted actor answering (`actor_back_s`, its model
  loaded and graphs captured), the gateway placing work on it again (`placed_again_s`), and the
  first request it serves (`serving_again_s`).
"""
from __future__ import annotations

import argparse
import os
import threading
import time

from tqdm import tqdm

from bench.common import hardware, write

PROMPT_LEN = 16


def prompts(n: int, vocab: int) -> list[list[int]]:
    return [[(31 * i + 7 * j + 3) % vocab for j in range(PROMPT_LEN)] for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a .tinyloop file or HF directory (default: the embedded model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--lanes", type=int, default=4)
    ap.add_argument("--streams-per-worker", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--loops", type=int, default=4)
    ap.add_argument("--kill-after-s", type=float, default=0.5)
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    if args.workers < 2:
        raise ValueError("--workers must be >= 2: one is killed, the others must go on")

    import grpc
    import ray
    import torch

    from tinyloop.client import TinyLoopClient, TinyLoopError
    from tinyloop.gateway import workers
    from tinyloop.gateway.server import GatewayOptions, GatewayThread
    from tinyloop.worker import Model
    from tinyloop.worker.model.default_model import default_model_path

    path = args.model or default_model_path()
    torch.set_num_threads(args.torch_threads)
    n_streams = args.workers * args.streams_per_worker
    with Model(path, max_seq_len=PROMPT_LEN + args.max_tokens + 8, device=args.device) as m:
        vocab = m.config.vocab_size
        ps = prompts(n_streams, vocab)
        standalone = [list(m.generate(p, loops=args.loops, max_tokens=args.max_tokens, stop_token_ids=[]))[len(p):]
                      for p in tqdm(ps, desc="standalone runs")]

    ray.init(num_cpus=max(4, args.workers * 2), include_dashboard=False, log_to_driver=False,
             namespace="tinyloop-recover")
    opts = workers.WorkerOptions(model_path=path, lanes=args.lanes, max_seq_len=PROMPT_LEN + args.max_tokens + 8,
                                 device=args.device, torch_threads=args.torch_threads, coalesce_s=0.005)
    actors = workers.spawn(args.workers, opts, name_prefix="recover")
    gw = GatewayThread(actors, GatewayOptions(port=0, health_interval_s=0.1))
    victim = "worker-0"
    results: list[dict] = [{} for _ in range(n_streams)]
    first = threading.Barrier(n_streams + 1)

    def run(i: int) -> None:
        r = results[i]
        with TinyLoopClient(gw.address) as c:
            stream = c.generate(ps[i], loops=args.loops, max_tokens=args.max_tokens, stop_token_ids=[])
            ids, first_seen = [], False
            try:
                for chunk in stream:
                    ids += chunk.ids
                    if not first_seen:
                        first_seen = True
                        first.wait(120)
                r.update(worker=stream.complete.worker_id, ids=ids, outcome="completed")
            except TinyLoopError as e:
                r.update(worker=victim if e.reason == "WORKER_UNAVAILABLE" else None, ids=ids,
                         outcome=f"{e.code.name}/{e.reason}")
            finally:
                if not first_seen:
                    first.wait(120)

    try:
        with TinyLoopClient(gw.address) as c:
            handles: dict[str, object] = {}
            while len(handles) < args.workers:  # one handle on each worker, built before the kill
                h = c.build_resume_handle(ps[0], l_used=2, max_loops=args.loops)
                handles.setdefault(h.worker_id, h)
            threads = [threading.Thread(target=run, args=(i,)) for i in range(n_streams)]
            for t in threads:
                t.start()
            first.wait(300)  # every stream has its first tokens
            time.sleep(args.kill_after_s)
            t_kill = time.monotonic()
            ray.kill(actors[0], no_restart=False)
            for t in tqdm(threads, desc="streams"):
                t.join(600)

            recovery: dict[str, float | None] = {"actor_back_s": None, "placed_again_s": None, "serving_again_s": None}
            deadline = t_kill + 600
            while recovery["actor_back_s"] is None and time.monotonic() < deadline:
                try:
                    if ray.get(actors[0].info.remote(), timeout=5)["epoch"] >= 2:
                        recovery["actor_back_s"] = time.monotonic() - t_kill
                except (ray.exceptions.RayError, TimeoutError):
                    time.sleep(0.05)
            w0 = gw.gateway.servicer.workers[0]
            while not w0.healthy and time.monotonic() < deadline:
                time.sleep(0.02)
            recovery["placed_again_s"] = time.monotonic() - t_kill if w0.healthy else None
            for _ in range(64):  # placement alternates between idle workers: the victim's turn comes
                if c.generate(ps[0], loops=1, max_tokens=1).collect()[1].worker_id == victim:
                    recovery["serving_again_s"] = time.monotonic() - t_kill
                    break

            lost = {}
            for worker_id, h in handles.items():
                try:
                    c.resume(h.handle_id, args.loops, max_tokens=2).collect()
                    lost[worker_id] = "resumed"
                    c.free_handle(h.handle_id)
                except TinyLoopError as e:
                    lost[worker_id] = f"{e.code.name}/{e.reason}"
    finally:
        gw.stop(0.5)
        for a in actors:
            ray.kill(a, no_restart=True)
        ray.shutdown()

    per_worker: dict[str, dict] = {}
    exact = True
    for i, r in enumerate(results):
        w = per_worker.setdefault(str(r.get("worker")), {"streams": 0, "completed": 0, "outcomes": {}})
        w["streams"] += 1
        w["outcomes"][r.get("outcome")] = w["outcomes"].get(r.get("outcome"), 0) + 1
        if r.get("outcome") == "completed":
            w["completed"] += 1
            exact &= r["ids"] == standalone[i]
    survivors = [r for r in results if r.get("worker") != victim]
    row = {"killed": victim, "per_worker": per_worker, "survivors_exact": exact,
           "survivors_completed": sum(r.get("outcome") == "completed" for r in survivors),
           "survivors": len(survivors), "handles_after_kill": lost, "recovery": recovery}
    print(f"killed {victim}: survivors completed {row['survivors_completed']}/{row['survivors']} "
          f"(exact: {exact}); victim's streams: {per_worker.get(victim)}; handles: {lost}; recovery {recovery}")
    dev = torch.device(args.device)
    write(f"recover-{dev.type}", {
        "hardware": hardware(dev),
        "workload": {"model": "the embedded default model" if args.model is None else os.path.basename(path),
                     "workers": args.workers, "lanes": args.lanes, "streams": n_streams, "loops": args.loops,
                     "prompt_tokens": PROMPT_LEN, "max_tokens": args.max_tokens, "greedy": True,
                     "kill_after_first_tokens_s": args.kill_after_s, "torch_threads": args.torch_threads},
        **row}, args.out_dir)
    return 0 if exact and row["survivors_completed"] == row["survivors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
