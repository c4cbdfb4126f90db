"""The MLA conversion pass: Before (GQA), the pass, Expected (DeepSeek-V3-style MLA layers in the spec, the
artifact and the runtime), numerics against the source, the budget solver against brute force, healing."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch

from kiln import runtime
from kiln.kernels.errors import KilnError
from kiln.kernels.targets import get_target
from kiln.optimizer.loader import load_checkpoint
from kiln.optimizer.lower import write_artifact
from kiln.optimizer.measure.gate import engine_from_graph
from kiln.optimizer.measure.runner import RuntimeRunner
from kiln.passes.base import PassContext, Pipeline
from kiln.passes.kv_cache import KvCacheQuantization
from kiln.passes.mla import MlaConversion
from kiln.passes.mla_factorize import choose_ranks, converted_layer, install, unconvertible
from kiln.runtime.artifact import WEIGHTS
from kiln.runtime.kv_format import kv_bytes_per_token
from tests.conftest import STORIES, needs_stories

MANIFEST = {"passes": [], "target": "hopper", "source": {"model_type": "llama"}, "recipe": {"name": "t", "passes": []}}


def _tokens(vocab: int, count: int = 24, length: int = 40, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=gen).tolist() for _ in range(count)]


def _ctx(graph, tokens) -> PassContext:
    return PassContext(get_target("hopper"), runner=RuntimeRunner(graph, tokens))


def _logits(graph, tokens) -> torch.Tensor:
    return torch.cat(engine_from_graph(graph).logits(tokens))


def test_full_rank_conversion_is_exact_up_to_the_latent_norm(tiny_checkpoints):
    """Every K dim in the rotary key and the latent at full rank: RoRoPE's head mix, the PCA basis and the
    softmax scale folded into the query are exact, so without DeepSeek's latent RMSNorm the MLA model computes
    the source's logits."""
    graph = load_checkpoint(tiny_checkpoints["llama"])
    tokens = _tokens(graph.spec.vocab_size)
    before = _logits(graph, tokens[:4])
    a = graph.spec.layers[0].attention
    k_dims = a.num_kv_heads * a.head_dim
    p = MlaConversion(kv_fraction=1.0, rope_dim=k_dims)
    session = RuntimeRunner(graph, tokens).session(graph)
    factors = p._factorize(graph, session, list(graph.blocks))
    for layer in graph.blocks:
        f = factors[(layer.index, k_dims)]
        assert f.max_rank == k_dims  # V's dims; K is all rotary
        wq = graph.tensors[f"{layer.attention.linears['q'].name}.weight"]
        install(graph, *converted_layer(f, wq, f.max_rank, graph.spec.rms_norm_eps, wq.dtype))
    # Expected structure: DeepSeek-V3 names and dims in every layer
    for layer in graph.spec.layers:
        m = layer.attention
        assert m.kind == "mla" and m.kv_lora_rank == k_dims and m.qk_rope_head_dim == k_dims
        assert set(m.linears) == {"q", "kv_a", "kv_b", "o"}
        assert m.linears["kv_a"].name.endswith("kv_a_proj_with_mqa") and m.qk_nope_head_dim == a.head_dim
        assert m.softmax_scale == pytest.approx((a.head_dim + k_dims) ** -0.5)
        assert f"{layer.prefix}.self_attn.k_proj.weight" not in graph.tensors
    engine = engine_from_graph(graph)
    for block in engine.model.blocks:
        block.attention.kv_a_layernorm = torch.nn.Identity()
    after = torch.cat(engine.logits(tokens[:4]))
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rope_dim", [4, 16])
def test_the_latent_reconstructs_residual_keys_and_values_at_full_rank(tiny_checkpoints, rope_dim):
    """With part of K rotary, the residual keys n and the values v go through the latent: at full rank the
    decoder undoes the encoder on calibration inputs, and lower ranks lose progressively more."""
    graph = load_checkpoint(tiny_checkpoints["llama"])
    tokens = _tokens(graph.spec.vocab_size)
    session = RuntimeRunner(graph, tokens).session(graph)
    f = MlaConversion(kv_fraction=0.5, rope_dim=rope_dim)._factorize(graph, session, [graph.spec.layers[0]])[
        (0, rope_dim)]
    z = f.sample.double() @ f.w_z.T
    errors = []
    for rank in (f.max_rank // 4, f.max_rank // 2, f.max_rank):
        back = z @ (f.decoder[:, :rank] @ f.encoder[:rank]).T
        errors.append(float((back - z).pow(2).sum() / z.pow(2).sum()))
    assert errors[-1] < 1e-10 and errors[0] > errors[1] > errors[2]


def test_the_pass_meets_its_budget_and_reports_every_layer(tiny_checkpoints, tmp_path):
    graph = load_checkpoint(tiny_checkpoints["llama"])
    source_kv = sum(kv_bytes_per_token(graph.spec).values())
    tokens = _tokens(graph.spec.vocab_size)
    (record,) = Pipeline([MlaConversion(kv_fraction=0.5, heal_steps=0, sensitivity_paragraphs=8)]).run(
        graph, _ctx(graph, tokens))
    after_kv = sum(kv_bytes_per_token(graph.spec).values())
    assert after_kv <= source_kv // 2
    converted = [layer for layer in graph.spec.layers if layer.attention.kind == "mla"]
    assert converted and len(record.result.changed) == len(converted)
    assert set(record.result.changed) | set(record.result.skipped) == {
        f"{layer.prefix}.self_attn" for layer in graph.spec.layers}
    mla = graph.metadata["mla"]
    for layer in converted:
        entry = mla[str(layer.index)]
        assert (entry["rank"], entry["rope_dim"]) == (layer.attention.kv_lora_rank, layer.attention.qk_rope_head_dim)
        assert entry["probe_kl"]
    # the artifact carries the new structure; the runtime loads and runs it as the graph does
    art = write_artifact(graph, tmp_path / "art", MANIFEST, "report")
    arch = json.loads((art / "manifest.json").read_text())["architecture"]
    assert [layer["attention"]["kind"] for layer in arch["layers"]] == [
        layer.attention.kind for layer in graph.spec.layers]
    torch.testing.assert_close(torch.cat(runtime.load(art).logits(tokens[:3])), _logits(graph, tokens[:3]))


def test_layers_it_cannot_convert_are_skipped_with_the_reason(tiny_checkpoints):
    graph = load_checkpoint(tiny_checkpoints["qwen3"])  # per-head q/k norms
    assert "q/k norms" in unconvertible(graph.spec.layers[0].attention)
    with pytest.raises(KilnError, match="matched no layers.*q/k norms"):
        Pipeline([MlaConversion(kv_fraction=0.5)]).run(graph, _ctx(graph, _tokens(graph.spec.vocab_size)))
    deepseek = load_checkpoint(tiny_checkpoints["deepseek_v3"])
    assert unconvertible(deepseek.spec.layers[0].attention) == "already MLA"
    # Gemma 3: q/k norms and one KV head; refused in one line naming both (global and local layers alike)
    gemma = load_checkpoint(tiny_checkpoints["gemma3_text"])
    with pytest.raises(KilnError, match="matched no layers.*q/k norms.*one KV head"):
        Pipeline([MlaConversion(kv_fraction=0.5)]).run(gemma, _ctx(gemma, _tokens(gemma.spec.vocab_size)))


def test_impossible_budgets_and_bad_configs_are_refused(tiny_checkpoints):
    with pytest.raises(KilnError, match="one budget"):
        MlaConversion()
    with pytest.raises(KilnError, match="kv_fraction"):
        MlaConversion(kv_fraction=1.5)
    with pytest.raises(KilnError, match="rope_dim"):
        MlaConversion(kv_fraction=0.5, rope_dim=3)
    graph = load_checkpoint(tiny_checkpoints["llama"])
    with pytest.raises(KilnError, match="KV budget of 1 values per token is below"):
        Pipeline([MlaConversion(kv_bytes_per_token=2, sensitivity_paragraphs=2, heal_steps=0)]).run(
            graph, _ctx(graph, _tokens(graph.spec.vocab_size, count=4)))
    with pytest.raises(KilnError, match="calibration text"):
        Pipeline([MlaConversion(kv_fraction=0.5)]).run(graph, PassContext(get_target("hopper")))


def test_the_budget_solver_is_exact():
    rng = random.Random(0)
    for _ in range(40):
        options = {i: [(rng.randint(1, 12), rng.random(), (i, k)) for k in range(rng.randint(1, 4))] + [(12, 0.0, None)]
                   for i in range(rng.randint(1, 4))}
        budget = rng.randint(sum(min(v for v, _, _ in o) for o in options.values()), 12 * len(options))
        picked = choose_ranks(options, budget)
        got = sum(next(kl for v, kl, c in options[i] if c == picked[i]) for i in options)
        values = sum(next(v for v, kl, c in options[i] if c == picked[i]) for i in options)
        best = min(sum(o[1] for o in combo) for combo in itertools.product(*options.values())
                   if sum(o[0] for o in combo) <= budget)
        assert values <= budget and got == pytest.approx(best)


def test_mla_then_fp8_kv_stores_the_latent_in_fp8(tiny_checkpoints):
    graph = load_checkpoint(tiny_checkpoints["llama"])
    source_kv = sum(kv_bytes_per_token(graph.spec).values())
    with pytest.raises(KilnError, match="must run after 'mla'"):
        Pipeline([KvCacheQuantization(format="fp8"), MlaConversion(kv_fraction=0.5)])
    Pipeline([MlaConversion(kv_fraction=0.5, heal_steps=0, sensitivity_paragraphs=8),
              KvCacheQuantization(format="fp8")]).run(graph, _ctx(graph, _tokens(graph.spec.vocab_size)))
    from kiln.optimizer.lower import kv_cache_table

    after = sum(kv_bytes_per_token(graph.spec, kv_cache_table(graph)).values())
    assert after <= source_kv // 4 + 4 * len(graph.spec.layers)  # + per-tensor scales, if any


@needs_stories
def test_healing_lowers_the_kl_on_stories260k():
    from kiln.calibration.data import load_token_lists
    from kiln.optimizer.defaults import default_data
    from kiln.runtime.engine import load_tokenizer

    tokens = load_token_lists(load_tokenizer(STORIES), default_data("calibration"), 48)
    results = {}
    for steps in (0, 30):
        graph = load_checkpoint(STORIES)
        (record,) = Pipeline([MlaConversion(kv_fraction=0.5, heal_steps=steps, heal_batch_tokens=1024,
                                            heal_lr=3e-3, sensitivity_paragraphs=8)]).run(graph, _ctx(graph, tokens))
        results[steps] = RuntimeRunner(load_checkpoint(STORIES), tokens).logit_kl(graph, 16)
        if steps:
            assert any(n.startswith("healed 30 steps") for n in record.result.notes)
    assert results[30] < 0.7 * results[0]


def _convert_by_hand(graph, splits: dict[int, tuple[int, int]], tokens) -> None:
    """Convert each layer at its (rotary width, rank), without probes."""
    session = RuntimeRunner(graph, tokens).session(graph)
    for index, (rope_dim, rank) in splits.items():
        p = MlaConversion(kv_fraction=0.5, rope_dim=rope_dim)
        f = p._factorize(graph, session, [graph.spec.layers[index]])[(index, rope_dim)]
        wq = graph.tensors[f"{graph.spec.layers[index].attention.linears['q'].name}.weight"]
        install(graph, *converted_layer(f, wq, rank, graph.spec.rms_norm_eps, wq.dtype))


def test_export_loads_in_transformers_as_deepseek_v3_with_the_runtime_logits(tiny_checkpoints, tmp_path, cli):
    from transformers import AutoModelForCausalLM

    from kiln.optimizer.export.deepseek import export_logit_difference

    graph = load_checkpoint(tiny_checkpoints["llama"])
    tokens = _tokens(graph.spec.vocab_size)
    # layers of different ranks and rotary widths: the export pads them to one layout
    _convert_by_hand(graph, {0: (8, 12), 1: (32, 20)}, tokens)
    art = write_artifact(graph, tmp_path / "art", MANIFEST, "report")
    code, _out, err = cli("export", str(art), "--format", "hf", "-o", str(tmp_path / "hf"))
    assert code == 0, err
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["kv_lora_rank"] == 20
    assert config["qk_nope_head_dim"] == 16 and config["v_head_dim"] == 16
    assert config["qk_rope_head_dim"] >= 32 and config["first_k_dense_replace"] == 2
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert export_logit_difference(tmp_path / "hf", art, tokens[:3]) < 1e-4


def test_export_refuses_a_mixed_gqa_mla_model(tiny_checkpoints, tmp_path, cli):
    graph = load_checkpoint(tiny_checkpoints["llama"])
    _convert_by_hand(graph, {1: (16, 16)}, _tokens(graph.spec.vocab_size))
    art = write_artifact(graph, tmp_path / "art", MANIFEST, "report")
    code, _out, err = cli("export", str(art), "--format", "hf", "-o", str(tmp_path / "hf"))
    assert code != 0 and "layer 0 is GQA attention: a mixed GQA/MLA model has no DeepSeek-V3 layout" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "hf").exists()


