"""Train a looped transformer with randomized depth (nanoGPT-style, one file).

Each step draws one depth L from [1, max_train_loops] (all samples of the step share it, so a
step is one plain forward) -- the model is trained to be useful at every depth, and deeper is
better because deeper runs see every shallower run's iterations as a prefix. `depth_weighting`
"uniform" gives each depth an equal share of the steps; "deep" draws L with probability
proportional to L, so the deep depths (the ones "try harder" serves) get most of the updates
while every shallow depth still trains (each deep step also trains its shallow prefix).

AdamW (fused on CUDA; no decay on norms), linear warm-up then cosine decay to `min_lr_frac`,
bf16 autocast on CUDA, gradient clipping. The schedule runs on the fraction of the budget
spent -- steps or wall time, whichever ends first -- so a time-limited run still anneals.
Batches are random contiguous windows of the train split, held on the device.

Best checkpoint: every held-out eval that lowers the loss at the deepest eval depth (8 by
default) snapshots the weights (a copy on the device), and the run returns that snapshot, not
the last step's weights -- a small model on a small corpus can overfit before its budget ends.
The summary names `best_step` and its eval losses beside the last eval's.
"""
from __future__ import annotations

import contextlib
import json
import math
import random
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tinyloop.train import evaluate
from tinyloop.worker.model.config import LoopedConfig
from tinyloop.worker.model.modules import LoopedTransformer


@dataclass
class TrainArgs:
    steps: int | None = None         # stop after this many steps ...
    minutes: float | None = None     # ... or this much wall time (at least one must be set)
    batch_size: int = 64
    seq_len: int = 512
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    max_train_loops: int = 12
    depth_weighting: str = "uniform"  # "uniform" | "deep": P(L) proportional to L (sample_depth)
    eval_every: int = 250
    eval_windows: int = 64
    eval_loops: tuple[int, ...] = (1, 4, 8)
    log_every: int = 10
    seed: int = 0
    init_from: str | None = None  # a .tinyloop whose weights the run starts from (its config must be cfg)
    compile: bool = False
    progress: bool = True


DEPTH_WEIGHTINGS = ("uniform", "deep")


def depth_weights(max_loops: int, weighting: str) -> list[float]:
    """P(L) for L = 1..max_loops."""
    if weighting not in DEPTH_WEIGHTINGS:
        raise ValueError(f"depth_weighting must be one of {DEPTH_WEIGHTINGS}, got {weighting!r}")
    w = [1.0] * max_loops if weighting == "uniform" else [float(L) for L in range(1, max_loops + 1)]
    return [x / sum(w) for x in w]


def sample_depth(rng: random.Random, max_loops: int, weighting: str) -> int:
    return rng.choices(range(1, max_loops + 1), weights=depth_weights(max_loops, weighting))[0]


