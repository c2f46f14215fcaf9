"""Calibration tokens for the checkpoint tools, from a local text file or a token file.

Formats (chosen by the file's suffix):

- `.json`: a list of token ids, or a list of lists (documents);
- `.npy`: an integer array, any shape;
- `.pt`: an integer tensor, or a list of tensors/lists (documents), loaded with `weights_only=True`;
- anything else is UTF-8 text, tokenized with the checkpoint's own tokenizer
  (`transformers.AutoTokenizer` on the source directory, no special tokens added), read in
  chunks until enough tokens are collected.

All tokens are concatenated in file order into one stream (documents are not padded; put an EOS
id between them yourself if you want one) and cut into `num_tokens // seq_len` sequences of
`seq_len` tokens; the rest is unused.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

__all__ = ["TOKEN_SUFFIXES", "load_calibration"]

TOKEN_SUFFIXES = (".json", ".npy", ".pt")
_TEXT_CHUNK_CHARS = 1 << 20


def _flatten(obj: object, path: Path) -> torch.Tensor:
    if isinstance(obj, torch.Tensor):
        return obj.reshape(-1)
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj.reshape(-1).copy())
    if isinstance(obj, list | tuple):
        if all(isinstance(v, int) and not isinstance(v, bool) for v in obj):
            return torch.tensor(obj, dtype=torch.int64)
        if all(isinstance(v, list | tuple | torch.Tensor | np.ndarray) for v in obj):
            return torch.cat([_flatten(v, path) for v in obj])
    raise ValueError(
        f"{path}: expected token ids (a list of ints or a list of lists of ints), got {type(obj).__name__}"
    )


def _token_file(path: Path) -> torch.Tensor:
    try:
        if path.suffix == ".json":
            obj: object = json.loads(path.read_text())
        elif path.suffix == ".npy":
            obj = np.load(path, allow_pickle=False)
        else:
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, ValueError, RuntimeError) as e:
        raise ValueError(f"{path}: cannot read calibration tokens: {e}") from e
    ids = _flatten(obj, path)
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"{path}: calibration tokens must be integers, got {ids.dtype}")
    return ids.to(torch.int64)


def _text_file(path: Path, tokenizer_dir: Path, need: int) -> torch.Tensor:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except (OSError, ValueError) as e:
        raise ValueError(
            f"{path}: a text calibration file is tokenized with the checkpoint's tokenizer, but {tokenizer_dir} has "
            f"none that transformers can load ({e}); pass a token file ({', '.join(TOKEN_SUFFIXES)}) instead"
        ) from e
    ids: list[int] = []
    with open(path, encoding="utf-8") as f:
        while len(ids) < need:
            chunk = f.read(_TEXT_CHUNK_CHARS)
            if not chunk:
                break
            ids.extend(tok(chunk, add_special_tokens=False)["input_ids"])
    return torch.tensor(ids, dtype=torch.int64)


def load_calibration(
    path: str | Path | torch.Tensor, *, tokenizer_dir: str | Path, num_tokens: int, seq_len: int, vocab_size: int
) -> torch.Tensor:
    """Calibration sequences int64 [num_tokens // seq_len, seq_len] (format: the module docstring).

    `path` may also be token ids already cut, an integer tensor [sequences, length] (used as it is, after the
    vocabulary check). Raises ValueError naming the file when it cannot be read, holds non-integer or
    out-of-vocabulary ids, or holds fewer tokens than asked for.
    """
    if isinstance(path, torch.Tensor):
        if path.dim() != 2 or path.is_floating_point() or path.is_complex() or path.dtype == torch.bool:
            raise ValueError(
                f"calibration tensor: expected integer ids [sequences, length], got {path.dtype} {list(path.shape)}"
            )
        return _check_vocab(path.long(), "calibration tensor", vocab_size)
    path = Path(path)
    if seq_len < 1 or num_tokens < seq_len:
        raise ValueError(f"calibration: --calib-tokens {num_tokens} must be at least --seq-len {seq_len} (>= 1)")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: calibration file not found")
    n_seq = num_tokens // seq_len
    need = n_seq * seq_len
    if path.suffix in TOKEN_SUFFIXES:
        ids = _token_file(path)
    else:
        ids = _text_file(path, Path(tokenizer_dir), need)
    if ids.numel() < need:
        raise ValueError(
            f"{path}: holds {ids.numel()} calibration tokens, {need} needed ({n_seq} sequences of --seq-len "
            f"{seq_len}); pass a longer file or lower --calib-tokens"
        )
    return _check_vocab(ids[:need].view(n_seq, seq_len), str(path), vocab_size)


def _check_vocab(ids: torch.Tensor, where: str, vocab_size: int) -> torch.Tensor:
    flat = ids.reshape(-1)
    bad = (flat < 0) | (flat >= vocab_size)
    if bool(bad.any()):
        pos = int(bad.nonzero()[0])
        raise ValueError(f"{where}: token {pos} is id {int(flat[pos])}, outside the vocabulary [0, {vocab_size})")
    return ids
