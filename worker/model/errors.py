"""The checkpoint error, in a module of its own so that checking a model directory needs no
torch (`tinyloop serve` checks its --model before it starts any worker)."""


class CheckpointError(ValueError):
    """A checkpoint (a `.tinyloop` file or a Hugging Face directory) that is missing, truncated
    or inconsistent; the message names the file and what is wrong with it."""