def test_quantization_runs_after_mla_and_quantizes_the_new_projections(tiny_checkpoints):
    from kiln.passes.auto_precision import AutoPrecision
    from kiln.passes.weight_quant import WeightQuantization

    for quant in (WeightQuantization(format="fp8"), AutoPrecision(weight_bits=6.0)):
        with pytest.raises(KilnError, match="must run after 'mla'"):
            Pipeline([quant, MlaConversion(kv_fraction=0.5)])
    graph = load_checkpoint(tiny_checkpoints["llama"])
    Pipeline([MlaConversion(kv_fraction=0.5, heal_steps=0, sensitivity_paragraphs=4),
              WeightQuantization(format="fp8", method="rtn")]).run(graph, _ctx(graph, _tokens(graph.spec.vocab_size)))
    mla_linears = [lin for layer in graph.spec.layers if layer.attention.kind == "mla"
                   for role, lin in layer.attention.linears.items() if role in ("kv_a", "kv_b")]
    assert mla_linears and all(graph.linears[lin.name].format == "fp8_e4m3" for lin in mla_linears)


def _quantized_converted_artifact(tiny_checkpoints, tmp_path, quant):
    """The tiny Llama, layers converted at different ranks and rotary widths (the export pads both), then `quant`."""
    graph = load_checkpoint(tiny_checkpoints["llama"])
    tokens = _tokens(graph.spec.vocab_size)
    _convert_by_hand(graph, {0: (8, 12), 1: (32, 20)}, tokens)
    Pipeline([quant]).run(graph, _ctx(graph, tokens))
    return write_artifact(graph, tmp_path / "art", MANIFEST, "report"), tokens


