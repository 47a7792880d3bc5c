"""Self-speculative decoding: the draft model is the same model at a shallower depth.

Chain. A round starts at position p with the token t_p already decided (emitted) but not yet
fed. The draft feeds t_p, d_1, ..., d_{k-1} one decode step at a time at `draft_loops` (L_d),
each step drafting the next token from its L_d logits, then feeds d_k through iterations
[0, L_d) only. Every step keeps its residual after L_d iterations.

Warm-start verification. Iteration i of a token reads only tokens <= it at iterations <= i, with
the weights every iteration shares, so the draft's cache layers [0, L_d) for the chunk
[t_p, d_1 .. d_k] are exactly the layers a verify at `verify_loops` (L_v) would write for the
tokens that get accepted. Verify therefore runs only iterations [L_d, L_v) over the chunk, from
the saved residuals, then the coda and the logits at every chunk position: each chunk token runs
L_v iterations in total, never more (the engine's counters prove it). Verifier logits at p + i
decide position p + i + 1: accept while the verifier's token equals the draft; the verifier's
token at the first mismatch (or the bonus after a fully accepted chunk) is the round's last
token and the next round's t_p.

Tree. K branches: branch b starts from the b-th most likely draft token after t_p, then a greedy
chain, k tokens deep. The 1 + K·k nodes sit in the cache breadth first after the prefix (node 0
is t_p at slot p, depth-i node of branch b at slot p + 1 + (i - 1)·K + b), so the nodes drafted
so far always fill a contiguous run of slots. One tree pass per depth drafts all branches; one
tree pass over every node verifies them all (compact mask: an int64 ancestor bitmask per node).
The accepted path's K / V then move from node slots to their linear slots p + depth in every
cache layer the verifier uses. With K = 1 the layout is the chain's.

Rollback. The cache is position addressed and every read is bounded by the reader's position
(or the nodes written so far), so K / V left by rejected tokens are overwritten before anything
reads them; nothing is copied back.

Sampling (temperature > 0). Chain: speculative sampling (Leviathan et al. 2023; Chen et al.
2023): d ~ q, accept with min(1, p(d) / q(d)), else draw from normalize(max(0, p - q)); the
emitted token is distributed as p. Tree: the K first tokens are deterministic proposals (top-K
of q), i.e. point masses; the multi-candidate form of the same rule (accept candidate x with
p'(x), else remove it from p' and renormalise, then draw from what is left) emits a token
distributed exactly as p, and in law it is a single draw y ~ p followed by "accept the child
whose token is y". That draw is the plain sampler's own (STREAM_TOKEN at the position), so a
seeded tree run emits the same tokens as a seeded `generate` at verify_loops. Every random
number is sampling.uniform(seed, absolute position, stream): reproducible on any path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyloop.kernels.tree_attention import MAX_NODES, ancestors_from_parents
from tinyloop.worker.runner.engine import Engine, Pass, Tree
from tinyloop.worker.generation.decode import (FINISH_LENGTH, FINISH_STOP, Finish, Request, StagedPass, TokenStream,
                                      prefill)
from tinyloop.worker.generation.sampling import (STREAM_ACCEPT, STREAM_RESIDUAL, STREAM_TOKEN, SamplingParams,
                                      draw, probs, uniform)

MAX_DRAFT_AHEAD = 16
MAX_BRANCHES = 8


@dataclass(frozen=True)
class SpecParams:
    draft_loops: int
    verify_loops: int
    draft_ahead: int
    k_branches: int = 1
    tree: bool = False   # False: the chain path (k_branches must be 1); True: tree passes

    def check(self, max_loops: int) -> "SpecParams":
        """Raise ValueError with the argument's name and the reason."""
        for name in ("draft_loops", "verify_loops", "draft_ahead", "k_branches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{name} must be an int, got {type(v).__name__}")
        if self.draft_loops < 1:
            raise ValueError(f"draft_loops must be >= 1, got {self.draft_loops}")
        if self.verify_loops > max_loops:
            raise ValueError(f"verify_loops={self.verify_loops} exceeds max_loops={max_loops}")
        if self.draft_loops >= self.verify_loops:
            raise ValueError(f"draft_loops={self.draft_loops} must be < verify_loops={self.verify_loops}")
        if not 1 <= self.draft_ahead <= MAX_DRAFT_AHEAD:
            raise ValueError(f"draft_ahead={self.draft_ahead} out of range [1, {MAX_DRAFT_AHEAD}]")
        if not 1 <= self.k_branches <= MAX_BRANCHES:
            raise ValueError(f"K_branches={self.k_branches} out of range [1, {MAX_BRANCHES}]")
        if not self.tree and self.k_branches != 1:
            raise ValueError("the chain path takes k_branches=1; use the tree path for more branches")
        if 1 + self.k_branches * self.draft_ahead > MAX_NODES:
            raise ValueError(f"a tree of 1 + K_branches·draft_ahead = {1 + self.k_branches * self.draft_ahead} "
                             f"nodes exceeds the {MAX_NODES} the tree mask holds")
        return self


