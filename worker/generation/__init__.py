"""The generation layer: decode, resume, speculative decoding, batching, scoring and
sampling, as algorithms over the runner's stages (they never ask whether a graph runs)."""
