"""lm-eval tasks through Kiln's runtime (kiln.optimizer.eval.tasks): the requests equal lm-eval's own HFLM on the same
checkpoint, the example tasks run end to end on stories260K, and floors hold or fail as declared."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

from kiln.optimizer.eval.tasks import check_task, run_tasks
from tests.conftest import EVAL_TEXT, ROOT, STORIES, refused

EXAMPLES = ROOT / "examples" / "tasks"
TASKS_FILE = EXAMPLES / "tinystories.yaml"

needs_shared = pytest.mark.skipif(not (STORIES / "config.json").is_file() or not EVAL_TEXT.is_file(),
                                  reason="../shared (stories260K and the TinyStories evaluation text) absent")


@pytest.fixture(scope="module")
def lm_eval():
    return pytest.importorskip("lm_eval", reason="lm-eval not installed (pip install -e '.[tasks]')")


@pytest.fixture(scope="module")
def engine(lm_eval):
    from kiln.optimizer.loader import load_checkpoint
    from kiln.optimizer.measure.gate import engine_from_graph
    from kiln.runtime.engine import load_tokenizer

    if not (STORIES / "config.json").is_file():
        pytest.skip("../shared/models absent")
    return engine_from_graph(load_checkpoint(STORIES), load_tokenizer(STORIES))


def hflm(**kwargs):
    """lm-eval's own Hugging Face model over the checkpoint (offline: a local path)."""
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(STORIES), device="cpu", batch_size=4, **kwargs)


def instances(kind, *args):
    from lm_eval.api.instance import Instance

    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


LOGLIKELIHOOD = [
    ("Once upon a time, there was a", " little girl"),
    ("Once upon a time ", "there"),  # trailing space moves to the continuation
    ("", "Once upon a time"),  # empty context: the prefix token (BOS) conditions
    ("Lily saw a big dog in the park. The dog was", " happy and wanted to play."),
]
ROLLING = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her dog."


@needs_shared
@pytest.mark.parametrize("max_length", [None, 8])  # 8: contexts cut from the left, text in several windows
def test_requests_equal_lm_evals_hflm(lm_eval, engine, max_length):
    from kiln.optimizer.eval.tasks import engine_lm

    ours = engine_lm(engine, max_length=max_length)
    theirs = hflm(max_length=max_length)
    for (value, greedy), (ref_value, ref_greedy) in zip(ours.loglikelihood(instances("loglikelihood", *LOGLIKELIHOOD)),
                                                         theirs.loglikelihood(instances("loglikelihood", *LOGLIKELIHOOD),
                                                                              disable_tqdm=True), strict=True):
        assert value == pytest.approx(ref_value, abs=1e-4) and greedy == ref_greedy
    # HFLM scores the tokenizer's BOS after its prefix BOS as well; without it, its windows are ours
    rolling = instances("loglikelihood_rolling", (ROLLING,))
    assert ours.loglikelihood_rolling(rolling) == pytest.approx(
        hflm(max_length=max_length, add_bos_token=False).loglikelihood_rolling(rolling, disable_tqdm=True), abs=1e-4)


@needs_shared
def test_loglikelihood_equals_a_direct_computation_with_the_engine(lm_eval, engine):
    from kiln.optimizer.eval.tasks import engine_lm

    tok = engine.tokenizer
    ours = engine_lm(engine)
    for context, continuation in (LOGLIKELIHOOD[0], LOGLIKELIHOOD[3]):
        whole, prefix = tok.encode(context + continuation), tok.encode(context)
        log_probs = torch.log_softmax(engine.logits([whole])[0].double(), -1)
        expected = sum(float(log_probs[t - 1, whole[t]]) for t in range(len(prefix), len(whole)))
        [(value, _)] = ours.loglikelihood(instances("loglikelihood", (context, continuation)))
        assert value == pytest.approx(expected, abs=1e-4)
    # rolling, one window: every token of the text after BOS, BOS itself not scored
    ids = [tok.bos_token_id, *tok.encode(ROLLING, add_special_tokens=False)]
    log_probs = torch.log_softmax(engine.logits([ids])[0].double(), -1)
    expected = sum(float(log_probs[t - 1, ids[t]]) for t in range(1, len(ids)))
    assert ours.loglikelihood_rolling(instances("loglikelihood_rolling", (ROLLING,))) == [pytest.approx(expected,
                                                                                                      abs=1e-4)]


