"""Passkey retrieval: a random 5-digit key hidden at a depth of filler text of a given token length, then asked for.

The prompt is built in token ids with the reference's tokenizer (both sides read the same ids):
    intro | filler[:d] | needle | filler[d:] | question
with the filler a fixed sentence repeated and cut so that the prompt is exactly `length` tokens, and d the `depth`
fraction of the filler. A cell is retrieved when the first run of digits the model generates (greedy) is the key.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_trn_plugin.gate.errors import GateError

DEFAULT_LENGTHS = (2048, 8192, 14336, 32768)  # tokens: the source document's 14k and 32k, and two shorter
DEFAULT_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
ANSWER_TOKENS = 12  # generated per cell: the key and a little slack (a byte tokenizer spends 6 on " 12345")

INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n"
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\nWhat is the pass key? The pass key is"


@dataclass
class Cell:
    length: int
    depth: float
    key: str
    prompt: list[int]


def build_prompt(encode: Callable[[str], list[int]], length: int, depth: float, key: str) -> list[int]:
    """The prompt of exactly `length` tokens with `key` at `depth` (0..1) of the filler."""
    if not 0.0 <= depth <= 1.0:
        raise GateError(f"--passkey-depths: {depth} is not a fraction in [0, 1]")
    intro, needle, question = encode(INTRO), encode(NEEDLE.format(key=key)), encode(QUESTION)
    room = length - len(intro) - len(needle) - len(question)
    if room < 1:
        raise GateError(f"--passkey-lengths: {length} tokens cannot hold the passkey prompt (needs > {length - room})")
    unit = encode(FILLER)
    filler = (unit * (room // len(unit) + 1))[:room]
    d = round(depth * room)
    return intro + filler[:d] + needle + filler[d:] + question


def cells(encode: Callable[[str], list[int]], lengths: Sequence[int], depths: Sequence[float], seed: int) -> list[Cell]:
    """One cell per (length, depth), each with its own random key (reproducible from `seed`)."""
    rng = random.Random(seed)
    out = []
    for length in lengths:
        for depth in depths:
            key = str(rng.randint(10000, 99999))
            out.append(Cell(length, depth, key, build_prompt(encode, length, depth, key)))
    return out


def retrieved(text: str, key: str) -> bool:
    """Whether the first run of digits in `text` is exactly `key`."""
    m = re.search(r"\d+", text)
    return m is not None and m.group(0) == key


def fitting_lengths(lengths: Sequence[int], limit: int) -> tuple[list[int], list[int]]:
    """(the lengths to test, those dropped): lengths over `limit` (the most prompt tokens both sides allow) are
    replaced by `limit` itself, once, so that the longest context the deployment allows is always tested."""
    keep = sorted({min(x, limit) for x in lengths})
    return keep, sorted(x for x in lengths if x > limit)


Generated = tuple[str, list[int] | None]  # text, token ids (None: the server did not return them)


def score_grid(grid: list[Cell], ref_out: list[Generated], cand_out: list[Generated]) -> dict[str, Any]:
    """Per cell: each side's text, whether it retrieved the key, and whether the two generated the same tokens
    (compared as ids where both sides return them: a detokenizer may hold back an incomplete character)."""
    rows = []
    for c, (r, r_ids), (k, k_ids) in zip(grid, ref_out, cand_out):
        rows.append(
            {
                "length": c.length,
                "depth": c.depth,
                "key": c.key,
                "reference_text": r,
                "candidate_text": k,
                "reference_ok": retrieved(r, c.key),
                "candidate_ok": retrieved(k, c.key),
                "same_text": r_ids == k_ids if r_ids is not None and k_ids is not None else r == k,
            }
        )
    return {
        "cells": rows,
        "reference_retrieved": sum(r["reference_ok"] for r in rows),
        "candidate_retrieved": sum(r["candidate_ok"] for r in rows),
        "misses": sum(r["reference_ok"] and not r["candidate_ok"] for r in rows),
        "same_text": sum(r["same_text"] for r in rows),
    }
