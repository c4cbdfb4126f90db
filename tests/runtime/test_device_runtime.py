"""The device-aware runtime: `runtime.load(path, device=..., dtype=...)`.

This machine has no GPU, so what a GPU run depends on is checked in three ways:
- bf16 on the CPU runs the whole GPU code path but the kernels' dispatch (packed weights, bf16 activations,
  bf16 KV reads, the scheduler and sampling), and must track the fp32 reference;
- on the meta device every tensor a forward reads must be on the engine's device (an op mixing a CPU tensor
  with a meta one raises, as it would with a CUDA one), prefill, scoring and the decode step alike;
- the static-shape decode step (what a CUDA graph captures) pads to a few bucketed shapes, traces as one
  graph (fullgraph: no host sync), and decodes the eager tokens.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from kiln import runtime
from kiln.kernels.errors import KilnError
from kiln.optimizer.build import build
from kiln.optimizer.recipes import Recipe
from kiln.passes.kv_cache import KvCacheQuantization
from kiln.passes.weight_quant import WeightQuantization
from kiln.runtime.compiled_decode import DECODE_BATCH_SIZES, DECODE_LENGTH_STEP
from kiln.runtime.linear import PackedLinear, QuantLinear
from kiln.runtime.model_weights import RMSNorm
from tests.conftest import STORIES

torch.set_num_threads(1)
if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
    # before anything here imports Triton: its kernels are interpreted only if this is set by then
    os.environ.setdefault("TRITON_INTERPRET", "1")

TOKENS = [[1, 403, 261, 348, 416, 401, 263, 260, 443, 344, 261, 348, 402], [1, 285, 388, 262, 289]]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """stories260K as FP8 W8A8 with an FP8 (per-token) KV cache, as NVFP4 W4A16 with an NVFP4 KV cache, and
    with its weights as they are and an NVFP4 KV cache."""
    if not (STORIES / "config.json").is_file():
        pytest.skip("../shared/models absent")
    root = tmp_path_factory.mktemp("device")
    recipes = {
        "fp8": (WeightQuantization(method="rtn", format="fp8", activations="dynamic"),
                KvCacheQuantization(format="fp8", scaling="dynamic")),
        "nvfp4": (WeightQuantization(method="rtn", format="nvfp4"), KvCacheQuantization(format="nvfp4")),
        "nvfp4-kv": (KvCacheQuantization(format="nvfp4"),),
    }
    return {name: build(STORIES, "blackwell", Recipe(name, passes), root / name, gate=False).path
            for name, passes in recipes.items()}


@pytest.fixture
def no_triton(monkeypatch):
    from kiln.kernels import gpu

    monkeypatch.setattr(gpu, "use_triton", lambda x: False)


@pytest.mark.parametrize("name", ["fp8", "nvfp4"])
def test_bf16_engine_keeps_packed_bytes_and_tracks_the_fp32_reference(artifacts, name, no_triton):
    reference = runtime.load(artifacts[name])
    engine = runtime.load(artifacts[name], dtype=torch.bfloat16, packed=True)
    assert (reference.dtype, reference.packed) == (torch.float32, False)
    assert (engine.dtype, engine.packed) == (torch.bfloat16, True)
    assert engine.model.embed.dtype == torch.bfloat16
    for module in engine.model.modules():
        if isinstance(module, RMSNorm | QuantLinear):
            assert module.weight.dtype == torch.bfloat16
        if isinstance(module, PackedLinear):  # the stored bytes and fp32 scales, not cast
            assert {b.dtype for b in module.buffers()} <= {torch.float8_e4m3fn, torch.uint8, torch.float32}
    assert any(isinstance(m, PackedLinear) for m in engine.model.modules())
    cache = engine.new_kv_cache(4)
    assert cache.dtype == torch.bfloat16 and all(s.format != "bf16" for layer in engine.kv_streams for s in layer)

    agree, total = 0, 0
    for expected, got in zip(reference.logits(TOKENS), engine.logits(TOKENS), strict=True):
        assert got.dtype == torch.bfloat16
        # bf16 activations move some FP8/FP4 activation and KV roundings by a step (measured here: a mean error
        # of 0.3% of the largest logit unquantized, 0.8-1.7% quantized; the worst logit up to 10%), so the
        # mean error is held, and the top token
        error = (got.float() - expected).abs().mean() / expected.abs().max()
        assert float(error) < 0.03
        agree += int((got.float().argmax(-1) == expected.argmax(-1)).sum())
        total += len(expected)
    assert agree >= 0.85 * total

    # the scheduler and sampling in bf16: seeded sampling repeats itself, greedy decoding runs to its length
    sampled = [engine.generate_ids(TOKENS, 12, temperature=0.8, seed=7, repetition_penalty=1.3) for _ in range(2)]
    assert sampled[0] == sampled[1]
    greedy = engine.generate_ids(TOKENS, 12, stop_ids=())
    for out, reason in greedy:
        assert reason == "length" and len(out) == 12 and all(0 <= t < engine.spec.vocab_size for t in out)
    # speculative decoding in bf16: greedy verification, and the rejection sampler on bf16 probabilities
    drafter = engine.drafter("prompt-lookup")
    spec_greedy, stats = engine.speculative_ids(TOKENS, 12, drafter=drafter, stop_ids=())
    assert stats.steps > 0 and [len(out) for out, _ in spec_greedy] == [12, 12]
    # verification runs several tokens a forward, plain decoding one: in bf16 their roundings differ, so the
    # outputs agree on a prefix at least (a near-tie may part them after)
    assert all(a[:4] == b[:4] for (a, _), (b, _) in zip(spec_greedy, greedy, strict=True))
    sampled_spec = [engine.speculative_ids(TOKENS, 12, drafter=drafter, temperature=0.8, seed=3, stop_ids=())[0]
                    for _ in range(2)]
    assert sampled_spec[0] == sampled_spec[1]


# NVFP4 weights are left out: on a GPU they run the Triton kernels; their torch references, which run here,
# check the stored codes on the host at every product (a CPU-only reference, which meta tensors cannot run)
@pytest.mark.parametrize("name", ["fp8", "nvfp4-kv"])
def test_every_tensor_a_forward_reads_is_on_the_engine_device(artifacts, name, no_triton):
    engine = runtime.load(artifacts[name], device="meta")
    assert engine.device == torch.device("meta") and engine.packed and engine.dtype == torch.bfloat16
    assert all(s.format != "bf16" for layer in engine.kv_streams for s in layer)
    assert all(t.device.type == "meta" for t in (*engine.model.parameters(), *engine.model.buffers()))
    # scoring: padded batch, paged scratch cache
    for tokens, out in zip(TOKENS, engine.logits(TOKENS), strict=True):
        assert out.device.type == "meta" and tuple(out.shape) == (len(tokens), engine.spec.vocab_size)
    # prefill, then a decode step, on the engine's block pool
    cache = engine.new_kv_cache(8)
    assert all(getattr(pool, n).device.type == "meta" for layer in cache.pools for pool in layer for n in pool.storage)
    for row in range(2):
        cache.add_sequence(row)
    logits = engine.prefill_rows(cache, [0, 1], TOKENS)
    assert logits.device.type == "meta" and tuple(logits.shape) == (2, engine.spec.vocab_size)
    positions = cache.prepare([0, 1], torch.tensor([[len(TOKENS[0])], [len(TOKENS[1])]]))
    assert positions.device.type == "meta"
    step = engine.decode_logits(torch.zeros(2, 1, dtype=torch.long, device="meta"), positions, cache)
    assert step.device.type == "meta" and tuple(step.shape) == (2, engine.spec.vocab_size)


def test_a_forward_fed_host_tensors_on_another_device_fails():
    """The property the meta test relies on: an op mixing a meta tensor with a CPU one raises."""
    with pytest.raises(RuntimeError, match="device"):
        torch.ones(2, device="meta") + torch.ones(2)


def test_devices_and_dtypes_that_cannot_run_are_refused(artifacts):
    if not torch.cuda.is_available():
        with pytest.raises(KilnError, match="no CUDA GPU"):
            runtime.load(artifacts["fp8"], device="cuda")
    for device in ("gpu0", "mps"):  # not a device; a device the runtime has no path for
        with pytest.raises(KilnError, match=f"unknown device '{device}': the runtime runs on cpu or cuda"):
            runtime.load(artifacts["fp8"], device=device)
    with pytest.raises(KilnError, match="compute dtype"):
        runtime.load(artifacts["fp8"], dtype=torch.int8)


def test_the_cli_refuses_a_device_it_does_not_have(artifacts, cli):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code, out, err = cli("generate", artifacts["fp8"], "Once", "--device", "cuda")
    assert code == 2 and "no CUDA GPU" in err and len(err.strip().splitlines()) == 1 and not out


def test_the_gpu_decode_table_runs_here_on_the_cpu(capsys):
    """benchmarks/gpu_decode.py (gpu_check's decode rows) is written for a GPU this machine lacks: its code path
    runs here on the CPU (bf16, stories260K's shape, both formats, eager, and compiled for FP8 as the 8B shape
    is on a GPU), so a lent GPU's few minutes are not lost to a broken script."""
    from tests.conftest import benchmark

    gpu_decode = benchmark("gpu_decode")
    rows = gpu_decode.decode_table("cpu", 10.0, ["stories260K"], batches=(1, 3), prompt_tokens=8, steps=5,
                                   compile_models=("stories260K",))
    assert [(r["weights"], r["batch"]) for r in rows] == [("fp8", 1), ("fp8", 3), ("nvfp4", 1), ("nvfp4", 3)]
    for row in rows:
        assert row["eager_ms"] > 0 and row["transformers_ms"] > 0 and row["roofline_ms"] > 0
        assert (row["compiled_ms"] is not None) == (row["weights"] == "fp8")  # compiled: the FP8 rows
    assert "error" not in capsys.readouterr().out


TINY = {  # a Llama shape whose heads the paged decode kernel serves (head dim 32), built with random weights
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
}
PROMPTS = [[1, *range(10 + i, 14 + 5 * i)] for i in range(3)]  # histories of 5 to 14 tokens, then more


def _tiny_engine(kv: str, packed: bool = False):
    """TINY with random weights; `packed`: layer 0's linears FP8 W8A8 (per-token activations), layer 1's NVFP4
    W4A16, both kept packed (runtime.linear.PackedLinear)."""
    from kiln.kernels.fp8 import fp8_quantize_per_channel
    from kiln.kernels.nvfp4 import nvfp4_quantize
    from kiln.optimizer.loader_config import build_spec
    from kiln.runtime.engine import Engine

    spec = build_spec(TINY)
    gen = torch.Generator().manual_seed(0)
    tensors = {spec.embedding: torch.randn(256, 128, generator=gen)}
    tensors.update({name: 1 + 0.1 * torch.randn(size, generator=gen) for name, size in spec.norms().items()})
    formats = {}
    for lin in spec.linears()[:-1]:  # the lm_head is tied
        w = torch.randn(lin.out_features, lin.in_features, generator=gen) * 0.15
        tensors[f"{lin.name}.weight"] = w
        if packed and ".layers.0." in lin.name:
            tensors[f"{lin.name}.weight"], tensors[f"{lin.name}.weight_scale"] = fp8_quantize_per_channel(w)
            formats[lin.name] = {"format": "fp8_e4m3", "activation": "fp8_dynamic_per_token"}
        elif packed:
            del tensors[f"{lin.name}.weight"]
            tensors.update({f"{lin.name}.{k}": v for k, v in nvfp4_quantize(w).tensors().items()})
            formats[lin.name] = {"format": "nvfp4", "activation": "none"}
    table = None if kv == "bf16" else {str(i): {"format": "fp8_e4m3", "scaling": "dynamic"} for i in range(2)}
    return Engine(spec, tensors, formats, kv_cache=table, kv_block_size=4, packed=packed)


def _counted_kernel(monkeypatch, name: str, triton: bool) -> list:
    """Count the calls of kiln.kernels.gpu's `name`, run by the Triton interpreter (`triton`) or its reference."""
    from kiln.kernels import gpu

    if triton and not gpu.use_triton(torch.zeros(1)):
        pytest.skip("Triton is not installed or not interpreting")
    if not triton:
        monkeypatch.setattr(gpu, "use_triton", lambda x: False)
    calls = []
    kernel = getattr(gpu, name)
    monkeypatch.setattr(gpu, name, lambda *a, **k: calls.append(1) or kernel(*a, **k))
    return calls


def _decode_steps(engine, prompts, steps: int) -> torch.Tensor:
    """Logits [steps, B, V] of `steps` greedy decode steps after prefilling `prompts`, one row each."""
    cache = engine.new_kv_cache(32)
    rows = list(range(len(prompts)))
    for row in rows:
        cache.add_sequence(row)
    logits = []
    with torch.inference_mode():
        tokens = engine.prefill_rows(cache, rows, prompts).argmax(-1, keepdim=True)
        for step in range(steps):
            positions = cache.prepare(rows, torch.tensor([[len(p) + step] for p in prompts]))
            logits.append(engine.decode_logits(tokens, positions, cache))
            tokens = logits[-1].argmax(-1, keepdim=True)
    return torch.stack(logits)


@pytest.mark.parametrize("kv", ["bf16", "fp8-dynamic"])
@pytest.mark.parametrize("triton", [False, True], ids=["reference", "triton"])
def test_decode_through_the_paged_kernel_gives_the_gathering_paths_logits(kv, triton, monkeypatch):
    """A GPU engine's decode steps attend through kiln.kernels.gpu.paged_decode_attention, reading the pools as
    stored; here its torch reference, and the Triton kernel interpreted, against the CPU gather-and-SDPA path."""
    calls = _counted_kernel(monkeypatch, "paged_decode_attention", triton)
    gather, paged = _tiny_engine(kv), _tiny_engine(kv)
    paged.decode_kernel = True
    assert all(b.attention.kernel_decodes for b in paged.model.blocks)
    expected, got = _decode_steps(gather, PROMPTS, 6), _decode_steps(paged, PROMPTS, 6)
    assert len(calls) == 6 * 2  # every decode step, every layer; never the prefill
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4 * float(expected.abs().max()))
    assert paged.generate_ids(PROMPTS, 12, stop_ids=()) == gather.generate_ids(PROMPTS, 12, stop_ids=())


