"""KV-cache quantization on stories260K: accuracy recovery, KV bytes per token, paged vs contiguous decode speed.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/kv_cache.py [--paragraphs 600] [--batch 32] [--steps 128]

Accuracy: each KV config is applied by the kv-cache pass (scales calibrated on calibration.txt) and scored by
the build's accuracy gate through the runtime's paged cache on evaluation.txt (recovery = ppl_bf16 / ppl).
stories260K has head_dim 8, so NVFP4 KV (16-value blocks) backs off to FP8 there; NVFP4 is measured on a
small head_dim-16 Llama trained here for a minute on calibration.txt (stories260K's embeddings and MLPs as
a warm start; cached under $KILN_CACHE), which is a real trained model, not a random one.
Speed: batched greedy decode, the same prompts of mixed lengths, contiguous vs paged cache, best of 5.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kiln.calibration.data import load_token_lists
from kiln.kernels.targets import get_target
from kiln.optimizer.defaults import CALIBRATION_TEXT as CALIB
from kiln.optimizer.defaults import EVALUATION_TEXT as EVAL
from kiln.optimizer.defaults import STORIES260K as STORIES
from kiln.optimizer.loader import load_checkpoint
from kiln.optimizer.measure.gate import AccuracyGate, engine_from_graph
from kiln.optimizer.measure.runner import RuntimeRunner
from kiln.passes.base import PassContext
from kiln.passes.kv_cache import KvCacheQuantization
from kiln.runtime.engine import load_tokenizer
from kiln.runtime.kv_format import kv_bytes_per_token
from kiln.runtime.model_runner import decode_one_token, prefill
from tests.runtime.contiguous_kv_cache import ContiguousKVCache

CONFIGS = [  # label, pass config (None: the BF16 baseline)
    ("bf16", None),
    ("fp8 per-tensor (fp8-kv)", KvCacheQuantization(format="fp8", scaling="per_tensor")),
    ("fp8 per-head", KvCacheQuantization(format="fp8", scaling="per_head")),
    ("fp8 dynamic per-token", KvCacheQuantization(format="fp8", scaling="dynamic")),
    ("fp8 per-tensor, no offset", KvCacheQuantization(format="fp8", scaling="per_tensor", center=False)),
    ("fp8 per-head, no offset", KvCacheQuantization(format="fp8", scaling="per_head", center=False)),
    ("nvfp4 (nvfp4-kv)", KvCacheQuantization(format="nvfp4")),
    ("nvfp4, no offset", KvCacheQuantization(format="nvfp4", center=False)),
]


def head_dim16_model(tokenizer, seconds: float) -> Path:
    """A 4-layer Llama with head_dim 16 trained briefly on calibration.txt (cached)."""
    import random
    import shutil

    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(os.environ.get("KILN_CACHE", Path.home() / ".cache" / "kiln")) / f"kv-bench-hd16-{int(seconds)}s"
    if (path / "model.safetensors").is_file():
        return path
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=172, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config)
    state = model.state_dict()
    for name, value in load_file(STORIES / "model.safetensors").items():  # warm start: embeddings, MLPs, norms
        if name in state and state[name].shape == value.shape and "self_attn" not in name:
            state[name].copy_(value)
    train = load_token_lists(tokenizer, CALIB, None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    rng = random.Random(0)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        rows = [r[:128] for r in rng.sample(train, 16)]
        T = max(map(len, rows))
        x = torch.zeros(16, T, dtype=torch.long)
        mask = torch.zeros(16, T, dtype=torch.bool)
        for i, r in enumerate(rows):
            x[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), True
        loss = model(input_ids=x, attention_mask=mask.long(), labels=x.masked_fill(~mask, -100)).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(STORIES / f, path / f)
    return path


def accuracy(checkpoint: Path, tokenizer, paragraphs: int, configs) -> list[dict]:
    graph = load_checkpoint(checkpoint)
    spec = graph.spec
    gate = AccuracyGate(engine_from_graph(graph), load_token_lists(tokenizer, EVAL, paragraphs))
    ctx = PassContext(get_target("hopper"), runner=RuntimeRunner(graph, load_token_lists(tokenizer, CALIB, 256)))
    bf16_bytes = sum(kv_bytes_per_token(spec).values())
    rows = []
    for label, config in configs:
        graph.kv_cache = {}
        note = ""
        if config is not None:
            result = config.apply(graph, ctx)
            note = "; ".join(n for n in result.notes if "NVFP4" in n)
        formats = sorted({e["format"] for e in graph.kv_cache.values()}) or ["bf16"]
        table = {str(k): v for k, v in graph.kv_cache.items()}
        g = gate(graph, 0.99)
        kv = sum(kv_bytes_per_token(spec, table).values())
        rows.append({"config": label, "stored": "+".join(formats), "bytes": kv, "ratio": kv / bf16_bytes,
                     "recovery": g.recovery, "kl": g.kl, "top1": g.top1, "ppl": g.perplexity, "note": note})
    return rows


def decode_speed(checkpoint: Path, batch: int, steps: int, tokenizer, repeats: int = 5) -> dict[str, float]:
    """tokens/s of batched greedy decode: contiguous fp32 cache, paged BF16 (fp32) layers, paged FP8 layers."""
    graph = load_checkpoint(checkpoint)
    plain = engine_from_graph(graph)
    KvCacheQuantization(format="fp8").apply(graph, PassContext(
        get_target("hopper"), runner=RuntimeRunner(graph, load_token_lists(tokenizer, CALIB, 64))))
    fp8 = engine_from_graph(graph)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, 129, (batch,), generator=gen)
    T = int(lengths.max())
    tokens = torch.randint(3, 512, (batch, T), generator=gen)
    positions = torch.arange(T).expand(batch, -1)

    @torch.inference_mode()
    def run(engine, paged: bool) -> float:
        if paged:
            cache = engine.new_kv_cache(num_blocks=batch * math.ceil((T + steps) / 16), block_size=16)
            for row in range(batch):
                cache.add_sequence(row)
            cache.prepare(range(batch), positions, positions < lengths.unsqueeze(1))
        else:
            cache = ContiguousKVCache(engine.model.stream_shapes(), batch, T + steps)
        next_tokens = prefill(engine.model, tokens, positions, cache)[torch.arange(batch), lengths - 1].argmax(-1)
        start = time.perf_counter()
        for step in range(steps):
            pos = (lengths + step).unsqueeze(1)
            if paged:
                cache.prepare(range(batch), pos)  # block tables and on-demand allocation are part of the cost
            next_tokens = decode_one_token(engine.model, next_tokens.unsqueeze(1), pos, cache).argmax(-1)
        return batch * steps / (time.perf_counter() - start)

    runs = {"contiguous (fp32)": (plain, False), "paged, BF16 layers (fp32)": (plain, True),
            "paged, FP8 E4M3 per-tensor": (fp8, True)}
    best = dict.fromkeys(runs, 0.0)
    for _ in range(repeats):  # interleaved, so drifts in machine load hit every variant alike
        for label, (engine, paged) in runs.items():
            best[label] = max(best[label], run(engine, paged))
    return best


def _table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print(f"| {'KV config':<26} | {'stored as':<9} | {'B/token':>7} | {'vs BF16':>7} | {'ppl':>7} | "
          f"{'recovery':>8} | {'KL':>8} | {'top-1':>6} |")
    print(f"|{'-' * 28}|{'-' * 11}|{'-' * 9}|{'-' * 9}|{'-' * 9}|{'-' * 10}|{'-' * 10}|{'-' * 8}|")
    for r in rows:
        print(f"| {r['config']:<26} | {r['stored']:<9} | {r['bytes']:>7} | {r['ratio']:>7.3f} | {r['ppl']:>7.4f} | "
              f"{r['recovery']:>8.4f} | {r['kl']:>8.5f} | {r['top1']:>6.4f} |")
    for r in rows:
        if r["note"]:
            print(f"  {r['config']}: {r['note']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paragraphs", type=int, default=600, help="evaluation paragraphs the gate scores")
    parser.add_argument("--batch", type=int, default=32, help="sequences decoded together")
    parser.add_argument("--steps", type=int, default=128, help="decode steps timed")
    parser.add_argument("--train-seconds", type=float, default=90, help="training time of the head_dim-16 model")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not (STORIES / "model.safetensors").is_file():
        sys.exit(f"{STORIES} is absent: this benchmark needs ../shared")
    tok = load_tokenizer(STORIES)

    _table(f"stories260K (head_dim 8, 5 layers, 4 KV heads): {args.paragraphs} paragraphs of evaluation.txt",
           accuracy(STORIES, tok, args.paragraphs, CONFIGS))
    hd16 = head_dim16_model(tok, args.train_seconds)
    nvfp4_configs = [c for c in CONFIGS if c[0] in ("bf16", "fp8 per-tensor (fp8-kv)", "nvfp4 (nvfp4-kv)",
                                                     "nvfp4, no offset")]
    _table(f"head_dim-16 Llama (4 layers, 2 KV heads; trained {args.train_seconds:.0f} s on calibration.txt)",
           accuracy(hd16, tok, args.paragraphs, nvfp4_configs))

    print(f"\nbatched greedy decode, stories260K, batch {args.batch}, prompts of 16-128 tokens, {args.steps} steps "
          "(tokens/s, best of 5, 1 CPU thread)")
    speeds = decode_speed(STORIES, args.batch, args.steps, tok)
    contiguous = speeds["contiguous (fp32)"]
    print(f"| {'cache':<28} | {'tokens/s':>9} | {'time vs contiguous':>18} |")
    print(f"|{'-' * 30}|{'-' * 11}|{'-' * 20}|")
    for label, speed in speeds.items():
        print(f"| {label:<28} | {speed:>9.0f} | {contiguous / speed:>17.2f}x |")


if __name__ == "__main__":
    main()