@needs_shared
def test_full_vocabulary_logits_exist_only_for_a_chunk_of_scored_positions(lm_eval, engine, monkeypatch):
    from kiln.optimizer.eval.tasks import engine_lm
    from kiln.optimizer.measure import gate as gate_module
    from kiln.runtime.engine import Engine

    requests = instances("loglikelihood", *LOGLIKELIHOOD)
    rolling = instances("loglikelihood_rolling", (ROLLING,))
    expected = engine_lm(engine).loglikelihood(requests), engine_lm(engine).loglikelihood_rolling(rolling)
    widest = []

    def head_logits(self, hidden):
        widest.append(hidden.shape[0])
        return self.model.lm_head(hidden)

    def no_full_logits(self, token_lists):
        raise AssertionError("the task runner computed full-sequence logits")

    monkeypatch.setattr(gate_module, "HEAD_CHUNK", 5)
    monkeypatch.setattr(Engine, "head_logits", head_logits)
    monkeypatch.setattr(Engine, "logits", no_full_logits)
    got = engine_lm(engine).loglikelihood(requests), engine_lm(engine).loglikelihood_rolling(rolling)
    assert got[0] == [(pytest.approx(v, abs=1e-5), g) for v, g in expected[0]]
    assert got[1] == pytest.approx(expected[1], abs=1e-5)
    assert max(widest) == 5  # the rolling text has more scored tokens than that: it was chunked


@needs_shared
def test_generate_until_equals_hflms_greedy_text(lm_eval, engine):
    from kiln.optimizer.eval.tasks import engine_lm

    requests = [("Once upon a time", {"until": ["."], "max_gen_toks": 40}),
                ("Lily went to the park", {"until": ["\n\n", "ball"], "max_gen_toks": 30}),
                ("Tom had a red", {"until": [], "max_gen_toks": 12, "do_sample": False})]
    ours = engine_lm(engine).generate_until(instances("generate_until", *requests))
    assert ours == hflm().generate_until(instances("generate_until", *requests), disable_tqdm=True)
    assert ours[0] == ", there was a little girl named Lily"
    assert "ball" not in ours[1]
    refused(engine_lm(engine).generate_until,
            instances("generate_until", ("Once", {"until": ["."], "do_sample": True, "temperature": 0.7})),
            match="greedily")


@needs_shared
def test_the_example_tasks_run_end_to_end_on_stories260k(lm_eval, engine):
    checks, raw = run_tasks(TASKS_FILE, engine, engine)

    by_name = {c.name: c for c in checks}
    assert sorted(by_name) == ["task:tinystories_next_word:acc", "task:tinystories_perplexity:word_perplexity"]
    assert all(c.passed for c in checks), [c.as_json() for c in checks]
    next_word = raw["tasks"]["tinystories_next_word"]
    perplexity = raw["tasks"]["tinystories_perplexity"]
    assert (next_word["samples"], perplexity["samples"]) == (150, 100)
    assert next_word["candidate"]["acc,none"] > 0.5  # chance is 0.25 (4 choices)
    assert 1 < perplexity["candidate"]["word_perplexity,none"] < 200
    assert perplexity["candidate"]["bits_per_byte,none"] < 2
    # deterministic: the same engine twice gives the same figures, so recovery is exactly 1
    assert next_word["candidate"] == next_word["baseline"] and perplexity["candidate"] == perplexity["baseline"]
    acc = by_name["task:tinystories_next_word:acc"]
    assert (acc.relation, acc.floor) == (">=", pytest.approx(0.95 * acc.value))
    ppl = by_name["task:tinystories_perplexity:word_perplexity"]
    assert (ppl.relation, ppl.floor) == ("<=", pytest.approx(ppl.value / 0.95))
    json.dumps({"checks": [c.as_json() for c in checks], "raw": raw})  # the gate's report writes both as JSON


@needs_shared
def test_a_worse_candidate_fails_its_floors(lm_eval, engine):
    from kiln.optimizer.loader import load_checkpoint
    from kiln.optimizer.measure.gate import engine_from_graph

    graph = load_checkpoint(STORIES)
    for layer in range(len(graph.blocks)):  # attention's and the MLP's outputs gone: the model reads one token
        for name in (f"model.layers.{layer}.self_attn.o_proj.weight", f"model.layers.{layer}.mlp.down_proj.weight"):
            graph.tensors[name] = torch.zeros_like(graph.tensors[name])
    worse = engine_from_graph(graph, engine.tokenizer)
    checks, raw = run_tasks(TASKS_FILE, worse, engine, limit=40)
    failed = {c.name for c in checks if not c.passed}
    assert failed == {"task:tinystories_next_word:acc", "task:tinystories_perplexity:word_perplexity"}, raw
    assert raw["tasks"]["tinystories_next_word"]["samples"] == 40


# --- floors and errors ---------------------------------------------------------------------------------------

TASK_YAML = """\
task: tiny_next_word
custom_dataset: !function utils.next_word_dataset
dataset_kwargs: {{items: 5, text_file: paragraphs.txt}}
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: gold
metric_list:
  - {{metric: acc, aggregation: mean, higher_is_better: true}}
{metadata}
"""


