"""runtime.tokenizer.Tokenizer (tokenizers + jinja2) gives transformers' ids, text and chat prompts, and the
runtime path never imports transformers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.calibration.data import read_paragraphs
from kiln.runtime.engine import load_tokenizer
from kiln.runtime.tokenizer import Tokenizer, readable
from tests.conftest import EVAL_TEXT, ROOT, STORIES, needs_stories

SMOL = Path(os.environ.get("KILN_SMOLLM2_HF", Path.home() / ".cache/kiln/SmolLM2-135M-Instruct"))
MODELS = [pytest.param(STORIES, id="stories260K", marks=needs_stories),
          pytest.param(SMOL, id="SmolLM2", marks=pytest.mark.skipif(
              not (SMOL / "tokenizer.json").is_file(),
              reason=f"SmolLM2's HF tokenizer absent ({SMOL}; to_hf.py in the GGUF folder writes it)"))]
ODD_TEXTS = ["", " ", "  leading and trailing  ", "Once upon a time", "tabs\tand\nnew lines\n\n",
             "naïve café – “quotes” 東京 🙂", "<s>inline</s> specials <|im_start|>user<|im_end|>",
             "I can't, you're, it's , ok .", "a" * 300, "\u00a0non-breaking\u2009thin"]
CHATS = [[{"role": "user", "content": "Tell me a story."}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello! 🙂"}, {"role": "user", "content": "Again, in French: né"}]]


def _hf(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _texts() -> list[str]:
    return read_paragraphs(EVAL_TEXT, 200) + ODD_TEXTS


@pytest.mark.parametrize("path", MODELS)
def test_ids_and_text_match_transformers(path):
    ours, theirs = Tokenizer(path), _hf(path)
    assert readable(path) and isinstance(load_tokenizer(path), Tokenizer)
    for text in _texts():
        ids = theirs(text)["input_ids"]
        assert ours(text)["input_ids"] == ids, text
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), text
    batch = _texts()[:8]
    assert ours(batch)["input_ids"] == theirs(batch)["input_ids"]
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    assert ours.special_tokens_map == theirs.special_tokens_map
    assert len(ours) == len(theirs)
    assert ours.all_special_ids == sorted(theirs.all_special_ids)


@pytest.mark.parametrize("path", MODELS)
def test_decoding_any_ids_matches_transformers(path):
    """Every id, specials included, and byte-fallback pieces out of order (a half multi-byte character)."""
    import random

    ours, theirs = Tokenizer(path), _hf(path)
    rng = random.Random(0)
    size = len(theirs)
    sequences = [[i] for i in range(min(size, 600))]
    sequences += [[rng.randrange(size) for _ in range(rng.randrange(1, 24))] for _ in range(300)]
    for ids in sequences:
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), ids


@pytest.mark.parametrize("path", MODELS)
def test_chat_template_matches_transformers(path):
    ours, theirs = Tokenizer(path), _hf(path)
    assert bool(ours.chat_template) == bool(theirs.chat_template)
    if not theirs.chat_template:
        pytest.skip(f"{path.name} has no chat template (the fallback is tested in test_server)")
    for messages in CHATS:
        for prompt in (True, False):
            text = theirs.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False)
            assert ours.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False) == text
            assert ours(text, add_special_tokens=False)["input_ids"] == theirs(text, add_special_tokens=False)[
                "input_ids"]


TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
            "{{ raise_exception('only user and assistant roles, got ' + m['role']) }}{% endif %}\n"
            "  {{ '[' + m['role'] + '] ' + m['content'] | trim + eos_token }}\n"
            "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}{{ {'k': '<é>'} | tojson }}")


@needs_stories
@pytest.mark.parametrize("config_edit", [{"chat_template": TEMPLATE}, {"chat_template": TEMPLATE,
                                                                         "add_bos_token": False},
                                         {"add_bos_token": True, "add_eos_token": True},
                                         {"clean_up_tokenization_spaces": True}])
def test_config_semantics_match_transformers(tmp_path, config_edit):
    """A chat template using raise_exception, bos_token, eos_token, trim_blocks/lstrip_blocks and tojson;
    add_bos_token/add_eos_token overriding tokenizer.json's post-processor; clean_up_tokenization_spaces."""
    for name in ("tokenizer.json", "config.json"):
        shutil.copy(STORIES / name, tmp_path / name)
    config = json.loads((STORIES / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, **config_edit}))
    ours, theirs = Tokenizer(tmp_path), _hf(tmp_path)
    for text in _texts()[:50] + ODD_TEXTS:
        ids = theirs(text)["input_ids"]
        assert ours(text)["input_ids"] == ids, text
        assert ours.decode(ids) == theirs.decode(ids)
    if "chat_template" not in config_edit:
        return
    for messages in CHATS[:1] + [[{"role": "user", "content": " a "}, {"role": "assistant", "content": "b"}]]:
        for prompt in (True, False):
            assert ours.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False) == \
                theirs.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False)
    from jinja2.exceptions import TemplateError

    with pytest.raises(TemplateError, match="only user and assistant roles, got system"):
        ours.apply_chat_template(CHATS[1], add_generation_prompt=True, tokenize=False)
    with pytest.raises(TemplateError, match="only user and assistant roles, got system"):
        theirs.apply_chat_template(CHATS[1], add_generation_prompt=True, tokenize=False)


def test_model_specific_classes_go_to_transformers(tmp_path):
    """A class transformers v5 rebuilds (LlamaTokenizer) is not read as plain tokenizer.json."""
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    assert not readable(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend",
                                                                "auto_map": {"AutoTokenizer": ["x.Y", None]}}))
    assert not readable(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend"}))
    assert readable(tmp_path)


def test_runtime_path_does_not_import_transformers(plain_artifact):
    """runtime.load + generate (what `optimize generate` and `serve` run) import neither transformers nor
    anything of the optimizer's."""
    code = ("import sys; from kiln import runtime; e = runtime.load(sys.argv[1]); "
            "g = e.generate(['Once upon a time'], max_new_tokens=4)[0]; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers' or m.startswith('kiln.optimizer')))")
    out = subprocess.run([sys.executable, "-c", code, str(plain_artifact)], capture_output=True, text=True,
                         cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), check=True).stdout
    assert out.strip() == "[]", out


@needs_stories
def test_named_extra_special_tokens_reach_the_chat_template(tmp_path):
    """transformers v5's named extra_special_tokens ({"image_token": "<img>"}): a template may use the name."""
    for name in ("tokenizer.json", "config.json"):
        shutil.copy(STORIES / name, tmp_path / name)
    config = json.loads((STORIES / "tokenizer_config.json").read_text())
    template = "{{ bos_token }}[{{ image_token }}]{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {**config, "chat_template": template, "extra_special_tokens": {"image_token": "<img>"}}))
    ours, theirs = Tokenizer(tmp_path), _hf(tmp_path)
    messages = [{"role": "user", "content": "hi"}]
    expected = theirs.apply_chat_template(messages, tokenize=False)
    assert "<img>" in expected
    assert ours.apply_chat_template(messages, tokenize=False) == expected
    assert ours("a <img> b")["input_ids"] == theirs("a <img> b")["input_ids"]
