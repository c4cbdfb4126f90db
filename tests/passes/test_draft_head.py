"""The draft-head pass: a head trained by self-distillation, its gate metric (tau), the CLI's speculative
generation and evaluation, recipe ordering, and a DeepSeek-V3 checkpoint's own MTP layer as the draft."""

from __future__ import annotations

import json

import pytest

from kiln.kernels.errors import KilnError
from kiln.optimizer.recipes import Recipe, resolve_recipe
from kiln.passes.draft_head import DraftHead
from tests.conftest import EVAL_TEXT, STORIES, needs_stories


@pytest.fixture(scope="module")
def head_artifact(tmp_path_factory):
    if not (STORIES / "config.json").is_file():
        pytest.skip("../shared/models absent")
    from kiln.optimizer.build import build

    recipe = Recipe("draft-head", (DraftHead(train_steps=150, generated=64, generated_tokens=64, min_tau=1.3),))
    return build(STORIES, "hopper", recipe, tmp_path_factory.mktemp("draft") / "art", eval_data=EVAL_TEXT,
                 paragraphs=80)


@needs_stories
def test_a_short_training_beats_prompt_lookup_and_leaves_the_target_alone(head_artifact):
    record = head_artifact.manifest["passes"][0]
    gate = record["gate"]
    assert record["decision"] == "kept" and gate["recovery"] == 1.0 and gate["kl"] == 0.0
    tau = next(m for m in gate["metrics"] if m["name"] == "tau")
    assert tau["passed"] and tau["value"] > 1.3  # prompt lookup: about 1.23 here
    metrics = record["result"]["metrics"]
    assert metrics["train_steps"] == 150 and metrics["train_tokens"] > 150 * 1000 and metrics["parameters"] > 40_000
    stored = json.loads((head_artifact.path / "manifest.json").read_text())
    modules = stored["architecture"]["extra_modules"]
    assert [(m["kind"], m["name"], m["aux_layers"]) for m in modules] == [("eagle3", "draft_head", [1, 2, 4])]
    assert modules[0]["tree_width"] == 3  # the width its gate measured tau with: the runtime's default


@needs_stories
def test_the_runtime_takes_the_tree_width_from_the_spec_and_from_older_artifacts_pass_records(head_artifact, tmp_path):
    import shutil

    from kiln import runtime
    from tests.runtime.test_artifact_hostile import _lie

    assert runtime.load(head_artifact.path).drafter("head").tree_width == 3
    recorded = shutil.copytree(head_artifact.path, tmp_path / "width2")
    _lie(recorded, lambda m: m["architecture"]["extra_modules"][0].update(tree_width=2))
    assert runtime.load(recorded).drafter("head").tree_width == 2
    older = shutil.copytree(head_artifact.path, tmp_path / "older")  # built before the spec carried it

    def before(m):
        del m["architecture"]["extra_modules"][0]["tree_width"]
        m["passes"][0]["config"]["tree_width"] = 4

    _lie(older, before)
    assert runtime.load(older).drafter("head").tree_width == 4


@needs_stories
def test_cli_speculative_generate_and_eval(cli, head_artifact):
    prompt = "Once upon a time, there was a little dog"
    code, plain, _ = cli("generate", head_artifact.path, prompt, "--max-new-tokens", "40")
    code2, spec, stderr = cli("generate", head_artifact.path, prompt, "--max-new-tokens", "40", "--speculative",
                              "--draft-tokens", "3")
    assert code == code2 == 0 and spec == plain and "tokens per target call" in stderr
    code, stdout, _ = cli("eval", head_artifact.path, "--data", EVAL_TEXT, "--paragraphs", "40", "--speculative",
                          "--json")
    result = json.loads(stdout)
    assert code == 0 and result["identical"] == result["prompts"] == 40 and result["tau"] > 1.3
    code, _, stderr = cli("generate", head_artifact.path, prompt, "--speculative", "--draft-tokens", "0")
    assert code == 2 and "--draft-tokens must be an integer in [1, 16]" in stderr


