"""The economics report: its arithmetic against figures computed here by hand (Llama-3.1-8B-shaped and
DeepSeek-V3-shaped configs, no weights), the waterfall's factors, the `optimize report` command and the build's
report.md section and PNG."""

from __future__ import annotations

import json
import math

import pytest

from kiln.optimizer.loader_config import build_spec
from kiln.optimizer.report.economics import economics_report
from kiln.optimizer.report.roofline import Speculation, decode_step, max_batch
from kiln.optimizer.report.scenarios import _speculation_of, config_scenario
from kiln.optimizer.report.waterfall_plot import WATERFALL_PNG

# Llama-3.1-8B's shape (benchmarks/streaming.py builds the same)
LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}
# DeepSeek-V3's shape (its config.json, without the MTP layer and the FP8 block quantization)
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "num_experts_per_tok": 8,
    "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3, "moe_layer_freq": 1,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "vocab_size": 129280, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "norm_topk_prob": True,
    "tie_word_embeddings": False, "rope_theta": 10000,
}
# Gemma 3 27B's text model (google/gemma-3-27b-it's text_config): 62 layers, 5 of every 6 with a 1024-token window
GEMMA3_27B = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 5376,
    "intermediate_size": 21504, "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16,
    "head_dim": 128, "query_pre_attn_scalar": 168, "sliding_window": 1024, "vocab_size": 262208,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
}
USD = 10**6 / 3600  # the 277.78


@pytest.fixture(scope="module")
def llama_8b():
    return build_spec(LLAMA_8B)


@pytest.fixture(scope="module")
def deepseek_v3():
    return build_spec(DEEPSEEK_V3)


