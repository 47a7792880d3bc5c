"""The runner layer: the only code that knows about CUDA graphs, eager fallback, buckets,
staging buffers, cache lanes and work counting. Generation is written against `Runner`'s
stages. Imports from the model layer only."""