def test_hf_modelopt_exports_a_converted_nvfp4_model_in_deepseek_layout(tiny_checkpoints, tmp_path, cli):
    from safetensors.torch import load_file

    from kiln.optimizer.export.deepseek import logit_difference
    from kiln.optimizer.export.deepseek_modelopt import dequantized_model
    from kiln.passes.weight_quant import WeightQuantization

    art, tokens = _quantized_converted_artifact(tiny_checkpoints, tmp_path, WeightQuantization(format="nvfp4",
                                                                                               method="rtn"))
    out = tmp_path / "mo"
    code, stdout, err = cli("export", str(art), "--format", "hf-modelopt", "-o", str(out))
    assert code == 0, err
    assert "DeepSeek-V3 layout" in stdout
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["kv_lora_rank"] == 20
    assert config["quantization_config"]["quant_method"] == "modelopt"
    quant = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "W4A16_NVFP4" and quant["group_size"] == 16
    stored, source = load_file(str(out / "model.safetensors")), load_file(str(art / WEIGHTS))
    # layer 0's kv_b keeps its 12 latent columns' codes (8 bytes a row, padded to a 16-block) and pads to the
    # largest rank, 20, with zero codes (32 columns with the block padding: 16 bytes a row)
    kv_b = "model.layers.0.self_attn.kv_b_proj"
    assert stored[f"{kv_b}.weight"].dtype == torch.uint8 and stored[f"{kv_b}.weight"].shape[1] == 16
    assert torch.equal(stored[f"{kv_b}.weight"][:, :8], source[f"{kv_b}.weight"][:, :8])
    assert not stored[f"{kv_b}.weight"][:, 8:].any()
    # transformers' DeepseekV3 on the weights a serving engine dequantizes gives the runtime's logits
    assert logit_difference(dequantized_model(out), art, tokens[:3]) < 1e-4