def lr_at(args: TrainArgs, step: int, frac: float) -> float:
    """Linear warm-up over `warmup_steps`, then cosine on `frac` (the budget spent, 0..1)."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    cos = 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * cos)


def make_optimizer(model: torch.nn.Module, args: TrainArgs, device: torch.device) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                             fused=device.type == "cuda")


def train(cfg: LoopedConfig, train_tokens: np.ndarray, heldout_tokens: np.ndarray, args: TrainArgs,
          device: str | torch.device = "cpu", log_path: str | None = None) -> tuple[LoopedTransformer, dict]:
    """-> (fp32 model in eval mode holding the weights of the best held-out eval, summary: steps,
    tokens, wall time, last losses, best_step and its eval losses)."""
    if args.steps is None and args.minutes is None:
        raise ValueError("set steps or minutes (or both)")
    if args.max_train_loops > cfg.max_loops:
        raise ValueError(f"max_train_loops ({args.max_train_loops}) exceeds max_loops ({cfg.max_loops})")
    depth_weights(args.max_train_loops, args.depth_weighting)  # a bad weighting fails before any work
    device = torch.device(device)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    model = LoopedTransformer(cfg)
    model.init_weights(torch.Generator().manual_seed(args.seed))
    if args.init_from is not None:
        from tinyloop.worker.model import checkpoint
        start, _ = checkpoint.load(args.init_from, "cpu", torch.float32)
        if start.config.to_json() != cfg.to_json():
            raise ValueError(f"init_from {args.init_from}: its config is not the run's")
        model.load_state_dict(start.state_dict())
    model.to(device).train()
    if args.compile:
        # Per layer, so the Python loop over L stays eager: one compiled graph serves every depth.
        for layer in [*model.prelude, *model.loop, *model.coda]:
            layer.compile()
    opt = make_optimizer(model, args, device)
    autocast = (torch.autocast("cuda", torch.bfloat16) if device.type == "cuda"
                else contextlib.nullcontext())

    # Bytes stay uint8 on the device (the whole split fits); BPE ids widen to int32.
    data = torch.from_numpy(train_tokens if train_tokens.dtype == np.uint8
                            else train_tokens.astype(np.int32)).to(device)
    span = torch.arange(args.seq_len + 1, device=device)
    eval_win = evaluate.windows(heldout_tokens, args.eval_windows, args.seq_len)
    budget_s = args.minutes * 60 if args.minutes is not None else None

    log = open(log_path, "w") if log_path else None
    bar = None
    if args.progress:
        from tqdm import tqdm
        bar = tqdm(total=args.steps, unit="step", mininterval=10, dynamic_ncols=True)

    def emit(rec: dict) -> None:
        if log:
            log.write(json.dumps(rec) + "\n")
            log.flush()

    select_L = str(max(args.eval_loops))
    best = {"step": None, "eval_loss": None, "state": None}

    def run_eval(step: int, elapsed: float) -> dict:
        model.eval()
        with autocast:
            losses = {str(L): round(evaluate.mean_loss(model, eval_win, L), 4) for L in args.eval_loops}
        model.train()
        improved = best["eval_loss"] is None or losses[select_L] < best["eval_loss"][select_L]
        if improved:
            best.update(step=step, eval_loss=losses,
                        state={k: v.detach().clone() for k, v in model.state_dict().items()})
        emit({"step": step, "elapsed_s": round(elapsed, 1), "eval_loss": losses, "best": improved})
        return losses

    t0 = time.time()
    step, tokens, loss_sum, loss_n, last = 0, 0, torch.zeros((), device=device), 0, {}
    eval_losses, eval_step = {}, -1
    while True:
        elapsed = time.time() - t0
        frac = max(step / args.steps if args.steps else 0.0, elapsed / budget_s if budget_s else 0.0)
        if frac >= 1.0:
            break
        lr = lr_at(args, step, frac)
        for g in opt.param_groups:
            g["lr"] = lr
        L = rng.randint(1, args.max_train_loops) if args.depth_weighting == "uniform" else \
            sample_depth(rng, args.max_train_loops, args.depth_weighting)
        ix = torch.randint(len(data) - args.seq_len - 1, (args.batch_size,), generator=gen).to(device)
        batch = data[ix[:, None] + span].long()  # (B, T+1)
        x, y = batch[:, :-1], batch[:, 1:]
        with autocast:
            logits = model(x, L)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        step += 1
        tokens += x.numel()
        loss_sum += loss.detach()
        loss_n += 1
        if step % args.log_every == 0:
            elapsed = time.time() - t0
            last = {"step": step, "loops": L, "loss": round(loss_sum.item() / loss_n, 4), "lr": lr,
                    "tokens": tokens, "elapsed_s": round(elapsed, 1), "tok_per_s": round(tokens / elapsed)}
            emit(last)
            loss_sum.zero_()
            loss_n = 0
            if bar is not None:
                bar.set_postfix(loss=last["loss"], L=L, lr=f"{lr:.2e}", s=int(elapsed), refresh=False)
        if args.eval_every and step % args.eval_every == 0:
            eval_losses, eval_step = run_eval(step, time.time() - t0), step
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    wall = time.time() - t0
    if eval_step != step:
        eval_losses = run_eval(step, wall)
    model.load_state_dict(best["state"])
    emit({"step": step, "restored_step": best["step"], "selected_by": f"eval_loss[{select_L}]",
          "eval_loss": best["eval_loss"]})
    if log:
        log.close()
    summary = {"steps": step, "tokens": tokens, "train_wall_s": round(wall, 1),
               "tok_per_s": round(tokens / max(wall, 1e-9)), "final_train_loss": last.get("loss"),
               "final_eval_loss": eval_losses, "best_step": best["step"], "best_eval_loss": best["eval_loss"],
               "selected_by_loops": int(select_L), "args": {k: v for k, v in vars(args).items()}}
    return model.eval(), summary
