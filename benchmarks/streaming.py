"""Streaming build: a checkpoint larger than RAM builds in bounded memory.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/streaming.py [--dir /tmp/stream/llama8b] [--layers 32]
        [--recipe fp8-weights] [--calib-tokens 2048] [--calib-data FILE] [--keep]

Writes a random Llama-3.1-8B-shaped bf16 checkpoint (hidden 4096, 32 layers, 32 heads / 8 KV heads,
intermediate 14336, vocabulary 128256, untied head: 16 GB) shard by shard as Hugging Face does (5 GB shards and
model.safetensors.index.json), one tensor in memory at a time, with stories260K's tokenizer (its 512 token ids
are a subset of the vocabulary); then builds it with

    optimize build CKPT --recipe fp8-weights --no-gate --calib-tokens 2048

under /usr/bin/time -v and prints the build's wall time and peak RSS (and the checkpoint's and artifact's
sizes). `--layers N` writes the same shapes with N layers: memory should not depend on it, only time.
Both directories are deleted at the end unless --keep (a kept checkpoint of the same shape is reused).
Weights are N(0, 0.02) (norms 1), like an initialised model; a random model has no accuracy to gate, hence
--no-gate.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kiln.optimizer.defaults import STORIES260K as STORIES
from kiln.optimizer.lower import write_safetensors

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "hidden_act": "silu",
    "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "bos_token_id": 1, "eos_token_id": 2,  # stories260K's tokenizer
}
SHARD_BYTES = 5 * 10**9
STD = 0.02


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Llama checkpoint, in the order Hugging Face writes them (embedding, layers, norm, head)."""
    c, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    shapes = {"model.embed_tokens.weight": (v, c)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (c,), p + "self_attn.q_proj.weight": (q, c),
                   p + "self_attn.k_proj.weight": (kv, c), p + "self_attn.v_proj.weight": (kv, c),
                   p + "self_attn.o_proj.weight": (c, q), p + "post_attention_layernorm.weight": (c,),
                   p + "mlp.gate_proj.weight": (f, c), p + "mlp.up_proj.weight": (f, c),
                   p + "mlp.down_proj.weight": (c, f)}
    return shapes | {"model.norm.weight": (c,), "lm_head.weight": (v, c)}


class RandomTensors(Mapping[str, torch.Tensor]):
    """Tensors made when asked (bf16, seeded by their index): a shard is written without being held."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], seeds: dict[str, int]):
        self.shapes, self.seeds = shapes, seeds

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        if len(shape) == 1:
            return torch.ones(shape, dtype=torch.bfloat16)  # norm gains
        g = torch.Generator().manual_seed(self.seeds[name])
        out = torch.empty(shape, dtype=torch.bfloat16)
        for rows in out.split(4096):  # in fp32 a slice at a time: the 1 GB embedding is never 2 GB of fp32
            rows.copy_(torch.randn(rows.shape, generator=g) * STD)
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def info(self, name: str):
        from kiln.passes.tensor_store import TensorInfo

        return TensorInfo(torch.bfloat16, self.shapes[name])


def write_checkpoint(path: Path, config: dict) -> int:
    """A sharded random checkpoint at `path`; returns its weight bytes."""
    path.mkdir(parents=True, exist_ok=True)
    shapes = tensor_shapes(config)
    seeds = {name: i for i, name in enumerate(shapes)}
    shards: list[dict[str, tuple[int, ...]]] = [{}]
    size = 0
    for name, shape in shapes.items():
        nbytes = 2 * torch.Size(shape).numel()
        if size and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = shape
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(path / file, RandomTensors(shard, seeds), {"format": "pt"})
        weight_map |= dict.fromkeys(shard, file)
        print(f"  wrote {file} ({sum(2 * torch.Size(s).numel() for s in shard.values()) / 1e9:.2f} GB)", flush=True)
    total = sum(2 * torch.Size(s).numel() for s in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(STORIES / name, path / name)
    return total


def timed_build(checkpoint: Path, output: Path, recipe: str, calib_tokens: int, calib_data: Path | None,
                log: Path) -> dict:
    """Run the build under /usr/bin/time -v (its output in `log`, to follow a long build); its wall time, peak
    RSS and exit code."""
    command = ["/usr/bin/time", "-v", str(ROOT / ".venv/bin/optimize"), "build", str(checkpoint), "--recipe", recipe,
               "--no-gate", "--calib-tokens", str(calib_tokens), "-o", str(output), "--overwrite"]
    if calib_data is not None:
        command += ["--calib-data", str(calib_data)]
    print("$ " + " ".join(command[2:]) + f"   (output: {log})", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    start = time.perf_counter()
    with open(log, "w") as out:
        run = subprocess.run(command, check=False, stdout=out, stderr=subprocess.STDOUT, env=env)
    seconds = time.perf_counter() - start
    text = log.read_text(errors="replace")
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    tail = [line for line in text.splitlines() if not line.startswith("\t")][-5:]
    return {"rc": run.returncode, "seconds": seconds, "peak_rss_bytes": int(peak.group(1)) * 1024 if peak else None,
            "tail": tail}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/stream/llama8b"))
    parser.add_argument("--layers", type=int, default=LLAMA_8B["num_hidden_layers"])
    parser.add_argument("--recipe", default="fp8-weights")
    parser.add_argument("--calib-tokens", type=int, default=2048)
    parser.add_argument("--calib-data", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint and the artifact")
    args = parser.parse_args()

    config = {**LLAMA_8B, "num_hidden_layers": args.layers}
    checkpoint, output = args.dir / "checkpoint", args.dir / "artifact"
    try:
        start = time.perf_counter()
        if (checkpoint / "config.json").is_file() and json.loads((checkpoint / "config.json").read_text()) == config:
            print(f"reusing the checkpoint in {checkpoint} (kept by an earlier --keep)", flush=True)
            source_bytes = sum(2 * torch.Size(s).numel() for s in tensor_shapes(config).values())
        else:
            print(f"writing a random Llama-3.1-8B-shaped checkpoint with {args.layers} layers to {checkpoint}",
                  flush=True)
            source_bytes = write_checkpoint(checkpoint, config)
            print(f"  {source_bytes / 1e9:.2f} GB in {time.perf_counter() - start:.0f} s", flush=True)
        result = timed_build(checkpoint, output, args.recipe, args.calib_tokens, args.calib_data,
                             args.dir / "build.log")
        artifact = (output / "model.safetensors").stat().st_size if result["rc"] == 0 else None
        rows = [("layers", str(args.layers)), ("checkpoint (bf16)", f"{source_bytes / 1e9:.2f} GB"),
                ("recipe", f"{args.recipe}, --no-gate, --calib-tokens {args.calib_tokens}"),
                ("exit code", str(result["rc"])), ("build wall time", f"{result['seconds']:.0f} s"),
                ("peak RSS", f"{result['peak_rss_bytes'] / 2**30:.2f} GiB" if result["peak_rss_bytes"] else "?"),
                ("artifact model.safetensors", f"{artifact / 1e9:.2f} GB" if artifact else "-")]
        width = max(len(k) for k, _ in rows)
        print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
        if result["rc"] != 0:
            print("build failed:\n" + "\n".join(result["tail"]))
            sys.exit(1)
    finally:
        if not args.keep:
            shutil.rmtree(checkpoint, ignore_errors=True)
            shutil.rmtree(output, ignore_errors=True)


if __name__ == "__main__":
    main()