# -- accept / resample -------------------------------------------------------------------
def accept_or_resample(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor,
                       u_accept: torch.Tensor, u_residual: torch.Tensor):
    """Speculative sampling's decision at one position, batched over rows.

    p, q (B, V) target and draft distributions, draft (B,) tokens drawn from q, uniforms (B,).
    -> (accepted (B,) bool, token (B,)): the draft where accepted (probability
    min(1, p / q)), else a draw from normalize(max(0, p - q)). The token is distributed as p."""
    p, q = p.double(), q.double()
    pd, qd = p.gather(1, draft[:, None])[:, 0], q.gather(1, draft[:, None])[:, 0]
    accepted = u_accept * qd < pd  # u < p / q without dividing; always true where p >= q
    residual = (p - q).clamp_min(0)
    # p == q leaves no residual mass (and then every draft is accepted): fall back to p
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    return accepted, torch.where(accepted, draft, draw(residual, u_residual))


class _Chooser:
    """The verifier's and the draft's token choices at absolute positions, for one request."""

    def __init__(self, sampling: SamplingParams, seed: int, device):
        self.sp = sampling
        self.greedy = sampling.greedy
        self.seed = torch.tensor([seed], device=device)
        self.device = device

    def _u(self, pos: int, stream: int) -> torch.Tensor:
        return uniform(self.seed, torch.tensor([pos], device=self.device), stream)

    def target(self, logits: torch.Tensor, pos: int) -> int:
        """The plain sampler's token at `pos` (argmax, or the STREAM_TOKEN draw from p)."""
        if self.greedy:
            return int(logits.argmax(-1))
        return int(draw(probs(logits.view(1, -1), self.sp), self._u(pos, STREAM_TOKEN)))

    def draft(self, logits: torch.Tensor, pos: int) -> tuple[int, torch.Tensor | None]:
        """A chain draft token at `pos` and its distribution q (None under greedy)."""
        if self.greedy:
            return int(logits.argmax(-1)), None
        q = probs(logits.view(1, -1), self.sp)
        return int(draw(q, self._u(pos, STREAM_TOKEN))), q

    def verify(self, logits: torch.Tensor, q: torch.Tensor | None, d: int, pos: int) -> tuple[bool, int]:
        """Chain verification of draft d at `pos` -> (accepted, emitted token)."""
        if self.greedy:
            t = int(logits.argmax(-1))
            return t == d, t
        p = probs(logits.view(1, -1), self.sp)
        acc, tok = accept_or_resample(p, q, torch.tensor([d], device=self.device),
                                      self._u(pos, STREAM_ACCEPT), self._u(pos, STREAM_RESIDUAL))
        return bool(acc), int(tok)


