"""The errors the worker raises for arguments it cannot honour, by type, so that the service
maps each to its status by type and never by message text. They subclass what the reference
runtime's API raises (RuntimeError for a prompt too long or a depth out of range; ValueError
stays ValueError), so in-process callers catch what they always caught. No torch here:
checking a model directory needs none (`tinyloop serve` checks its --model before it starts
any worker)."""
from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint (a `.tinyloop` file or a Hugging Face directory) that is missing, truncated
    or inconsistent; the message names the file and what is wrong with it."""


class TooLong(RuntimeError):
    """The prompt (plus max_tokens) does not fit the cache's max_seq_len."""


class OutOfRange(RuntimeError):
    """A depth outside what the model or the handle allows (L_used > max_loops, new_L outside
    [loops_used, max_loops])."""


class HandleFreed(RuntimeError):
    """The resume handle was freed (or belongs to another, closed model)."""


class OutOfMemory(RuntimeError):
    """The device could not allocate what the request needs (a resume handle)."""


class LanesBusy(RuntimeError):
    """Every cache lane is in use."""


class ModelClosed(RuntimeError):
    """The model was closed."""
