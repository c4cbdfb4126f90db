"""Text for calibration and evaluation, under one fixed protocol so figures compare across runs.

Protocol: split the file into paragraphs at blank lines, take the first N, tokenize each on its own with
BOS (the tokenizer's default), truncate to 256 tokens, and score next-token log-likelihood.
Calibrate on calibration text only; measure on evaluation text only.
"""

from __future__ import annotations

import re
from pathlib import Path

from kernels.errors import KilnError

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


def tokenize_paragraphs(tokenizer, paragraphs: list[str], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """Each paragraph tokenized on its own (with BOS), truncated to `max_tokens`; 1-token results dropped."""
    out = []
    for paragraph in paragraphs:
        ids = tokenizer(paragraph)["input_ids"][:max_tokens]
        if len(ids) >= 2:
            out.append(list(ids))
    return out


def load_token_lists(tokenizer, path: Path | str, paragraphs: int | None = DEFAULT_PARAGRAPHS,
                     max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    return tokenize_paragraphs(tokenizer, read_paragraphs(path, paragraphs), max_tokens)
