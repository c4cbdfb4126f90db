"""Text for calibration and evaluation, under one fixed protocol so figures compare across runs.

Protocol: split the file into paragraphs at blank lines, take the first N, tokenize each on its own with
BOS (the tokenizer's default), truncate to 256 tokens, and score next-token log-likelihood.
Calibrate on calibration text only; measure on evaluation text only.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path

from kiln.kernels.errors import KilnError

MAX_TOKENS = 256
DEFAULT_PARAGRAPHS = 600


def read_paragraphs(path: Path | str, limit: int | None = DEFAULT_PARAGRAPHS) -> list[str]:
    path = Path(path)
    if not path.is_file():
        raise KilnError(f"data file {path} not found")
    if limit is not None and limit <= 0:
        raise KilnError(f"paragraph count must be positive, got {limit}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise KilnError(f"{path} is not UTF-8 text: {exc}") from None
    # Paragraphs are kept as written (no strip): the reference figures include their edge whitespace.
    paragraphs = [p for p in re.split(r"\n\s*\n", text) if p.strip()]
    if not paragraphs:
        raise KilnError(f"{path} holds no paragraphs")
    return paragraphs[:limit] if limit is not None else paragraphs


FEW_TOKENS = 2000
"""Fewer scored tokens than this make a recovery figure too noisy to gate on: say so."""


def tokenize_paragraphs(tokenizer, paragraphs: list[str], max_tokens: int = MAX_TOKENS,
                        log: Callable[[str], None] | None = None) -> list[list[int]]:
    """Each paragraph tokenized on its own (with BOS), truncated to `max_tokens`; 1-token results dropped.
    `log` hears about truncated paragraphs and a token count too small to measure anything."""
    out, truncated, dropped = [], 0, 0
    for paragraph in paragraphs:
        ids = tokenizer(paragraph)["input_ids"]
        truncated += len(ids) > max_tokens
        ids = ids[:max_tokens]
        if len(ids) >= 2:
            out.append(list(ids))
        else:
            dropped += 1
    if log is not None:
        if truncated:
            log(f"warning: {truncated} of {len(paragraphs)} paragraphs are longer than {max_tokens} tokens; only "
                f"their first {max_tokens} tokens are used (separate paragraphs with blank lines)")
        if dropped:
            log(f"warning: {dropped} paragraphs of under 2 tokens are skipped")
        scored = sum(len(ids) - 1 for ids in out)
        if scored < FEW_TOKENS:
            log(f"warning: only {scored} tokens to score (under {FEW_TOKENS}): figures on so little text are noisy")
    if not out:
        raise KilnError("the text holds no paragraph of 2 or more tokens")
    return out


def load_token_lists(tokenizer, path: Path | str, paragraphs: int | None = DEFAULT_PARAGRAPHS,
                     max_tokens: int = MAX_TOKENS, log: Callable[[str], None] | None = None) -> list[list[int]]:
    return tokenize_paragraphs(tokenizer, read_paragraphs(path, paragraphs), max_tokens, log)


def length_batches(token_lists: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    """Indices of `token_lists` in batches: sorted by length (so padding stays small), each batch padded to its
    longest list holding at most `max_tokens` (a single longer list is a batch of its own)."""
    order = sorted(range(len(token_lists)), key=lambda i: len(token_lists[i]))
    batches: list[list[int]] = []
    batch: list[int] = []
    for i in order:
        if batch and (len(batch) + 1) * len(token_lists[i]) > max_tokens:
            batches.append(batch)
            batch = []
        batch.append(i)
    if batch:
        batches.append(batch)
    return batches