@pytest.fixture
def task_dir(tmp_path):
    """A directory holding the example tasks' utils.py, a paragraph text and a writer of one task YAML."""
    shutil.copy(EXAMPLES / "utils.py", tmp_path / "utils.py")
    words = ["the", "cat", "sat", "on", "the", "mat", "and", "looked", "at", "the", "little", "red", "ball", "near",
             "the", "old", "wooden", "door", "while", "her", "brother", "sang", "songs", "about", "green", "frogs",
             "jumping", "over", "tall", "trees"]
    (tmp_path / "paragraphs.txt").write_text("\n\n".join(" ".join((words * 2)[i:i + 16]) for i in range(12)))

    def write(metadata: str) -> Path:
        path = tmp_path / "task.yaml"
        path.write_text(TASK_YAML.format(metadata=metadata))
        return path

    return write


@pytest.mark.parametrize(("metadata", "match"), [
    ("", "has no floor"),
    ("metadata: {version: 1.0}", "has no floor"),
    ("metadata: {kiln_min_recovery: 0.9}", "kiln_metric must name one of its metrics (acc)"),
    ("metadata: {kiln_metric: f1, kiln_min: 0.5}", "kiln_metric 'f1' is not one of its metrics (acc)"),
    ("metadata: {kiln_metric: acc, kiln_floor: 0.5}", "unknown metadata key(s) kiln_floor"),
    ("metadata: {kiln_metric: acc, kiln_max: 0.5}", "takes kiln_min, not kiln_max"),
    ("metadata: {kiln_metric: acc, kiln_min_recovery: 2}", "kiln_min_recovery must be in (0, 1.5]"),
    ("metadata: {kiln_metric: acc, kiln_min: high}", "kiln_min must be a finite number"),
    ("metadata: {kiln_metric: acc, kiln_min_recovery: 0.9}", "relative to a baseline, and none was given"),
])
def test_a_task_without_a_valid_floor_is_refused_before_anything_runs(lm_eval, task_dir, metadata, match):
    refused(run_tasks, task_dir(metadata), None, None, match=match)  # no model: none is needed to refuse


def test_task_files_that_lm_eval_cannot_read_are_refused(lm_eval, tmp_path, task_dir):
    refused(run_tasks, tmp_path / "absent.yaml", None, match="not found")
    group = tmp_path / "group.yaml"
    group.write_text("group: mine\ntask:\n  - tiny_next_word\n  - not_a_task\n")
    task_dir("metadata: {kiln_metric: acc, kiln_min: 0.5}")
    refused(run_tasks, group, None, match="names task(s) not_a_task that no YAML in")
    (tmp_path / "plain.yaml").write_text("just: words\n")
    refused(run_tasks, tmp_path / "plain.yaml", None, match="needs a `task` or `group` name")


def test_a_missing_text_says_where_it_looked(lm_eval, tmp_path, monkeypatch):
    for name in ("utils.py", "tinystories_next_word.yaml"):
        shutil.copy(EXAMPLES / name, tmp_path / name)
    monkeypatch.setenv("KILN_TASK_TEXT", str(tmp_path / "nowhere.txt"))
    refused(run_tasks, tmp_path / "tinystories_next_word.yaml", None, match="nowhere.txt (KILN_TASK_TEXT) not found")


def test_without_lm_eval_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    refused(run_tasks, TASKS_FILE, None, match="pip install 'kiln[tasks]'")


def test_the_binding_bound_is_the_strictest_given():
    higher = {"metric": "acc", "filter": "none", "higher_is_better": True, "kiln_min_recovery": 0.9, "kiln_min": 0.5}
    check = check_task("t", higher, 0.6, 0.8, 10)
    assert (check.name, check.floor, check.relation, check.passed) == ("task:t:acc", pytest.approx(0.72), ">=", False)
    assert check_task("t", higher, 0.6, 0.4, 10).floor == 0.5  # the absolute floor binds over 0.9 x 0.4
    lower = {"metric": "word_perplexity", "filter": "none", "higher_is_better": False, "kiln_min_recovery": 0.8,
             "kiln_max": 20.0}
    check = check_task("t", lower, 12.0, 10.0, 10)
    assert (check.floor, check.relation, check.passed) == (pytest.approx(12.5), "<=", True)
    assert "recovery 0.8333" in check.detail
    assert check_task("t", lower, 12.0, 30.0, 10).floor == 20.0
    assert not check_task("t", lower, math.inf, 10.0, 10).passed
    filtered = {**higher, "filter": "strict-match"}
    assert check_task("t", filtered, 0.9, 0.9, None).name == "task:t:acc,strict-match"
