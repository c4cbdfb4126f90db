"""Datasets of the TinyStories tasks, built on the fly from a paragraph text (nothing derived is stored).

lm-eval calls these as `custom_dataset` with the task's `metadata` and `dataset_kwargs` as keyword arguments.
The text: `dataset_kwargs: {text_file: PATH}` in the task YAML (relative to the YAML), else the environment
variable KILN_TASK_TEXT, else ../shared/data/tinystories/evaluation.txt beside the repository (the gate
measures on evaluation text only; never calibrate on it). Any paragraph file `read_paragraphs` reads works:
plain text split at blank lines, or JSONL/Parquet records with a `text` field. Items are drawn with a fixed
seed, so a text gives the same items on every run and machine.
"""

from __future__ import annotations

import itertools
import os
import random
import re
from pathlib import Path

from kiln.calibration.data import read_paragraphs
from kiln.kernels.errors import KilnError
from kiln.optimizer.defaults import EVALUATION_TEXT, shared_dir

TEXT_VARIABLE = "KILN_TASK_TEXT"
WORD = re.compile(r"[a-z]{3,}")  # candidate answers and distractors: plain lowercase words, 3+ letters
TOKEN = re.compile(r"\S+")
PUNCTUATION = ".,!?;:\"'()"


def text_path(text_file: str | None = None, config_source: str | None = None) -> Path:
    if text_file:
        path = Path(text_file).expanduser()
        if not path.is_absolute() and config_source and config_source != "inline":
            path = Path(config_source).parent / path
        how = "dataset_kwargs text_file"
    elif os.environ.get(TEXT_VARIABLE):
        path, how = Path(os.environ[TEXT_VARIABLE]).expanduser(), TEXT_VARIABLE
    else:
        shared = shared_dir()
        path = shared / "data" / "tinystories" / "evaluation.txt" if shared else EVALUATION_TEXT
        how = "the default"
    if not path.is_file():
        raise KilnError(f"TinyStories task text {path} ({how}) not found: put ../shared beside the repository, "
                        f"set {TEXT_VARIABLE}=PATH, or give the task YAML dataset_kwargs: {{text_file: PATH}}")
    return path


def _paragraphs(text_file, config_source) -> list[str]:
    return [p.strip() for p in read_paragraphs(text_path(text_file, config_source), None) if p.strip()]


def _dataset(rows: list[dict]):
    import datasets

    return {"test": datasets.Dataset.from_list(rows)}


def _count(value, what: str, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise KilnError(f"TinyStories task: {what} must be an integer >= {least}, got {value!r}")
    return value


def next_word_dataset(text_file: str | None = None, items: int = 150, seed: int = 1234, choices: int = 4,
                      min_prefix_words: int = 8, config_source: str | None = None, **_metadata):
    """Multiple choice: a paragraph's first words, then its true next word or `choices` - 1 distractors.

    The answer is a plain lowercase word of 3+ letters at a random position past `min_prefix_words` words of a
    paragraph (punctuation after it is dropped). Distractors are words that follow the same word (the last of
    the context) somewhere in the other paragraphs, so each fits the sentence locally and only the story tells
    them apart; the rest of the text's words fill in when too few do. A word this paragraph uses is never a
    distractor, so none is also right. Rows: context, choices (words), gold (index)."""
    items, choices = _count(items, "items"), _count(choices, "choices", 2)
    min_prefix_words = _count(min_prefix_words, "min_prefix_words")
    paragraphs = _paragraphs(text_file, config_source)
    vocabulary = sorted({w for p in paragraphs for w in WORD.findall(p)})  # sorted: the draw depends on nothing else
    followers: dict[str, set[str]] = {}  # word -> the plain words that follow it anywhere in the text
    for paragraph in paragraphs:
        words = [w.lower().strip(PUNCTUATION) for w in paragraph.split()]
        for before, after in itertools.pairwise(words):
            if WORD.fullmatch(after):
                followers.setdefault(before, set()).add(after)
    rng = random.Random(seed)
    usable = []
    for index, paragraph in enumerate(paragraphs):
        tokens = list(TOKEN.finditer(paragraph))
        spots = [m for m in tokens[min_prefix_words:] if re.fullmatch(r"[a-z]{3,}[.,!?;:\"']*", m.group())]
        if spots:
            usable.append((index, spots))
    if len(usable) < items:
        raise KilnError(f"TinyStories next-word task: the text has {len(usable)} usable paragraphs, fewer than "
                        f"items={items}")
    rows = []
    for index, spots in sorted(rng.sample(usable, items)):
        spot = rng.choice(spots)
        answer = WORD.match(spot.group()).group()
        used = set(WORD.findall(paragraphs[index]))
        before = paragraphs[index][:spot.start()].split()[-1].lower().strip(PUNCTUATION)
        local = sorted(followers.get(before, set()) - used)
        distractors = rng.sample(local, min(choices - 1, len(local)))
        if len(distractors) < choices - 1:
            rest = [w for w in vocabulary if w not in used and w not in distractors]
            if len(rest) < choices - 1 - len(distractors):
                raise KilnError(f"TinyStories next-word task: the text has too few words for {choices - 1} "
                                f"distractors that paragraph {index} does not use")
            distractors += rng.sample(rest, choices - 1 - len(distractors))
        options = [answer, *distractors]
        rng.shuffle(options)
        rows.append({"paragraph": index, "context": paragraphs[index][:spot.start()].rstrip(), "choices": options,
                     "gold": options.index(answer)})
    return _dataset(rows)


def paragraph_dataset(text_file: str | None = None, items: int = 100, seed: int = 1234,
                      config_source: str | None = None, **_metadata):
    """`items` paragraphs drawn at random (kept in text order), for perplexity. Rows: paragraph, text."""
    items = _count(items, "items")
    paragraphs = _paragraphs(text_file, config_source)
    if len(paragraphs) < items:
        raise KilnError(f"TinyStories paragraph task: the text has {len(paragraphs)} paragraphs, fewer than "
                        f"items={items}")
    chosen = sorted(random.Random(seed).sample(range(len(paragraphs)), items))
    return _dataset([{"paragraph": i, "text": paragraphs[i]} for i in chosen])
