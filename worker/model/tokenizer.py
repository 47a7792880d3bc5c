"""Tokenizers: byte-level by default (no file), or an HF `tokenizer.json` shipped in the checkpoint."""
from __future__ import annotations

import codecs


class ByteTokenizer:
    """Token id = byte value (vocab 256). Decoding is incremental-safe via `decoder()`."""
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def decoder(self):
        """A stateful decoder: feed ids chunk by chunk, get text that never splits a character."""
        dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        return lambda ids: dec.decode(bytes(i for i in ids if 0 <= i < 256))


class HFTokenizer:
    def __init__(self, tokenizer_json: str):
        from tokenizers import Tokenizer
        self._tok = Tokenizer.from_str(tokenizer_json)
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)

    def decoder(self):
        """Incremental text: decode the whole stream so far and emit the new suffix."""
        ids: list[int] = []
        emitted = [0]

        def feed(new: list[int]) -> str:
            ids.extend(new)
            text = self._tok.decode(ids)
            if text.endswith("\ufffd"):  # a multi-byte character is not complete yet
                return ""
            out, emitted[0] = text[emitted[0]:], len(text)
            return out

        return feed


def from_metadata(meta: dict):
    tj = meta.get("tinyloop.tokenizer")
    return HFTokenizer(tj) if tj else ByteTokenizer()
