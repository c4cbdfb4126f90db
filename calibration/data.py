"""Text for calibration and evaluation, under one fixed protocol so figures compare across runs.

Protocol: split the file into paragraphs at blank lines, take the first N, tokenize each on its own with
BOS (the tokenizer's default), truncate to 256 tokens (or the model's context, when shorter: `token_cap`), and
score next-token log-likelihood.
Calibrate on calibration text only; measure on evaluation text only.

A .jsonl/.json or .parquet file holds one paragraph per record, in its `text` field (.json and .parquet read
through Hugging Face `datasets`, as users keep calibration sets in those forms; .jsonl line by line); any other
file is plain text.

Input is read in bounded pieces whatever its line lengths: a text file READ_CHARS characters at a time, a JSONL
file one record line at a time (at most MAX_RECORD_BYTES), reading stops once the paragraphs asked for are found,
and each paragraph keeps at most the characters its first tokens can span (`paragraph_chars`): a 200 MB text with
no newline costs a few MB, not the whole file as one string and then its tokens.
"""

from __future__ import annotations

import glob
import json
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
"""File suffix -> the `datasets` builder that reads it; any other suffix is plain text (.jsonl: read here, line
by line, with the messages `datasets` gave)."""

MAX_TOKEN_CHARS = 256
"""Characters one token may span, at most, for the paragraph cap: no tokenizer's longest vocabulary entry comes
near (stories260K's are a few characters; byte-level BPE vocabularies' longest are runs of 64-128 spaces or
symbols), so a paragraph cut at `paragraph_chars` tokenizes to the same first tokens as the whole."""
READ_CHARS = 1 << 20
"""Characters of a text file read at a time."""
MAX_RECORD_BYTES = 16 << 20
"""Longest JSONL record line read: one paragraph, of which at most `paragraph_chars` characters are used."""


def paragraph_chars(max_tokens: int = MAX_TOKENS) -> int:
    """The most characters of a paragraph the protocol can use when it keeps `max_tokens` tokens: one token
    more (tokenize_paragraphs counts a paragraph as truncated when it has more), each at most MAX_TOKEN_CHARS."""
    return (max_tokens + 1) * MAX_TOKEN_CHARS


def read_paragraphs(path: Path | str, limit: int | None = DEFAULT_PARAGRAPHS,
                    max_chars: int | None = None) -> list[str]:
    """The first `limit` paragraphs (None: all) of a data file: a text file split at blank lines, or each
    record's `text` of a JSONL/JSON or Parquet file (by suffix, RECORD_READERS). Each keeps at most `max_chars`
    characters (None: `paragraph_chars()`, what MAX_TOKENS tokens can span); a text or JSONL file is read only
    as far as the paragraphs asked for, in bounded pieces."""
    path = Path(path)
    if not path.is_file():
        raise KilnError(f"data file {path} not found")
    if limit is not None and limit <= 0:
        raise KilnError(f"paragraph count must be positive, got {limit}")
    max_chars = paragraph_chars() if max_chars is None else max_chars
    suffix = path.suffix.lower()
    builder = RECORD_READERS.get(suffix)
    if suffix == ".jsonl":
        paragraphs = _jsonl_paragraphs(path, limit, max_chars)
    elif builder is not None:
        paragraphs = [text[:max_chars] for text in read_records(path, builder)]
    else:
        paragraphs = _text_paragraphs(path, limit, max_chars)
    if not paragraphs:
        raise KilnError(f"{path} holds no paragraphs")
    return paragraphs[:limit] if limit is not None else paragraphs


def _text_paragraphs(path: Path, limit: int | None, max_chars: int) -> list[str]:
    r"""The paragraphs of a text file as re.split(r"\n\s*\n", text) splits the whole text, whitespace-only ones
    dropped: a line holding only whitespace between two newlines ends a paragraph, and a paragraph keeps its
    edge whitespace as written (the reference figures include it). Read READ_CHARS characters at a time (universal
    newlines, as Path.read_text), at most `limit` paragraphs, each cut at `max_chars`: memory stays bounded
    whatever the file's size and line lengths."""
    found: list[str] = []
    para: list[str] = []  # the current paragraph's pieces, at most max_chars characters in all
    para_size, para_lines, para_text = 0, 0, False  # its characters, lines, and whether it holds a non-space
    line: list[str] = []  # the current line's pieces, at most max_chars characters (more could never be used)
    line_size, line_text, first_line = 0, False, True

    def add_line() -> None:
        nonlocal para_size, para_lines, para_text
        for piece in (["\n"] if para_lines else []) + line:
            room = max_chars - para_size
            if room > 0:
                para.append(piece[:room])
                para_size += min(len(piece), room)
        para_lines += 1
        para_text = para_text or line_text

    def end_paragraph() -> None:
        nonlocal para_size, para_lines, para_text
        if para_text:
            found.append("".join(para))
        para.clear()
        para_size, para_lines, para_text = 0, 0, False

    try:
        with open(path, encoding="utf-8") as f:
            while limit is None or len(found) < limit:
                chunk = f.read(READ_CHARS)
                if not chunk:
                    break
                pieces = chunk.split("\n")
                for i, piece in enumerate(pieces):
                    if len(piece) and line_size < max_chars:
                        line.append(piece[: max_chars - line_size])
                        line_size += min(len(piece), max_chars - line_size)
                    line_text = line_text or bool(piece.strip())
                    if i == len(pieces) - 1:
                        break  # the chunk ends inside this line
                    # a newline ends the line: whitespace only, after the file's first line, it ends the paragraph
                    if line_text or first_line:
                        add_line()
                    else:
                        end_paragraph()
                    line.clear()
                    line_size, line_text, first_line = 0, False, False
                    if limit is not None and len(found) >= limit:
                        break
            else:
                return found[:limit]
    except UnicodeDecodeError as exc:
        raise KilnError(f"{path} is not UTF-8 text: {exc}") from None
    add_line()  # the last line, even whitespace only: no newline follows it
    end_paragraph()
    return found