def test_the_head_drafts_for_the_model_that_ships():
    from kiln.passes.base import Pipeline

    with pytest.raises(KilnError, match="'draft-head' must run after 'weight-quant'"):
        Pipeline(list(resolve_recipe("draft-head,fp8-weights").passes))
    assert [p.name for p in Pipeline(list(resolve_recipe("fp8-weights,draft-head").passes)).flat()] == [
        "weight-quant", "draft-head"]
    with pytest.raises(KilnError, match="min_tau must be >= 1"):
        DraftHead(min_tau=0.5)


def test_deepseek_v3_keeps_its_mtp_layer_as_the_draft(tmp_path, cli, generated_checkpoint):
    import shutil

    from examples.tiny_moe import TOKENIZER_FILES, add_mtp_layer
    from kiln import runtime
    from tests.tiny_models import make_tiny_checkpoint

    vocab = json.loads((generated_checkpoint / "config.json").read_text())["vocab_size"]
    ckpt = add_mtp_layer(make_tiny_checkpoint("deepseek_v3", tmp_path / "dsv3", overrides={"vocab_size": vocab}))
    for name in TOKENIZER_FILES:
        if (generated_checkpoint / name).is_file():
            shutil.copy(generated_checkpoint / name, ckpt / name)
    text = tmp_path / "t.txt"
    text.write_text("\n\n".join(" ".join(str(i * j % 97) for j in range(40)) for i in range(1, 30)))
    out = tmp_path / "art"
    code, _, stderr = cli("build", ckpt, "--recipe", "draft-head", "-o", out, "--force", "--eval-data", text,
                          "--calib-data", text)
    assert code in (0, 1), stderr  # random weights: tau may miss its floor; the MTP layer stays either way
    manifest = json.loads((out / "manifest.json").read_text())
    record = manifest["passes"][0]
    assert "the checkpoint's own mtp module is the draft" in json.dumps(record["result"]["changed"])
    engine = runtime.load(out)
    assert engine.draft_module() is not None and engine.draft_module().spec.kind == "mtp"
    prompts = [[1, 5, 9, 14], [3, 3, 8]]
    plain = engine.generate_ids(prompts, 20)
    spec, stats = engine.speculative_ids(prompts, 20, 3)
    assert spec == plain and stats.steps > 0


def test_gemma3_gets_an_mtp_head_that_drafts_losslessly(tiny_checkpoints):
    """auto: Gemma 3's (1 + w) and sandwich norms do not fit an EAGLE-3 (Llama) layer, so the head takes the MTP
    shape, a copy of the last Gemma layer; asked for EAGLE-3 explicitly, the pass refuses in one line."""
    import torch

    from kiln.kernels.targets import get_target
    from kiln.optimizer.loader import load_checkpoint
    from kiln.optimizer.measure.gate import engine_from_graph
    from kiln.optimizer.measure.runner import RuntimeRunner
    from kiln.passes.base import PassContext, Pipeline

    graph = load_checkpoint(tiny_checkpoints["gemma3_text"])
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(3, 160, (40,), generator=gen).tolist() for _ in range(8)]
    ctx = PassContext(get_target("hopper"), runner=RuntimeRunner(graph, tokens))
    with pytest.raises(KilnError, match="EAGLE-3 head is a Llama decoder layer"):
        Pipeline([DraftHead(architecture="eagle3", min_tau=1.0)]).run(graph, ctx)
    (record,) = Pipeline([DraftHead(train_steps=3, generated=4, generated_tokens=8, min_tau=1.0)]).run(graph, ctx)
    assert record.result.changed == {"draft_head": "mtp draft head attached: 47552 parameters"}
    (module,) = graph.spec.extra_modules
    assert module.kind == "draft_head" and len(module.layer.output_norms) == 2
    engine = engine_from_graph(graph)
    prompt = [tokens[0][:10]]
    ids, stats = engine.speculative_ids(prompt, 12, 3, engine.drafter("head", tree_width=1))
    assert ids == engine.generate_ids(prompt, max_new_tokens=12) and stats.tau >= 1.0


