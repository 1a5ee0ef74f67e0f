"""Tokenizers: text <-> token ids, saved with every checkpoint and model folder as a JSON-able dict.

CONTRACT (used by data, train, interop, experiments, generate):
  Tokenizer objects (CharTokenizer, BPETokenizer, HFTokenizer): encode(str) -> list[int], decode(list[int]) -> str,
      encode_batch(list[str]) -> list[list[int]],
      vocab_size: int, kind: str, to_dict() -> dict (JSON-able; saved next to a checkpoint),
      to_tokenizers() -> tokenizers.Tokenizer (the same ids; what a transformers export saves)
  tokenizer_from_dict(d) -> Tokenizer
  build_tokenizer(kind: "char" | "bpe", text: str, vocab_size: int | None = None) -> Tokenizer
  prefix_token(tokenizer) -> (id, what) | None: the token a text's first token is conditioned on when scored

This module sits below data, checkpoints and models and imports nothing else from diffattn.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as _TokenizersTokenizer  # the tokenizers library's class (ours: Tokenizer, below)

from diffattn.system.untrusted import Refused, loads_json, printable, read_bytes

DEFAULT_BPE_VOCAB = 2048
# A tokenizers JSON from elsewhere is checked against these before the tokenizers library parses it: the largest
# published ones (Gemma 3's: 262,144 tokens, 33 MB) fit with room; a crafted 170 MB file of 5 million tokens and
# merges took `info` 130 s and 4.4 GB.
MAX_TOKENIZER_BYTES = 64 << 20
MAX_TOKENS = 1 << 20  # the vocabulary, and the added tokens
MAX_MERGES = 2 << 20


class TokenizerError(Refused):
    """A tokenizer file or saved tokenizer diffattn does not read: not a tokenizers JSON, or larger than its
    bounds (one line, exit 2)."""


def check_tokenizer_json(obj: Any, where: object) -> dict[str, Any]:
    """``obj``, a tokenizers JSON document (already parsed, so its nesting was checked), when its vocabulary, merges
    and added tokens are within :data:`MAX_TOKENS` / :data:`MAX_MERGES`; else :class:`TokenizerError` naming
    ``where``, before the tokenizers library builds anything from it."""
    if not isinstance(obj, dict):
        raise TokenizerError(f"{printable(where)}: not a tokenizers JSON object (got {type(obj).__name__})")
    model = obj.get("model") if isinstance(obj.get("model"), dict) else {}
    for name, value, limit in (("model.vocab", model.get("vocab"), MAX_TOKENS),
                               ("model.merges", model.get("merges"), MAX_MERGES),
                               ("added_tokens", obj.get("added_tokens"), MAX_TOKENS)):
        if isinstance(value, (list, dict)) and len(value) > limit:
            raise TokenizerError(f"{printable(where)}: its {name} holds {len(value):,} entries; diffattn reads at "
                                 f"most {limit:,} (the largest published tokenizers hold about 262,000 tokens): "
                                 "the tokenizer is refused")
    return obj


def _check_ids(ids: Iterable[int], vocab_size: int) -> list[int]:
    out = [int(i) for i in ids]
    for i in out:
        if not 0 <= i < vocab_size:
            raise ValueError(f"token id {i} is out of range for a vocabulary of {vocab_size}")
    return out


class CharTokenizer:
    """One id per distinct character of the training text, ids in sorted character order.

    By default unseen characters are an error at encode time (ValueError naming the character and its
    position): there is no <unk> id, so a decoded text is always exactly what the model produced. With
    ``unk=True`` (classification, which reads validation and test texts the tokenizer was not fit on) one more
    id, ``len(chars)``, stands for every unseen character and decodes to U+FFFD.
    """

    kind = "char"

    def __init__(self, chars: Sequence[str], unk: bool = False):
        chars = list(chars)
        if not chars:
            raise ValueError("CharTokenizer needs at least one character")
        if any(len(c) != 1 for c in chars):
            raise ValueError("CharTokenizer: every vocabulary entry must be a single character")
        if len(set(chars)) != len(chars):
            raise ValueError("CharTokenizer: duplicate characters in the vocabulary")
        self.chars = chars
        self.index = {c: i for i, c in enumerate(chars)}
        self.unk = bool(unk)

    @classmethod
    def train(cls, text: str, unk: bool = False) -> CharTokenizer:
        if not text:
            raise ValueError("cannot build a character vocabulary from empty text")
        return cls(sorted(set(text)), unk=unk)

    @property
    def vocab_size(self) -> int:
        return len(self.chars) + self.unk

    def encode(self, text: str) -> list[int]:
        if self.unk:
            return [self.index.get(c, len(self.chars)) for c in text]
        try:
            return [self.index[c] for c in text]
        except KeyError as e:
            c = e.args[0]
            pos = text.index(c)
            raise ValueError(f"character {c!r} (U+{ord(c):04X}) at position {pos} is not in the character"
                             f" tokenizer's vocabulary ({self.vocab_size} characters seen in training)"
                             ) from None

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        chars = self.chars + ["\ufffd"] if self.unk else self.chars
        return "".join(chars[i] for i in _check_ids(ids, self.vocab_size))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "char", "chars": "".join(self.chars), **({"unk": True} if self.unk else {})}

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"

    @property
    def unk_text(self) -> str:
        """What the unseen-character id decodes to (U+FFFD), or the token name transformers shows for it when
        U+FFFD is itself a vocabulary character (only then do the two differ)."""
        return "<unk>" if "\ufffd" in self.index else "\ufffd"

    def to_tokenizers(self) -> _TokenizersTokenizer:
        """The same tokenizer as a ``tokenizers`` object (what transformers' fast tokenizers wrap): every
        character is split off alone (a regex matching any one character, newlines included) and looked up in
        a word-level vocabulary holding the characters at their ids; the decoder concatenates. Same ids as
        :meth:`encode` for every text; an unseen character is an error there too (with ``unk``: the unk id)."""
        vocab = dict(self.index)
        if self.unk:
            vocab[self.unk_text] = len(self.chars)
        tok = _TokenizersTokenizer(models.WordLevel(vocab, unk_token=self.unk_text if self.unk else None))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        tok.decoder = decoders.Fuse()
        return tok


class BPETokenizer:
    """Byte-level BPE (GPT-2 style byte alphabet, so every string is encodable), trained with HF tokenizers.

    ``to_dict`` embeds the tokenizer's own JSON serialisation, so it travels with a checkpoint. Decoding a
    list that ends inside a multi-byte character yields U+FFFD for the incomplete bytes (see
    generate.StreamDecoder).
    """

    kind = "bpe"

    def __init__(self, tok: Any):
        self.tok = tok

    @classmethod
    def train(cls, text: str, vocab_size: int = DEFAULT_BPE_VOCAB) -> BPETokenizer:
        if not text:
            raise ValueError("cannot train a BPE tokenizer on empty text")
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < len(alphabet):
            raise ValueError(f"BPE vocab_size must be an int >= {len(alphabet)} (the byte alphabet),"
                             f" got {vocab_size!r}")
        tok = _TokenizersTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=alphabet, special_tokens=[],
                                      show_progress=False)
        tok.train_from_iterator([text], trainer=trainer)
        return cls(tok)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``encode`` of each text; tokenizers runs the batch on all cores."""
        return [e.ids for e in self.tok.encode_batch(list(texts))]

    def decode(self, ids: Iterable[int]) -> str:
        # tokenizers silently drops unknown ids; an out-of-range id is a bug worth reporting
        return self.tok.decode(_check_ids(ids, self.vocab_size), skip_special_tokens=False)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "bpe", "tokenizer": json.loads(self.tok.to_str())}

    def to_tokenizers(self) -> _TokenizersTokenizer:
        """A copy of the underlying ``tokenizers`` object (the same ids)."""
        return _TokenizersTokenizer.from_str(self.tok.to_str())

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size})"


