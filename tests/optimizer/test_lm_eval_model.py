"""lm-eval's model `kiln` (kiln.optimizer.eval.lm_eval_model): lm-eval finds it by name (its own command line too,
through the installed .pth hook, kiln.optimizer.eval.lm_eval_plugin), and what lm-eval's own evaluator measures
through it equals what Kiln's scorer (`optimize eval`) and `Engine.generate` give on the same artifact."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from tests.conftest import EVAL_TEXT, ROOT, STORIES, refused, untuned

EXAMPLES = ROOT / "examples" / "tasks"
TASK = "tinystories_perplexity"  # a loglikelihood_rolling task: word and byte perplexity of whole paragraphs
ITEMS = 100  # the paragraphs the task draws (its dataset_kwargs)
DOCS = 6  # the paragraphs scored (lm-eval's limit)
MAX_TOKENS = 256  # the length `optimize eval` cuts paragraphs at (calibration.data.MAX_TOKENS)

needs_shared = pytest.mark.skipif(not (STORIES / "config.json").is_file() or not EVAL_TEXT.is_file(),
                                  reason="../shared (stories260K and the TinyStories evaluation text) absent")
pytestmark = needs_shared


@pytest.fixture(scope="module")
def kiln_lm():
    pytest.importorskip("lm_eval", reason="lm-eval not installed (pip install -e '.[tasks]')")
    from kiln.optimizer.eval.lm_eval_model import KilnLM, register

    register()
    return KilnLM


@pytest.fixture(scope="module")
def artifact(kiln_lm, tmp_path_factory):
    from kiln.optimizer.build import build

    return build(STORIES, "hopper", untuned("fp8-weights"), tmp_path_factory.mktemp("lm-eval") / "fp8", gate=False).path


@pytest.fixture(scope="module")
def short_paragraphs(tmp_path_factory) -> tuple:
    """The first ITEMS evaluation paragraphs that fit MAX_TOKENS with BOS, and a text file of them: the task draws
    all ITEMS of its text, in file order, and `optimize eval` cuts none of them, so both score every token."""
    from kiln.calibration.data import read_paragraphs
    from kiln.runtime.engine import load_tokenizer

    tok = load_tokenizer(STORIES)
    paragraphs = [p.strip() for p in read_paragraphs(EVAL_TEXT, None) if p.strip()]
    short = [p for p in paragraphs if len(tok(p)["input_ids"]) <= MAX_TOKENS][:ITEMS]
    path = tmp_path_factory.mktemp("text") / "short.txt"
    path.write_text("\n\n".join(short) + "\n")
    return short, path


def test_lm_eval_resolves_the_name_kiln_to_kiln_lm(kiln_lm):
    from lm_eval.api.registry import get_model
    from lm_eval.models.dummy import DummyLM

    from kiln.optimizer.eval.lm_eval_model import register

    [declared] = entry_points(group="lm_eval.models", name="kiln")  # what lm-eval's plugin discovery reads
    assert declared.load() is kiln_lm
    assert get_model("kiln") is kiln_lm
    register()  # a second time changes nothing
    assert get_model("kiln") is kiln_lm
    assert get_model("dummy") is DummyLM  # lm-eval's own models are still found


def test_rolling_perplexity_through_lm_eval_equals_optimize_eval(kiln_lm, artifact, short_paragraphs, monkeypatch,
                                                                 cli):
    import lm_eval
    from lm_eval.tasks import TaskManager

    paragraphs, text = short_paragraphs
    monkeypatch.setenv("KILN_TASK_TEXT", str(text))  # the example task's text (examples/tasks/utils.py)
    results = lm_eval.simple_evaluate(
        model="kiln", model_args=f"artifact={artifact}", tasks=[TASK], limit=DOCS, log_samples=True,
        bootstrap_iters=0, task_manager=TaskManager(include_path=str(EXAMPLES), include_defaults=False))
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    assert [s["doc"]["text"] for s in samples] == paragraphs[:DOCS]
    loglikelihood = sum(float(s["filtered_resps"][0]) for s in samples)

    nll = _optimize_eval_nll(cli, artifact, text)
    assert -loglikelihood == pytest.approx(nll, rel=1e-4)

    # lm-eval's perplexities are Kiln's summed NLL over the documents' words and bytes
    words = sum(len(re.split(r"\s+", p)) for p in paragraphs[:DOCS])
    size = sum(len(p.encode("utf-8")) for p in paragraphs[:DOCS])
    measured = results["results"][TASK]
    assert measured["word_perplexity,none"] == pytest.approx(math.exp(nll / words), rel=1e-4)
    assert measured["byte_perplexity,none"] == pytest.approx(math.exp(nll / size), rel=1e-4)
    assert measured["bits_per_byte,none"] == pytest.approx(nll / size / math.log(2), rel=1e-4)


def _optimize_eval_nll(cli, artifact, text) -> float:
    """`optimize eval`'s summed NLL over the first DOCS paragraphs of `text`."""
    code, out, err = cli("eval", artifact, "--data", text, "--paragraphs", DOCS, "--json")
    assert code == 0, err
    kiln = json.loads(out)
    assert kiln["paragraphs"] == DOCS
    return kiln["nll_per_token"] * kiln["tokens"]