def test_the_head_prompts_from_every_calibration_paragraph_not_observations_first_few(generated_checkpoint):
    """The build observes the first 256 calibration paragraphs (RuntimeRunner.calibration_tokens) but distils
    on all of them: the head's generations prompt from all of them too."""
    import torch

    from kiln.kernels.targets import get_target
    from kiln.optimizer.loader import load_checkpoint
    from kiln.optimizer.measure.runner import RuntimeRunner
    from kiln.passes.base import PassContext, Pipeline

    graph = load_checkpoint(generated_checkpoint)
    gen = torch.Generator().manual_seed(0)
    paragraphs = [torch.randint(3, 200, (20,), generator=gen).tolist() for _ in range(12)]
    runner = RuntimeRunner(graph, paragraphs[:3], distillation_tokens=paragraphs)
    ctx = PassContext(get_target("hopper"), runner=runner)
    def head(generated: int) -> DraftHead:
        return DraftHead(architecture="mtp", train_steps=1, generated=generated, generated_tokens=2, min_tau=1.0,
                         unroll=1)

    (record,) = Pipeline([head(10)]).run(graph, ctx)
    assert record.result.metrics["generated"] == 10 and record.result.metrics["unrolled_steps"] == 1
    (record,) = Pipeline([head(20)]).run(load_checkpoint(generated_checkpoint), ctx)
    assert record.result.metrics["generated"] == 12
    assert "generated 12 continuations, not 20" in record.result.notes[0] and "(of 12)" in record.result.notes[0]


def test_the_draft_vocabulary_is_the_most_frequent_tokens_by_hand():
    """Counts over the lists: token 5 four times, 2 three times, 9 and 7 twice (ties: the lower id), 1 once; a
    vocabulary of 3 holds {2, 5, 7} as d2t offsets from 0, 1, 2, and 9 of the 12 tokens."""
    import torch

    from kiln.passes.draft_head import draft_vocabulary, vocabulary_coverage

    lists = [[5, 5, 2, 9, 7], [2, 5, 1, 9], [5, 2, 7]]
    d2t, coverage = draft_vocabulary(lists, 3, vocab=12)
    assert (torch.arange(3) + d2t).tolist() == [2, 5, 7]
    assert coverage == pytest.approx(9 / 12) and vocabulary_coverage(lists, d2t) == pytest.approx(9 / 12)
    assert vocabulary_coverage([[9, 9, 1], [11]], d2t) == 0.0  # a resumed head's vocabulary on other text
    d2t, coverage = draft_vocabulary([[3, 3]], 3, vocab=12)  # too few distinct tokens: the lowest unseen fill
    assert (torch.arange(3) + d2t).tolist() == [0, 1, 3] and coverage == 1.0


def test_a_draft_vocabulary_is_eagle3s_and_smaller_than_the_vocabulary(generated_checkpoint):
    from kiln.optimizer.loader import load_checkpoint

    graph = load_checkpoint(generated_checkpoint)
    with pytest.raises(KilnError, match="draft_vocab is EAGLE-3's"):
        DraftHead(architecture="mtp", draft_vocab=8).check(graph, "hopper")
    with pytest.raises(KilnError, match="not smaller than the vocabulary"):
        DraftHead(architecture="eagle3", draft_vocab=graph.spec.vocab_size).check(graph, "hopper")
    with pytest.raises(KilnError, match="draft_vocab"):
        DraftHead(draft_vocab=-1)