@pytest.mark.parametrize("activations,granularity,algo", [("dynamic", "per_channel", "FP8_PER_CHANNEL_PER_TOKEN"),
                                                         ("static", "per_tensor", "FP8")])
def test_hf_modelopt_export_of_a_converted_w8a8_model_dequantizes_to_the_layout(tiny_checkpoints, tmp_path, cli,
                                                                               activations, granularity, algo):
    from safetensors.torch import load_file

    from kiln.optimizer.export.deepseek import deepseek_tensors
    from kiln.optimizer.export.modelopt import dequantize_hf_modelopt
    from kiln.passes.weight_quant import WeightQuantization
    from kiln.runtime.artifact import read_manifest
    from kiln.runtime.spec import spec_from_json

    art, _ = _quantized_converted_artifact(tiny_checkpoints, tmp_path, WeightQuantization(
        format="fp8", activations=activations, granularity=granularity))
    code, _out, err = cli("export", str(art), "--format", "hf-modelopt", "-o", str(tmp_path / "mo"))
    assert code == 0, err
    assert json.loads((tmp_path / "mo" / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == algo
    manifest, source = read_manifest(art), load_file(str(art / WEIGHTS))
    # each linear's factor went into its scale: the same weights as the unquantized DeepSeek-V3 layout
    expected = deepseek_tensors(spec_from_json(manifest["architecture"]), source, manifest["formats"])
    for name, weight in dequantize_hf_modelopt(tmp_path / "mo").items():
        if f"{name}.weight" in expected:
            torch.testing.assert_close(weight, expected[f"{name}.weight"], rtol=1e-6, atol=0)
    if activations == "static":  # o_proj's input grew by the factor its weight lost: its output is unchanged
        stored, o = load_file(str(tmp_path / "mo" / "model.safetensors")), "model.layers.0.self_attn.o_proj"
        product = stored[f"{o}.input_scale"] * stored[f"{o}.weight_scale"]
        torch.testing.assert_close(product, source[f"{o}.input_scale"] * source[f"{o}.weight_scale"])
        assert not torch.equal(stored[f"{o}.input_scale"], source[f"{o}.input_scale"])


def test_quantized_exports_of_a_converted_model_refuse_what_they_cannot_hold(tiny_checkpoints, tmp_path, cli):
    from kiln.passes.weight_quant import WeightQuantization

    art, _ = _quantized_converted_artifact(tiny_checkpoints, tmp_path, WeightQuantization(format="mxfp4",
                                                                                          method="rtn"))
    code, _out, err = cli("export", str(art), "--format", "compressed-tensors", "-o", str(tmp_path / "ct"))
    assert code != 0 and "converted to MLA: export with --format hf-modelopt" in err
    # the layout's factors (the latent norm's epsilon, the softmax scale) are not powers of two: MXFP4's E8M0
    # scales cannot take them exactly
    code, _out, err = cli("export", str(art), "--format", "hf-modelopt", "-o", str(tmp_path / "mo"))
    assert code != 0 and "MXFP4 scales are powers of two" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "ct").exists() and not (tmp_path / "mo").exists()


def test_hf_export_refuses_what_an_unquantized_checkpoint_cannot_compute(tiny_checkpoints, tmp_path, cli):
    graph = load_checkpoint(tiny_checkpoints["llama"])
    tokens = _tokens(graph.spec.vocab_size)
    _convert_by_hand(graph, {0: (16, 16), 1: (16, 16)}, tokens)
    Pipeline([KvCacheQuantization(format="fp8")]).run(graph, _ctx(graph, tokens))
    art = write_artifact(graph, tmp_path / "art", MANIFEST, "report")
    code, _out, err = cli("export", str(art), "--format", "hf", "-o", str(tmp_path / "hf"))
    assert code != 0 and "KV cache is fp8_e4m3" in err and "BF16 cache" in err and not (tmp_path / "hf").exists()


def test_a_rank_probe_rebuilds_and_reruns_only_the_converted_block(tiny_checkpoints):
    """LogitKl keeps the parts a structural probe did not touch: converting layer 1 rebuilds block 1 alone,
    and the KL equals a fresh measurement of the same graph."""
    from collections import Counter

    from kiln.optimizer.measure.logit_kl import LogitKl

    graph = load_checkpoint(tiny_checkpoints["llama"])
    tokens = _tokens(graph.spec.vocab_size, count=8)
    kept = LogitKl(graph, tokens)
    assert kept(graph, 8) == pytest.approx(0.0, abs=1e-9)
    before = Counter(kept.builds)
    _convert_by_hand(graph, {1: (16, 16)}, tokens)
    probed = kept(graph, 8)
    assert Counter(kept.builds) - before == Counter({1: 1})
    fresh = LogitKl(load_checkpoint(tiny_checkpoints["llama"]), tokens)(graph, 8)
    assert probed > 0 and probed == pytest.approx(fresh, rel=1e-5)


@pytest.mark.parametrize("fmt", ["fp8_tensor", "fp8_channel", "nvfp4", "mxfp4"])
def test_stored_relayout_equals_the_dense_relayout(fmt):
    """Rows moved, zero rows inserted, a factor folded and K padded on the stored codes dequantize to the same
    layout applied to the dequantized weight (MXFP4: a power-of-two factor; any other is refused)."""
    from kiln.kernels import fp8
    from kiln.kernels.dequantize import dequantize
    from kiln.kernels.mxfp4 import mxfp4_quantize
    from kiln.kernels.nvfp4 import nvfp4_quantize
    from kiln.optimizer.export.deepseek import RowLayout, relayout_dense
    from kiln.optimizer.export.deepseek_modelopt import relayout_stored

    w = torch.randn(12, 40, generator=torch.Generator().manual_seed(3))
    if fmt.startswith("fp8"):
        codes, scale = (fp8.fp8_quantize_per_tensor if fmt == "fp8_tensor" else fp8.fp8_quantize_per_channel)(w)
        name, stored = "fp8_e4m3", {"weight": codes, "weight_scale": scale}
    else:
        name, stored = fmt, (nvfp4_quantize(w) if fmt == "nvfp4" else mxfp4_quantize(w)).tensors()
    factor = 2.0 if fmt == "mxfp4" else 0.37
    layout = RowLayout(torch.tensor([3, -1, 0, 11, -1, 5, 7]), factor, 72)
    moved = relayout_stored("m", name, stored, layout)
    got = dequantize(name, moved, 72)
    torch.testing.assert_close(got, relayout_dense(dequantize(name, stored, 40), layout), rtol=1e-6, atol=0)
    assert not got[[1, 4]].any() and not got[:, 40:].any()
    if fmt == "mxfp4":
        with pytest.raises(KilnError, match="MXFP4 scales are powers of two"):
            relayout_stored("m", name, stored, layout._replace(factor=0.37))


# --- layout: deepseek (DeepSeek-V3's 512 + 64 in every layer, what vLLM's MLA kernels take) ----------------------
@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    """8 KV heads of 64: 1024 KV values a token per layer, enough for DeepSeek's 576."""
    from tests.tiny_models import make_tiny_checkpoint

    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("wide") / "ckpt", overrides={
        "hidden_size": 128, "intermediate_size": 128, "num_attention_heads": 8, "num_key_value_heads": 8,
        "head_dim": 64})


