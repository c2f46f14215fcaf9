"""The gate's text: a UTF-8 text file tokenized with the reference's tokenizer, or a token file, cut into windows.

A text file is read and tokenized in pieces of at most TEXT_PIECE_CHARS characters, cut at the last space or
newline when the piece has one and at the bound when it has none (CJK, minified JSON), so memory holds one piece
and one window whatever the file's length or content (both sides score the same ids, so where a piece boundary
falls changes nothing in the comparison). A token file (.json list, .npy) is read whole: ids are small.
Windows are consecutive and do not overlap: each starts with an empty context, so position p of a window has
context length p.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from vllm_trn_plugin.gate.errors import GateError

TOKEN_SUFFIXES = (".json", ".npy")
TEXT_PIECE_CHARS = 1 << 16


def _token_file(path: Path) -> list[int]:
    try:
        obj = json.loads(path.read_text()) if path.suffix == ".json" else np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise GateError(f"--tokens {path}: cannot read: {e}") from None
    arr = np.asarray(obj)
    if arr.dtype.kind not in "iu" or arr.ndim != 1:
        raise GateError(f"--tokens {path}: expected a flat list of integer token ids, got {arr.dtype} {arr.shape}")
    return arr.astype(np.int64).tolist()


def _text_pieces(path: Path) -> Iterator[str]:
    """The file's text in consecutive pieces of 1 to TEXT_PIECE_CHARS characters (code points) that put
    together give it back: each ends just before the last space or newline of the next TEXT_PIECE_CHARS
    characters, or takes all of them when they have none after their first. A short piece (a space near its
    start) is followed by one of at least TEXT_PIECE_CHARS minus its length: the work is linear in the text's
    length, and no piece (no /tokenize request) is longer than the bound."""
    bound = TEXT_PIECE_CHARS
    try:
        with open(path, encoding="utf-8") as f:
            buf = ""
            while True:
                block = f.read(bound - len(buf))
                buf += block
                if len(buf) < bound:
                    if block:
                        continue
                    if buf:  # the end of the file
                        yield buf
                    return
                cut = max(buf.rfind(" "), buf.rfind("\n"))
                if cut <= 0:
                    cut = bound
                yield buf[:cut]
                buf = buf[cut:]
    except UnicodeDecodeError as e:
        raise GateError(f"--text {path}: not UTF-8 text ({e}); pass token ids with --tokens") from None
    except OSError as e:
        raise GateError(f"--text {path}: cannot read: {e}") from None


class TokenInput:
    """The gate's token stream: `--text FILE` tokenized by `encode`, or `--tokens FILE`; at most `max_tokens`."""

    def __init__(
        self,
        text: str | None,
        tokens: str | None,
        encode: Callable[[str], list[int]],
        max_tokens: int | None = None,
    ) -> None:
        if (text is None) == (tokens is None):
            raise GateError("pass exactly one of --text FILE and --tokens FILE")
        self.path = Path(text or tokens or "")
        self.is_text = text is not None
        if not self.path.is_file():
            raise GateError(f"{'--text' if self.is_text else '--tokens'} {self.path}: no such file")
        if not self.is_text and self.path.suffix not in TOKEN_SUFFIXES:
            raise GateError(f"--tokens {self.path}: a token file is {' or '.join(TOKEN_SUFFIXES)}")
        self.encode, self.max_tokens = encode, max_tokens
        self._ids = None if self.is_text else _token_file(self.path)
        self.total = self._count()

    def _count(self) -> int:
        """A first pass that keeps only the count: the windows and the buckets they fill are known before scoring."""
        n = sum(len(self.encode(p)) for p in _text_pieces(self.path)) if self._ids is None else len(self._ids)
        return n if self.max_tokens is None else min(n, self.max_tokens)

    def ids(self) -> Iterator[int]:
        count = 0
        if self._ids is not None:
            src: Iterator[int] = iter(self._ids)
        else:
            src = (t for p in _text_pieces(self.path) for t in self.encode(p))
        for t in src:
            if count >= self.total:
                return
            yield t
            count += 1

    def windows(self, size: int) -> Iterator[list[int]]:
        """Consecutive windows of `size` tokens, then the remainder if it has at least 2 (one scored position)."""
        buf: list[int] = []
        for t in self.ids():
            buf.append(t)
            if len(buf) == size:
                yield buf
                buf = []
        if len(buf) >= 2:
            yield buf

    def window_lengths(self, size: int) -> list[int]:
        full, rest = divmod(self.total, size)
        return [size] * full + ([rest] if rest >= 2 else [])


def check_vocab(window: list[int], vocab: int | None, label: str, offset: int) -> None:
    if vocab is None:
        return
    for i, t in enumerate(window):
        if not 0 <= t < vocab:
            raise GateError(f"token {offset + i} is id {t}, outside the {label}'s vocabulary [0, {vocab})")
