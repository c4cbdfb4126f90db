"""The gate at real vocabularies: chunked scoring equals full-logits scoring, KL and top-1 floors beside
recovery, foreign text refused, scoring within the model's context."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from kiln.calibration.data import load_token_lists
from kiln.calibration.metrics import kl_terms
from kiln.kernels.errors import KilnError
from kiln.kernels.targets import get_target
from kiln.optimizer.loader import load_checkpoint
from kiln.optimizer.measure import gate as gate_module
from kiln.optimizer.measure.gate import AccuracyGate, artifact_floors, check_floors, engine_from_graph, score
from kiln.passes.base import Pass, PassContext, PassResult, Pipeline
from kiln.passes.gate_result import GateResult
from kiln.passes.weight_quant import WeightQuantization
from kiln.runtime.engine import Engine, load_tokenizer
from tests.breakage import broken_copy
from tests.conftest import EVAL_TEXT, STORIES, needs_stories, refused


def full_logits_reference(baseline: Engine, candidate: Engine, token_lists) -> dict:
    """The gate's figures the straightforward way: every paragraph's full logits, log-softmax, reduce."""
    nll = kl = 0.0
    agree = count = 0
    for ids, base, cand in zip(token_lists, baseline.logits(token_lists), candidate.logits(token_lists), strict=True):
        base, cand = torch.log_softmax(base[:-1].float(), -1), torch.log_softmax(cand[:-1].float(), -1)
        targets = torch.as_tensor(ids[1:])
        nll -= float(cand.gather(1, targets[:, None]).sum())
        kl += float(kl_terms(base, cand).sum())
        agree += int((base.argmax(-1) == cand.argmax(-1)).sum())
        count += len(targets)
    return {"perplexity": math.exp(nll / count), "kl": kl / count, "top1": agree / count, "tokens": count}


def test_head_chunks_shrink_with_the_vocabulary():
    """32 MiB of fp32 log-probs per chunk: 128 positions at SmolLM2's 49K vocabulary, 64 at 128K, 32 at Gemma 3's
    262K; never fewer than 8 rows."""
    assert [gate_module.head_rows(v) for v in (512, 49152, 128256, 262144, 10**7)] == [128, 128, 65, 32, 8]


@needs_stories
@pytest.mark.parametrize("chunk", [gate_module.HEAD_CHUNK, 37])
def test_chunked_gate_equals_the_full_logits_reference(stories_graph, monkeypatch, chunk):
    tokens = load_token_lists(load_tokenizer(STORIES), EVAL_TEXT, 16)
    baseline = engine_from_graph(stories_graph)
    Pipeline([WeightQuantization(format="nvfp4")]).run(stories_graph, PassContext(get_target("hopper")))
    candidate = engine_from_graph(stories_graph)
    expected = full_logits_reference(baseline, candidate, tokens)

    monkeypatch.setattr(gate_module, "HEAD_CHUNK", chunk)
    widest = []

    def head_logits(self, hidden):
        widest.append(hidden.shape[0])
        return self.model.lm_head(hidden)

    def no_full_logits(self, token_lists):
        raise AssertionError("the gate computed full-sequence logits")

    monkeypatch.setattr(Engine, "head_logits", head_logits)
    monkeypatch.setattr(Engine, "logits", no_full_logits)
    gate = AccuracyGate(baseline, tokens)
    result = gate.compare(candidate, 0.9)
    candidate_score = score(candidate, tokens)

    assert result.tokens == expected["tokens"] == candidate_score.tokens
    for name in ("perplexity", "kl", "top1"):
        assert getattr(result, name) == pytest.approx(expected[name], rel=1e-6), name
    assert candidate_score.perplexity == pytest.approx(expected["perplexity"], rel=1e-6)
    assert result.kl > 0.01 and result.top1 < 0.99  # NVFP4 changes the model: the figures are not trivial
    # no more than `chunk` positions of full-vocabulary logits at once; the baseline keeps [n-1, hidden] only
    assert widest and max(widest) <= chunk
    assert [tuple(h.shape) for h in gate.baseline_hidden] == [(len(t) - 1, stories_graph.spec.hidden_size)
                                                              for t in tokens]


def figures(kl: float, top1: float, **judged) -> GateResult:
    return GateResult(perplexity=5.0, baseline_perplexity=5.0, kl=kl, top1=top1, tokens=1000, floor=0.99, **judged)


def test_every_floor_must_hold():
    assert figures(0.01, 0.95, max_kl=0.02, min_top1=0.9).passed
    too_far = figures(0.05, 0.95, max_kl=0.02, min_top1=0.9)  # recovery 1.0: a perplexity match is not enough
    assert too_far.recovery == 1.0 and not too_far.passed
    assert too_far.floors_held == {"recovery": True, "kl": False, "top1": True}
    assert too_far.failures == ["KL 0.05 nats/token is above the ceiling 0.02"]
    disagrees = figures(0.01, 0.85, max_kl=0.02, min_top1=0.9)
    assert not disagrees.passed and disagrees.failures == ["top-1 agreement 0.8500 is below the floor 0.9"]
    out = disagrees.to_json()
    assert (out["max_kl"], out["min_top1"], out["held"], out["passed"]) == (
        0.02, 0.9, {"recovery": True, "kl": True, "top1": False}, False)


def test_a_later_pass_is_judged_on_its_own_kl_and_top1():
    # after a pass that cost KL 0.03 and 4% agreement, one that adds KL 0.01 and 1% more disagreement
    later = figures(0.04, 0.95, max_kl=0.02, min_top1=0.97, reference_kl=0.03, reference_top1=0.96)
    assert later.pass_kl == pytest.approx(0.01) and later.pass_top1 == pytest.approx(0.99) and later.passed


@dataclass(frozen=True)
class Noise(Pass):
    """Changes nothing; the fake gate below reports the figures."""

    name: ClassVar[str] = "noise"

    def apply(self, graph, ctx) -> PassResult:
        return PassResult(self.name, changed={"lm_head": "noted"})


def test_pass_defaults_and_overrides_reach_the_gate(stories_graph):
    def fake_gate(graph, floor):  # the pass is free by perplexity, not by KL
        return GateResult(5.0, 5.0, kl=0.05, top1=0.95, tokens=1000, floor=floor)

    target = get_target("hopper")
    (record,) = Pipeline([Noise()]).run(stories_graph, PassContext(target, gate=fake_gate))
    assert record.decision == "reverted"  # recovery 1.0, KL 0.05 > the default ceiling
    assert (record.gate.max_kl, record.gate.min_top1) == (Pass.default_max_kl, Pass.default_min_top1)
    (record,) = Pipeline([Noise()]).run(stories_graph, PassContext(target, gate=fake_gate, max_kl=0.1,
                                                                   min_top1=0.9))
    assert record.decision == "kept" and record.gate.max_kl == 0.1 and record.gate.min_top1 == 0.9
    # weight formats declare their own (FP4 may cost more than FP8), and what the user sets replaces them all
    ctx, override = PassContext(target), PassContext(target, max_kl=0.3, min_top1=0.5)
    for fine, coarse in ((WeightQuantization(format="fp8"), WeightQuantization(format="nvfp4")),
                         (WeightQuantization(format="nvfp4"), WeightQuantization(format="nvfp4", activations="dynamic"))):
        assert fine.max_kl(ctx) < coarse.max_kl(ctx) and fine.min_top1(ctx) > coarse.min_top1(ctx)
        assert (coarse.max_kl(override), coarse.min_top1(override)) == (0.3, 0.5)


def test_floor_arguments_are_checked():
    for args, match in (((0.0, None, None), "--min-recovery"), ((None, -0.1, None), "--max-kl"),
                        ((None, math.nan, None), "--max-kl"), ((None, None, 1.5), "--min-top1")):
        refused(check_floors, *args, match=match)
    check_floors(0.99, 0.0, 1.0)


def test_an_artifact_is_gated_on_the_sum_of_its_passes_floors():
    manifest = {"passes": [{"decision": "kept", "gate": {"max_kl": 0.01, "min_top1": 0.95}},
                           {"decision": "reverted", "gate": {"max_kl": 0.5, "min_top1": 0.5}},
                           {"decision": "backed-off", "gate": {"max_kl": 0.02, "min_top1": 0.9}}]}
    max_kl, min_top1 = artifact_floors(manifest)
    assert max_kl == pytest.approx(0.03) and min_top1 == pytest.approx(0.85)
    assert artifact_floors({"passes": []}) == (0.0, 1.0)  # no pass: the artifact is its source


@pytest.fixture(scope="module")
def stories_artifact(tmp_path_factory):
    from kiln.optimizer.build import build

    if not (STORIES / "config.json").is_file():
        pytest.skip("../shared/models absent")
    return build(STORIES, "hopper", "none", tmp_path_factory.mktemp("plain") / "art", gate=False).path


def random_token_text(path, paragraphs: int = 20, length: int = 60):
    """Paragraphs of uniformly random tokens of stories260K's vocabulary, decoded to text."""
    tokenizer = load_tokenizer(STORIES)
    gen = torch.Generator().manual_seed(0)
    texts = [tokenizer.decode(torch.randint(3, 512, (length,), generator=gen).tolist()) for _ in range(paragraphs)]
    path.write_text("\n\n".join(" ".join(t.split()) for t in texts))
    return path


