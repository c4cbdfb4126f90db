"""Text for calibration and evaluation, under one fixed protocol so figures compare across runs.

Protocol: split the file into paragraphs at blank lines, take the first N, tokenize each on its own with
BOS (the tokenizer's default), truncate to 256 tokens (or the model's context, when shorter: `token_cap`), and
score next-token log-likelihood.
Calibrate on calibration text only; measure on evaluation text only.

A .jsonl/.json or .parquet file holds one paragraph per record, in its `text` field (read through Hugging Face
`datasets`, as users keep calibration sets in those forms); any other file is plain text.
"""

from __future__ import annotations

import glob
import re
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from kiln.kernels.errors import KilnError

MAX_TOKENS = 256
DEFAULT_PARAGRAPHS = 600


def token_cap(context: int) -> int:
    """The length paragraphs are cut at for a model of `context` positions: MAX_TOKENS, or the context when it
    is shorter (positions past it were never trained, and the runtime refuses them)."""
    return min(MAX_TOKENS, context)


RECORD_READERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
"""File suffix -> the `datasets` builder that reads it; any other suffix is plain text."""


def read_paragraphs(path: Path | str, limit: int | None = DEFAULT_PARAGRAPHS) -> list[str]:
    """The first `limit` paragraphs (None: all) of a data file: a text file split at blank lines, or each
    record's `text` of a JSONL/JSON or Parquet file (by suffix, RECORD_READERS)."""
    path = Path(path)
    if not path.is_file():
        raise KilnError(f"data file {path} not found")
    if limit is not None and limit <= 0:
        raise KilnError(f"paragraph count must be positive, got {limit}")
    builder = RECORD_READERS.get(path.suffix.lower())
    if builder is not None:
        paragraphs = read_records(path, builder)
    else:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise KilnError(f"{path} is not UTF-8 text: {exc}") from None
        # Paragraphs are kept as written (no strip): the reference figures include their edge whitespace.
        paragraphs = [p for p in re.split(r"\n\s*\n", text) if p.strip()]
    if not paragraphs:
        raise KilnError(f"{path} holds no paragraphs")
    return paragraphs[:limit] if limit is not None else paragraphs


def read_records(path: Path, builder: str) -> list[str]:
    """Each record's `text`, as written, through `datasets` (a local file: nothing is fetched, so it works with
    HF_DATASETS_OFFLINE). Records whose text is empty or only whitespace are skipped, as blank stretches of a text
    file are; a record without text (missing or null) or whose text is not a string is refused. `datasets` builds
    into a temporary cache, removed afterwards, so nothing lands in the user's Hugging Face cache."""
    if path.stat().st_size == 0:  # `datasets` answers an empty JSON file with a bare StopIteration
        raise KilnError(f"{path} holds no records")
    import datasets  # slow to import (over a second): only for record files
    import pyarrow

    verbosity, bars = datasets.logging.get_verbosity(), datasets.is_progress_bar_enabled()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its own "Failed to load JSON" line repeats ours
    datasets.disable_progress_bars()  # "Generating train split" is not the user's business
    try:
        with tempfile.TemporaryDirectory(prefix="kiln-datasets-") as cache:
            # glob.escape: data_files are patterns, and a file name may hold '[' or '*'
            records = datasets.load_dataset(builder, data_files=glob.escape(str(path.resolve())), split="train",
                                            keep_in_memory=True, cache_dir=cache)
    except (datasets.exceptions.DatasetsError, pyarrow.ArrowException, ValueError, OSError, StopIteration) as exc:
        cause = exc.__cause__ or exc
        detail = (str(cause).strip().splitlines() or [type(cause).__name__])[0][:160]
        raise KilnError(f"{path} is not readable as {builder}: {detail}") from None
    finally:
        datasets.logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()
    if "text" not in records.column_names:
        fields = ", ".join(records.column_names)
        raise KilnError(f"{path}: its records have no 'text' field (fields: {fields[:120]})")
    paragraphs = []
    for number, text in enumerate(records["text"], start=1):
        if not isinstance(text, str):
            what = "no text" if text is None else f"text of type {type(text).__name__}"
            raise KilnError(f"{path}: record {number} has {what}; every record's 'text' must be a string")
        if text.strip():
            paragraphs.append(text)
    return paragraphs


FEW_TOKENS = 2000
"""Fewer scored tokens than this make a recovery figure too noisy to gate on: say so."""


def tokenize_paragraphs(tokenizer, paragraphs: list[str], max_tokens: int = MAX_TOKENS,
                        log: Callable[[str], None] | None = None, required: bool = True) -> list[list[int]]:
    """Each paragraph tokenized on its own (with BOS), truncated to `max_tokens`; 1-token results dropped.
    `log` hears about truncated paragraphs and a token count too small to measure anything. No paragraph left
    is an error, unless not `required` (the rest of a text whose first part was tokenized already)."""
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
    if not out and required:
        raise KilnError("the text holds no paragraph of 2 or more tokens")
    return out


def within_tokens(token_lists: Sequence[Sequence[int]], budget: int | None) -> list[list[int]]:
    """The longest leading run of `token_lists` holding at most `budget` tokens in all, and at least the first
    list; None: all of them. Whole paragraphs in file order, so a budget never cuts a paragraph short."""
    taken: list[list[int]] = []
    total = 0
    for ids in token_lists:
        if budget is not None and taken and total + len(ids) > budget:
            break
        taken.append(list(ids))
        total += len(ids)
    return taken


def load_token_lists(tokenizer, path: Path | str, paragraphs: int | None = DEFAULT_PARAGRAPHS,
                     max_tokens: int = MAX_TOKENS, log: Callable[[str], None] | None = None) -> list[list[int]]:
    return tokenize_paragraphs(tokenizer, read_paragraphs(path, paragraphs), max_tokens, log)


FORWARD_BATCH_TOKENS = 2048
"""Tokens (padding included) per forward batch of calibration, probes and the gate on CPU. Small on purpose: a
batch's activations ([2048, 1536] fp32 at SmolLM2's MLP: 12 MiB) then stay under glibc's largest heap
allocation (32 MiB; larger buffers are fresh mappings, zero-filled page by page on every use): SmolLM2's gate
took 47 s with 8192-token batches and 30 s with 2048 (150 paragraphs, 2 cores), the same arithmetic."""

ACTIVATION_BYTES = 32 << 20
"""The most bytes one fp32 activation of a forward batch may take, [tokens, width] (see forward_batch_tokens)."""


def forward_batch_tokens(widest: int, max_tokens: int = FORWARD_BATCH_TOKENS) -> int:
    """Tokens per forward batch for blocks whose widest activation has `widest` features: at most `max_tokens`,
    and few enough that a [tokens, widest] fp32 buffer takes at most ACTIVATION_BYTES. SmolLM2 (1536 wide)
    keeps 2048; an 8B model's MLP (14336 wide) gets 585: its gate, up and SiLU outputs at 2048 tokens took
    336 MiB, and an observer's copies of the down_proj input as much again, of a 3.4 GiB block peak."""
    if widest < 1:
        raise ValueError(f"widest must be positive, got {widest}")
    return max(1, min(max_tokens, ACTIVATION_BYTES // (4 * widest)))


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