def test_deepseek_layout_is_rank_512_and_rotary_64_in_every_layer(wide_llama, tmp_path, cli):
    from kiln.optimizer.export.deepseek import deepseek_config, serving_engines, standard_theta

    graph = load_checkpoint(wide_llama)
    source = [layer.attention.rotary.inv_freq for layer in graph.spec.layers]
    layers = len(graph.spec.layers)
    tokens = _tokens(graph.spec.vocab_size)
    (record,) = Pipeline([MlaConversion(kv_bytes_per_token=2 * 576 * layers, layout="deepseek", heal_steps=0)]).run(
        graph, _ctx(graph, tokens))
    assert len(record.result.changed) == layers and not record.result.skipped
    for layer, freqs in zip(graph.spec.layers, source, strict=True):
        a = layer.attention
        assert (a.kind, a.kv_lora_rank, a.qk_rope_head_dim, a.qk_nope_head_dim) == ("mla", 512, 64, 64)
        # one component per frequency: the rotary key keeps the standard theta^(-2j/64), which engines derive
        assert a.rotary.inv_freq == freqs
        assert graph.metadata["mla"][str(layer.index)]["layout"] == "deepseek"
    assert sum(kv_bytes_per_token(graph.spec).values()) == 2 * 576 * layers
    config = deepseek_config(graph.spec, {})
    assert standard_theta(graph.spec) == 10000.0
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0} and config["rope_interleave"]
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"]) == (512, 64)
    assert "vLLM CPU" in serving_engines(512, 64) and "vLLM CPU" not in serving_engines(24, 18)
    # the export (interleaved rotary rows, rope_theta) gives the runtime's logits in transformers (checked on write)
    art = write_artifact(graph, tmp_path / "art", MANIFEST, "report")
    code, _, err = cli("export", str(art), "--format", "hf", "-o", str(tmp_path / "hf"))
    assert code == 0, err
    assert "576: taken by vLLM CPU" in (tmp_path / "hf" / "README.md").read_text()


def test_deepseek_layout_refuses_what_cannot_hold_it_before_any_work(wide_llama, tiny_checkpoints):
    target = get_target("hopper")
    wide = load_checkpoint(wide_llama)
    with pytest.raises(KilnError, match=r"budget of 1024 values per token is below 1152 \(512 latent \+ 64 rotary"):
        MlaConversion(kv_fraction=0.5, layout="deepseek").check(wide, target)
    MlaConversion(kv_fraction=0.5625, layout="deepseek").check(wide, target)  # 1152: fits
    small = load_checkpoint(tiny_checkpoints["llama"])  # 2 KV heads of 16
    with pytest.raises(KilnError, match="fewer than DeepSeek's 576"):
        MlaConversion(kv_fraction=0.5, layout="deepseek").check(small, target)
    with pytest.raises(KilnError, match="layout must be one of kiln, deepseek"):
        MlaConversion(kv_fraction=0.5, layout="vllm")
    with pytest.raises(KilnError, match="drop layers and rope_dim"):
        MlaConversion(kv_fraction=0.5, layout="deepseek", rope_dim=32)