def _jsonl_paragraphs(path: Path, limit: int | None, max_chars: int) -> list[str]:
    """Each record's `text` (cut at `max_chars`) of a JSON-lines file, one line at a time (at most
    MAX_RECORD_BYTES each), until `limit` paragraphs; the refusals of read_records, in its words."""
    if path.stat().st_size == 0:
        raise KilnError(f"{path} holds no records")
    paragraphs: list[str] = []
    number = 0
    with open(path, "rb") as f:
        records = _jsonl_records(f, path)
        for number, record in records:
            text = record.get("text")
            if text is None and "text" not in record and not paragraphs:
                _refuse_textless(path, number, record, records)
            if not isinstance(text, str):
                what = "no text" if text is None else f"text of type {type(text).__name__}"
                raise KilnError(f"{path}: record {number} has {what}; every record's 'text' must be a string")
            if text.strip():
                paragraphs.append(text[:max_chars])
                if limit is not None and len(paragraphs) >= limit:
                    break
    if number == 0:
        raise KilnError(f"{path} holds no records")  # blank lines only
    return paragraphs


def _jsonl_records(f, path: Path):
    """(record number, record) per non-blank line of an open JSONL file, each line read with a bound."""
    number = 0
    for line_number in range(1, 1 << 62):
        raw = f.readline(MAX_RECORD_BYTES + 1)
        if not raw:
            return
        if len(raw) > MAX_RECORD_BYTES:
            raise KilnError(f"{path}: line {line_number} is longer than {MAX_RECORD_BYTES >> 20} MiB; a record holds "
                            f"one paragraph, of which at most {paragraph_chars()} characters are read")
        if not raw.strip():
            continue  # blank lines between records
        number += 1
        try:
            record = json.loads(raw)
        except ValueError as exc:  # json.JSONDecodeError, UnicodeDecodeError
            detail = getattr(exc, "msg", None) or type(exc).__name__
            raise KilnError(f"{path} is not readable as json: JSON parse error on line {line_number}: "
                            f"{str(detail)[:120]}") from None
        if not isinstance(record, dict):
            raise KilnError(f"{path} is not readable as json: line {line_number} is a JSON "
                            f"{type(record).__name__}, not an object with a 'text' field")
        yield number, record


def _refuse_textless(path: Path, number: int, record: dict, rest) -> None:
    """Record `number`, the first, has no 'text' key: either no record has one (say which fields they have, as
    `datasets` did) or this one lacks it (checked by reading the rest of the file, one line at a time)."""
    fields = dict.fromkeys(record)
    for _, other in rest:
        if "text" in other:
            raise KilnError(f"{path}: record {number} has no text; every record's 'text' must be a string")
        fields.update(dict.fromkeys(k for k in other if len(fields) < 50))
    raise KilnError(f"{path}: its records have no 'text' field (fields: {', '.join(map(str, fields))[:120]})")


def read_records(path: Path, builder: str) -> list[str]:
    """Each record's `text`, as written, through `datasets` (a local file: nothing is fetched, so it works with
    HF_DATASETS_OFFLINE). Records whose text is empty or only whitespace are skipped, as blank stretches of a text
    file are; a record without text (missing or null) or whose text is not a string is refused. `datasets` builds
    into a temporary cache, removed afterwards, so nothing lands in the user's Hugging Face cache."""
    if path.stat().st_size == 0:  # `datasets` answers an empty JSON file with a bare StopIteration
        raise KilnError(f"{path} holds no records")
    # lazy: datasets (with pyarrow) takes over a second to import, and only record files need it
    import datasets
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
    # each paragraph cut at what its first max_tokens tokens can span: a huge one is never tokenized whole
    return tokenize_paragraphs(tokenizer, read_paragraphs(path, paragraphs, paragraph_chars(max_tokens)), max_tokens,
                               log)


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
