"""Graphs.replay_sequence's bookkeeping, which needs no GPU: a sequence of stages replays
stage by stage until its `fuse_after`-th launch, runs as one captured graph from then on, and
one whose capture fails (a capture while serving can be invalidated) runs stage by stage for
good, the launch itself unharmed. The graph objects are stand-ins (capturing needs CUDA); the
class's own method decides."""
import logging

import pytest

from tinyloop.worker.runner.graphs import Graphs


class Replayable:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def replay(self):
        self.log.append(self.name)


def graphs_with(stages, capture):
    """A Graphs (its __init__ asks for a CUDA engine) holding stage stand-ins, capturing by `capture`."""
    g = Graphs.__new__(Graphs)
    g.log = []
    g.stages = {("batch", 2, s): Replayable(g.log, s) for s in stages}
    g.fused, g._seen, g._unfusable = {}, {}, set()
    g.fuse_after, g.captures, g.capture_failures = 3, 0, 0
    g._record = capture
    return g


def test_a_sequence_fuses_at_its_fuse_after_th_launch():
    made = []

    def capture(fn):
        made.append(fn)
        return Replayable(g.log, "fused")
    g = graphs_with(["prelude", 0, "coda"], capture)
    for _ in range(5):
        g.replay_sequence("batch", 2, ("prelude", 0, "coda"), lambda s: None)
    assert g.log == ["prelude", 0, "coda"] * 2 + ["fused"] * 3
    assert len(made) == 1 and g.capture_failures == 0


def test_a_failed_capture_leaves_its_sequence_to_its_stages(caplog):
    tries = []

    def capture(fn):
        tries.append(fn)
        raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
    g = graphs_with(["prelude", 0, "coda"], capture)
    with caplog.at_level(logging.WARNING, logger="tinyloop.worker.runner.graphs"):
        for _ in range(6):
            g.replay_sequence("batch", 2, ("prelude", 0, "coda"), lambda s: None)
    assert g.log == ["prelude", 0, "coda"] * 6  # every launch ran, the failed one too
    assert len(tries) == 1 and g.capture_failures == 1 and not g.fused
    assert "during capture" in caplog.text and "stage by stage" in caplog.text
    # another sequence still fuses
    g._record = lambda fn: Replayable(g.log, "fused")
    g.log.clear()
    for _ in range(3):
        g.replay_sequence("batch", 2, ("prelude", "coda"), lambda s: None)
    assert g.log == ["prelude", "coda"] * 2 + ["fused"]


def test_an_error_that_is_not_a_capture_error_still_raises():
    def capture(fn):
        raise KeyboardInterrupt
    g = graphs_with(["prelude"], capture)
    with pytest.raises(KeyboardInterrupt):
        for _ in range(3):
            g.replay_sequence("batch", 2, ("prelude",), lambda s: None)
