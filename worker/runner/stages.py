"""Stage sets over static buffers: what one CUDA graph captures, and what runs eagerly in the
same order where nothing is captured (a CPU engine, a bucket with no graph).

A stage set is a pass split into stages: "prelude" embeds the tokens and runs the prelude into
the residual buffer x, iteration i runs in place on x, "coda" runs the coda and writes the
logits. So any depth composes from few graphs. Every input that changes from one call to the
next (tokens, positions, cache slots, depths, tree masks) lives in a device buffer that the
call loads before running the stages; nothing in a stage depends on a host value, so a graph
captured once serves every lane, position and depth mix.

Only `runner.Runner` builds and runs these; nothing here counts work.
"""
from __future__ import annotations

import numpy as np
import torch

from tinyloop.kernels.tree_attention import ancestors_from_parents
from tinyloop.worker.runner.engine import Engine, Pass, Tree

PAD_ID = 0  # pads a prompt to its bucket: any id does, no real token sees a pad


def prefill_buckets(max_seq_len: int, max_len: int) -> list[int]:
    """The prompt lengths a padded prefill is built for: powers of two from 16, and the top
    (the smaller of max_seq_len and max_len) when that is not one."""
    top = min(max_seq_len, max_len)
    buckets = [1 << k for k in range(4, top.bit_length()) if 1 << k <= top]
    return buckets + [top] if top >= 16 and top not in buckets else buckets


def batch_buckets(n_slots: int) -> list[int]:
    """The lane counts a batched decode step is built for: powers of two from 2 up to
    n_slots, and n_slots itself."""
    buckets = [1 << k for k in range(1, n_slots.bit_length()) if 1 << k < n_slots]
    return buckets + [n_slots] if n_slots > 1 else []


