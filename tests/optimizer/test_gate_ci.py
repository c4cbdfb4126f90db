"""`optimize gate` for CI: the recovery interval (paired bootstrap), --decision, the long-generation check,
JSON / Markdown / JUnit outputs and exit codes."""

from __future__ import annotations

import hashlib
import itertools
import json
import shutil
import xml.etree.ElementTree as ET

import numpy as np
import pytest
import torch

from kiln.optimizer.measure.gate import recovery_interval
from tests.conftest import EVAL_TEXT, STORIES, needs_stories, untuned


def test_bootstrap_matches_the_exhaustive_resampling_distribution():
    # 4 documents: all 4^4 = 256 equally likely resamples give the exact bootstrap distribution of recovery
    base, cand, tokens = np.array([30.0, 50.0, 12.0, 80.0]), np.array([31.0, 50.5, 12.9, 80.2]), np.array([10, 20, 5, 30])
    exact = np.sort([np.exp(-(cand[list(p)] - base[list(p)]).sum() / tokens[list(p)].sum())
                     for p in itertools.product(range(4), repeat=4)])
    for level in (0.5, 0.8, 0.95):
        low, high = recovery_interval(base, cand, tokens, resamples=40_000, seed=3, confidence=level)
        tail = (1 - level) / 2
        # each end is a quantile of the exact distribution: P(X < end) <= q <= P(X <= end), to sampling noise
        for end, q in ((low, tail), (high, 1 - tail)):
            below, at_or_below = np.searchsorted(exact, end) / 256, np.searchsorted(exact, end, side="right") / 256
            assert below - 0.01 <= q <= at_or_below + 0.01, (level, end, below, at_or_below)


def test_interval_is_deterministic_and_paired():
    rng = np.random.default_rng(0)
    tokens = rng.integers(50, 200, size=300)
    base = tokens * rng.uniform(1.0, 2.5, size=300)  # documents differ a lot in difficulty
    cand = base + 0.01 * tokens  # ... but the candidate costs exactly 0.01 nats on every token
    low, high = recovery_interval(base, cand, tokens, seed=1)
    assert low == pytest.approx(np.exp(-0.01), rel=1e-12) and high == pytest.approx(np.exp(-0.01), rel=1e-12)
    noisy = cand + rng.normal(0, 0.5, size=300)
    assert recovery_interval(base, noisy, tokens, seed=5) == recovery_interval(base, noisy, tokens, seed=5)
    a, b = recovery_interval(base, noisy, tokens, seed=5), recovery_interval(base, noisy, tokens, seed=6)
    assert a != b and abs(a[0] - b[0]) < 2e-4 and abs(a[1] - b[1]) < 2e-4  # seeds agree to the resampling noise
    point = np.exp(-(noisy - base).sum() / tokens.sum())
    assert a[0] < point < a[1]


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from kiln.runtime.sampling import penalize_repeats

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    seen = [[1, 2, 2, 7], [0], [49, 3, 10, 11]]
    for penalty in (0.7, 1.0, 1.3):
        ours = penalize_repeats(logits, seen, penalty)
        theirs = torch.stack([RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([s]), logits[i:i + 1].clone())[0]
                              for i, s in enumerate(seen)])
        assert torch.equal(ours, theirs)


def _rehash(artifact, name: str) -> None:
    manifest = json.loads((artifact / "manifest.json").read_text())
    manifest["files"][name] = hashlib.sha256((artifact / name).read_bytes()).hexdigest()
    (artifact / "manifest.json").write_text(json.dumps(manifest, indent=2))


def looping_copy(artifact, dst, penalty: float = 0.85):
    """The artifact, weights untouched, shipping a generation_config.json whose repetition penalty below 1
    rewards repeats (a served default, applied by the runtime as vLLM applies it): perplexity is unchanged,
    greedy generations fall into loops."""
    shutil.copytree(artifact, dst)
    config = json.loads((dst / "generation_config.json").read_text())
    config["repetition_penalty"] = penalty
    (dst / "generation_config.json").write_text(json.dumps(config))
    _rehash(dst, "generation_config.json")
    return dst


def test_a_bad_shipped_repetition_penalty_is_one_line(art):
    from kiln import runtime
    from tests.conftest import refused

    (art / "generation_config.json").write_text(json.dumps({"repetition_penalty": -1}))
    _rehash(art, "generation_config.json")
    refused(runtime.load, art, match="repetition_penalty must be a finite number > 0")


@pytest.fixture(scope="module")
def fp8_artifact(tmp_path_factory):
    if not (STORIES / "config.json").is_file():
        pytest.skip("../shared/models absent")
    from kiln.optimizer.build import build

    return build(STORIES, "hopper", untuned("fp8-weights"), tmp_path_factory.mktemp("gate-ci") / "fp8",
                 eval_data=EVAL_TEXT, paragraphs=60).path


GATE = ("--baseline", STORIES, "--data", EVAL_TEXT, "--paragraphs", "100")
SHORT_GENERATION = ("--generate", "12", "--generate-tokens", "128")


