"""Input text is read in bounded pieces, whatever its line lengths (issue #18, 3): a huge text with no newline,
a huge JSONL record, a long file of which only the first paragraphs are asked for. The streaming reader splits
exactly as the whole-text protocol did (re.split at blank lines, edge whitespace kept)."""

from __future__ import annotations

import json
import random
import re
import tracemalloc

import pytest

from kiln.calibration import data
from kiln.calibration.data import MAX_RECORD_BYTES, load_token_lists, paragraph_chars, read_paragraphs
from tests.conftest import STORIES, needs_stories, refused

SENTENCE = "Once upon a time there was a little cat who liked to play in the sun. "


def _no_newline_text(path, megabytes: int):
    block = SENTENCE * ((1 << 20) // len(SENTENCE))  # about 1 MB
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(block for _ in range(megabytes))
    return path


def _peak(call, *args):
    """(result, peak bytes Python allocated during `call`)."""
    tracemalloc.start()
    try:
        result = call(*args)
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_huge_text_without_newlines_is_read_in_bounded_memory(tmp_path):
    path = _no_newline_text(tmp_path / "one-line.txt", 48)  # the whole-file read held 48 MB (and its copies)
    paragraphs, peak = _peak(read_paragraphs, path, 600)
    assert len(paragraphs) == 1 and len(paragraphs[0]) == paragraph_chars()
    assert paragraphs[0] == path.read_text(encoding="utf-8")[: paragraph_chars()]
    assert peak < 12 * 2**20, peak


def test_only_the_paragraphs_asked_for_are_read(tmp_path):
    path = tmp_path / "many.txt"
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(f"{SENTENCE}{i}\n\n" for i in range(200_000))  # about 15 MB of short paragraphs
    paragraphs, peak = _peak(read_paragraphs, path, 10)
    assert paragraphs == [f"{SENTENCE}{i}" for i in range(10)]
    assert peak < 6 * 2**20, peak


@pytest.mark.parametrize("chunk", [1, 2, 7, 1 << 20])
def test_the_streamed_split_is_the_whole_text_split(tmp_path, monkeypatch, chunk):
    """Random texts of letters, spaces, tabs, CR, LF, CRLF and Unicode whitespace, read `chunk` characters at a
    time, split as re.split(r"\\n\\s*\\n") splits the whole text (universal newlines, as Path.read_text)."""
    monkeypatch.setattr(data, "READ_CHARS", chunk)
    rng = random.Random(chunk)
    alphabet = ["a", "b", " ", "\n", "\n", "\t", "\r", "\r\n", "\u2028", "é"]
    path = tmp_path / "t.txt"
    for _ in range(400):
        path.write_bytes("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))).encode("utf-8"))
        expected = [p for p in re.split(r"\n\s*\n", path.read_text(encoding="utf-8")) if p.strip()]
        for limit in (None, 1, 2):
            if expected:
                assert read_paragraphs(path, limit) == (expected[:limit] if limit else expected)
            else:
                refused(read_paragraphs, path, limit, match="holds no paragraphs")


def test_a_long_paragraph_is_cut_at_max_chars(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("x" * 100 + "\n" + "z" * 5 + "\n\n  " + "y" * 10, encoding="utf-8")
    assert read_paragraphs(path, None, max_chars=7) == ["x" * 7, "  yyyyy"]
    assert read_paragraphs(path, None, max_chars=1000) == ["x" * 100 + "\nzzzzz", "  " + "y" * 10]


def test_a_jsonl_record_is_read_line_by_line_and_a_huge_one_is_refused(tmp_path):
    path = tmp_path / "big.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps({"text": "first story"}) + "\n")
        f.write('{"text": "' + "a" * (3 * MAX_RECORD_BYTES) + '"}\n')
    assert read_paragraphs(path, 1) == ["first story"]  # the limit is met before the huge line is read
    _, peak = _peak(lambda: refused(read_paragraphs, path, None, match="line 2 is longer than 16 MiB"))
    assert peak < 2.5 * MAX_RECORD_BYTES, peak  # a bounded piece of the line (its buffer and copy), never all of it


def test_a_jsonl_file_stops_at_the_paragraphs_asked_for(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": f"story {i}", "id": i}) + "\n" for i in range(5)) + "not json\n",
                    encoding="utf-8")
    assert read_paragraphs(path, 3) == ["story 0", "story 1", "story 2"]
    refused(read_paragraphs, path, None, match="is not readable as json: JSON parse error on line 6")
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"text": "b" * 50_000}) + "\n", encoding="utf-8")
    assert read_paragraphs(long, None, max_chars=100) == ["b" * 100]


@needs_stories
def test_tokenizing_a_huge_paragraph_costs_what_its_first_tokens_need(tmp_path):
    """A 48 MB paragraph gives the first 256 tokens the whole text gives, without tokenizing 48 MB."""
    from kiln.runtime.engine import load_tokenizer

    tokenizer = load_tokenizer(STORIES)
    path = _no_newline_text(tmp_path / "one-line.txt", 48)
    head = tmp_path / "head.txt"
    head.write_text(path.read_text(encoding="utf-8")[:200_000], encoding="utf-8")
    warnings = []
    (tokens,), peak = _peak(load_token_lists, tokenizer, path, 600, 256, warnings.append)
    assert tokens == load_token_lists(tokenizer, head, 600, 256)[0] and len(tokens) == 256
    assert any("longer than 256 tokens" in w for w in warnings)
    assert peak < 12 * 2**20, peak