def test_llama_8b_fp8_on_h100_matches_a_hand_computation(llama_8b):
    report = economics_report(config_scenario("8b", llama_8b, weights="fp8"), ["h100"], {"h100": (3.0, "given")})
    g = report["gpus"]["h100"]

    # bytes: every linear but the LM head E4M3 (1 byte) + one fp32 scale per output channel; the rest BF16
    d, f, layers, vocab, q, kv = 4096, 14336, 32, 128256, 32 * 128, 8 * 128
    linears = layers * (d * q + 2 * d * kv + q * d + 3 * d * f)  # q, k, v, o, gate, up, down: 6,979,321,856
    fp8 = linears + 4 * layers * (q + 2 * kv + d + 2 * f + d)
    embedding = lm_head = 2 * vocab * d
    norms = 2 * (2 * layers + 1) * d
    weights = fp8 + embedding + lm_head + norms
    assert g["weight_bytes"] == weights == 9_086_705_664
    kv_per_token = layers * 2 * 8 * 128 * 2  # K and V, 8 heads of 128, BF16
    assert g["kv_bytes_per_token"] == kv_per_token == 131_072

    # H100: 80 GB, 3.35 TB/s, 989 TFLOPs BF16, 1979 FP8; 10% of HBM held back
    free = 80e9 - weights - 8e9
    assert g["max_concurrency"] == {"4096": int(free // (kv_per_token * 4096)),
                                    "32768": int(free // (kv_per_token * 32768))}
    batch = g["max_batch"]
    assert batch == int(free // (kv_per_token * 4096)) == 117

    read = fp8 + lm_head + norms  # a step reads every linear, the LM head and the norms, not the embedding table
    compute_per_token = (2 * linears / 1979e12 + 2 * vocab * d / 989e12  # W8A8 GEMMs; the BF16 LM head
                         + 4096 * layers * 2 * 32 * (128 + 128) / 989e12)  # attention over 4096 cached tokens
    step_1 = (read + 4096 * kv_per_token) / 3.35e12
    step_max = (read + batch * 4096 * kv_per_token) / 3.35e12
    assert compute_per_token < step_1 and batch * compute_per_token < step_max  # memory-bound both
    assert g["decode_tokens_per_s_batch1"] == pytest.approx(1 / step_1, rel=0.01)  # about 391
    assert g["usd_per_mtok_batch1"] == pytest.approx(277.78 * 3.0 * step_1, rel=0.01)  # about $2.13
    assert g["decode_tokens_per_s_max_batch"] == pytest.approx(batch / step_max, rel=0.01)  # about 5,530
    assert g["usd_per_mtok_max_batch"] == pytest.approx(277.78 * 3.0 * step_max / batch, rel=0.01)
    assert (g["bound_batch1"], g["bound_max_batch"]) == ("memory", "memory")
    prefill = 1000 * (2 * linears / 1979e12 + 2 * vocab * d / 989e12) + layers * 32 * 256 * 1000 * 1001 / 989e12
    assert g["prefill_seconds_per_1k_tokens"] == pytest.approx(prefill, rel=0.01)


def test_deepseek_v3_mla_moe_on_8_h200_matches_a_hand_computation(deepseek_v3):
    report = economics_report(config_scenario("v3", deepseek_v3, weights="fp8", kv="fp8"), ["h200"],
                              {"h200": (3.5, "given")}, gpus_per_replica=8)
    g = report["gpus"]["h200"]
    h, layers, dense_layers, moe_layers, vocab = 7168, 61, 3, 58, 129280
    heads, nope, rope, v, q_rank, kv_rank = 128, 128, 64, 128, 1536, 512
    # (params, output channels) of each linear group; FP8 bytes = params + 4 x output channels
    attention = (h * q_rank + q_rank * heads * (nope + rope) + h * (kv_rank + rope) + kv_rank * heads * (nope + v)
                 + heads * v * h, q_rank + heads * (nope + rope) + kv_rank + rope + heads * (nope + v) + h)
    dense_mlp = (3 * h * 18432, 2 * 18432 + h)
    expert = (3 * h * 2048, 2 * 2048 + h)  # a routed expert, and the one shared expert

    def fp8(group):
        return group[0] + 4 * group[1]

    router = h * 256  # BF16
    assert layers * attention[0] + dense_layers * dense_mlp[0] + moe_layers * (257 * expert[0] + router) \
        + 2 * vocab * h == pytest.approx(671e9, rel=0.002)  # DeepSeek-V3's 671B
    norms = 2 * (layers * (2 * h + kv_rank + q_rank) + h)
    experts_bytes = 256 * fp8(expert)  # all routed experts of one MoE layer
    dense_read = (layers * fp8(attention) + dense_layers * fp8(dense_mlp)
                  + moe_layers * (fp8(expert) + 2 * router) + 2 * vocab * h + norms)
    weights = dense_read + moe_layers * experts_bytes + 2 * vocab * h
    assert g["weight_bytes"] == weights
    kv_per_token = layers * (kv_rank + rope)  # MLA: the latent and the roped key, FP8 (per-tensor scales)
    assert g["kv_bytes_per_token"] == kv_per_token == 35_136

    hbm, bw, bf16, fp8_flops = 8 * 141e9, 8 * 4.8e12, 8 * 989e12, 8 * 1979e12
    batch = int((hbm - weights - 0.1 * hbm) // (kv_per_token * 4096))
    assert g["max_batch"] == batch
    active_fp8 = layers * attention[0] + dense_layers * dense_mlp[0] + moe_layers * (expert[0] + 8 * expert[0])
    compute_per_token = (2 * active_fp8 / fp8_flops + 2 * (moe_layers * router + vocab * h) / bf16
                         + 4096 * layers * 2 * heads * (2 * kv_rank + rope) / bf16)  # absorbed MLA decode

    def step(tokens):  # routed experts read: 1 - (1 - 8/256)^tokens of them
        read = dense_read + moe_layers * experts_bytes * (1 - (1 - 8 / 256) ** tokens)
        return max((read + tokens * 4096 * kv_per_token) / bw, tokens * compute_per_token)

    price = 8 * 3.5
    assert g["decode_tokens_per_s_batch1"] == pytest.approx(1 / step(1), rel=0.01)
    assert g["usd_per_mtok_batch1"] == pytest.approx(277.78 * price * step(1), rel=0.01)
    assert g["decode_tokens_per_s_max_batch"] == pytest.approx(batch / step(batch), rel=0.01)
    assert g["usd_per_mtok_max_batch"] == pytest.approx(277.78 * price * step(batch) / batch, rel=0.01)
    assert g["bound_batch1"] == "memory" and g["bound_max_batch"] == "compute"
    prefill = 1000 * compute_per_token - 1000 * 4096 * layers * 2 * heads * (2 * kv_rank + rope) / bf16 \
        + layers * heads * (nope + rope + v) * 1000 * 1001 / bf16  # prefill: per-head K (192) and V (128)
    assert g["prefill_seconds_per_1k_tokens"] == pytest.approx(prefill, rel=0.01)
    # one GPU cannot hold it
    alone = economics_report(config_scenario("v3", deepseek_v3, weights="fp8"), ["h200"])["gpus"]["h200"]
    assert alone["max_batch"] == 0 and alone["decode_tokens_per_s_batch1"] is None


def _applied_factors(rows):
    return [r["factor"] for r in rows[1:] if r["applied"]]


@pytest.mark.parametrize("gpu", ["h100", "b200"])
def test_the_waterfall_factors_multiply_to_the_total_against_honest_baselines(llama_8b, gpu):
    scn = config_scenario("8b", llama_8b, weights="nvfp4", kv="fp8", speculation=Speculation(2.5, 3))
    g = economics_report(scn, [gpu])["gpus"][gpu]
    rows = {r["step"]: r for r in g["waterfall"]}
    assert [r["step"] for r in g["waterfall"]] == ["source", "window", "mla", "fp8", "fp4", "kv", "speculation",
                                                   "capacity"]
    assert not rows["capacity"]["applied"] and rows["capacity"]["factor"] == 1.0  # one price, no tier table
    assert not rows["mla"]["applied"] and rows["mla"]["factor"] == 1.0  # Llama has no MLA conversion
    assert not rows["window"]["applied"] and rows["window"]["factor"] == 1.0  # nor sliding windows
    assert math.prod(_applied_factors(g["waterfall"])) == pytest.approx(g["total_factor"], rel=1e-12)
    assert g["total_factor"] == pytest.approx(rows["source"]["usd_per_mtok"] / g["usd_per_mtok_max_batch"], rel=1e-12)
    # FP4 is priced against FP8 on the same GPU, each at its own largest batch
    assert rows["fp4"]["factor"] == pytest.approx(rows["fp8"]["usd_per_mtok"] / rows["fp4"]["usd_per_mtok"])
    assert rows["fp4"]["batch"] > rows["fp8"]["batch"] > rows["source"]["batch"]
    assert rows["kv"]["batch"] > rows["fp4"]["batch"]  # an FP8 cache fits more sequences
    assert rows["speculation"]["batch"] == rows["kv"]["batch"]  # speculation at production concurrency


def test_speculation_gains_tau_at_batch_1_and_less_where_the_max_batch_is_compute_bound(llama_8b, deepseek_v3):
    from kiln.optimizer.report.roofline import GPUS, replica

    spec = Speculation(2.5, 3)
    dense = config_scenario("8b", llama_8b, weights="fp8").served.figures
    plain = decode_step(dense, GPUS["h100"], 1, 4096)
    assert decode_step(dense, GPUS["h100"], 1, 4096, spec).tokens_per_second == pytest.approx(
        2.5 * plain.tokens_per_second)
    moe = config_scenario("v3", deepseek_v3, weights="fp8", kv="fp8").served.figures
    node = replica(GPUS["h200"], 8)
    batch = max_batch(moe, node, 4096)
    plain, verify = decode_step(moe, node, batch, 4096), decode_step(moe, node, batch, 4096, spec)
    assert plain.bound == "compute" and verify.tokens_per_second / plain.tokens_per_second == pytest.approx(2.5 / 4)


def test_a_recorded_tau_is_read_from_a_kept_pass_gate_metric():
    metric = {"name": "tau", "value": 2.2, "floor": 1.5, "higher_is_better": True, "passed": True}
    passes = [{"name": "draft-head", "decision": "kept", "config": {"draft_tokens": 4},
               "gate": {"metrics": [metric]}}]
    assert _speculation_of({"passes": passes}) == Speculation(2.2, 4)
    assert _speculation_of({"passes": [{**passes[0], "decision": "reverted"}]}) is None


def _measured(tmp_path, rows, break_even, nodes=12):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({"rows": [{"concurrency": c, "tau": t} for c, t in rows], "break_even": break_even,
                                "verified_per_sequence": nodes, "machine": "2-core CPU"}))
    return path


def test_a_measured_speculation_prices_tau_below_its_break_even_and_turns_off_from_it(tmp_path, llama_8b):
    """tau is the one measured at the largest concurrency below the break-even (2.6 at 4 here, not 2.9 at 1
    nor 2.4 at 8); a step at the break-even batch or beyond decodes plainly."""
    from kiln.optimizer.report.roofline import GPUS
    from kiln.optimizer.report.scenarios import load_speculation

    spec = load_speculation(_measured(tmp_path, [(1, 2.9), (4, 2.6), (8, 2.4), (16, 2.3)], 8))
    assert (spec.tau, spec.draft_tokens, spec.break_even) == (2.6, 12, 8)
    assert "measured at concurrency 4, 2-core CPU" in spec.source
    dense = config_scenario("8b", llama_8b, weights="fp8").served.figures
    for batch in (1, 7):
        plain = decode_step(dense, GPUS["h100"], batch, 4096)
        assert decode_step(dense, GPUS["h100"], batch, 4096, spec).tokens_per_second != plain.tokens_per_second
    for batch in (8, 64):
        plain = decode_step(dense, GPUS["h100"], batch, 4096)
        assert decode_step(dense, GPUS["h100"], batch, 4096, spec) == plain
    # never broke even: the largest concurrency's tau, always on
    assert load_speculation(_measured(tmp_path, [(1, 2.9), (4, 2.6)], None)) == Speculation(
        2.6, 12, None, "measured at concurrency 4, 2-core CPU")


def test_the_report_takes_a_measured_speculation_and_refuses_a_bad_one(tmp_path, cli):
    llama_8b_config = tmp_path / "config.json"
    llama_8b_config.write_text(json.dumps(LLAMA_8B))
    path = _measured(tmp_path, [(1, 2.9), (4, 2.6), (8, 2.4)], 8)
    code, out, err = cli("report", llama_8b_config, "--weights", "fp8", "--speculation", path, "--json")
    assert code == 0, err
    step = next(s for s in json.loads(out)["gpus"]["h100"]["waterfall"] if s["step"] == "speculation")
    assert step["factor"] == pytest.approx(1.0) and "break-even batch 8" in step["note"]  # max batch >= 8: off
    for bad, message in (("{}", "not a speculative_serving.py measurement"),
                         (json.dumps({"rows": [{"concurrency": 1, "tau": 1.2}], "break_even": 1,
                                      "verified_per_sequence": 4}), "did not pay at any measured concurrency")):
        path.write_text(bad)
        code, _, err = cli("report", llama_8b_config, "--speculation", path)
        assert code != 0 and message in err and err.strip().count("\n") == 0
    code, _, err = cli("report", llama_8b_config, "--speculation", path, "--tau", "2")
    assert code != 0 and "not both" in err


def test_report_json_on_a_small_artifact_and_the_build_writes_the_section(cli, plain_artifact):
    report_md = (plain_artifact / "report.md").read_text()
    assert "## Economics" in report_md and "### Not modelled" in report_md and WATERFALL_PNG in report_md
    png = (plain_artifact / WATERFALL_PNG).read_bytes()
    assert png.startswith(b"\x89PNG")
    assert WATERFALL_PNG in json.loads((plain_artifact / "manifest.json").read_text())["files"]
    code, stdout, stderr = cli("report", plain_artifact, "--gpu", "h100", "--price-per-hour", "3.1", "--json")
    assert code == 0, stderr
    g = json.loads(stdout)["gpus"]["h100"]
    for key in ("weight_bytes", "kv_bytes_per_token", "decode_tokens_per_s_batch1", "usd_per_mtok_batch1", "max_batch",
                "decode_tokens_per_s_max_batch", "usd_per_mtok_max_batch"):
        assert isinstance(g[key], int | float) and g[key] > 0, key
    assert g["price_per_hour"] == 3.1 and g["usd_per_mtok_batch1"] == pytest.approx(
        277.78 * 3.1 / g["decode_tokens_per_s_batch1"], rel=1e-4)
    code, stdout, _ = cli("report", plain_artifact, "--gpu", "h100,b200", "--price-per-hour", "b200=6")
    assert code == 0 and "H100-80GB" in stdout and "B200-192GB" in stdout and "Not modelled: routing" in stdout


def test_report_of_an_mla_artifact_prices_the_conversion_per_layer(cli, tiny_checkpoints, tmp_path):
    import torch

    from kiln.kernels.targets import get_target
    from kiln.optimizer.loader import load_checkpoint
    from kiln.optimizer.lower import write_artifact
    from kiln.optimizer.measure.runner import RuntimeRunner
    from kiln.passes.base import PassContext, Pipeline
    from kiln.passes.kv_cache import KvCacheQuantization
    from kiln.passes.mla import MlaConversion

    graph = load_checkpoint(tiny_checkpoints["llama"])
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, graph.spec.vocab_size, (40,), generator=gen).tolist() for _ in range(16)]
    Pipeline([MlaConversion(kv_fraction=0.5, heal_steps=0, sensitivity_paragraphs=8),
              KvCacheQuantization(format="fp8")]).run(
        graph, PassContext(get_target("hopper"), runner=RuntimeRunner(graph, tokens)))
    manifest = {"passes": [], "target": "hopper", "source": {"model_type": "llama"},
                "recipe": {"name": "t", "passes": []}}
    art = write_artifact(graph, tmp_path / "art", manifest, "report")
    code, stdout, stderr = cli("report", art, "--gpu", "h100", "--json", "-o", tmp_path / "econ")
    assert code == 0, stderr
    report = json.loads(stdout)
    rows = {r["step"]: r for r in report["gpus"]["h100"]["waterfall"]}
    assert rows["mla"]["applied"] and rows["kv"]["applied"] and rows["mla"]["factor"] > 1
    layers = report["mla_layers"]
    assert [r["layer"] for r in layers] == [0, 1]
    assert all(r["bytes_per_token"] < r["source_bytes_per_token"] for r in layers)
    assert sum(r["source_bytes_per_token"] for r in layers) == 2 * 2 * 2 * 16 * 2  # 2 layers, K+V, 2 heads of 16, BF16
    assert "### MLA per layer" in (tmp_path / "econ" / "report.md").read_text()
    assert (tmp_path / "econ" / WATERFALL_PNG).read_bytes().startswith(b"\x89PNG")


def test_report_of_a_config_writes_markdown_and_png(cli, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    code, _, stderr = cli("report", tmp_path, "--weights", "nvfp4", "--kv", "fp8", "-o", tmp_path / "out")
    assert code == 0, stderr
    text = (tmp_path / "out" / "report.md").read_text()
    assert "weights FP4" in text and "FP8 on the same GPU" in text and "utilisation" in text
    assert (tmp_path / "out" / WATERFALL_PNG).stat().st_size > 1000


@pytest.mark.parametrize("args, message", [
    (("{missing}",), "does not exist"),
    (("{art}", "--gpu", "a100"), "unknown GPU 'a100'"),
    (("{art}", "--price-per-hour", "0"), "--price-per-hour must be a positive number"),
    (("{art}", "--price-per-hour", "h100=-2"), "--price-per-hour h100 must be a positive number"),
    (("{art}", "--price-per-hour", "tpu=2"), "unknown GPU 'tpu'"),
    (("{art}", "--context", "0"), "--context must be a positive"),
    (("{art}", "--weights", "fp8"), "--weights and --kv describe a config"),
    (("{art}", "--tau", "9"), "tau must lie between 1 and"),
    (("{art}", "-o", "{art}"), "is a Kiln artifact"),
    (("{config}", "--weights", "int3"), "--weights must be one of"),
])
def test_bad_input_is_one_line_exit_2(cli, plain_artifact, tmp_path, args, message):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    paths = {"missing": tmp_path / "nope", "art": plain_artifact, "config": tmp_path / "config.json"}
    code, _, stderr = cli("report", *[a.format(**paths) for a in args])
    assert code == 2 and stderr.startswith("error: ") and message in stderr, stderr
    assert stderr.count("\n") == 1


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp6"])
def test_a_block_formats_deployed_bytes_are_what_its_packed_weight_holds(fmt):
    # K = 172 pads to whole blocks (176 for NVFP4's 16, 192 for the MX formats' 32) in storage and in HBM
    import torch

    from kiln.calibration.quantize import quantize_weight
    from kiln.optimizer.report.figures import linear_cost
    from kiln.runtime.spec import LinearSpec

    stored = quantize_weight(torch.randn(48, 172), fmt)
    cost = linear_cost(LinearSpec("m", "down", 172, 48, layer=0), fmt)
    assert cost.bytes == sum(t.numel() * t.element_size() for t in stored.values()) and cost.compute == "bf16"


def test_gemma3_27b_sliding_windows_by_hand():
    """KV per layer type and per sequence, checked by hand: 10 full-attention layers (every sixth) and 52 with
    a 1024-token window, each caching 2 x 16 KV heads x 128 x 2 bytes = 8192 bytes a token (BF16). A sequence of
    32K holds 10 x 8192 x 32768 + 52 x 8192 x 1024 bytes (2.91 GiB), not 62 x 8192 x 32768 (15.5 GiB); the
    waterfall prices the windows against full attention on every layer."""
    from kiln.runtime.kv_budget import kv_budget

    spec = build_spec(GEMMA3_27B)
    windows = [layer.attention.sliding_window for layer in spec.layers]
    assert [i for i, w in enumerate(windows) if w is None] == list(range(5, 62, 6))  # 10 global layers
    assert spec.layers[5].attention.rotary != spec.layers[0].attention.rotary  # 1M theta, linear x8 vs 10K
    assert spec.layers[0].attention.softmax_scale == 168**-0.5
    budget = kv_budget(spec, None, 0, 0)
    assert budget["kv_bytes_per_token"] == 62 * 8192
    assert budget["by_layer_type"] == {
        "full attention": {"layers": 10, "bytes_per_token": 10 * 8192, "window": None},
        "sliding window 1024": {"layers": 52, "bytes_per_token": 52 * 8192, "window": 1024}}
    rows = {(r["device"], r["context"]): r for r in budget["max_concurrent_sequences"]}
    assert rows[("H100-80GB", 32768)]["sequence_bytes"] == 10 * 8192 * 32768 + 52 * 8192 * 1024 == 3_120_562_176
    assert rows[("H100-80GB", 4096)]["sequence_bytes"] == 10 * 8192 * 4096 + 52 * 8192 * 1024 == 771_751_936
    from kiln.kernels.targets import H100
    from kiln.runtime.kv_budget import activation_reserve_bytes

    scn = config_scenario("27b", spec, weights="fp8")
    g = economics_report(scn, ["h100"])["gpus"]["h100"]
    steps = {r["step"]: r for r in g["waterfall"]}
    # at the waterfall's 4K context, beside the same BF16 weights: 2.7x the sequences
    free = H100.hbm_bytes - scn.steps[0].figures.resident_bytes - activation_reserve_bytes(H100)
    assert steps["source"]["batch"] == free // (62 * 8192 * 4096)
    assert steps["window"]["applied"] and steps["window"]["batch"] == free // 771_751_936
    assert math.prod(_applied_factors(g["waterfall"])) == pytest.approx(g["total_factor"], rel=1e-12)


def test_capacity_tiers_by_hand(llama_8b, tmp_path):
    """A spot tier at $1.60 that loses 10 minutes to each of 0.1 interruptions an hour serves 59 minutes of 60:
    $1.60 / (1 - 0.1 x 10/60) = $1.6271 a serving hour, x2.0896 against $3.40 on-demand; the waterfall's last
    step takes the cheapest tier, and every tier's $/Mtok is on-demand's x its price / on-demand's."""
    from kiln.kernels.errors import KilnError
    from kiln.optimizer.report.prices import load_tiers, parse_prices

    table = tmp_path / "tiers.yaml"
    table.write_text("h100:\n  on-demand: 3.40\n  reserved-1y: 2.40\n"
                     "  spot: {price: 1.60, interruptions_per_hour: 0.1, restart_minutes: 10}\n")
    tiers = load_tiers(table, ["h100"])
    assert parse_prices(str(table), ["h100"]) == {"h100": (3.40, "given")}
    scn = config_scenario("8b", llama_8b, weights="fp8")
    g = economics_report(scn, ["h100"], parse_prices(str(table), ["h100"]), tiers=tiers)["gpus"]["h100"]
    rows = {t["tier"]: t for t in g["capacity_tiers"]}
    on_demand = g["usd_per_mtok_max_batch"]
    assert rows["on-demand"]["usd_per_mtok"] == pytest.approx(on_demand)
    assert rows["reserved-1y"]["usd_per_mtok"] == pytest.approx(on_demand * 2.40 / 3.40)
    assert rows["spot"]["effective_price_per_hour"] == pytest.approx(1.60 / (1 - 0.1 * 10 / 60))
    assert rows["spot"]["factor_vs_on_demand"] == pytest.approx(3.40 * (1 - 1 / 60) / 1.60)
    last = g["waterfall"][-1]
    assert last["step"] == "capacity" and last["applied"] and last["label"] == "capacity tier (spot)"
    assert last["factor"] == pytest.approx(rows["spot"]["factor_vs_on_demand"])
    assert math.prod(_applied_factors(g["waterfall"])) == pytest.approx(g["total_factor"], rel=1e-12)
    for text, message in (("h100:\n  reserved-1y: 2.4\n", "no 'on-demand' tier"),
                          ("h100:\n  on-demand: -1\n", "positive number of dollars"),
                          (("h100:\n  on-demand: 3\n  spot: {price: 1, interruptions_per_hour: 6, "
                            "restart_minutes: 10}\n"), "leave no serving time"),
                          ("a100:\n  on-demand: 3\n", "unknown GPU"),
                          ("h100:\n  on-demand: {price: 3, discount: 1}\n", "unknown field")):
        table.write_text(text)
        with pytest.raises(KilnError, match=message):
            load_tiers(table, ["h100"])
