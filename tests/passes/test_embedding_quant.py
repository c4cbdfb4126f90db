"""EmbeddingQuantization: the table (and a tied lm_head) stored FP8 / NVFP4 / MXFP4 and read back exactly.

Before: a dense tied embedding. Expected: the artifact stores the table in its format under the embedding's name,
the runtime's lookup and tied head both read its exact dequantized values (one tensor), the logits are those of
the dense model holding those values, and exports refuse the layout in one line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from kiln import runtime
from kiln.kernels import fp8
from kiln.kernels.errors import KilnError
from kiln.kernels.targets import get_target
from kiln.optimizer.build import build
from kiln.optimizer.export import export
from kiln.optimizer.loader import load_checkpoint
from kiln.optimizer.recipes import Recipe, resolve_recipe
from kiln.passes.base import PassContext, Pipeline
from kiln.passes.embedding_quant import EmbeddingQuantization, quantize_rows
from kiln.passes.graph import QuantizedWeight
from tests.conftest import refused

FORMATS = ("fp8", "nvfp4", "mxfp4")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("method", ("rtn", "mse"))
def test_chunked_rows_equal_the_whole_table_bit_for_bit(fmt, method):
    torch.manual_seed(0)
    w = torch.randn(300, 64) * torch.linspace(0.1, 3, 300).unsqueeze(1)
    whole = quantize_rows(w, fmt, method, rows_per_chunk=1 << 20)
    chunked = quantize_rows(w, fmt, method, rows_per_chunk=128)  # three chunks, the last one short
    assert whole.tensors.keys() == chunked.tensors.keys()
    for key in whole.tensors:
        a, b = whole.tensors[key], chunked.tensors[key]
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                           b.view(torch.uint8) if b.element_size() == 1 else b), key


def test_fp8_rows_are_the_kernels_per_channel_quantization():
    torch.manual_seed(1)
    w = torch.randn(40, 16)
    q = quantize_rows(w, "fp8", "rtn")
    codes, scale = fp8.fp8_quantize_per_channel(w)
    assert torch.equal(q.tensors["weight"].view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(q.tensors["weight_scale"], scale)


def _run(graph, fmt="fp8", method="rtn"):
    (record,) = Pipeline([EmbeddingQuantization(format=fmt, method=method)]).run(graph, PassContext(get_target("hopper")))
    return record


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_graph_holds_the_exact_stored_values_and_reports_bytes(tiny_checkpoints, fmt):
    graph = load_checkpoint(tiny_checkpoints["gemma3_text"])  # tied, as Gemma 3 is
    name = graph.embedding
    source = graph.tensors[name].clone()
    assert graph.linears["lm_head"].tied_to == name
    record = _run(graph, fmt)
    q = graph.embedding_quant
    assert isinstance(q, QuantizedWeight) and q.format.startswith(fmt)
    assert torch.equal(graph.tensors[name], q.dequantize())
    assert not torch.equal(graph.tensors[name], source)  # it did change the table
    assert (graph.tensors[name] - source).abs().max() <= source.abs().max() * 0.5  # and kept it
    module = name.removesuffix(".weight")
    assert "tied lm_head" in record.result.changed[module]
    m = record.result.metrics
    assert m[f"{module}.bytes"] == q.stored_bytes() < m[f"{module}.bytes_bf16"] == source.numel() * 2


def test_a_revert_restores_the_dense_table(tiny_checkpoints):
    graph = load_checkpoint(tiny_checkpoints["gemma3_text"])
    source = graph.tensors[graph.embedding].clone()
    state = graph.snapshot()
    _run(graph)
    graph.restore(state)
    assert graph.embedding_quant is None and torch.equal(graph.tensors[graph.embedding], source)


def test_an_untied_model_quantizes_the_lookup_only(tiny_checkpoints):
    graph = load_checkpoint(tiny_checkpoints["mixtral"])  # tie_word_embeddings false
    assert graph.linears["lm_head"].tied_to is None
    head = graph.weight("lm_head").clone()
    record = _run(graph)
    assert "tied" not in next(iter(record.result.changed.values()))
    assert any("not tied" in n for n in record.result.notes)
    assert torch.equal(graph.weight("lm_head"), head)


def test_two_embedding_formats_are_refused_before_any_work():
    with pytest.raises(KilnError, match="embedding's format"):
        resolve_recipe("embedding-fp8,embedding-nvfp4")


@pytest.fixture(scope="module")
def artifacts(generated_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("emb")
    dense = build(generated_checkpoint, "hopper", "none", root / "dense", gate=False).path
    out = {"dense": dense}
    for fmt in ("fp8", "nvfp4"):
        out[fmt] = build(generated_checkpoint, "hopper", Recipe(f"embedding-{fmt}", (EmbeddingQuantization(fmt),)),
                         root / fmt, gate=False).path
    return out


@pytest.mark.parametrize("fmt", ("fp8", "nvfp4"))
def test_the_runtime_reads_the_stored_table_once_for_lookup_and_head(artifacts, fmt, tmp_path):
    path = artifacts[fmt]
    manifest = json.loads((path / "manifest.json").read_text())
    spec_name = "model.embed_tokens"
    assert manifest["formats"][spec_name]["role"] == "embedding"
    assert manifest["formats"]["lm_head"].get("tied_to") == f"{spec_name}.weight"
    stored = load_file(path / "model.safetensors")
    assert stored[f"{spec_name}.weight"].dtype in (torch.float8_e4m3fn, torch.uint8)  # codes, not floats
    dense_bytes = load_file(artifacts["dense"] / "model.safetensors")[f"{spec_name}.weight"].numel() * 2
    assert sum(t.numel() * t.element_size() for k, t in stored.items() if k.startswith(spec_name)) < dense_bytes / 1.7

    engine = runtime.load(path)
    model = engine.model
    assert model.lm_head.weight.data_ptr() == model.embed.data_ptr()  # one table, two readers

    # the reference: the dense artifact holding the dequantized values as an ordinary fp32 embedding
    table = model.embed.detach().clone()
    assert not torch.equal(table, load_file(artifacts["dense"] / "model.safetensors")[f"{spec_name}.weight"].float())

    def swap(tensors, manifest):
        tensors[f"{spec_name}.weight"] = table

    reference = runtime.load(_tamper(artifacts["dense"], tmp_path, edit_tensors=swap)).model
    tokens = torch.tensor([[1, 5, 9, 40, 77, 3, 8]])
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    torch.testing.assert_close(model(tokens, positions), reference(tokens, positions), rtol=0, atol=0)


def test_exports_refuse_a_quantized_table_in_one_line(artifacts, tmp_path):
    for fmt in ("compressed-tensors", "hf-modelopt", "onnx"):
        refused(export, artifacts["fp8"], fmt, tmp_path / fmt, match="embedding-quant")
        assert not (tmp_path / fmt).exists()


def test_the_report_has_its_own_embedding_line(artifacts):
    report = (artifacts["fp8"] / "report.md").read_text()
    section = report.split("## Embedding", 1)[1].strip().splitlines()[0]
    assert "fp8_e4m3" in section and "in BF16 (saves" in section


def _tamper(path, tmp_path, edit_manifest=None, edit_tensors=None):
    """A copy of the artifact edited and re-signed (checksums, tensors table, sizes), as a hostile writer would."""
    from tests.runtime.test_artifact_hostile import _lie

    out = shutil.copytree(path, tmp_path / "t")
    _lie(out, edit_manifest, edit_tensors)
    return out


@pytest.mark.parametrize(("edit", "match"), [
    (lambda m: m["formats"]["model.embed_tokens"].update(role="lm_head"), 'its role must be "embedding"'),
    (lambda m: m["formats"]["model.embed_tokens"].update(activation="fp8_dynamic_per_token"),
     "activation must be none"),
    (lambda m: m["formats"]["model.embed_tokens"].update(format="dense"), "model.embed_tokens"),
    (lambda m: m["formats"]["lm_head"].update(format="fp8_e4m3"), "tied to the embedding"),
    (lambda m: m["formats"]["model.embed_tokens"].update(input_rotation={"kind": "block_hadamard", "block_size": 16}),
     "with no input_rotation"),
])
def test_a_lying_embedding_entry_is_refused_at_load(artifacts, tmp_path, edit, match):
    path = _tamper(artifacts["fp8"], tmp_path, edit)
    refused(runtime.load, path, match=match)


def test_a_stray_scale_beside_a_dense_table_is_refused(artifacts, tmp_path):
    def edit(t, m):
        t["model.embed_tokens.weight_scale"] = torch.ones(t["model.embed_tokens.weight"].shape[0], 1)
        m["formats"]["model.embed_tokens"] = {"format": "dense", "activation": "none", "role": "embedding"}

    path = _tamper(artifacts["dense"], tmp_path, edit_tensors=edit)
    refused(runtime.load, path, match="reads no model.embed_tokens.weight_scale")


@pytest.mark.parametrize("fmt", ("fp8", "nvfp4"))
def test_the_packed_runtime_multiplies_by_the_stored_table(artifacts, fmt, monkeypatch):
    from kiln.kernels import gpu
    from kiln.runtime.linear import PackedLinear

    monkeypatch.setattr(gpu, "use_triton", lambda x: False)  # the kernels' torch references
    reference, packed = runtime.load(artifacts[fmt]), runtime.load(artifacts[fmt], packed=True)
    head = packed.model.lm_head
    assert isinstance(head, PackedLinear)  # the tied head's GEMM reads the table's codes and scales
    stored = load_file(artifacts[fmt] / "model.safetensors")
    assert head.stored_bytes == sum(t.numel() * t.element_size() for k, t in stored.items()
                                    if k.startswith("model.embed_tokens."))
    tokens = [[1, 5, 9, 40, 77, 3, 8]]
    for expected, got in zip(reference.logits(tokens), packed.logits(tokens), strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=2e-4 * float(expected.abs().max()))


def test_the_economics_price_the_table_in_its_format(artifacts):
    from kiln.optimizer.report.figures import linear_cost
    from kiln.optimizer.report.scenarios import manifest_scenario
    from kiln.runtime.artifact import read_manifest
    from kiln.runtime.spec import spec_from_json

    figures = {}
    for name in ("dense", "fp8"):
        manifest = read_manifest(artifacts[name])
        spec = spec_from_json(manifest["architecture"])
        figures[name] = manifest_scenario(name, manifest, spec, spec).served.figures
    V, H = spec.vocab_size, spec.hidden_size
    table = linear_cost(spec.lm_head, "fp8_e4m3").bytes
    assert table < 2 * V * H
    saved = 2 * V * H - table  # the table is resident once, and the tied head reads it whole every step
    assert figures["dense"].resident_bytes - figures["fp8"].resident_bytes == saved
    assert figures["dense"].dense_read_bytes - figures["fp8"].dense_read_bytes == saved