@needs_stories
def test_foreign_text_is_refused_unless_forced(cli, stories_artifact, tmp_path):
    text = random_token_text(tmp_path / "random.txt")
    code, _, stderr = cli("eval", stories_artifact, "--data", text)
    error = stderr.strip().splitlines()[-1]  # after the scoring progress: one line
    assert code == 2 and error.startswith("error: the text random.txt is foreign to the model: its perplexity ")
    assert "of 512 tokens" in error and "--force" in error and "Traceback" not in stderr
    code, stdout, stderr = cli("eval", stories_artifact, "--data", text, "--force", "--json")
    assert code == 0 and "warning:" in stderr and json.loads(stdout)["perplexity"] > 512 / 8
    gate_args = ("gate", stories_artifact, "--baseline", STORIES, "--data", text, "--min-recovery", "0.9",
                 "--generate", "0")
    code, _, stderr = cli(*gate_args)
    assert code == 2 and "foreign to the model" in stderr.strip().splitlines()[-1]
    assert cli(*gate_args, "--force")[0] == 0  # the artifact is its source: every floor holds
    out = tmp_path / "built"
    code, _, stderr = cli("build", STORIES, "--recipe", "fp8-weights", "-o", out, "--eval-data", text)
    assert code == 2 and "foreign to the model" in stderr and not out.exists()
    # the model's own text passes the check
    code, stdout, _ = cli("eval", stories_artifact, "--data", EVAL_TEXT, "--paragraphs", "20", "--json")
    assert code == 0 and json.loads(stdout)["perplexity"] < 10


