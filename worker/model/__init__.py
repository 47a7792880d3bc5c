"""The model layer: config, modules, the static cache, checkpoints, tokenizer and the ops
backends. Imports nothing from the layers above (runner, generation, serving)."""