@needs_stories
def test_gate_reports_an_interval_and_checks_in_json_and_junit(cli, fp8_artifact, tmp_path):
    junit = tmp_path / "gate.xml"
    code, stdout, _ = cli("gate", fp8_artifact, *GATE, *SHORT_GENERATION, "--min-recovery", "0.98", "--json",
                          "--junit", junit)
    result = json.loads(stdout)
    assert code == 0 and result["passed"]
    assert result["recovery_low"] < result["recovery"] < result["recovery_high"] < 1.0
    assert 0.98 < result["recovery_low"] and result["recovery_high"] - result["recovery_low"] < 0.01
    assert (result["resamples"], result["seed"], result["documents"], result["decision"]) == (2000, 0, 100, "point")
    names = [c["name"] for c in result["checks"]]
    assert names[:3] == ["recovery", "KL (nats/token)", "top-1 agreement"]
    assert sum(n.startswith("generation agreement") for n in names) == 4 and len(names) == 9
    assert all({"name", "value", "floor", "passed"} <= set(c) and c["passed"] for c in result["checks"])
    generation = result["generation"]
    assert generation["prompts"] == 12 and min(generation["agreement"]) > 0.9
    cases = ET.parse(junit).getroot().findall("./testsuite/testcase")
    assert [c.get("name") for c in cases] == names and not any(c.find("failure") is not None for c in cases)
    # another seed: the same decision, an interval that moves by resampling noise only
    code, stdout, _ = cli("gate", fp8_artifact, *GATE, "--generate", "0", "--min-recovery", "0.98", "--json",
                          "--seed", "7")
    other = json.loads(stdout)
    assert code == 0 and other["recovery"] == result["recovery"]
    assert abs(other["recovery_low"] - result["recovery_low"]) < 5e-4
    code, stdout, _ = cli("gate", fp8_artifact, *GATE, "--generate", "0", "--min-recovery", "0.98",
                          "--format", "markdown")
    assert code == 0 and stdout.startswith("## Kiln gate: fp8") and "| recovery |" in stdout


@needs_stories
def test_decision_lower_holds_the_interval_to_the_floor(cli, fp8_artifact):
    args = ("gate", fp8_artifact, *GATE, "--generate", "0", "--json")
    result = json.loads(cli(*args, "--min-recovery", "0.5")[1])
    between = round((result["recovery_low"] + result["recovery"]) / 2, 6)
    assert cli(*args, "--min-recovery", str(between))[0] == 0
    code, stdout, stderr = cli(*args, "--min-recovery", str(between), "--decision", "lower")
    assert code == 1 and "recovery (95% lower bound)" in stderr and "below the floor" in stderr
    assert not json.loads(stdout)["passed"]


@needs_stories
def test_long_generation_catches_a_looping_artifact(cli, fp8_artifact, tmp_path):
    looping = looping_copy(fp8_artifact, tmp_path / "looping")
    scores = [json.loads(cli("eval", a, "--data", EVAL_TEXT, "--paragraphs", "100", "--json")[1])["perplexity"]
              for a in (fp8_artifact, looping)]
    assert scores[0] == scores[1]  # the same weights: perplexity cannot see it
    junit = tmp_path / "gate.xml"
    code, stdout, stderr = cli("gate", looping, *GATE, *SHORT_GENERATION, "--min-recovery", "0.98", "--json",
                               "--junit", junit)
    result = json.loads(stdout)
    assert code == 1 and not result["passed"] and "checks failed: generation" in stderr
    checks = {c["name"]: c for c in result["checks"]}
    assert checks["recovery"]["passed"] and checks["KL (nats/token)"]["passed"]
    assert not checks["generation distinct-4 ratio"]["passed"] and checks["generation distinct-4 ratio"]["value"] < 0.6
    failed = [c.get("name") for c in ET.parse(junit).getroot().iter("testcase") if c.find("failure") is not None]
    assert "generation distinct-4 ratio" in failed and "recovery" not in failed


@pytest.mark.parametrize(("extra", "message"), [
    (("--format", "xml"), "--format must be one of text, json, markdown, junit"),
    (("--decision", "mean"), "--decision must be point or lower"),
    (("--generate", "-1"), "--generate must be an integer in [0, 10000]"),
    (("--min-distinct-ratio", "7"), "distinct4-ratio floor must be in [0, 1.5]"),
    (("--resamples", "0"), "--resamples must be an integer in [1, 100000]"),
])
def test_gate_usage_errors_exit_2_with_one_line(cli, plain_artifact, generated_checkpoint, tmp_path, extra, message):
    text = tmp_path / "t.txt"
    text.write_text("Once upon a time there was a cat.\n\nThe cat sat on a mat and was happy.\n")
    code, _, stderr = cli("gate", plain_artifact, "--baseline", generated_checkpoint, "--data", text,
                          "--min-recovery", "0.9", "--force", "--generate", "0", *extra)
    lines = stderr.strip().splitlines()
    assert code == 2 and message in lines[-1] and "Traceback" not in stderr


@needs_stories
def test_gate_runs_local_lm_eval_tasks_with_their_floors(cli, fp8_artifact):
    pytest.importorskip("lm_eval")
    from tests.conftest import ROOT

    code, stdout, _ = cli("gate", fp8_artifact, *GATE, "--generate", "0", "--min-recovery", "0.98", "--json",
                          "--tasks", ROOT / "examples" / "tasks" / "tinystories.yaml", "--task-limit", "40")
    result = json.loads(stdout)
    tasks = {c["name"]: c for c in result["checks"] if c["name"].startswith("task:")}
    assert code == 0 and set(tasks) == {"task:tinystories_next_word:acc",
                                        "task:tinystories_perplexity:word_perplexity"}
    assert tasks["task:tinystories_next_word:acc"]["value"] > 0.4  # 4 choices: chance is 0.25
    assert tasks["task:tinystories_perplexity:word_perplexity"]["relation"] == "<="