@needs_stories
def test_gate_json_shows_every_floor_and_fails_on_any(cli, stories_artifact):
    args = ("gate", stories_artifact, "--baseline", STORIES, "--data", EVAL_TEXT, "--paragraphs", "20",
            "--min-recovery", "0.9", "--json", "--generate", "0")
    code, stdout, _ = cli(*args)
    result = json.loads(stdout)
    assert code == 0 and (result["max_kl"], result["min_top1"]) == (0.0, 1.0)  # no passes: identical required
    assert result["held"] == {"recovery": True, "kl": True, "top1": True} and result["kl"] == 0.0


@needs_stories
def test_scoring_stays_within_a_short_context(cli, tmp_path):
    from kiln.optimizer.build import build

    short = broken_copy(STORIES, tmp_path / "ctx128", "intact")
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 128}))
    art = build(short, "hopper", "none", tmp_path / "art", gate=False).path
    paragraphs = 40
    full = load_token_lists(load_tokenizer(STORIES), EVAL_TEXT, paragraphs)  # cut at 256
    assert max(map(len, full)) > 128  # some paragraphs run past the short context
    code, stdout, _ = cli("eval", art, "--data", EVAL_TEXT, "--paragraphs", str(paragraphs), "--json")
    assert code == 0
    assert json.loads(stdout)["tokens"] == sum(min(len(t), 128) - 1 for t in full)
    engine = engine_from_graph(load_checkpoint(short))
    refused(engine.logits, [list(range(1, 130))], match="exceeds the model's context 128")
    assert engine.logits([list(range(1, 129))])[0].shape == (128, 512)
    with pytest.raises(KilnError):
        engine.hidden_states([list(range(1, 130))])
