"""Artifacts whose tensors disagree with their architecture: refused at load with one line naming the tensor.

The checksums are updated after each edit (the manifest's "files" and "tensors" tables), so every artifact
here passes verification: the refusal must come from the runtime checking each tensor it uses against the
spec, never from a matmul in the middle of `optimize generate`. One tiny artifact (conftest `plain_artifact`)
is built per session; each test edits its own copy. The packed formats are checked on tensors built by the
kernels' own quantizers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln import runtime
from kiln.kernels import fp8
from kiln.runtime.artifact import MANIFEST, WEIGHTS, sha256_file
from kiln.runtime.weights import dequantize_weight
from tests.conftest import refused

Q = "model.layers.0.self_attn.q_proj"
DOWN = "model.layers.0.mlp.down_proj"
NORM = "model.layers.1.post_attention_layernorm.weight"
EMBED = "model.embed_tokens.weight"


def _manifest(art: Path) -> dict:
    return json.loads((art / MANIFEST).read_text())


def _rewrite_weights(art: Path, edit, formats: dict | None = None) -> None:
    """Apply `edit` to the tensor dict, save it, and make the manifest match (checksum, tensor table, weight
    bytes, format entries), so that the edited artifact passes verification."""
    tensors = load_file(str(art / WEIGHTS))
    edit(tensors)
    save_file(tensors, str(art / WEIGHTS))
    manifest = _manifest(art)
    manifest["files"][WEIGHTS] = sha256_file(art / WEIGHTS)
    manifest["tensors"] = {name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                           for name, t in tensors.items()}
    manifest["sizes"]["weight_bytes"] = sum(t.numel() * t.element_size() for t in tensors.values())
    manifest["formats"].update(formats or {})
    (art / MANIFEST).write_text(json.dumps(manifest))


def _rewrite_architecture(art: Path, **changes) -> None:
    manifest = _manifest(art)
    manifest["architecture"].update(changes)
    (art / MANIFEST).write_text(json.dumps(manifest))


def test_the_intact_copy_loads_and_generates(art, cli):
    assert runtime.load(art).generate("hi", max_new_tokens=2)[0].finish_reason in ("length", "eos")
    code, _, err = cli("generate", art, "hi", "--max-new-tokens", "2")
    assert code == 0, err


# --- shapes and presence through runtime.load and the console --------------------------------------------
def test_a_sliced_weight_is_refused_at_load_and_by_generate(art, cli):
    def edit(t):
        t[f"{Q}.weight"] = t[f"{Q}.weight"][:, :32].contiguous()

    _rewrite_weights(art, edit)
    message = f"artifact tensor {Q}.weight has shape (64, 32), the architecture needs (64, 64)"
    refused(runtime.load, art, match=message)
    code, out, err = cli("generate", art, "hi")
    assert code == 2, err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err + out


def test_a_reshaped_weight_of_the_same_size_isrefused(art):
    def edit(t):
        t[f"{DOWN}.weight"] = t[f"{DOWN}.weight"].reshape(172, 64).contiguous()

    _rewrite_weights(art, edit)
    refused(runtime.load, art, match=f"artifact tensor {DOWN}.weight has shape (172, 64), the architecture needs "
                                      "(64, 172)")


def test_an_architecture_vocab_size_disagreeing_with_the_embedding_isrefused(art, cli):
    _rewrite_architecture(art, vocab_size=500)
    message = "architecture.lm_head (lm_head): out_features is 384, the architecture's other sizes need 500"
    refused(runtime.load, art, match=message)
    code, _, err = cli("generate", art, "hi")
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_a_norm_of_the_wrong_length_isrefused(art):
    _rewrite_weights(art, lambda t: t.update({NORM: t[NORM][:32].contiguous()}))
    refused(runtime.load, art, match=f"artifact tensor {NORM} has shape (32,), the architecture needs (64,)")


def test_a_missing_tensor_isrefused(art, cli):
    _rewrite_weights(art, lambda t: t.pop(NORM))
    refused(runtime.load, art, match=f"artifact is missing tensor '{NORM}'")
    code, _, err = cli("generate", art, "hi")
    assert code == 2 and "artifact is missing tensor" in err and len(err.strip().splitlines()) == 1, err


def test_a_missing_embedding_isrefused(art):
    _rewrite_weights(art, lambda t: t.pop(EMBED))
    refused(runtime.load, art, match=f"artifact is missing tensor '{EMBED}'")


def test_non_finite_dense_values_arerefused(art):
    def edit(t):
        t[f"{DOWN}.weight"][3, 5] = float("inf")

    _rewrite_weights(art, edit)
    refused(runtime.load, art, match=f"artifact tensor {DOWN}.weight holds non-finite values (NaN or Inf)")


def test_an_integer_norm_isrefused(art):
    _rewrite_weights(art, lambda t: t.update({NORM: t[NORM].to(torch.int32)}))
    refused(runtime.load, art, match=f"artifact tensor {NORM} has dtype int32; a norm weight must be float32")


def test_an_unknown_format_isrefused(art, cli):
    manifest = _manifest(art)
    manifest["formats"][DOWN]["format"] = "int3"
    (art / MANIFEST).write_text(json.dumps(manifest))
    message = (f"{DOWN}: unknown weight format 'int3' in the manifest's format table; "
               "known: dense, fp8_e4m3, nvfp4, mxfp4, mxfp6")
    refused(runtime.load, art, match=message)
    code, _, err = cli("generate", art, "hi")
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_an_unknown_format_on_the_tied_lm_head_isrefused(art):
    manifest = _manifest(art)
    assert manifest["formats"]["lm_head"].get("tied_to")
    manifest["formats"]["lm_head"]["format"] = "nvfp5"
    (art / MANIFEST).write_text(json.dumps(manifest))
    refused(runtime.load, art, match="lm_head: unknown weight format 'nvfp5'")


# --- FP8 stored in the artifact ------------------------------------------------------------------------------
def _as_fp8(t: dict, module: str, scale_shape=None) -> None:
    q, scale = fp8.fp8_quantize_per_channel(t.pop(f"{module}.weight").float())
    t[f"{module}.weight"] = q
    t[f"{module}.weight_scale"] = scale if scale_shape is None else scale.reshape(scale_shape).contiguous()


def test_an_fp8_artifact_edit_loads_when_consistent(art):
    _rewrite_weights(art, lambda t: _as_fp8(t, Q), {Q: {"format": "fp8_e4m3", "activation": "none"}})
    assert len(runtime.load(art).generate("hi", max_new_tokens=2)[0].token_ids) >= 1


def test_an_fp8_scale_of_the_wrong_shape_isrefused(art, cli):
    _rewrite_weights(art, lambda t: _as_fp8(t, Q, (64,)), {Q: {"format": "fp8_e4m3", "activation": "none"}})
    message = (f"artifact tensor {Q}.weight_scale has shape (64,), the architecture needs () or (1,) or (64, 1)")
    refused(runtime.load, art, match=message)
    code, _, err = cli("generate", art, "hi")
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_a_dense_weight_labelled_fp8_isrefused(art):
    _rewrite_weights(art, lambda t: t.update({f"{Q}.weight_scale": torch.tensor(1.0)}),
                     {Q: {"format": "fp8_e4m3", "activation": "none"}})
    refused(runtime.load, art, match=f"artifact tensor {Q}.weight has dtype float32; an fp8_e4m3 weight must be "
                                      "float8_e4m3fn")


@pytest.mark.parametrize("bad", [torch.tensor([1.0, 2.0]), torch.tensor(float("nan")), torch.tensor(-1.0)])
def test_a_bad_static_input_scale_isrefused(art, bad):
    _rewrite_weights(art, lambda t: (_as_fp8(t, Q), t.update({f"{Q}.input_scale": bad})),
                     {Q: {"format": "fp8_e4m3", "activation": "fp8_static_per_tensor"}})
    refused(runtime.load, art, match=f"artifact tensor {Q}.input_scale")


# --- packed formats, on the kernels' own tensors ----------------------------------------------------------
def _shape_error(module: str, entry: dict, tensors: dict, shape: tuple[int, int], match: str) -> str:
    return refused(dequantize_weight, module, entry, tensors, shape, match=match)


def test_fp8_layouts():
    w = torch.randn(8, 32)
    q, scale = fp8.fp8_quantize_per_channel(w)
    entry = {"format": "fp8_e4m3"}
    for s in (scale, scale.max(), scale.max().reshape(1)):
        assert dequantize_weight("m", entry, {"m.weight": q, "m.weight_scale": s}, (8, 32)).shape == (8, 32)
    _shape_error("m", entry, {"m.weight": q, "m.weight_scale": scale}, (8, 64),
                 "artifact tensor m.weight has shape (8, 32), the architecture needs (8, 64)")
    _shape_error("m", entry, {"m.weight": q, "m.weight_scale": scale.reshape(1, 8)}, (8, 32),
                 "artifact tensor m.weight_scale has shape (1, 8), the architecture needs () or (1,) or (8, 1)")
    _shape_error("m", entry, {"m.weight": q}, (8, 32), "artifact is missing tensor 'm.weight_scale'")
    nan_scale = scale.clone()
    nan_scale[2] = float("nan")
    _shape_error("m", entry, {"m.weight": q, "m.weight_scale": nan_scale}, (8, 32),
                 "artifact tensor m.weight (fp8_e4m3, dequantized) holds non-finite values")


def test_nvfp4_layouts():
    from kiln.kernels.nvfp4 import nvfp4_quantize

    w = torch.randn(8, 40)  # padded to 48: packed [8, 24], block scales [8, 3]
    t = {f"m.{k}": v for k, v in nvfp4_quantize(w).tensors().items()}
    entry = {"format": "nvfp4", "in_features": 40}
    assert dequantize_weight("m", entry, t, (8, 40)).shape == (8, 40)
    assert dequantize_weight("m", entry, {**t, "m.weight_scale_2": t["m.weight_scale_2"].reshape(1)},
                             (8, 40)).shape == (8, 40)
    _shape_error("m", entry, t, (8, 64), "manifest formats[m].in_features is 40, the architecture needs 64")
    _shape_error("m", {"format": "nvfp4"}, t, (8, 64),
                 "artifact tensor m.weight has shape (8, 24), the architecture needs (8, 32)")
    _shape_error("m", entry, t, (16, 40), "artifact tensor m.weight has shape (8, 24), the architecture needs (16, 24)")
    _shape_error("m", entry, {**t, "m.weight_scale": t["m.weight_scale"][:, :2].contiguous()}, (8, 40),
                 "artifact tensor m.weight_scale has shape (8, 2), the architecture needs (8, 3)")
    _shape_error("m", entry, {**t, "m.weight_scale_2": torch.ones(2)}, (8, 40),
                 "artifact tensor m.weight_scale_2 has shape (2,), the architecture needs () or (1,)")
    _shape_error("m", entry, {**t, "m.weight_scale": t["m.weight_scale"].float()}, (8, 40),
                 "m.weight_scale has dtype float32; its block scales must be float8_e4m3fn")
    _shape_error("m", entry, {**t, "m.weight_scale_2": torch.tensor(float("inf"))}, (8, 40),
                 "artifact tensors of m (nvfp4) are malformed: global_scale must be positive and finite, got inf")
    del t["m.weight_scale_2"]
    _shape_error("m", entry, t, (8, 40), "artifact is missing tensor 'm.weight_scale_2'")
    # without the architecture's shape (export checks), the entry's in_features is required
    refused(dequantize_weight, "m", {"format": "nvfp4"}, t, match="manifest formats[m] (nvfp4) needs in_features")


def test_mxfp4_layouts():
    from kiln.kernels.mxfp4 import mxfp4_quantize

    w = torch.randn(4, 40)  # padded to 64: packed [4, 32], E8M0 scales [4, 2]
    t = {f"m.{k}": v for k, v in mxfp4_quantize(w).tensors().items()}
    entry = {"format": "mxfp4", "in_features": 40}
    assert dequantize_weight("m", entry, t, (4, 40)).shape == (4, 40)
    _shape_error("m", {"format": "mxfp4"}, t, (4, 96),
                 "artifact tensor m.weight has shape (4, 32), the architecture needs (4, 48)")
    _shape_error("m", entry, {**t, "m.weight_scale": t["m.weight_scale"][:, :1].contiguous()}, (4, 40),
                 "artifact tensor m.weight_scale has shape (4, 1), the architecture needs (4, 2)")
    _shape_error("m", entry, {**t, "m.weight_scale": torch.full((4, 2), 255, dtype=torch.uint8)}, (4, 40),
                 "artifact tensors of m (mxfp4) are malformed: scale_e8m0 must hold exponents 0..254")


def test_mxfp6_layouts():
    from kiln.kernels.mxfp6 import mxfp6_dequantize, mxfp6_quantize

    w = torch.randn(4, 40)  # padded to 64: packed [4, 48] (four codes in three bytes), E8M0 scales [4, 2]
    q = mxfp6_quantize(w)
    t = {f"m.{k}": v for k, v in q.tensors().items()}
    entry = {"format": "mxfp6", "in_features": 40}
    assert torch.equal(dequantize_weight("m", entry, t, (4, 40)), mxfp6_dequantize(q))
    assert torch.equal(dequantize_weight("m", entry, t), mxfp6_dequantize(q))  # K from the entry
    _shape_error("m", {"format": "mxfp6"}, t, (4, 96),
                 "artifact tensor m.weight has shape (4, 48), the architecture needs (4, 72)")
    _shape_error("m", entry, {**t, "m.weight_scale": torch.full((4, 2), 255, dtype=torch.uint8)}, (4, 40),
                 "artifact tensors of m (mxfp6) are malformed: scale_e8m0 must hold exponents 0..254")


def test_unknown_formats_name_the_module_and_the_known_ones():
    t = {"m.weight": torch.randn(4, 4)}
    refused(dequantize_weight, "m", {"format": "int3"}, t,
             match="m: unknown weight format 'int3' in the manifest's format table; known: dense, fp8_e4m3, nvfp4, "
                   "mxfp4, mxfp6")
    refused(dequantize_weight, "m", {}, t, match="m: unknown weight format None")