class _Emitter:
    """Counts emitted tokens against max_tokens and stop ids; truncates a round's tokens."""

    def __init__(self, req: Request):
        self.req = req
        self.generated = 0
        self.reason: str | None = None

    def take(self, tokens: list[int]) -> list[int]:
        out = []
        for t in tokens:
            out.append(t)
            self.generated += 1
            if t in self.req.stop_ids:
                self.reason = FINISH_STOP
                break
            if self.generated >= self.req.max_tokens:
                self.reason = FINISH_LENGTH
                break
        return out


# -- the generators ------------------------------------------------------------------------
def stream_speculative(engine: Engine, lane: int, req: Request, spec: SpecParams) -> TokenStream:
    """Prefill at verify_loops, then chain or tree rounds; yields each verify's tokens."""
    before = engine.counters.snapshot()
    chooser = _Chooser(req.sampling, req.seed, engine.cache.k.device)
    emit = _Emitter(req)
    T = len(req.prompt)
    logits, _ = prefill(engine, lane, req.prompt, spec.verify_loops, 0)
    t = chooser.target(logits[0], T)
    yield emit.take([t])
    rounds = drafted = accepted = 0
    pos = T  # position of t: decided, not yet fed
    while emit.reason is None:
        # never draft past what max_tokens can still use: a round emits at most k + 1 tokens
        k = min(spec.draft_ahead, req.max_tokens - emit.generated - 1)
        if spec.tree:  # side branches sit past the linear positions: keep every node inside the cache
            k = min(k, (engine.cache.max_seq_len - pos - 1) // spec.k_branches)
        if spec.tree:
            toks, n_acc = _tree_round(engine, lane, spec, chooser, t, pos, k)
        else:
            toks, n_acc = _chain_round(engine, lane, spec, chooser, t, pos, k)
        rounds += 1
        drafted += k
        accepted += n_acc
        pos += len(toks)
        t = toks[-1]
        yield emit.take(toks)
    work = engine.counters.since(before)
    return Finish(emit.reason, {
        "prompt_tokens": T, "completion_tokens": emit.generated,
        "loop_iterations": work.loop_iterations,
        "loop_token_iterations": work.loop_token_iterations,
        "verify_steps": rounds, "drafted_tokens": drafted, "accepted_tokens": accepted,
        "accepted_per_verify": accepted / rounds if rounds else 0.0,
        "tokens_per_verify": (emit.generated - 1) / rounds if rounds else 0.0,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "draft_loops": spec.draft_loops, "verify_loops": spec.verify_loops,
        "draft_ahead": spec.draft_ahead, "k_branches": spec.k_branches,
    })


def _chain_round(engine: Engine, lane: int, spec: SpecParams, chooser: _Chooser, t: int, pos: int,
                 k: int) -> tuple[list[int], int]:
    """Draft k tokens after t (at pos), verify [t, d_1 .. d_k] from the draft's residuals.
    -> (tokens decided this round, number of drafts accepted)."""
    device = engine.cache.k.device
    Ld, Lv = spec.draft_loops, spec.verify_loops
    lanes = slice(lane, lane + 1)
    graph = engine.graphs.get(Ld, lane) if engine.graphs is not None and chooser.greedy else None
    drafts = None  # the graph drafts' tokens, on the device until the round's one read
    if graph is not None:
        drafts, x = _graph_drafts(engine, graph, t, pos, k)
    else:
        chunk, xs, qs = [t], [], []
        for i in range(k + 1):
            p = engine.make_pass(lanes, torch.tensor([[pos + i]], device=device), pos + i + 1)
            x = engine.run_loops(engine.embed_prelude(torch.tensor([[chunk[i]]], device=device), p), p, 0, Ld)
            xs.append(x)
            if i < k:  # the last drafted token needs only its residual, not a draft of its own
                d, q = chooser.draft(engine.logits(engine.coda(x, p))[0, -1], pos + i + 1)
                chunk.append(d)
                qs.append(q)
        x = torch.cat(xs, 1)
    n = k + 1
    logits = engine.graphs.verify.run(lane, x, pos, Ld, Lv) if engine.graphs is not None else None
    if logits is None:  # no captured stages cover it: eagerly
        p = engine.make_pass(lanes, torch.arange(pos, pos + n, device=device)[None], pos + n)
        logits = engine.logits(engine.coda(engine.run_loops(x, p, Ld, Lv), p))[0]  # (n, V)
    if chooser.greedy:
        # the verifier's tokens (and the graph drafts) in one read: accept while they agree
        targets = logits.argmax(-1)
        if drafts is not None:
            both = torch.cat([drafts, targets]).tolist()
            chunk, targets = [t, *both[:k]], both[k:]
        else:
            targets = targets.tolist()
        n_acc = next((i for i in range(k) if targets[i] != chunk[i + 1]), k)
        return targets[:n_acc + 1], n_acc  # the first mismatch, or the bonus after a full chunk
    out = []
    for i in range(k):
        ok, tok = chooser.verify(logits[i], qs[i], chunk[i + 1], pos + i + 1)
        out.append(tok)
        if not ok:
            return out, i
    out.append(chooser.target(logits[k], pos + k + 1))  # bonus: the whole chunk was accepted
    return out, k


def _graph_drafts(engine: Engine, graph, t: int, pos: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A greedy chain's drafts by replaying the lane's captured decode step at draft_loops
    (worker/graphs.py): k + 1 replays from t at pos, each fed its own greedy token on the device,
    so the drafts run with no launch from Python and no host sync (the round reads the drafted
    tokens with the verifier's). -> (d_1 .. d_k (k,) on the device, the residuals after the
    draft's iterations (1, k + 1, D)). The cache gets what the eager drafts write (every replay
    also runs the coda and head of its token, which the eager path skips for d_k: the verify
    overwrites those coda layers' K / V at the chunk's positions)."""
    residuals = graph.residual.new_empty(1, k + 1, graph.residual.shape[-1])
    drafts = graph.greedy.new_empty(k)
    for i in range(k + 1):
        graph.step(t if i == 0 else graph.greedy, pos + i)
        residuals[:, i] = graph.residual[:, 0]
        if i < k:
            drafts[i:i + 1] = graph.greedy
        engine.counters.loop_iterations += graph.loops
        engine.counters.loop_token_iterations += graph.loops
    return drafts, residuals


# Node counts TreeStages is built for: a chain round of the default draft_ahead (4), and the
# longest chain (trees of up to 17 nodes: K_branches x draft_ahead <= 16; larger trees run
# eagerly). Two, not more: each is a graph per lane and depth captured at start-up (with four,
# 1.5 s a lane on bench-285m against 0.8), and a pass's pads cost little (its projections are
# bound by the weight read).
VERIFY_BUCKETS = (5, MAX_DRAFT_AHEAD + 1)


def verify_bucket(n: int) -> int | None:
    """The smallest verify bucket that holds a chunk of n tokens (None: none does)."""
    return next((b for b in VERIFY_BUCKETS if b >= n), None)


class TreeStages(StagedPass):
    """Tree-mode passes (engine.Tree) over a bucket of nodes on `lane` as stages over static
    buffers, so that each stage is captured once as a CUDA graph (worker/graphs.py) and
    replayed for any tree of up to `bucket` nodes at any position and depths. The same stages
    run eagerly anywhere.

    Stages: "prelude" (the nodes' tokens embedded, the prelude), iteration i (in place on the
    residual buffer), "coda" (the coda, then the logits of every node). Node u sits at slot
    pos + u and attends to the prefix (its length a device-side buffer: the tree-attention
    kernel bounds its reads by it) and to its ancestors. The slots, positions, prefix length,
    ancestor masks and RoPE rows are buffers that `load_chain` or `load_tree` sets, so nothing
    in a stage depends on the position on the host.

    A chain round's verify (`verify_chain`) is a tree pass over a chain: the drafted residuals,
    iterations [L_d, L_v), the coda. A tree round (`_tree_round` on stages) runs, for each draft
    depth, the prelude and iterations [0, L_d) over every node with the tokens drafted so far,
    then the coda for that depth's logits; the verify continues from the last depth's residuals
    with iterations [L_d, L_v) and the coda. A node not drafted yet holds token 0 and writes
    K / V that nothing reads (a node attends to its ancestors only, all drafted at shallower
    depths) and the next depth rewrites.

    Pads (nodes past the tree) sit at the slots after it, at positions equal to their slots,
    attend to themselves only, and write K/V there, in the layers the stages run. That is
    harmless for the reason rejected drafts are (module docstring, Rollback): nothing reads a
    position before a later round or step writes it, and no real node has a pad as an ancestor.
    A tree runs only where its pads stay inside the cache (`fits`)."""

    def __init__(self, engine: Engine, lane: int, bucket: int):
        cfg, device = engine.config, engine.cache.k.device
        dtype = engine.model.tok_embeddings.weight.dtype
        self.engine, self.bucket = engine, bucket
        self.tokens = torch.zeros(1, bucket, dtype=torch.long, device=device)
        self.x = torch.zeros(1, bucket, cfg.d_model, dtype=dtype, device=device)
        self.logits = torch.zeros(bucket, cfg.vocab_size, dtype=torch.float32, device=device)
        self.offsets = torch.arange(bucket, device=device)[None]
        self.slots = self.offsets.clone()       # (1, bucket): pos + node
        self.positions = self.offsets.clone()   # (1, bucket): pos + the node's depth (a pad's: its slot)
        self.prefix = torch.zeros(1, dtype=torch.long, device=device)
        self.chain = ancestors_from_parents(torch.arange(-1, bucket - 1, device=device)[None])
        self.ancestors = self.chain.clone()
        self.trees: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (K, k): tree_layout's, padded
        S = engine.cache.max_seq_len
        self.p = engine.make_pass(slice(lane, lane + 1), self.positions, S)
        self.p.tree = Tree(self.slots, self.prefix, self.ancestors)
        self.p.rope_rows()  # gathered now, into buffers the loads refresh (see Pass)

    @staticmethod
    def stages(start: int, stop: int, prelude: bool = False) -> list:
        return [*(["prelude"] if prelude else []), *range(start, stop), "coda"]

    def fits(self, pos: int) -> bool:
        return pos + self.bucket <= self.engine.cache.max_seq_len

    def coda_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The coda stage's logits: every node's, (bucket, V)."""
        return self.engine.logits(h, self.p)[0]

    def _place(self, pos: int, ancestors: torch.Tensor, depths: torch.Tensor | None) -> None:
        torch.add(self.offsets, pos, out=self.slots)
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
    def load_chain(self, residual: torch.Tensor, pos: int) -> None:
        """Set the buffers for the chain (1, n, D) of residuals whose first token sits at pos."""
        n = residual.shape[1]
        self.x[:, :n].copy_(residual)
        self.x[:, n:].zero_()  # pads: any finite value does
        self._place(pos, self.chain, None)

    @torch.no_grad()
    def load_tree(self, t: int, pos: int, K: int, k: int) -> None:
        """Set the buffers for a round's tree (`tree_layout(K, k)`) rooted at token t at pos: the
        root's token, every other node's 0 until drafted."""
        if (K, k) not in self.trees:
            parents, depths = tree_layout(K, k, self.offsets.device)
            pad = torch.arange(parents.shape[0], self.bucket, device=parents.device)
            self.trees[(K, k)] = (ancestors_from_parents(torch.cat([parents, torch.full_like(pad, -1)])[None]),
                                  torch.cat([depths, pad])[None])
        ancestors, depths = self.trees[(K, k)]
        self.tokens.zero_()
        self.tokens[:, :1].fill_(t)
        self._place(pos, ancestors, depths)

    def verify_chain(self, residual: torch.Tensor, pos: int, start: int, stop: int, run=None) -> torch.Tensor:
        """The verify of the chain (1, n, D) of residuals at pos from iteration `start` to `stop`:
        its logits (n, V), a view of the buffer the next pass overwrites. run(stage) runs a
        stage: `self.run` (eager) or a captured graph's replay."""
        n = residual.shape[1]
        if not self.fits(pos) or n > self.bucket:
            raise ValueError(f"a chunk of {n} tokens at {pos} does not fit bucket {self.bucket} "
                             f"of a {self.engine.cache.max_seq_len}-position cache")
        e = self.engine
        self.load_chain(residual, pos)
        before = e.counters.snapshot()
        for stage in self.stages(start, stop):
            (run or self.run)(stage)
        # count what the chunk needs, as the eager verify does (a replay counts nothing)
        e.counters.loop_iterations = before.loop_iterations + stop - start
        e.counters.loop_token_iterations = before.loop_token_iterations + (stop - start) * n
        return self.logits[:n]


def tree_layout(K: int, depth: int, device=None):
    """The breadth-first draft tree: node 0 the root, node 1 + (i - 1)·K + b the depth-i node of
    branch b. -> (parents (N,) int64, node depths (N,) int64)."""
    N = 1 + K * depth
    node = torch.arange(N, device=device)
    depths = torch.where(node == 0, 0, (node - 1) // K + 1)
    parents = torch.where(node == 0, -1, torch.where(depths == 1, 0, node - K))
    return parents, depths


def _tree_round(engine: Engine, lane: int, spec: SpecParams, chooser: _Chooser, t: int, pos: int,
                k: int) -> tuple[list[int], int]:
    """Draft a K-branch tree of depth k below t (at pos), verify all nodes in one tree pass,
    move the accepted path to its linear slots. -> (tokens decided, drafts accepted). The
    passes replay the lane's captured tree stages where they cover the tree (`_staged_tree`),
    else run eagerly (`_eager_tree`)."""
    K = min(spec.k_branches, engine.config.vocab_size) if k else 1
    staged = None
    if engine.graphs is not None:
        staged = engine.graphs.verify.runner(lane, 1 + K * k, pos, TreeStages.stages(0, spec.verify_loops, True))
    tokens, logits, targets = (_eager_tree(engine, lane, spec, t, pos, k, K) if staged is None
                               else _staged_tree(engine, spec, chooser, t, pos, k, K, *staged))
    out, path, cur = [], [], 0
    for i in range(1, k + 1):
        y = targets[cur] if targets is not None else chooser.target(logits[cur], pos + i)
        out.append(y)
        children = range(1, 1 + K) if i == 1 else [cur + K]
        nxt = next((c for c in children if tokens[c] == y), None)
        if nxt is None:
            break
        path.append(nxt)
        cur = nxt
    else:  # bonus after a full branch
        out.append(targets[cur] if targets is not None else chooser.target(logits[cur], pos + k + 1))
    _move_path(engine, lane, pos, path, spec.verify_loops)
    return out, len(path)


def _eager_tree(engine: Engine, lane: int, spec: SpecParams, t: int, pos: int, k: int,
                K: int) -> tuple[list[int], torch.Tensor, None]:
    """The tree's passes run eagerly, each draft depth over that depth's nodes only.
    -> (the nodes' tokens, their verifier logits (N, V), None)."""
    device = engine.cache.k.device
    Ld, Lv = spec.draft_loops, spec.verify_loops
    lanes = slice(lane, lane + 1)
    parents, depths = tree_layout(K, k, device)
    N = parents.shape[0]
    anc = ancestors_from_parents(parents[None])                       # (1, N)
    prefix = torch.tensor([pos], device=device)
    tokens = torch.empty(N, dtype=torch.long, device=device)
    tokens[0] = t
    xs = []
    for i in range(k + 1):
        n_written = 1 + i * K  # breadth first: the nodes up to depth i fill slots [pos, pos + n_written)
        nodes = torch.arange(n_written - (K if i else 1), n_written, device=device)
        p = _tree_pass(engine, lanes, pos, depths, nodes, prefix, anc[:, :n_written])
        x = engine.run_loops(engine.embed_prelude(tokens[nodes][None], p), p, 0, Ld)
        xs.append(x)
        if i < k:
            _draft_depth(engine.logits(engine.coda(x, p))[0], tokens, i, K)
    p = _tree_pass(engine, lanes, pos, depths, None, prefix, anc)
    logits = engine.logits(engine.coda(engine.run_loops(torch.cat(xs, 1), p, Ld, Lv), p))[0]  # (N, V)
    return tokens.tolist(), logits, None


def _staged_tree(engine: Engine, spec: SpecParams, chooser: _Chooser, t: int, pos: int, k: int, K: int,
                 ts: TreeStages, run) -> tuple[list[int], torch.Tensor, list[int] | None]:
    """The tree's passes on TreeStages (run(stage): a replay of the lane's captured stage, or
    the stage eagerly), each draft depth over every node. The tokens move on the device only; a
    greedy round reads them and the verifier's argmax in one transfer. The counters count what
    the eager passes run: each draft depth's nodes, not the whole bucket.
    -> (the nodes' tokens, their verifier logits (N, V), greedy: the verifier's tokens, else None)."""
    Ld, Lv = spec.draft_loops, spec.verify_loops
    N = 1 + K * k
    ts.load_tree(t, pos, K, k)
    before = engine.counters.snapshot()
    for i in range(k + 1):
        for stage in ("prelude", *range(Ld)):
            run(stage)
        if i < k:
            run("coda")
            first = 1 + (i - 1) * K if i else 0
            _draft_depth(ts.logits[first:first + (K if i else 1)], ts.tokens[0], i, K)
    for stage in (*range(Ld, Lv), "coda"):
        run(stage)
    engine.counters.loop_iterations = before.loop_iterations + (k + 1) * Ld + Lv - Ld
    engine.counters.loop_token_iterations = before.loop_token_iterations + Lv * N
    logits = ts.logits[:N]
    if not chooser.greedy:
        return ts.tokens[0, :N].tolist(), logits, None
    both = torch.cat([ts.tokens[0, :N], logits.argmax(-1)]).tolist()
    return both[:N], logits, both[N:]


def _draft_depth(logits: torch.Tensor, tokens: torch.Tensor, i: int, K: int) -> None:
    """The depth-(i + 1) nodes' tokens from the draft logits of depth i, on the device: the K
    most likely after the root (the branches' first tokens), then each branch's greedy next."""
    tokens[1 + i * K:1 + (i + 1) * K] = logits[0].topk(K).indices if i == 0 else logits.argmax(-1)


def _tree_pass(engine: Engine, lanes: slice, pos: int, depths: torch.Tensor, nodes: torch.Tensor | None,
               prefix: torch.Tensor, anc: torch.Tensor) -> Pass:
    """A tree-mode pass over `nodes` (None: all of anc's nodes) of the tree rooted at slot pos."""
    N = anc.shape[1]
    q_nodes = torch.arange(N, device=prefix.device) if nodes is None else nodes
    p = engine.make_pass(lanes, (pos + depths[q_nodes])[None], pos + N)
    p.tree = Tree((pos + q_nodes)[None], prefix, anc, nodes)
    return p


def _move_path(engine: Engine, lane: int, pos: int, path: list[int], loops: int) -> None:
    """Accepted nodes at depth 1..j: K / V from slot pos + node to pos + depth, in every cache
    layer a call at `loops` uses (prelude, iterations [0, loops), coda)."""
    moves = [(pos + node, pos + d) for d, node in enumerate(path, 1) if node != d]
    if not moves:
        return
    cache = engine.cache
    device = cache.k.device
    layers = torch.tensor(cache.layers_for(loops), device=device)[:, None]   # (layers, 1)
    src = torch.tensor([s for s, _ in moves], device=device)[None]           # (1, moves)
    dst = torch.tensor([d for _, d in moves], device=device)[None]
    for buf in (cache.k, cache.v):
        buf[layers, lane, :, dst] = buf[layers, lane, :, src]  # (layers, moves, Hkv, hd); gathered first
