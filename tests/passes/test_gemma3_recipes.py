"""Every recipe on a tiny random Gemma 3 (sliding window, (1 + w) and sandwich norms, GeGLU, one KV head): it
builds, says what it changed, and the artifact decodes; MLA's refusal and the draft head are in test_mla.py and
test_draft_head.py, the runtime against transformers in tests/runtime/test_model.py."""

from __future__ import annotations

import pytest

from kiln import runtime
from kiln.optimizer.build import build
from tests.conftest import untuned
from tests.precision_helpers import tiny_with_tokenizer


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    return tiny_with_tokenizer("gemma3_text", tmp_path_factory.mktemp("gemma"))


@pytest.mark.parametrize(("recipe", "options", "passes"), [
    ("mxfp4-w4a16", {}, ["weight-quant"]),
    ("nvfp4", {}, ["weight-quant"]),
    pytest.param("production", {}, ["production-precision"], marks=pytest.mark.slow),
    pytest.param("auto", {"weight_bits": 5.0}, ["auto-precision"], marks=pytest.mark.slow),  # 2 minutes
    ("fp8-kv", {}, ["kv-cache"]),
    ("nvfp4-kv", {}, ["kv-cache"]),
    ("fp8,fuse", {}, ["weight-quant", "fuse"]),
])
def test_every_recipe_builds_and_decodes(tiny_gemma, tmp_path, recipe, options, passes):
    if recipe in ("mxfp4-w4a16", "nvfp4"):  # the layout, not the tuned accuracy: untuned (a minute less)
        recipe = untuned(recipe)
    result = build(tiny_gemma, "blackwell", recipe, tmp_path / "art", gate=False, calib_tokens=512, **options)
    assert [r.name for r in result.records] == passes
    assert all(r.result.changed for r in result.records)  # each pass did something, and says what
    engine = runtime.load(result.path)
    (out,) = engine.generate_ids([[2, 5, 9]], max_new_tokens=5)
    assert len(out[0]) == 5