def device_tensor(data, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """torch.tensor(data) on `device`, with no host sync: a copy to the GPU from pageable
    memory waits for all the work queued before it (a prefill just launched, a step launched
    ahead); from pinned memory it is queued like a kernel."""
    t = torch.tensor(data, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


class Staging:
    """Host buffers that a stage set's inputs are written into and copied from, reused in turn
    (pinned on CUDA, written through a numpy view): each slot keeps the event of the copy that
    last read it and waits for it before it is written again, since a launch's copy may still
    be queued when the next launch is prepared. No tensor is made per launch."""

    def __init__(self, shape: tuple, dtype: torch.dtype, device: torch.device, slots: int = 2):
        cuda = device.type == "cuda"
        self.bufs = [torch.zeros(shape, dtype=dtype, pin_memory=cuda) for _ in range(slots)]
        self.views = [b.numpy() for b in self.bufs]
        self.events = [torch.cuda.Event() for _ in range(slots)] if cuda else None
        self.read = [False] * slots
        self.i = 0

    def next(self):
        """The next slot's numpy view, once no copy still reads it."""
        self.i = (self.i + 1) % len(self.bufs)
        if self.events is not None and self.read[self.i]:
            self.events[self.i].synchronize()
        return self.views[self.i]

    def copy_to(self, dst: torch.Tensor) -> None:
        """Copy the slot `next` gave into dst (queued on the current stream)."""
        dst.copy_(self.bufs[self.i], non_blocking=True)
        if self.events is not None:
            self.events[self.i].record()
            self.read[self.i] = True


def _pinned(data: list, like: torch.Tensor) -> torch.Tensor:
    """A host tensor to copy into `like` without a host sync (pinned on CUDA)."""
    t = torch.tensor(data, dtype=like.dtype)
    return t.pin_memory() if like.is_cuda else t


class StagedPass:
    """A pass as stages over static buffers (the engine, its Pass p, tokens, the residual x and
    the logits, set by the subclass)."""

    depth: torch.Tensor | None = None

    @staticmethod
    def stages(loops: int) -> list:
        return ["prelude", *range(loops), "coda"]

    @torch.no_grad()
    def run(self, stage) -> None:
        """One stage, eagerly (what a graph captures)."""
        e, p = self.engine, self.p
        if stage == "prelude":
            self.x.copy_(e.embed_prelude(self.tokens, p))
        elif stage == "coda":
            self.logits.copy_(self.coda_logits(e.coda(self.x, p)))
        elif stage == "greedy":  # a batched step's (BatchStep.stages)
            torch.argmax(self.logits, -1, out=self.greedy)
        else:
            e.run_loops(self.x, p, stage, stage + 1, depth=self.depth, out=self.x)

    def coda_logits(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class PaddedPrefill(StagedPass):
    """A chunk of a fresh prompt (positions 0..T-1, full cache, no norm tracking) padded to
    `bucket` tokens, on the cache slot in `slots`: "coda" gives the last real token's logits,
    read through a device index.

    Pads sit at positions T..bucket-1 and write K/V there. That is harmless: attention is
    causal, so no real token sees them, and every later step writes a position before it
    attends to it. The buffers may be views of larger ones shared by every bucket
    (`prefill_buffers`): their stages never run at once.

    rows > 1: that many prompts, each on its own slot and at its own depth (`depth`, as a
    batched decode step's rows: an iteration keeps a row's result only below its depth), the
    prompts padded to the bucket each; `load_prompts` fills every row (a multi-row pass has no
    idle row: a row writes its slot's cache)."""

    def __init__(self, engine: Engine, bucket: int, buffers: tuple | None = None, rows: int = 1):
        tokens, last, slot, x, logits = buffers if buffers is not None else prefill_buffers(engine, bucket, rows)
        device = engine.cache.device
        self.engine, self.bucket, self.rows = engine, bucket, rows
        # (rows, bucket), (rows, bucket, D)
        self.tokens, self.x = tokens[:rows, :bucket], x[:rows, :bucket]
        # (rows,) index T-1 of each row, (rows,) slots, (rows, V)
        self.last, self.slot, self.logits = last[:rows], slot[:rows], logits[:rows]
        if rows > 1:
            self.depth = torch.zeros(rows, dtype=torch.long, device=device)
            self._rows = torch.arange(rows, device=device)
        self.p = engine.make_pass(self.slot, torch.arange(bucket, device=device).repeat(rows, 1), bucket)
        self.p.rope_rows()  # now, outside any capture: every stage's graph reads them (see Pass)

    def coda_logits(self, h: torch.Tensor) -> torch.Tensor:
        if self.rows == 1:
            return self.engine.logits(h.index_select(1, self.last))[:, -1]
        return self.engine.logits(h[self._rows, self.last][:, None])[:, -1]

    def load_prompts(self, lanes: list[int], prompts: list[list[int]], depths: list[int]) -> None:
        """Every row's prompt, lane and depth (as many of each as rows)."""
        if not (len(lanes) == len(prompts) == len(depths) == self.rows):
            raise ValueError(f"a {self.rows}-row prefill takes {self.rows} prompts, got {len(prompts)}")
        self.tokens.copy_(_pinned([t + [PAD_ID] * (self.bucket - len(t)) for t in prompts], self.tokens),
                          non_blocking=True)
        self.last.copy_(_pinned([len(t) - 1 for t in prompts], self.last), non_blocking=True)
        self.slot.copy_(_pinned(lanes, self.slot), non_blocking=True)
        self.depth.copy_(_pinned(depths, self.depth), non_blocking=True)

    def load_tokens(self, lane: int, tokens: list[int]) -> None:
        self.tokens.copy_(_pinned([tokens + [PAD_ID] * (self.bucket - len(tokens))], self.tokens),
                          non_blocking=True)
        self._load(lane, len(tokens))

    def load_residual(self, lane: int, residual: torch.Tensor) -> None:
        T = residual.shape[1]
        self.x[:, :T].copy_(residual)
        self.x[:, T:].zero_()  # pads: any finite value does
        self._load(lane, T)

    def _load(self, lane: int, T: int) -> None:
        self.last.fill_(T - 1)
        self.slot.fill_(lane)


def prefill_buffers(engine: Engine, bucket: int, rows: int = 1) -> tuple:
    """Static buffers of a padded prefill of up to `rows` prompts of up to `bucket` tokens:
    tokens, last index, slot, residual, logits."""
    cfg, device = engine.config, engine.cache.device
    dtype = engine.model.tok_embeddings.weight.dtype
    return (torch.zeros(rows, bucket, dtype=torch.long, device=device),
            torch.zeros(rows, dtype=torch.long, device=device),
            torch.zeros(rows, dtype=torch.long, device=device),
            torch.zeros(rows, bucket, cfg.residual_width, dtype=dtype, device=device),
            torch.zeros(rows, cfg.vocab_size, dtype=torch.float32, device=device))


def rows_prefill_buffers(engine: Engine, tokens: int, rows: int) -> tuple:
    """Static buffers every multi-row padded prefill of up to `rows` prompts and `tokens`
    padded tokens in all can take views of (`rows_prefill_views`): tokens and residual flat,
    last index, slot and logits per row."""
    tok, _, _, x, _ = prefill_buffers(engine, tokens)
    _, last, slot, _, logits = prefill_buffers(engine, 0, rows)
    return tok.view(-1), last, slot, x.view(tokens, -1), logits


def rows_prefill_views(buffers: tuple, rows: int, bucket: int) -> tuple:
    """The (rows, bucket[, D]) fronts of `rows_prefill_buffers`, contiguous, as PaddedPrefill
    takes them."""
    tok, last, slot, x, logits = buffers
    return tok[:rows * bucket].view(rows, bucket), last, slot, x[:rows * bucket].view(rows, bucket, -1), logits


class BatchStep(StagedPass):
    """One decode step of `bucket` rows: per row a token, its position, its depth
    (`Engine.run_loops(depth=...)`) and its cache slot, all in one (4, bucket) int64 buffer,
    written from a host staging buffer (`Staging`: one copy, no tensor made per step). A
    stage after the coda, "greedy", writes each row's greedy token (`greedy`): inside the
    step's graph, not a launch of its own after it. The early-exit step, which runs the coda
    for its checks too, leaves that stage out.

    A row that takes no part is idle: token 0, position `max_seq_len` (outside the cache:
    `rope_decode_attention` neither writes nor reads its cache), depth 0, slot 0. No stage
    computes RoPE rows: each attention gathers its rows' rows of the model's tables at the
    positions in the buffer. The buffers may be views of larger ones shared by every bucket
    (`batch_buffers`): their stages never run at once."""

    def __init__(self, engine: Engine, bucket: int, buffers: tuple | None = None):
        ctl, x, logits, greedy = buffers if buffers is not None else batch_buffers(engine, bucket)
        self.engine, self.bucket = engine, bucket
        self.ctl = ctl[:, :bucket]                       # (4, bucket): tokens, positions, depths, slots
        self.tokens, self.depth = self.ctl[0, :, None], self.ctl[2]
        self.x, self.logits = x[:bucket], logits[:bucket]  # (bucket, 1, D), (bucket, V)
        self.greedy = greedy[:bucket]                    # (bucket,)
        self._staging = None  # made on the first load (the host side of ctl)
        S = engine.cache.max_seq_len
        # no rope: rows kept in this pass would go stale, its positions change every step
        self.p = Pass(self.ctl[3], self.ctl[1, :, None], S + 1)

    @staticmethod
    def stages(loops: int) -> list:
        return [*StagedPass.stages(loops), "greedy"]

    def coda_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.engine.logits(h)[:, -1]

    def load(self, lanes: list[int], tokens: list[int], positions: list[int], depths: list[int],
             on_device: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Rows [0, len(lanes)) from the lists, the rest idle. on_device (row indices, tokens),
        both device tensors: those rows' tokens, sampled on the device and not read on the
        host yet; they replace the host list's entries (row indices None: rows 0, 1, ...)."""
        B = len(lanes)
        if self._staging is None:
            self._staging = Staging((4, self.bucket), self.ctl.dtype, self.ctl.device)
        v = self._staging.next()
        for k, (row, idle) in enumerate(((tokens, 0), (positions, self.engine.cache.max_seq_len), (depths, 0),
                                         (lanes, 0))):
            v[k, :B] = row
            v[k, B:] = idle
        self._staging.copy_to(self.ctl)
        _device_tokens_into(self.ctl[0], on_device)


def _device_tokens_into(tokens: torch.Tensor, on_device: tuple[torch.Tensor | None, torch.Tensor] | None) -> None:
    """A step's token row: the rows sampled on the device and not read on the host yet take
    their tokens from there (rows None: rows 0, 1, ...)."""
    if on_device is not None:
        rows, values = on_device
        if rows is None:
            tokens[:values.shape[0]].copy_(values)
        else:
            tokens.index_copy_(0, rows, values)


def batch_buffers(engine: Engine, bucket: int) -> tuple:
    """Static buffers of a batched decode step of up to `bucket` rows: (tokens, positions,
    depths, slots), residual, logits, greedy tokens."""
    cfg, device = engine.config, engine.cache.device
    dtype = engine.model.tok_embeddings.weight.dtype
    return (torch.zeros(4, bucket, dtype=torch.long, device=device),
            torch.zeros(bucket, 1, cfg.residual_width, dtype=dtype, device=device),
            torch.zeros(bucket, cfg.vocab_size, dtype=torch.float32, device=device),
            torch.zeros(bucket, dtype=torch.long, device=device))


class InterleavedStep(StagedPass):
    """Passes of `bucket` decode rows that each sit at their own iteration of their own token
    (`Runner.interleave`). Per row, in one (9, bucket) int64 buffer: its token, position, cache
    lane, the iteration it starts the call at, its row of the lane residuals (`lane_x`, which
    keeps a row's residual between calls; n_slots for an idle row, a row of its own), the
    layer-flattened cache rows of its loop layer 0 at the iteration it runs next and at its last
    (kernels/interleave.py: a row is live while the first is at most the second), its depth, and
    the iterations its token has run where an exit rule stopped it (its depth otherwise).

    Stages, each over every row of the bucket:
    - "next": the rows of the last load again, each row whose token the launch before ended one
      position on and starting its next token, its greedy token of that launch (`greedy` is the
      coda's argmax), each other row going on with its token from where it stopped (all on the
      device: `loaded` holds each row as it would start its next token);
    - "resume": the residual of each row from its lane's row of lane_x;
    - "prelude": the rows that start at iteration 0 embed their token and run the prelude (the
      others pass position max_seq_len, which writes and reads no cache, and keep their residual);
    - "iter": one iteration, each row at its own (its cache rows from `Ops.interleave_pass`),
      kept only where the row is live (one past its depth writes and reads nothing and carries
      its residual); every row then moves on by one iteration;
    - "save": each row's residual into its lane's row of lane_x;
    - "coda": the rows whose iterations passed their last run the coda (the others, again, at
      position max_seq_len) and every row the head: the logits of the rows that finished, and
      their argmax (`greedy`).

    With exit rules (`with_exits`: an ExitState of n_slots + 1 rows, one per lane and row n_slots
    for the idle rows, which keeps each lane's criteria between calls as lane_x keeps its
    residual), three more stages:
    - "exit_start": every row's rule into its lane's parameters, and the criteria's running
      state cleared for the rows that start a token;
    - "iter_exit": "iter", then each live row's check (`ExitState.check` over its lane's state);
      a row its rule stops has its depth entry set to the iterations it ran, and its last cache
      row pulled back to them, so it is live no more: later passes carry it, the coda takes it;
    - "exit_end": the skipped iterations' cache entries of the rows that stopped (the `copy`
      policy, `Ops.exit_fill_rows`), and each row's iterations, whether its token ended and its
      greedy token published to a host buffer (pinned on CUDA): one host read for all three.

    An idle row: token 0, position max_seq_len, lane 0, lane_x row n_slots, past its last
    iteration from the start (so never live, its cache rows lane 0's valid ones), depth 0. The
    buffers may be views of larger ones shared by every bucket (`interleaved_buffers`)."""

    def __init__(self, engine: Engine, bucket: int, lane_x: torch.Tensor, buffers: tuple | None = None):
        ctl, x, logits, pos, rows, live = buffers if buffers is not None else interleaved_buffers(engine, bucket)
        cfg, cache = engine.config, engine.cache
        self.engine, self.bucket, self.lane_x = engine, bucket, lane_x
        self.ctl = ctl[:, :bucket]
        self.tokens = self.ctl[0, :, None]
        self.positions, self.lanes, self.starts, self.xrows, self.base, self.last, self.token_depth, self.ran = (
            self.ctl[k] for k in range(1, 9))
        self.x, self.logits, self.live = x[:bucket], logits[:bucket], live[:bucket]
        self.pos = pos[:, :bucket]  # (3, bucket, 1): the positions the prelude, iter and coda pass
        self.rows = rows[:cfg.n_loop_layers * bucket].view(cfg.n_loop_layers, bucket)  # contiguous, per bucket
        self.S, self.n_slots = cache.max_seq_len, cache.n_slots
        self.stride = cfg.n_loop_layers * cache.n_slots  # one iteration in the layer-flattened cache
        self._outside = torch.tensor(self.S, device=cache.device)  # the position that touches no cache
        self.passes = [Pass(self.lanes, self.pos[k], self.S + 1) for k in range(3)]
        self.exits = None  # an ExitState over the lanes, once `with_exits`
        self._staging = self._rule_staging = None  # the host side of ctl's and rules' loads
        self._rules_loaded = None  # the rows `rules` holds (ExitState.load_host's list: kept unchanged)
        # rows 0-8: ctl as the last `load` wrote it with each row at the start of its token (start
        # 0, its first cache row), at the position of the token it runs (a row's next token starts
        # from here, one position on); row 9: 1 for its rows; rows 10-11: the load's own starts and
        # first cache rows, for ctl
        self.loaded = torch.zeros(12, bucket, dtype=ctl.dtype, device=ctl.device)
        self._loaded_rows = 0
        self.greedy = torch.zeros(bucket, dtype=torch.long, device=ctl.device)  # the coda's argmax

    def reload_next(self, tokens: torch.Tensor) -> None:
        """The rows of the last `load`, each at its next position and starting its next token,
        tokens[i] (on the device) for row i, all on the device: for rows whose every token ended
        in the launch before (the caller knows). The "next" stage moves rows on inside the launch,
        with each ended row's greedy token of the launch before (`greedy`), whichever ended."""
        self._move_on()
        self.ctl[0, :self._loaded_rows].copy_(tokens)

    def _move_on(self) -> None:
        """The "next" stage: each row of the last `load` whose token ended (its iterations past
        its last, set by the passes or its exit rule) one position on at the start of its next
        token, its greedy token; each other row as it stands, marked as midway (start 1: no
        prelude, its exit criteria kept); idle rows idle (`Ops.interleave_next`)."""
        self.engine.ops.interleave_next(self.ctl, self.loaded, self.greedy)

    def with_exits(self, state, never: list[float], criteria) -> None:
        """Give the step exit stages over `state` (the class docstring); never: the parameters
        of a row with no rule and depth 0 (ExitState's), for the idle rows' row; criteria: those
        the passes check (early_exit.INTERLEAVED_CRITERIA)."""
        if self.exits is not None:
            return
        dev = self.x.device
        self.exits = state
        self.rules = torch.zeros(self.bucket, 6, dtype=torch.float32, device=dev)
        self.never_host = list(never)
        self.never = torch.tensor(never, dtype=torch.float32, device=dev)
        self.published = torch.zeros(3, self.bucket, dtype=torch.long, pin_memory=dev.type == "cuda")
        self.published_event = torch.cuda.Event() if dev.type == "cuda" else None
        self.kinds = state.all_kinds & frozenset(criteria)

    @torch.no_grad()
    def run(self, stage) -> None:
        e, x = self.engine, self.x
        if stage == "resume":
            torch.index_select(self.lane_x, 0, self.xrows, out=x)
        elif stage == "prelude":
            start = self.starts == 0
            torch.where(start, self.positions, self._outside, out=self.pos[0, :, 0])
            torch.where(start[:, None, None], e.embed_prelude(self.tokens, self.passes[0]), x, out=x)
        elif stage == "iter":
            self._pass()
        elif stage == "save":
            self.lane_x.index_copy_(0, self.xrows, x)
        elif stage == "coda":
            torch.where(self.base > self.last, self.positions, self._outside, out=self.pos[2, :, 0])
            self.logits.copy_(e.logits(e.coda(x, self.passes[2]))[:, -1])
            torch.argmax(self.logits, dim=-1, out=self.greedy)
        elif stage == "next":
            self._move_on()
        elif stage in EXIT_STAGES and self.exits is not None:
            self._run_exit(stage)
        else:
            raise ValueError(f"an interleaved step has no stage {stage!r}")

    def _pass(self, order: torch.Tensor | None = None) -> None:
        """One iteration of every row, each at its own (the "iter" stage); with order, each row's
        row of the exit state's buffers too (its lane's where live, else the idle rows')."""
        e, x = self.engine, self.x
        e.ops.interleave_pass(self.base, self.last, self.positions, self.S, self.stride, self.n_slots,
                              self.rows, self.pos[1, :, 0], self.live, order, None if order is None else self.xrows)
        torch.where(self.live[:, None, None], e.iteration_rows(x, self.passes[1], self.rows), x, out=x)

    def _run_exit(self, stage) -> None:
        e, st, n = self.engine, self.exits, self.n_slots
        if stage == "exit_start":
            st.params.index_copy_(0, self.xrows, self.rules)
            st.params[n].copy_(self.never)  # the idle rows' row: no rule, so never a decision
            fresh = torch.where(self.starts == 0, self.xrows, n)  # the rows that start a token
            for buf, value in ((st.d, 0), (st.remaining, 1), (st.cum, 0), (st.prev_arg, -1), (st.streak, 0)):
                buf.index_fill_(0, fresh, value)
        elif stage == "iter_exit":
            # live rows check their own lane's criteria; the others (done, idle) the idle row's
            self._pass(st.order[:self.bucket])
            st.check(self.bucket, e.model.state(self.x[:, 0]), None, self.ran, None, self.kinds)
            cfg = e.config
            e.ops.interleave_stop(self.ran, self.token_depth, self.last, self.lanes, cfg.n_prelude, cfg.n_loop_layers, n)
        else:  # exit_end
            cfg, cache = e.config, e.cache
            e.ops.exit_fill_rows(cache.k, cache.v, self.ran, self.token_depth, self.lanes, self.positions, cfg.n_prelude,
                                 cfg.n_loop_layers, cache.max_loops)
            self.published[0].copy_(self.ran, non_blocking=True)
            self.published[1].copy_(self.base > self.last, non_blocking=True)
            self.published[2].copy_(self.greedy, non_blocking=True)

    def load(self, lanes: list[int], tokens: list[int], positions: list[int], depths: list[int],
             starts: list[int], on_device: tuple[torch.Tensor | None, torch.Tensor] | None = None,
             rules: list[list[float]] | None = None) -> None:
        """Rows [0, len(lanes)) from the lists, the rest idle; on_device as `BatchStep.load`'s;
        rules: each row's exit parameters (ExitState.load_host's rows), with exit stages."""
        B = len(lanes)
        cfg, n = self.engine.config, self.n_slots
        nl, npre = cfg.n_loop_layers, cfg.n_prelude
        if self._staging is None:
            self._staging = Staging(tuple(self.loaded.shape), self.ctl.dtype, self.ctl.device)
        v = self._staging.next()
        lane, start, depth = (np.asarray(a, dtype=np.int64) for a in (lanes, starts, depths))
        # an idle row: past its last (valid) row from the start, so never live
        for k, (row, idle) in enumerate(((tokens, 0), (positions, self.S), (lane, 0), (0, 0), (lane, n),
                                        (npre * n + lane, (nl + npre) * n),
                                        (((depth - 1) * nl + npre) * n + lane, npre * n), (depth, 0), (depth, 0),
                                        (1, 0), (start, 0), ((start * nl + npre) * n + lane, (nl + npre) * n))):
            v[k, :B] = row
            v[k, B:] = idle
        self._staging.copy_to(self.loaded)
        self.ctl.copy_(self.loaded[:9])
        if any(starts):  # rows midway through a token: their own start and first cache row
            self.ctl[3:6:2].copy_(self.loaded[10:12])
        self._loaded_rows = B
        _device_tokens_into(self.ctl[0], on_device)
        if rules is not None and rules is not self._rules_loaded:  # the same rows are on the device already
            if self._rule_staging is None:
                self._rule_staging = Staging(tuple(self.rules.shape), self.rules.dtype, self.ctl.device)
            r = self._rule_staging.next()
            if B:
                r[:B] = rules
            r[B:] = self.never_host
            self._rule_staging.copy_to(self.rules)
            self._rules_loaded = rules


INTERLEAVED_STAGES = ("next", "resume", "prelude", "iter", "save", "coda")
EXIT_STAGES = ("exit_start", "iter_exit", "exit_end")  # an interleaved step's, with exit rules


def interleaved_buffers(engine: Engine, bucket: int) -> tuple:
    """Static buffers of interleaved passes of up to `bucket` rows: the (9, bucket) control rows,
    residual, logits, the three passes' positions, the iteration's flat cache rows and live rows."""
    cfg, device = engine.config, engine.cache.device
    dtype = engine.model.tok_embeddings.weight.dtype
    return (torch.zeros(9, bucket, dtype=torch.long, device=device),
            torch.zeros(bucket, 1, cfg.residual_width, dtype=dtype, device=device),
            torch.zeros(bucket, cfg.vocab_size, dtype=torch.float32, device=device),
            torch.zeros(3, bucket, 1, dtype=torch.long, device=device),
            torch.zeros(cfg.n_loop_layers * bucket, dtype=torch.long, device=device),
            torch.zeros(bucket, dtype=torch.bool, device=device))


def ancestor_table(parents: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """parents (N,) int64 (-1: the root; parents[u] < u) -> (depth (N,), ancestors (N, width)):
    each node's depth and its ancestors' node indices by depth (root first), 0 past its depth.
    Host work, once per tree shape."""
    parents = parents.tolist()
    depth, anc = [], []
    for u, p in enumerate(parents):
        chain = [] if p < 0 else anc[p][:depth[p]] + [p]
        depth.append(len(chain))
        anc.append(chain + [0] * (width - len(chain)))
    return torch.tensor(depth, dtype=torch.long), torch.tensor(anc, dtype=torch.long).view(len(parents), width)


def tree_layout(K: int, depth: int, device=None):
    """The breadth-first draft tree: node 0 the root, node 1 + (i - 1)·K + b the depth-i node of
    branch b. -> (parents (N,) int64, node depths (N,) int64)."""
    N = 1 + K * depth
    node = torch.arange(N, device=device)
    depths = torch.where(node == 0, 0, (node - 1) // K + 1)
    parents = torch.where(node == 0, -1, torch.where(depths == 1, 0, node - K))
    return parents, depths


class TreeStages(StagedPass):
    """Tree-mode passes (engine.Tree) over a bucket of nodes of one lane.

    "prelude" embeds the nodes' tokens, iteration i runs in place on the residual buffer,
    "coda" gives the logits of every node. Node u sits at cache position pos + u and attends to
    the prefix (its length a device buffer: the tree-attention kernel bounds its reads by it)
    and to its ancestors. The slot, cache positions, RoPE positions, prefix length, ancestor
    masks and RoPE rows are buffers that `load_chain` or `load_tree` sets.

    A chain verify is a tree pass over a chain (each node's ancestors: the nodes before it).
    Pads (nodes past the tree) sit at the positions after it, at RoPE positions equal to their
    slots, attend to themselves only, and write K/V there: harmless, since nothing reads a
    position before a later round or step writes it, and no real node has a pad as an
    ancestor. A tree runs only where its pads stay inside the cache (`fits`)."""

    def __init__(self, engine: Engine, bucket: int):
        cfg, device = engine.config, engine.cache.device
        dtype = engine.model.tok_embeddings.weight.dtype
        self.engine, self.bucket = engine, bucket
        self.tokens = torch.zeros(1, bucket, dtype=torch.long, device=device)
        self.x = torch.zeros(1, bucket, cfg.residual_width, dtype=dtype, device=device)
        self.logits = torch.zeros(bucket, cfg.vocab_size, dtype=torch.float32, device=device)
        self.offsets = torch.arange(bucket, device=device)[None]
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.slots = self.offsets.clone()       # (1, bucket): pos + node
        self.positions = self.offsets.clone()   # (1, bucket): pos + the node's depth (a pad's: its slot)
        self.prefix = torch.zeros(1, dtype=torch.long, device=device)
        chain = torch.arange(-1, bucket - 1, device=device)
        self.chain = ancestors_from_parents(chain[None])
        self.ancestors = self.chain.clone()
        # each node's depth and its ancestors' node indices (the batch-invariant read's), and
        # the ancestors' slots: the chain's, or the loaded tree's
        self.chain_table = self._table(chain)
        self.node_depth, self.ancestor_slots = (t.clone() for t in self.chain_table)
        # (K, k): tree_layout's ancestors and positions and the invariant read's table, padded
        self.trees: dict[tuple[int, int], tuple] = {}
        S = engine.cache.max_seq_len
        self.p = engine.make_pass(self.slot, self.positions, S)
        self.p.tree = Tree(self.slots, self.prefix, self.ancestors, depth=self.node_depth,
                           ancestor_slots=self.ancestor_slots)
        self.p.rope_rows()  # gathered now, into buffers the loads refresh (see Pass)

    def _table(self, parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`ancestor_table` of the bucket's parents (N,), as (1, N) and (1, N, N - 1) device tensors."""
        return tuple(t.to(parents.device)[None] for t in ancestor_table(parents.cpu(), max(self.bucket - 1, 1)))

    @staticmethod
    def span(start: int, stop: int, prelude: bool = False) -> list:
        return [*(["prelude"] if prelude else []), *range(start, stop), "coda"]

    def fits(self, pos: int) -> bool:
        return pos + self.bucket <= self.engine.cache.max_seq_len

    def coda_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.engine.logits(h, self.p)[0]

    def _place(self, lane: int, pos: int, ancestors: torch.Tensor, depths: torch.Tensor | None,
               table: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.slot.fill_(lane)
        torch.add(self.offsets, pos, out=self.slots)
        self.node_depth.copy_(table[0])
        torch.add(table[1], pos, out=self.ancestor_slots)  # node u sits at slot pos + u
        if depths is None:
            self.positions.copy_(self.slots)
        else:
            torch.add(depths, pos, out=self.positions)
        self.prefix.fill_(pos)
        self.ancestors.copy_(ancestors)
        m = self.engine.model
        for table, rows in zip((m.rope_cos, m.rope_sin), self.p.rows):
            torch.index_select(table, 0, self.positions.view(-1), out=rows.view(self.bucket, -1))

    @torch.no_grad()
    def load_chain(self, lane: int, residual: torch.Tensor, pos: int) -> None:
        """The chain (1, n, D) of residuals whose first token sits at pos."""
        n = residual.shape[1]
        self.x[:, :n].copy_(residual)
        self.x[:, n:].zero_()  # pads: any finite value does
        self._place(lane, pos, self.chain, None, self.chain_table)

    @torch.no_grad()
    def load_tree(self, lane: int, t: int, pos: int, K: int, k: int) -> None:
        """A round's tree (`tree_layout(K, k)`) rooted at token t at pos: the root's token,
        every other node's 0 until drafted."""
        if (K, k) not in self.trees:
            parents, depths = tree_layout(K, k, self.offsets.device)
            pad = torch.arange(parents.shape[0], self.bucket, device=parents.device)
            padded = torch.cat([parents, torch.full_like(pad, -1)])  # a pad: a root of its own, depth 0
            self.trees[(K, k)] = (ancestors_from_parents(padded[None]), torch.cat([depths, pad])[None],
                                  self._table(padded))
        ancestors, depths, table = self.trees[(K, k)]
        self.tokens.zero_()
        self.tokens[:, :1].fill_(t)
        self._place(lane, pos, ancestors, depths, table)
