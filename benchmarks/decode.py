"""CPU decode step: Kiln's runtime against the memory-bandwidth floor and transformers `generate`.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/decode.py [--models llama125m,smollm2] [--batches 1,8,32]
        [--prompt-tokens 16] [--new-tokens 32] [--repeats 3] [--smollm2-artifact DIR] [--gemma3-artifact DIR]
        [--compile]
        [--vllm-python ~/vllm-venv/bin/python] [--json]

Models:
- llama125m: a Llama-shaped random checkpoint of ~126M parameters (hidden 768, 14 layers, 12 heads / 4 KV
  heads, MLP 2048, SmolLM2's tokenizer and vocabulary of 49,152, tied head), built here, lowered with the
  recipe `none` (no passes: the runtime's fp32 reference is what is measured; the weights' format changes
  nothing on the CPU path, which dequantizes at load);
- gemma3: Gemma 3 270M (../shared/models/gemma-3-270m converted to ~/.cache/kiln/gemma-3-270m), as an
  fp8-weights artifact (--gemma3-artifact, or built as smollm2's), against transformers on the fp32 checkpoint;
- smollm2: SmolLM2-135M-Instruct (../shared/models, converted to ~/.cache/kiln/SmolLM2-135M-Instruct), as an
  fp8-weights artifact (--smollm2-artifact; built with `optimize build ... --recipe fp8-weights --no-gate`
  when not given), against transformers on the fp32 checkpoint.

Protocol: one thread; B prompts of --prompt-tokens random tokens; greedy; --new-tokens new tokens with EOS
ignored. Kiln: the scheduler prefills, then every decode step is timed (ms/step = decode time / steps).
transformers: `generate` for new_tokens and for 1 new token (the prefill and first token), fp32, eager
attention, `min_new_tokens` forcing the length; ms/step = the difference / (new_tokens - 1). The best of
--repeats, modes interleaved. --compile adds Kiln with its decode step compiled (Engine.compile_decode: a
second engine on the same artifact; its compile and warm-up are not timed). --vllm-python adds vLLM's CPU build
on the model's fp32 checkpoint, eager and compiled, after Kiln's rows of that model (benchmarks/vllm_decode.py,
one thread; ms/step from 33- and 1-token `generate` calls).

Floors, measured in the same run: read bandwidth (a sum over a 1 GiB tensor, one thread) and fp32 GEMM
throughput (a 2048^3 matmul). bandwidth floor = (linear weight bytes at fp32, what the CPU path reads + the
KV cache read at mid-generation) / bandwidth; compute floor = 2 x linear parameters x batch / GEMM
throughput; floor = the higher. --json prints one object per model and batch with kiln_ms, transformers_ms,
floor_ms (and the parts), and kiln_compiled_ms with --compile.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch

SMOL_SOURCE = ROOT.parent / "shared" / "models" / "SmolLM2-135M-Instruct"
SMOL_HF = Path.home() / ".cache" / "kiln" / "SmolLM2-135M-Instruct"
GEMMA_HF = Path.home() / ".cache" / "kiln" / "gemma-3-270m"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def read_bandwidth() -> float:
    """Bytes/s one thread reads: the best of 5 sums over 1 GiB."""
    big = torch.ones(2**28)
    big.sum()
    best = min(_timed(big.sum) for _ in range(5))
    return big.numel() * 4 / best


def gemm_flops() -> float:
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    return 2 * 2048**3 / min(_timed(lambda: a @ b) for _ in range(3))


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def llama125m(directory: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    if (directory / "config.json").is_file():
        return directory
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SMOL_HF)  # a build needs a tokenizer: SmolLM2's (49,152 tokens)
    config = LlamaConfig(hidden_size=768, num_hidden_layers=14, num_attention_heads=12, num_key_value_heads=4,
                         intermediate_size=2048, vocab_size=len(tokenizer), max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


def build(checkpoint: Path, recipe: str, out: Path) -> Path:
    if not (out / "manifest.json").is_file():
        log(f"building {out} ({recipe}) from {checkpoint} ...")
        subprocess.run([sys.executable, "-m", "kiln.optimizer.cli", "build", str(checkpoint), "--recipe", recipe,
                        "--no-gate", "--calib-tokens", "4096", "-o", str(out), "--overwrite"], check=True,
                       stdout=subprocess.DEVNULL)
    return out


def kiln_ms(engine, prompts, new_tokens: int) -> float:
    from kiln.runtime.request import SamplingParams
    from kiln.runtime.scheduler import Scheduler

    scheduler = Scheduler(engine, max_num_seqs=len(prompts), max_num_batched_tokens=1 << 16, prefix_caching=False,
                          num_blocks=engine.kv_cache_blocks)
    for prompt in prompts:
        scheduler.add_request(prompt, SamplingParams(max_tokens=new_tokens, stop_ids=()))
    scheduler.step()  # prefill + the first token
    start, steps = time.perf_counter(), 0
    while scheduler.has_work():
        scheduler.step()
        steps += 1
    return (time.perf_counter() - start) / steps * 1000


def transformers_ms(model, prompts, new_tokens: int) -> float:
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)

    def run(n):
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0)
        return time.perf_counter() - start

    return (run(new_tokens) - run(1)) / (new_tokens - 1) * 1000


def vllm_ms(args, checkpoint: Path) -> dict[str, dict[int, float]]:
    """vLLM's ms per decode step by mode and batch (benchmarks/vllm_decode.py in --vllm-python), one thread."""
    import os

    found: dict[str, dict[int, float]] = {}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for mode in ("eager", "compiled"):
        log(f"vLLM {mode} on {checkpoint} ...")
        done = subprocess.run([str(args.vllm_python), str(ROOT / "benchmarks" / "vllm_decode.py"), str(checkpoint),
                               mode, "--batches", args.batches, "--prompt-tokens", str(args.prompt_tokens),
                               "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)],
                              capture_output=True, text=True, env=env, cwd="/", check=False)
        if done.returncode != 0:
            log(f"vLLM {mode} failed: {(done.stderr.strip().splitlines() or ['no output'])[-1]}")
            continue
        lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        found[mode] = {line["batch"]: line["ms"] for line in lines}
    return found


def linear_parameters(engine) -> int:
    """Parameters of every linear the decode step runs (the lm_head included; the embedding is a row gather)."""
    return sum(m.weight.numel() for m in engine.model.modules()
               if isinstance(m, torch.nn.Linear) or type(m).__name__.endswith("Linear"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama125m,smollm2")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smollm2-artifact", type=Path)
    ap.add_argument("--gemma3-artifact", type=Path)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "kiln-decode-bench")
    ap.add_argument("--compile", action="store_true", help="also time the compiled decode step")
    ap.add_argument("--vllm-python", type=Path,
                    help="also time vLLM (eager and compiled) on the same checkpoint, through this venv's python "
                         "(benchmarks/vllm_decode.py; docs/exports.md gives the venv)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    from kiln import runtime

    bandwidth, flops = read_bandwidth(), gemm_flops()
    log(f"read bandwidth {bandwidth / 1e9:.1f} GB/s, fp32 GEMM {flops / 1e9:.1f} GFLOP/s (one thread)")
    rows = []
    for name in args.models.split(","):
        if name != "gemma3" and not (SMOL_HF / "config.json").is_file():  # both use SmolLM2's tokenizer
            if not SMOL_SOURCE.is_dir():
                raise SystemExit("../shared/models/SmolLM2-135M-Instruct is absent")
            subprocess.run([sys.executable, str(SMOL_SOURCE / "to_hf.py"), str(SMOL_HF)], check=True)
        if name == "llama125m":
            checkpoint = llama125m(args.work / "llama125m")
            artifact = build(checkpoint, "none", args.work / "llama125m-art")
        elif name == "smollm2":
            checkpoint = SMOL_HF
            artifact = args.smollm2_artifact or build(checkpoint, "fp8-weights", args.work / "smollm2-fp8w")
        elif name == "gemma3":
            checkpoint = GEMMA_HF
            if not (checkpoint / "config.json").is_file():
                raise SystemExit(f"{checkpoint} is absent: convert ../shared/models/gemma-3-270m with its to_hf.py")
            artifact = args.gemma3_artifact or build(checkpoint, "fp8-weights", args.work / "gemma3-fp8w")
        else:
            raise SystemExit(f"unknown model {name!r}: llama125m, smollm2 or gemma3")
        engine = runtime.load(artifact)
        compiled = None
        if args.compile:
            log(f"{name}: compiling the decode step ...")
            compiled = runtime.load(artifact)
            compiled.compile_decode()
        reference = AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32,
                                                         attn_implementation="eager").eval()
        params = linear_parameters(engine)
        first_row = len(rows)
        for batch in map(int, args.batches.split(",")):
            gen = torch.Generator().manual_seed(batch)
            prompts = torch.randint(3, engine.spec.vocab_size, (batch, args.prompt_tokens), generator=gen).tolist()
            kiln_ms(engine, prompts, 4)  # warm-up
            transformers_ms(reference, prompts, 3)
            kiln, hf, fast = [], [], []
            for _ in range(args.repeats):
                kiln.append(kiln_ms(engine, prompts, args.new_tokens))
                hf.append(transformers_ms(reference, prompts, args.new_tokens))
                if compiled is not None:
                    fast.append(kiln_ms(compiled, prompts, args.new_tokens))
            kv_bytes = batch * (args.prompt_tokens + args.new_tokens // 2) * sum(
                2 * layer.attention.num_kv_heads * layer.attention.head_dim * 4 for layer in engine.spec.layers)
            bw_ms = (params * 4 + kv_bytes) / bandwidth * 1000
            compute_ms = 2 * params * batch / flops * 1000
            floor = max(bw_ms, compute_ms)
            row = {"model": name, "batch": batch, "kiln_ms": round(min(kiln), 2),
                   "transformers_ms": round(min(hf), 2), "floor_ms": round(floor, 2),
                   "bandwidth_floor_ms": round(bw_ms, 2), "compute_floor_ms": round(compute_ms, 2),
                   "kiln_over_floor": round(min(kiln) / floor, 3),
                   "speedup_vs_transformers": round(min(hf) / min(kiln), 3),
                   "kiln_tokens_per_s": round(batch * 1000 / min(kiln), 1),
                   "transformers_tokens_per_s": round(batch * 1000 / min(hf), 1),
                   "linear_parameters": params, "read_gb_per_s": round(bandwidth / 1e9, 2),
                   "gemm_gflops": round(flops / 1e9, 1)}
            if fast:
                row.update({"kiln_compiled_ms": round(min(fast), 2),
                            "kiln_compiled_over_floor": round(min(fast) / floor, 3),
                            "compiled_speedup_vs_transformers": round(min(hf) / min(fast), 3),
                            "kiln_compiled_tokens_per_s": round(batch * 1000 / min(fast), 1)})
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                log(f"{name} batch {batch}: kiln {row['kiln_ms']} ms/step, transformers {row['transformers_ms']}, "
                    f"floor {row['floor_ms']}")
        if args.vllm_python is not None:
            for mode, found in vllm_ms(args, checkpoint).items():
                for row in rows[first_row:]:
                    row[f"vllm_{mode}_ms"] = found.get(row["batch"])
                    if args.json:
                        print(json.dumps({"model": name, "batch": row["batch"], f"vllm_{mode}_ms": row[f"vllm_{mode}_ms"]}),
                              flush=True)
    if not args.json:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"CPU decode, one thread, {args.prompt_tokens}-token prompts, {args.new_tokens} new "
                            f"tokens (read {bandwidth / 1e9:.1f} GB/s, GEMM {flops / 1e9:.0f} GFLOP/s)")
        columns = ["model", "batch", "Kiln ms/step", "× floor", "transformers ms/step", "× floor", "Kiln speedup"]
        if args.compile:
            columns += ["Kiln compiled ms/step", "× floor", "compiled speedup"]
        if args.vllm_python is not None:
            columns += ["vLLM eager ms/step", "vLLM compiled ms/step"]
        for column in (*columns, "floor ms (bw / compute)"):
            table.add_column(column, justify="right")
        for r in rows:
            cells = [r["model"], str(r["batch"]), f"{r['kiln_ms']:.1f}", f"{r['kiln_over_floor']:.2f}",
                     f"{r['transformers_ms']:.1f}", f"{r['transformers_ms'] / r['floor_ms']:.2f}",
                     f"{r['speedup_vs_transformers']:.2f}×"]
            if args.compile:
                cells += [f"{r['kiln_compiled_ms']:.1f}", f"{r['kiln_compiled_over_floor']:.2f}",
                          f"{r['compiled_speedup_vs_transformers']:.2f}×"]
            if args.vllm_python is not None:
                cells += [f"{r[f'vllm_{mode}_ms']:.1f}" if r.get(f"vllm_{mode}_ms") else "–"
                          for mode in ("eager", "compiled")]
            table.add_row(*cells, f"{r['floor_ms']:.1f} ({r['bandwidth_floor_ms']:.1f} / {r['compute_floor_ms']:.1f})")
        Console(width=160).print(table)


if __name__ == "__main__":
    main()