def test_a_static_decode_step_is_one_graph_at_bucketed_shapes(no_triton):
    """What `compile_decode(mode="reduce-overhead")` captures as CUDA graphs on a GPU, here on the CPU: the
    decode step of a GPU engine (packed FP8 W8A8 and NVFP4 linears, the paged decode kernel over an FP8 KV
    cache) traces as one graph, its kernels the custom ops kiln::fp8_linear, kiln::fp4_linear and
    kiln::paged_decode_attention (a kernel's Python launch code, or a host sync, would break or fail the
    fullgraph trace); it runs at bucketed shapes only and decodes the eager engine's tokens."""
    from torch._dynamo.utils import counters

    eager, static = _tiny_engine("fp8-dynamic", packed=True), _tiny_engine("fp8-dynamic", packed=True)
    eager.decode_kernel = static.decode_kernel = True
    assert {type(m).__name__ for m in static.model.modules()} >= {"PackedLinear"}
    torch._dynamo.reset()
    counters.clear()
    static.compile_decode(static_shapes=True, warmup=False)
    compiled, shapes = static.runner.compiled.forward, set()

    def recorded(tokens, positions, view):
        shapes.add((tokens.shape[0], view.length, tuple(view.kernel[0].block_table.shape)))
        return compiled(tokens, positions, view)

    static.runner.compiled.forward = recorded
    assert static.generate_ids(PROMPTS, 16, stop_ids=()) == eager.generate_ids(PROMPTS, 16, stop_ids=())
    # 3 rows pad to 4; at most 30 keys pad to 256, the tables to 256 / 4 blocks
    assert shapes == {(4, DECODE_LENGTH_STEP, (4, DECODE_LENGTH_STEP // 4))} and 4 in DECODE_BATCH_SIZES
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


@pytest.fixture(scope="module")
def mla_artifact(tmp_path_factory):
    """stories260K converted to MLA (half its KV, no healing), its latent cache FP8 per token (a dense pool
    goes through the same kernels in the GQA tests above and in tests/kernels)."""
    if not (STORIES / "config.json").is_file():
        pytest.skip("../shared/models absent")
    from kiln.passes.mla import MlaConversion

    passes = (MlaConversion(kv_fraction=0.5, heal_steps=0), KvCacheQuantization(format="fp8", scaling="dynamic"))
    return build(STORIES, "hopper", Recipe("mla-fp8-kv", passes), tmp_path_factory.mktemp("mla") / "mla",
                 gate=False).path


@pytest.mark.parametrize("triton", [False, True], ids=["reference", "triton"])
def test_mla_decode_through_the_latent_kernel_gives_the_gathering_paths_logits(mla_artifact, triton, monkeypatch):
    """MLA layers decode through kiln.kernels.gpu.mla_decode_attention (absorbed, reading the latent pool as
    stored), against the CPU path (gathered latents, absorbed SDPA)."""
    from kiln.runtime.attention import MlaAttention

    calls = _counted_kernel(monkeypatch, "mla_decode_attention", triton)
    gather, paged = runtime.load(mla_artifact), runtime.load(mla_artifact)
    paged.decode_kernel = True
    layers = [m for m in paged.model.modules() if isinstance(m, MlaAttention)]
    assert layers and all(m.kernel_decodes for m in layers)
    prompts = [TOKENS[0], TOKENS[1]]
    expected, got = _decode_steps(gather, prompts, 5), _decode_steps(paged, prompts, 5)
    assert len(calls) == 5 * len(layers)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4 * float(expected.abs().max()))
    assert paged.generate_ids(prompts, 10, stop_ids=()) == gather.generate_ids(prompts, 10, stop_ids=())


def test_a_compiled_static_mla_step_runs_the_latent_kernel_as_one_graph(mla_artifact, no_triton):
    from torch._dynamo.utils import counters

    eager, static = runtime.load(mla_artifact), runtime.load(mla_artifact)
    eager.decode_kernel = static.decode_kernel = True
    torch._dynamo.reset()
    counters.clear()
    static.compile_decode(static_shapes=True, warmup=False)
    assert static.generate_ids(TOKENS, 12, stop_ids=()) == eager.generate_ids(TOKENS, 12, stop_ids=())
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
