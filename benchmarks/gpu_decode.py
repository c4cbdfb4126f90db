"""Decode tokens/s of Kiln's runtime on a GPU against the HBM roofline and transformers (bf16).

    .venv/bin/python benchmarks/gpu_decode.py                      # on a GPU (gpu_check.py runs this too)
    .venv/bin/python benchmarks/gpu_decode.py --device cpu --models stories260K --steps 4   # a smoke run

Models, with random weights in their real shapes (timing does not depend on the values, and the GPU machine
need not hold the checkpoints): stories260K, SmolLM2-135M and Llama-3.1-8B. Each is built straight on the
device in the runtime's own formats: every decoder linear quantized by the kernels' quantizers (FP8 E4M3 with
per-channel scales and activations quantized per token, W8A8, the FP8 GEMM kernel's case; or NVFP4 W4A16), the
lm_head and embedding bf16, as ModelOpt's recipes leave them.
The engine is `runtime.Engine(device=...)`: packed weights through the Triton kernels, bf16 activations.

Protocol: B sequences of --prompt-tokens random tokens prefilled, then --steps decode steps, each one forward
of the B rows on the paged cache, the greedy token of each row, and the one host sync that reads them (what a
scheduler step does); ms/step is the median. "compiled" is the same step after
`Engine.compile_decode(mode="reduce-overhead")`: torch.compile with CUDA graphs, one per bucketed shape,
compiled at its first step (whose time is printed) and recorded at the next ones; the first 3 steps are not
timed. transformers: LlamaForCausalLM in bf16 with its default attention
and a DynamicCache, the same steps. Roofline: the bytes a step reads, weights (linears and lm_head as
stored) plus the KV cache at mid-run, divided by the bandwidth a device-to-device copy measured.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch

MODELS = {  # Hugging Face Llama config fields of each shape
    "stories260K": {"hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 5, "num_attention_heads": 8,
                    "num_key_value_heads": 4, "head_dim": 8, "vocab_size": 512, "max_position_embeddings": 512,
                    "tie_word_embeddings": True},
    "SmolLM2-135M": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                     "max_position_embeddings": 8192, "tie_word_embeddings": True, "rope_theta": 100000.0},
    "Llama-3.1-8B": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                     "max_position_embeddings": 131072, "tie_word_embeddings": False, "rope_theta": 500000.0},
}
FORMATS = ("fp8", "nvfp4")


def llama_config(name: str) -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5, "bos_token_id": 1,
            "eos_token_id": 2, **MODELS[name]}


def random_engine(name: str, fmt: str, device: str, kv_blocks: int):
    """An Engine of model `name`'s shape with random weights, its decoder linears in `fmt` (fp8: W8A8 with
    dynamic per-token activations; nvfp4: W4A16), built on `device`."""
    from kiln.kernels.fp8 import fp8_quantize_per_channel
    from kiln.kernels.nvfp4 import nvfp4_quantize
    from kiln.optimizer.loader_config import build_spec
    from kiln.runtime.engine import Engine

    spec = build_spec(llama_config(name))
    gen = torch.Generator(device).manual_seed(0)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * std).to(torch.bfloat16)

    tensors = {spec.embedding: normal(spec.vocab_size, spec.hidden_size, std=0.02)}
    tensors.update({norm: torch.ones(size, dtype=torch.bfloat16, device=device)
                    for norm, size in spec.norms().items()})
    formats = {}
    for lin in spec.linears():
        if lin.name == "lm_head":
            if not spec.tie_word_embeddings:
                tensors["lm_head.weight"] = normal(lin.out_features, lin.in_features, std=0.02)
            continue
        w = normal(lin.out_features, lin.in_features, std=lin.in_features ** -0.5)
        if fmt == "fp8":
            q, scale = fp8_quantize_per_channel(w)
            tensors[f"{lin.name}.weight"], tensors[f"{lin.name}.weight_scale"] = q, scale
            formats[lin.name] = {"format": "fp8_e4m3", "activation": "fp8_dynamic_per_token"}
        else:
            for key, value in nvfp4_quantize(w).tensors().items():
                tensors[f"{lin.name}.{key}"] = value
            formats[lin.name] = {"format": "nvfp4", "activation": "none", "in_features": lin.in_features}
        del w
    return Engine(spec, tensors, formats, kv_cache_blocks=kv_blocks, device=device)


def step_bytes(engine, batch: int, history: int) -> int:
    """Bytes one decode step reads: every linear's stored weight (lm_head included) and the KV cache."""
    from kiln.runtime.kv_pools import stored_bytes_per_token
    from kiln.runtime.linear import PackedLinear, QuantLinear

    weights = 0
    for module in engine.model.modules():
        if isinstance(module, PackedLinear):
            weights += module.stored_bytes
        elif isinstance(module, QuantLinear):
            weights += module.weight.numel() * module.weight.element_size()
    return weights + batch * history * stored_bytes_per_token(engine.kv_streams, engine.dtype)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def kiln_ms_per_step(engine, batch: int, prompt_tokens: int, steps: int) -> tuple[float, float]:
    """(median ms of a decode step of `batch` rows after a prefill of `prompt_tokens` each, ms of the first
    step: a compiled engine compiles, or records its CUDA graph, there). The engine's own block pool is used
    and left empty, so a compiled engine's static pool addresses hold across calls."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, engine.spec.vocab_size, (prompt_tokens,), generator=gen).tolist()
               for _ in range(batch)]
    cache = engine.kv_pool
    rows = list(range(batch))
    times = []
    with torch.inference_mode():
        for row in rows:
            cache.add_sequence(row)
        try:
            tokens = engine.prefill_rows(cache, rows, prompts).argmax(-1, keepdim=True)
            for step in range(steps):
                _sync(str(engine.device))
                start = time.perf_counter()
                positions = cache.prepare(rows, torch.full((batch, 1), prompt_tokens + step))
                tokens = engine.decode_logits(tokens, positions, cache).argmax(-1, keepdim=True)
                tokens.tolist()  # the scheduler's one host sync a step
                times.append(time.perf_counter() - start)
        finally:
            for row in rows:
                cache.free_sequence(row)
    # CUDA-graph trees run a new shape eagerly, then record it, then replay: the first steps are not timed
    return 1e3 * statistics.median(times[3:] if len(times) > 4 else times), 1e3 * times[0]


def transformers_ms_per_step(name: str, device: str, batch: int, prompt_tokens: int, steps: int) -> float:
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{k: v for k, v in llama_config(name).items() if k not in ("model_type", "architectures")})
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(3, config.vocab_size, (batch, prompt_tokens), device=device)
    times = []
    with torch.inference_mode():
        cache = DynamicCache()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        tokens = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(steps):
            _sync(device)
            start = time.perf_counter()
            out = model(input_ids=tokens, past_key_values=cache, use_cache=True)
            tokens = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.tolist()
            times.append(time.perf_counter() - start)
    del model, cache
    return 1e3 * statistics.median(times[1:] if len(times) > 1 else times)


def decode_table(device: str, bandwidth_gbps: float, models=tuple(MODELS), formats=FORMATS, batches=(1, 8),
                 prompt_tokens: int = 128, steps: int = 32, compile_models=("Llama-3.1-8B",),
                 deadline: float = float("inf"), kv_blocks: int = 512, compile_formats=("fp8",)) -> list[dict]:
    """Print Markdown rows as they finish and return them as dicts. Rows past `deadline`
    (time.perf_counter()) are skipped, each with a line saying so."""
    print("| model | weights | batch | kiln eager ms/step | kiln compiled ms/step | transformers bf16 ms/step "
          "| roofline ms | best / roofline | tokens/s (best) | vs transformers |")
    print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for name in models:
        baseline = {}
        for fmt in formats:
            if time.perf_counter() > deadline:
                print(f"| {name} | {fmt} | - | (skipped: past the time budget) |", flush=True)
                continue
            try:
                engine = random_engine(name, fmt, device, kv_blocks)
                compiled = None
                if name in compile_models and fmt in compile_formats:  # compiled on its first step, below
                    compiled = random_engine(name, fmt, device, kv_blocks)
                    compiled.compile_decode(mode="reduce-overhead" if device.startswith("cuda") else None,
                                            warmup=False)
                for batch in batches:
                    eager_ms, _ = kiln_ms_per_step(engine, batch, prompt_tokens, steps)
                    compiled_ms = None
                    if compiled is not None:
                        compiled_ms, first_ms = kiln_ms_per_step(compiled, batch, prompt_tokens, steps)
                        print(f"    (compiled {name} {fmt} batch {batch}: first step {first_ms / 1e3:.0f} s)",
                              flush=True)
                    if batch not in baseline:
                        baseline[batch] = transformers_ms_per_step(name, device, batch, prompt_tokens, steps)
                    roof = step_bytes(engine, batch, prompt_tokens + steps // 2) / (bandwidth_gbps * 1e9) * 1e3
                    best = min(eager_ms, compiled_ms or float("inf"))
                    row = {"model": name, "weights": fmt, "batch": batch, "eager_ms": eager_ms,
                           "compiled_ms": compiled_ms, "transformers_ms": baseline[batch], "roofline_ms": roof,
                           "tokens_per_s": batch * 1e3 / best}
                    rows.append(row)
                    cells = [name, fmt, batch, f"{eager_ms:.2f}", "-" if compiled_ms is None else f"{compiled_ms:.2f}",
                             f"{baseline[batch]:.2f}", f"{roof:.3f}", f"{best / roof:.2f}x",
                             f"{row['tokens_per_s']:.0f}", f"{baseline[batch] / best:.2f}x"]
                    print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)
                del engine, compiled
            except Exception as exc:  # noqa: BLE001 -- one failed model is a row, the others still run
                print(f"| {name} | {fmt} | - | error: {type(exc).__name__}: "
                      f"{(str(exc).splitlines() or [''])[0][:150]} |", flush=True)
            if device.startswith("cuda"):
                torch._dynamo.reset()
                torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--compile", default="Llama-3.1-8B", help="models also timed compiled (comma list)")
    parser.add_argument("--bandwidth", type=float, default=None, help="GB/s (default: measured by a copy)")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_decode: no CUDA GPU on this machine (--device cpu runs a smoke test)")
        return 0
    bandwidth = args.bandwidth
    if bandwidth is None:
        bandwidth = copy_bandwidth_gbps(args.device)
        print(f"copy bandwidth on {args.device}: {bandwidth:.0f} GB/s\n")
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        print(f"gpu_decode: unknown model(s) {', '.join(unknown)}; known: {', '.join(MODELS)}")
        return 2
    decode_table(args.device, bandwidth, models, args.formats.split(","), [int(b) for b in args.batches.split(",")],
                 args.prompt_tokens, args.steps, tuple(m for m in args.compile.split(",") if m))
    return 0


def copy_bandwidth_gbps(device: str) -> float:
    """(read + write bytes) / median time of a device-to-device copy (1 GiB on a GPU, 64 MiB elsewhere)."""
    n = (1 << 28) if device.startswith("cuda") else (1 << 24)
    src = torch.empty(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(10):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - start)
    return 2 * n * 4 / statistics.median(times) / 1e9


if __name__ == "__main__":
    sys.exit(main())