def test_the_installed_hook_registers_kiln_in_a_fresh_interpreter(kiln_lm):
    """No register() call: the kiln-lm-eval.pth that installing Kiln puts in site-packages adds `kiln` when
    lm-eval fills its registry, beside lm-eval's own names."""
    probe = ("from lm_eval.api.registry import get_model, model_registry\n"
             "print(get_model('kiln').__module__, get_model('kiln').__name__, 'hf' in model_registry, "
             "'dummy' in model_registry)")
    proc = subprocess.run([sys.executable, "-c", probe], check=False, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["kiln.optimizer.eval.lm_eval_model", "KilnLM", "True", "True"]


def test_lm_eval_command_line_runs_model_kiln_as_typed(kiln_lm, artifact, short_paragraphs, tmp_path, cli):
    """`lm_eval --model kiln --model_args artifact=DIR --tasks ...`, lm-eval's own console script, unchanged."""
    paragraphs, text = short_paragraphs
    command = [Path(sys.executable).with_name("lm_eval"), "--model", "kiln", "--model_args", f"artifact={artifact}",
               "--tasks", TASK, "--include_path", EXAMPLES, "--limit", DOCS, "--output_path", tmp_path / "out"]
    proc = subprocess.run(list(map(str, command)), check=False, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "KILN_TASK_TEXT": str(text), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    [saved] = (tmp_path / "out").rglob("results_*.json")
    measured = json.loads(saved.read_text())["results"][TASK]
    words = sum(len(re.split(r"\s+", p)) for p in paragraphs[:DOCS])
    nll = _optimize_eval_nll(cli, artifact, text)
    assert measured["word_perplexity,none"] == pytest.approx(math.exp(nll / words), rel=1e-4)


REQUESTS = [("Once upon a time", {"until": ["."], "max_gen_toks": 40}),
            ("Lily went to the park", {"until": ["\n\n", "ball"], "max_gen_toks": 30}),
            ("Tom had a red", {"until": [], "max_gen_toks": 12, "do_sample": False})]


def test_generate_until_returns_what_engine_generate_decodes_greedily(kiln_lm, artifact):
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model

    from kiln import runtime

    lm = get_model("kiln").create_from_arg_string(f"artifact={artifact}")
    texts = lm.generate_until([Instance("generate_until", {}, r, i) for i, r in enumerate(REQUESTS)])
    engine = runtime.load(artifact)
    for text, (prompt, kwargs) in zip(texts, REQUESTS, strict=True):
        [greedy] = engine.generate([prompt], max_new_tokens=kwargs["max_gen_toks"], stop=kwargs["until"])
        # the same tokens; lm-eval's text is the continuation decoded on its own, as HFLM's is, so SentencePiece
        # drops the word-boundary space that Engine.generate keeps after the prompt
        alone = engine.tokenizer.decode(greedy.token_ids, skip_special_tokens=True)
        assert text == alone[:min([alone.index(s) for s in kwargs["until"] if s in alone], default=len(alone))]
        assert text == greedy.text.removeprefix(" ")
    assert texts[0] == ", there was a little girl named Lily"
    sampled = Instance("generate_until", {}, ("Once", {"until": ["."], "do_sample": True, "temperature": 0.7}), 0)
    refused(lm.generate_until, [sampled], match="decodes greedily")


def test_a_missing_or_damaged_artifact_or_bad_model_args_are_one_line_errors(kiln_lm, artifact, tmp_path):
    make = kiln_lm.create_from_arg_string
    refused(make, f"artifact={tmp_path / 'nowhere'}", match="does not exist")
    refused(make, "", match="--model_args artifact=DIR")
    refused(make, f"artifact={STORIES}", match="not a Kiln artifact")  # a checkpoint, not an artifact
    damaged = shutil.copytree(artifact, tmp_path / "damaged")
    weights = damaged / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    refused(make, f"artifact={damaged}", match="checksum mismatch")
    refused(make, f"artifact={artifact},temperature=0.7", match="unknown model_args temperature")
    refused(make, f"artifact={artifact},max_length=100000", match="max_length must be in [1, 512]")
    refused(make, f"artifact={artifact}", {"batch_size": "many"}, match="batch_size must be")
    # lm-eval's command line passes its batch size and device to every model: accepted, results unchanged
    assert make(f"artifact={artifact}", {"batch_size": "auto:4", "max_batch_size": 8, "device": "cuda:0"})


def test_kiln_lm_eval_prints_a_kiln_error_as_one_line(kiln_lm, tmp_path, monkeypatch, capsys):
    import lm_eval.__main__
    from lm_eval.api.registry import get_model

    from kiln.optimizer.eval import lm_eval_model

    def cli_evaluate():  # lm-eval's command line, less the indexing of its own task catalogue (30 s)
        get_model(sys.argv[2]).create_from_arg_string(sys.argv[4])

    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", cli_evaluate)
    monkeypatch.setattr(sys, "argv", ["kiln-lm-eval", "--model", "kiln", "--model_args",
                                      f"artifact={tmp_path / 'nowhere'}", "--tasks", TASK])
    with pytest.raises(SystemExit) as info:
        lm_eval_model.main()
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.startswith("error: artifact ") and "nowhere" in err and err.count("\n") == 1, err
