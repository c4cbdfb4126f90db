"""Calibration and evaluation data as text, JSONL, JSON or Parquet, and the --calib-tokens budget.

A record file must give the token lists its text equivalent gives (the reference figures are measured on the
text protocol); a bad record file is one line and exit 2; the budget bounds what the passes calibrate on, and
the manifest records which file (path, sha256) and how many tokens."""

from __future__ import annotations

import hashlib
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kiln.calibration.data import load_token_lists, read_paragraphs, tokenize_paragraphs, within_tokens
from kiln.runtime.artifact import validate_manifest
from kiln.runtime.engine import load_tokenizer
from tests.conftest import CALIB_TEXT, EVAL_TEXT, STORIES, needs_stories, refused


def _write_jsonl(path, texts, **extra):
    path.write_text("".join(json.dumps({"text": t, **extra}) + "\n" for t in texts), encoding="utf-8")
    return path


@needs_stories
@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_records_give_the_text_files_token_lists(tmp_path, suffix):
    paragraphs = read_paragraphs(EVAL_TEXT, 40)
    # edge whitespace kept as written; an empty or blank record is skipped, as a blank stretch of text is
    texts = [*paragraphs[:20], "", "  \n", *paragraphs[20:]]
    path = tmp_path / f"eval{suffix}"
    if suffix == ".parquet":
        pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), path)
    elif suffix == ".json":
        path.write_text(json.dumps([{"text": t} for t in texts]), encoding="utf-8")
    else:
        _write_jsonl(path, texts, source="tinystories")
    tokenizer = load_tokenizer(STORIES)
    assert read_paragraphs(path, None) == paragraphs
    expected = load_token_lists(tokenizer, EVAL_TEXT, 40)
    assert load_token_lists(tokenizer, path, 40) == expected
    assert load_token_lists(tokenizer, path, 7) == expected[:7]


@pytest.mark.parametrize("name, content, match", [
    ("no_text.jsonl", '{"body": "a story"}\n', "records have no 'text' field (fields: body)"),
    ("corrupt.jsonl", '{"text": "a story"\nnot json\n', "is not readable as json: JSON parse error"),
    ("empty.jsonl", "", "holds no records"),
    ("blank.jsonl", '{"text": ""}\n{"text": " "}\n', "holds no paragraphs"),
    ("null.jsonl", '{"text": "a story"}\n{"other": 1}\n', "record 2 has no text"),
    ("number.jsonl", '{"text": 3}\n', "record 1 has text of type int"),
    ("corrupt.parquet", "PAR1 not a parquet file", "is not readable as parquet"),
])
def test_bad_record_files_are_one_line(tmp_path, name, content, match):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    refused(read_paragraphs, path, None, match=match)


def test_a_parquet_text_column_of_numbers_is_refused(tmp_path):
    path = tmp_path / "numbers.parquet"
    pq.write_table(pa.table({"text": [1, 2]}), path)
    refused(read_paragraphs, path, None, match="record 1 has text of type int")


def test_within_tokens_takes_whole_paragraphs_in_order():
    lists = [[1] * 5, [2] * 3, [3] * 4, [4] * 1]
    assert within_tokens(lists, None) == lists
    assert within_tokens(lists, 8) == lists[:2]  # 5 + 3 fit; the 4 after them would not, so stop (file order)
    assert within_tokens(lists, 11) == lists[:2]
    assert within_tokens(lists, 12) == lists[:3]
    assert within_tokens(lists, 2) == lists[:1]  # at least one paragraph, even over the budget


@needs_stories
def test_bad_jsonl_calibration_is_refused_by_the_cli(cli, tmp_path):
    bad = tmp_path / "calib.jsonl"
    bad.write_text('{"story": "Once upon a time"}\n', encoding="utf-8")
    out = tmp_path / "outs"
    out.mkdir()
    code, _, stderr = cli("build", STORIES, "--recipe", "fp8-kv", "--no-gate", "--calib-data", bad, "-o", out / "art")
    assert code == 2
    assert stderr.startswith("error: ") and "no 'text' field" in stderr and stderr.count("\n") == 1, stderr
    assert list(out.iterdir()) == []


@needs_stories
def test_calib_tokens_bounds_the_calibration_and_the_manifest_records_it(cli, tmp_path):
    """The budget counts every token (BOS included) of whole paragraphs in file order; each data file's record
    is its own path and sha256, and the report states them."""
    calib = _write_jsonl(tmp_path / "calib.jsonl", read_paragraphs(CALIB_TEXT, None))
    held_out = tmp_path / "eval.parquet"
    pq.write_table(pa.table({"text": read_paragraphs(EVAL_TEXT, 30)}), held_out)
    budget = 1500
    lengths = [len(ids) for ids in tokenize_paragraphs(load_tokenizer(STORIES), read_paragraphs(CALIB_TEXT, None))]
    fit = next(k for k in range(len(lengths)) if sum(lengths[:k + 1]) > budget)  # paragraphs that fit
    assert 2 < fit < 256  # the budget, not the 256-paragraph observation limit, is what binds

    out = tmp_path / "art"
    code, _, stderr = cli("build", STORIES, "--recipe", "fp8-kv", "--calib-data", calib, "--calib-tokens", budget,
                          "--eval-data", held_out, "--paragraphs", 20, "-o", out, "--reproducible")
    assert code == 0, stderr
    manifest = validate_manifest(json.loads((out / "manifest.json").read_text()))
    assert manifest["calibration"] == {"path": str(calib), "sha256": hashlib.sha256(calib.read_bytes()).hexdigest(),
                                       "paragraphs": fit, "tokens": sum(lengths[:fit]), "token_budget": budget}
    evaluation = manifest["evaluation"]
    assert (evaluation["path"], evaluation["data"], evaluation["paragraphs"], evaluation["paragraph_budget"]) == \
        (str(held_out), "eval.parquet", 20, 20)
    assert evaluation["sha256"] == hashlib.sha256(held_out.read_bytes()).hexdigest()
    assert evaluation["device"] == "cpu"  # where the gate ran (--device)
    report = (out / "report.md").read_text()
    assert f"- calibration: `{calib}` (sha256 `{manifest['calibration']['sha256']}`)" in report
    assert f"a budget of {budget} tokens" in report and f"- held-out (the gate): `{held_out}`" in report


@needs_stories
def test_default_calibration_observes_256_paragraphs_and_tunes_on_all(tmp_path):
    """Without a budget the sets are today's: the first 256 paragraphs to observe, every paragraph to tune."""
    from kiln.optimizer.build import build

    calib = tmp_path / "calib.txt"  # 300 paragraphs of the calibration text, as written
    calib.write_text("\n\n".join(CALIB_TEXT.read_text(encoding="utf-8").split("\n\n")[:300]), encoding="utf-8")
    tokenizer = load_tokenizer(STORIES)
    observed, tuned = load_token_lists(tokenizer, calib, 256), load_token_lists(tokenizer, calib, None)
    assert len(tuned) > 256
    record = build(STORIES, "hopper", "fp8-kv", None, gate=False, calib_data=calib).manifest["calibration"]
    assert record["observation"] == {"paragraphs": 256, "tokens": sum(map(len, observed))}
    assert record["tuning"] == {"paragraphs": len(tuned), "tokens": sum(map(len, tuned))} == \
        {"paragraphs": record["paragraphs"], "tokens": record["tokens"]}
    assert record["token_budget"] is None and record["path"] == str(calib)