class HFTokenizer(BPETokenizer):
    """A Hugging Face ``tokenizer.json`` used as it is: its model (BPE, Unigram, WordPiece, ...), normalizer,
    pre-tokenizer, post-processor (e.g. a BOS token added by encode) and special tokens all apply unchanged.
    This is the tokenizer of a model converted from a transformers folder. ``vocab_size`` counts added tokens.
    """

    kind = "hf"

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> HFTokenizer:
        """The tokenizer of a ``tokenizer.json``, checked before the tokenizers library parses it: a FIFO, a file
        larger than :data:`MAX_TOKENIZER_BYTES` (before it is read), a document nested too deeply, and one of
        more tokens or merges than the bounds are refused (a :class:`~diffattn.system.untrusted.Refused`, one line)."""
        text = read_bytes(path, MAX_TOKENIZER_BYTES, what="tokenizer").decode("utf-8", errors="replace")
        try:
            check_tokenizer_json(loads_json(text, path), path)
            return cls(_TokenizersTokenizer.from_str(text))
        except Refused:
            raise
        except Exception as e:  # invalid JSON; tokenizers raises its own exception type
            raise TokenizerError(f"{printable(path)}: not a valid tokenizers JSON file: {printable(e)}") from None

    @classmethod
    def train(cls, text: str, vocab_size: int = DEFAULT_BPE_VOCAB) -> HFTokenizer:
        raise ValueError("an 'hf' tokenizer is read from a tokenizer.json, not trained; use 'bpe' to train one")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "hf", "tokenizer": json.loads(self.tok.to_str())}

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size})"


