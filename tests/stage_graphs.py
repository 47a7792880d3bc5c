"""CPU stand-in for the runner's CUDA graphs, for the tests of its bucket path: "capturing" a
stage runs it once, as the GPU capture's warm-up does, and keeps the closure the GPU captures
(a stage set's `run` over its static buffers); "replaying" runs that closure eagerly. The
runner's bucket lists, capture order, covers / fits checks and replay-or-eager choices are its
own; only the graph object is replaced."""
import pytest
import torch

from tinyloop.worker import Model
from tinyloop.worker.runner import graphs as graphs_mod
from tinyloop.worker.runner import runner as runner_mod
from tinyloop.worker.runner.runner import Runner, RunnerSettings


class EagerGraphs:
    """Stands in for graphs.Graphs on CPU: "capturing" a stage keeps the closure the GPU
    captures (the runner's stage sets over their static buffers), "replaying" it runs that
    closure eagerly. No decode graphs. `log`: every replay, as (kind, bucket, stage)."""

    def __init__(self, engine):
        self.engine, self.decode, self.stages, self.log = engine, {}, {}, []
        self.seen, self.fused = {}, []  # replay_sequence's launches of each sequence; the fused ones
        self.fuse_after = graphs_mod.FUSE_AFTER
        self.captures = 0  # as Graphs': stages and calls "captured" so far

    def __len__(self):
        return len(self.stages)

    def capture_decode(self, loops):
        return None

    def capture_stage(self, kind, bucket, stage, run):
        if (kind, bucket, stage) not in self.stages:
            self.captures += 1
            run()  # the warm-up: a stage whose inputs were not loaded for it fails here
            self.stages[(kind, bucket, stage)] = run

    def drop(self):
        self.stages.clear()

    def capture_call(self, fn):
        """A "graph" of fn (the sampler's): its replay runs fn eagerly, logged as kind "call"."""
        self.captures += 1
        fn()  # the warm-up, as the GPU's
        log = self.log

        class Call:
            def replay(self):
                log.append(("call", None, fn))
                fn()
        return Call()

    def covers(self, kind, bucket, stages):
        return all((kind, bucket, s) in self.stages for s in stages)

    def replayed(self, kind):
        """The (bucket, stage) replays of one kind, in order."""
        return [(b, s) for k, b, s in self.log if k == kind]

    def replay(self, kind, bucket, stage):
        self.log.append((kind, bucket, stage))
        self.stages[(kind, bucket, stage)]()

    def replay_sequence(self, kind, bucket, stages, run):
        """As Graphs': the stages in order, from a sequence's `fuse_after`-th launch on as the fused
        graph's closure (run(stage) for each); logged as the stages' replays, and the fused
        launches in `fused`."""
        key = (kind, bucket, stages)
        self.seen[key] = self.seen.get(key, 0) + 1
        fused = self.seen[key] >= self.fuse_after
        if fused:
            self.fused.append(key)
        for stage in stages:
            self.log.append((kind, bucket, stage))
            if fused:
                run(stage)
            else:
                self.stages[(kind, bucket, stage)]()


def with_stage_graphs(m: Model, loops, prefill_graph_len: int = 0, interleave: bool = True) -> EagerGraphs:
    """Give m a graphed runner (its buckets, its capture, its replay-or-eager choices, as on
    the GPU) whose graphs are EagerGraphs, captured for the depths in `loops`."""
    r = m.runner
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(graphs_mod, "Graphs", EagerGraphs)  # Runner looks it up when cuda_graphs is on
        mp.setattr(runner_mod, "Graphs", EagerGraphs, raising=False)
        mp.setattr(torch.cuda, "synchronize", lambda device=None: None)
        mp.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
        settings = RunnerSettings(cuda_graphs=True, prefill_graph_len=prefill_graph_len, interleave=interleave)
        m.runner = Runner(r.model, r.cache, r.ops, settings)
        m.capture_graphs(loops)
    assert isinstance(m.runner.graphs, EagerGraphs)
    return m.runner.graphs