@needs_stories
def test_init_from_resumes_an_artifacts_head_bit_for_bit_and_refuses_another_shape(head_artifact, plain_artifact,
                                                                                      tmp_path):
    """Zero more steps from the fixture's head ship that head unchanged (each tensor equal, its draft figures
    the same); a head of another shape, an artifact without one, or one of another model is refused before
    anything runs, and nothing is written."""
    import shutil

    import torch
    from safetensors.torch import load_file

    from kiln.optimizer.build import build
    from tests.runtime.test_artifact_hostile import _lie

    def run(head: DraftHead, name: str):
        return build(STORIES, "hopper", Recipe("resume", (head,)), tmp_path / name, eval_data=EVAL_TEXT,
                     paragraphs=80)

    source = str(head_artifact.path)
    resumed = run(DraftHead(train_steps=0, generated=0, min_tau=1.0, init_from=source), "resumed")
    theirs, ours = load_file(head_artifact.path / "model.safetensors"), load_file(resumed.path / "model.safetensors")
    head = [n for n in theirs if n.startswith("draft_head.")]
    assert len(head) > 8 and all(torch.equal(theirs[n], ours[n]) for n in head)
    record = resumed.manifest["passes"][0]
    assert any(f"{source}'s eagle3 head (150 steps in its build)" in note for note in record["result"]["notes"])
    tau = [next(m["value"] for m in r["gate"]["metrics"] if m["name"] == "tau")
           for r in (head_artifact.manifest["passes"][0], record)]
    assert tau[0] == tau[1]

    with pytest.raises(KilnError, match="its head \\(eagle3 reading layers \\[1, 2, 4\\]\\) is not this recipe's \\(mtp\\)"):
        run(DraftHead(architecture="mtp", init_from=source), "mtp")
    headless = shutil.copytree(head_artifact.path, tmp_path / "headless")

    def drop(tensors, manifest):
        manifest["architecture"]["extra_modules"] = []
        for name in [n for n in tensors if n.startswith("draft_head.")]:
            del tensors[name]

    _lie(headless, edit_tensors=drop)
    with pytest.raises(KilnError, match="has no draft head to start from"):
        run(DraftHead(init_from=str(headless)), "none")
    with pytest.raises(KilnError, match="was built from another model"):
        run(DraftHead(init_from=str(plain_artifact)), "other")
    with pytest.raises(KilnError, match="is not a Kiln artifact"):
        run(DraftHead(init_from=str(tmp_path)), "missing")
    assert not any((tmp_path / n).exists() for n in ("mtp", "none", "other", "missing"))


@needs_stories
def test_init_from_keeps_the_artifacts_draft_vocabulary_and_counts_its_coverage(tmp_path):
    """A head with a draft vocabulary resumes with that vocabulary (d2t, and so the lm_head's rows, equal) and
    reports its coverage of the same training text as its own build did."""
    import torch
    from safetensors.torch import load_file

    from kiln.optimizer.build import build

    def run(name: str, **config):
        head = DraftHead(architecture="eagle3", draft_vocab=64, generated=4, generated_tokens=8, min_tau=1.0,
                         **config)
        return build(STORIES, "hopper", Recipe(name, (head,)), tmp_path / name, eval_data=EVAL_TEXT, paragraphs=16)

    first = run("first", train_steps=5)
    resumed = run("resumed", train_steps=0, init_from=str(first.path))
    theirs, ours = load_file(first.path / "model.safetensors"), load_file(resumed.path / "model.safetensors")
    head = [n for n in theirs if n.startswith("draft_head.")]
    assert "draft_head.d2t" in head and all(torch.equal(theirs[n], ours[n]) for n in head)
    coverage = [b.manifest["passes"][0]["result"]["metrics"]["draft_vocab_coverage"] for b in (first, resumed)]
    assert 0 < coverage[0] == coverage[1] < 1
    assert any(f"{first.path}'s {coverage[1]:.2%}" in n for n in resumed.manifest["passes"][0]["result"]["notes"])