Tokenizer = CharTokenizer | BPETokenizer | HFTokenizer


def tokenizer_from_dict(d: dict[str, Any]) -> Tokenizer:
    """Inverse of ``tokenizer.to_dict()``."""
    if not isinstance(d, dict) or "kind" not in d:
        raise ValueError(f"tokenizer dict must be a dict with a 'kind' key, got {type(d).__name__}")
    kind = d["kind"]
    if kind == "char":
        if not isinstance(d.get("chars"), str):
            raise ValueError("char tokenizer dict needs 'chars': a string of the vocabulary characters")
        return CharTokenizer(list(d["chars"]), unk=bool(d.get("unk", False)))
    if kind in ("bpe", "hf"):
        if not isinstance(d.get("tokenizer"), dict):
            raise ValueError(f"{kind} tokenizer dict needs 'tokenizer': the HF tokenizers JSON object")
        check_tokenizer_json(d["tokenizer"], f"the saved {kind} tokenizer")
        try:
            tok = _TokenizersTokenizer.from_str(json.dumps(d["tokenizer"]))
        except Exception as e:  # tokenizers raises its own exception type
            raise ValueError(f"{kind} tokenizer dict is not a valid tokenizers JSON: {e}") from None
        return BPETokenizer(tok) if kind == "bpe" else HFTokenizer(tok)
    raise ValueError(f"unknown tokenizer kind {kind!r}; known: 'char', 'bpe', 'hf'")


def prefix_token(tokenizer: Tokenizer) -> tuple[int, str] | None:
    """The token a text's first token is conditioned on when a text is scored from its start (lm-eval's
    ``prefix_token_id``), and what it is: ``(id, "bos")``, the BOS an HF tokenizer's post-processor adds (what
    ``encode("")`` gives), else ``(id, "line break")``, the line break's id. Our char and BPE tokenizers have no
    BOS/EOS: the training text is documents joined by line breaks (``diffattn.data.text``), so a line break is
    what came before the start of every document but the first. None: neither exists (a char tokenizer that never
    saw a line break, a BPE merge that leaves no lone line-break token)."""
    starts = tokenizer.encode("")
    if len(starts) == 1:
        return starts[0], "bos"
    try:
        ids = tokenizer.encode("\n")
    except ValueError:  # a char tokenizer that never saw a line break
        return None
    return (ids[0], "line break") if len(ids) == 1 else None


def build_tokenizer(kind: str, text: str, vocab_size: int | None = None, unk: bool = False) -> Tokenizer:
    """Train a tokenizer of ``kind`` ("char" or "bpe") on ``text``. ``vocab_size`` is the BPE target (default
    2048; the result is smaller when the text has fewer merges); it must be None for "char". ``unk``: the char
    tokenizer gets an id for unseen characters (byte-level BPE encodes any text anyway)."""
    if kind == "char":
        if vocab_size is not None:
            raise ValueError(f"vocab_size ({vocab_size}) does not apply to the char tokenizer (its vocabulary"
                             " is the set of characters in the text); leave it unset or use tokenizer 'bpe'")
        return CharTokenizer.train(text, unk=unk)
    if kind == "bpe":
        return BPETokenizer.train(text, DEFAULT_BPE_VOCAB if vocab_size is None else vocab_size)
    raise ValueError(f"unknown tokenizer {kind!r}; choose 'char' or 'bpe'")
