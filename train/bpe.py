"""BPE for the larger benchmark model: a byte-level BPE trained by `tokenizers` on the train
split. Id 0 is the document separator `<|doc|>` (the byte path's DOC_SEP is 0 too). `encode`
also takes a Hugging Face model's own tokenizer, which joins documents with the model's
end-of-text token."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from tinyloop.train.corpus import DOC_SEP, Corpus

DOC_TOKEN = "<|doc|>"


def _docs(data: np.ndarray) -> list[str]:
    return [d.decode("utf-8", errors="replace") for d in data.tobytes().split(bytes([DOC_SEP])) if d]


def sample_docs(docs: list[str], sample_bytes: int | None) -> list[str]:
    """Every k-th document, k chosen so the sample holds about sample_bytes: the merges are
    learnt from all of the corpus's packages in a fraction of the time (None: every document)."""
    total = sum(len(d) for d in docs)
    if not sample_bytes or total <= sample_bytes:
        return docs
    return docs[::-(-total // sample_bytes)]


def train_tokenizer(corpus: Corpus, vocab_size: int, sample_bytes: int | None = None) -> str:
    """-> tokenizer.json text (what the checkpoint embeds), learnt from the train split (or an
    evenly strided sample of its documents)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[DOC_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(sample_docs(_docs(corpus.train), sample_bytes), trainer=trainer)
    return tok.to_str()


def separator(config) -> int | None:
    """The token a model of `config` was trained to see between documents when its tokenizer
    has no DOC_TOKEN (a Hugging Face model's own tokenizer): its end-of-text token, else its
    beginning-of-text token; None: neither is known."""
    for t in (config.eos_id, config.bos_id):
        if t is not None and t >= 0:
            return t
    return None


def encode(tokenizer_json: str, data: np.ndarray, sep_id: int | None = None) -> np.ndarray:
    """Byte corpus (documents joined by DOC_SEP) -> token ids, documents joined by the
    tokenizer's DOC_TOKEN (id 0 in this project's tokenizers) or, for a tokenizer without one,
    by sep_id (`separator` of the model's config). ValueError: neither."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_str(tokenizer_json)
    sep = tok.token_to_id(DOC_TOKEN)
    if sep is None:
        if sep_id is None:
            raise ValueError(f"the tokenizer has no {DOC_TOKEN} token and the model names no EOS or BOS token: "
                             f"nothing to join documents with")
        if not 0 <= sep_id < tok.get_vocab_size(with_added_tokens=True):
            raise ValueError(f"document separator {sep_id} outside the tokenizer's "
                             f"{tok.get_vocab_size(with_added_tokens=True)} ids")
        sep = sep_id
    out: list[int] = []
    for enc in tok.encode_batch(_docs(data), add_special_tokens=False):
        out.extend(enc.ids)
        out.append(sep)
    dtype = np.uint16 if tok.get_vocab_size() <= 2 ** 16 else np.int32
    return np.asarray(out, dtype=dtype)


def build(corpus: Corpus, vocab_size: int, cache_dir: str | None = None, sample_bytes: int | None = None):
    """-> (train ids, heldout ids, tokenizer_json), cached beside the byte corpus."""
    key = hashlib.sha1(f"{corpus.info['signature']}-{vocab_size}-{sample_bytes}".encode()).hexdigest()[:12]
    paths = None
    if cache_dir is not None:
        paths = {k: Path(cache_dir) / f"bpe-{key}-{k}" for k in ("train.npy", "heldout.npy", "tokenizer.json")}
        if all(p.exists() for p in paths.values()):
            return (np.load(paths["train.npy"]), np.load(paths["heldout.npy"]),
                    paths["tokenizer.json"].read_text())
    tj = train_tokenizer(corpus, vocab_size, sample_bytes)
    train, heldout = encode(tj, corpus.train), encode(tj, corpus.heldout)
    if paths is not None:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        np.save(paths["train.npy"], train)
        np.save(paths["heldout.npy"], heldout)
        paths["tokenizer.json"].write_text(tj)
    return train, heldout, tj


def vocab_size_of(tokenizer_json: str) -> int:
    from tokenizers import Tokenizer
    return Tokenizer.from_str(tokenizer_json).get_vocab_size()
