"""MLA conversion: KV bytes per token against recovery, with and without healing, beside the training-free PCA
anchor; plus what the budget buys a Llama-3.1-8B-shaped model (bytes and concurrency only, meta device).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/mla.py [--paragraphs 200] [--fractions 0.75,0.5,0.25]
        [--heal-steps 600] [--smollm2 DIR [--smollm2-only] [--smollm2-rope-dims 64,128]
        [--smollm2-heal-steps 0]] [--out artifacts/mla]
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/mla.py --decode SOURCE_ART,MLA_ART [--decode ...]
        [--batches 1,8] [--cached 1024]

Each row runs the `mla` pass (calibration.txt: the first 256 paragraphs to observe and probe, all of it to
heal) through the Python API and scores the result with the build's accuracy gate on evaluation.txt
(recovery = ppl_source / ppl; KL and top-1 against the source). `fp8 latent` rows add the fp8-kv pass.
Writes a markdown table and a PNG (KV bytes per token, as a fraction of the source's, against recovery).

--decode times the scheduler's decode step of two artifacts of one model (the source, e.g. `--recipe none`,
and its MLA conversion) with `--cached` tokens in each sequence's cache (random prompts; capped at the model's
context less the new tokens), batch by batch, eager and compiled (Engine.compile_decode): ms per step, the
best of 3, one thread. MLA decodes absorbed (W_uk folded into the query, W_uv after the latent attention).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch

from kiln.calibration.data import load_token_lists
from kiln.kernels.targets import get_target
from kiln.optimizer.defaults import CALIBRATION_TEXT as CALIB
from kiln.optimizer.defaults import EVALUATION_TEXT as EVAL
from kiln.optimizer.defaults import STORIES260K as STORIES
from kiln.optimizer.loader import load_checkpoint
from kiln.optimizer.lower import kv_cache_table
from kiln.optimizer.measure.gate import AccuracyGate, engine_from_graph
from kiln.optimizer.measure.runner import RuntimeRunner
from kiln.passes.base import PassContext, Pipeline
from kiln.passes.kv_cache import KvCacheQuantization
from kiln.passes.mla import MlaConversion
from kiln.runtime.engine import load_tokenizer
from kiln.runtime.kv_format import kv_bytes_per_token

# issue #11: training-free joint low-rank K|V (PCA per layer, RoPE re-applied after the up-projection, so not
# absorbable), stories260K, 600 evaluation paragraphs
PCA_ANCHOR = {0.75: 0.990, 0.62: 0.973, 0.50: 0.902, 0.38: 0.665}


# SmolLM2 rows (30 layers, 49K vocabulary) on 2 CPU cores: each rank probe reruns the model from its layer, so
# each row fixes the rotary key's width (--smollm2-rope-dims) and probes score 8 paragraphs: ~210 probes, not ~600
SMOLLM2_PROBE_PARAGRAPHS = 8


def run(checkpoint: Path, fraction: float, heal_steps: int, fp8_latent: bool, paragraphs: int, **options) -> dict:
    graph = load_checkpoint(checkpoint)
    tokenizer = load_tokenizer(checkpoint)
    observe = load_token_lists(tokenizer, CALIB, 256)
    heal = load_token_lists(tokenizer, CALIB, 100_000)
    gate = AccuracyGate(engine_from_graph(graph), load_token_lists(tokenizer, EVAL, paragraphs))
    source = sum(kv_bytes_per_token(graph.spec).values())
    passes = [MlaConversion(kv_fraction=fraction, heal_steps=heal_steps, **options)]
    if fp8_latent:
        passes.append(KvCacheQuantization(format="fp8"))
    ctx = PassContext(get_target("hopper"), runner=RuntimeRunner(graph, observe, distillation_tokens=heal))
    start = time.perf_counter()
    records = Pipeline(passes).run(graph, ctx)
    seconds = time.perf_counter() - start
    result = gate(graph, 0.0)
    engine = engine_from_graph(graph)
    after = sum(kv_bytes_per_token(graph.spec, kv_cache_table(graph)).values())
    ranks = [f"{layer.attention.qk_rope_head_dim}+{layer.attention.kv_lora_rank}"
             if layer.attention.kind == "mla" else "gqa" for layer in graph.spec.layers]
    return {"model": checkpoint.name, "fraction": fraction, "heal": heal_steps, "fp8": fp8_latent,
            "source_bytes": source, "bytes": after, "recovery": result.recovery, "kl": result.kl, "top1": result.top1,
            "layers": " ".join(ranks), "seconds": seconds, "decode_ms": decode_ms(engine),
            "source_decode_ms": source_decode_ms(checkpoint),
            "notes": "; ".join(n for r in records for n in r.result.notes)}


def decode_ms(engine, cached: int = 1024, steps: int = 32, repeats: int = 3) -> float:
    """Milliseconds per greedy decode step of one sequence with `cached` tokens already in the cache (the
    model's own forward, past its trained context where that is shorter: this times the arithmetic)."""
    from kiln.runtime.model_runner import decode_one_token, prefill
    from tests.runtime.contiguous_kv_cache import ContiguousKVCache

    model = engine.model
    tokens = torch.randint(0, model.spec.vocab_size, (1, cached), generator=torch.Generator().manual_seed(0))
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            cache = ContiguousKVCache(model.stream_shapes(), 1, cached + steps)
            logits = prefill(model, tokens, torch.arange(cached).expand(1, -1), cache)
            token = logits[:, -1:].argmax(-1)
            start = time.perf_counter()
            for t in range(steps):
                token = decode_one_token(model, token, torch.full((1, 1), cached + t), cache).argmax(-1, keepdim=True)
            best = min(best, (time.perf_counter() - start) / steps * 1e3)
    return best


@functools.cache
def source_decode_ms(checkpoint: Path) -> float:
    """decode_ms of the source model, once per checkpoint."""
    return decode_ms(engine_from_graph(load_checkpoint(checkpoint)))


def step_ms(engine, batch: int, prompt: int, new: int, repeats: int = 3) -> float:
    """Milliseconds per scheduler decode step: `batch` random prompts of `prompt` tokens, `new` greedy tokens."""
    from kiln.runtime.request import SamplingParams
    from kiln.runtime.scheduler import Scheduler

    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(3, engine.spec.vocab_size, (batch, prompt), generator=gen).tolist()
    best = float("inf")
    for _ in range(repeats):
        scheduler = Scheduler(engine, max_num_seqs=batch, max_num_batched_tokens=1 << 16, prefix_caching=False,
                              num_blocks=engine.kv_cache_blocks)
        for ids in prompts:
            scheduler.add_request(ids, SamplingParams(max_tokens=new, stop_ids=()))
        scheduler.step()  # prefill
        start, steps = time.perf_counter(), 0
        while scheduler.has_work():
            scheduler.step()
            steps += 1
        best = min(best, (time.perf_counter() - start) / steps * 1e3)
    return best


def decode_rows(pairs: list[tuple[Path, Path]], batches: list[int], cached: int, new: int = 32) -> list[str]:
    """The --decode table: GQA source against its MLA conversion, eager and compiled, per batch."""
    from kiln import runtime

    lines = [("| model | cached tokens | batch | source eager ms | MLA eager ms | ratio | source compiled ms | "
             "MLA compiled ms | ratio |"), "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for source, mla in pairs:
        engines = {}
        for key, path in (("source", source), ("mla", mla)):
            engines[key, "eager"] = runtime.load(path)
            engines[key, "compiled"] = runtime.load(path)
            engines[key, "compiled"].compile_decode()
        prompt = min(cached, engines["source", "eager"].spec.max_position_embeddings - new)
        for batch in batches:
            ms = {k: step_ms(e, batch, prompt, new) for k, e in engines.items()}
            line = (f"| {source.name} vs {mla.name} | {prompt}-{prompt + new} | {batch} | "
                    f"{ms['source', 'eager']:.2f} | {ms['mla', 'eager']:.2f} | "
                    f"{ms['mla', 'eager'] / ms['source', 'eager']:.2f}x | {ms['source', 'compiled']:.2f} | "
                    f"{ms['mla', 'compiled']:.2f} | {ms['mla', 'compiled'] / ms['source', 'compiled']:.2f}x |")
            print(line, flush=True)
            lines.append(line)
    return lines


def meta_8b_rows(fractions: list[float]) -> list[str]:
    """Bytes per token and concurrency of a Llama-3.1-8B-shaped model converted uniformly (rotary key 64 dims,
    as DeepSeek-V3's) at each fraction: no weights, so no accuracy."""
    from kiln.kernels.targets import H200
    from kiln.optimizer.loader_config import build_spec
    from kiln.runtime.kv_budget import max_concurrent_sequences

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from streaming import LLAMA_8B

    spec = build_spec(LLAMA_8B)
    a = spec.layers[0].attention
    source = 2 * a.num_kv_heads * a.head_dim * 2 * len(spec.layers)  # BF16 K and V
    weights = 16 * 10**9
    header = ("| fraction | latent rank + rotary | KV bytes/token (BF16) | fp8 latent | H200 seqs @32K, BF16 | "
              "H200 seqs @32K, fp8 |")
    source_row = (f"| 1 (source GQA) | - | {source} | {source // 2} | "
                  f"{max_concurrent_sequences(H200, weights, source, 32768)} | "
                  f"{max_concurrent_sequences(H200, weights, source // 2, 32768)} |")
    lines = [header, "|---:|---|---:|---:|---:|---:|", source_row]
    for f in fractions:
        values = int(f * 2 * a.num_kv_heads * a.head_dim)
        per_token = values * 2 * len(spec.layers)
        lines.append(f"| {f} | {values - 64}+64 | {per_token} | {per_token // 2} | "
                     f"{max_concurrent_sequences(H200, weights, per_token, 32768)} | "
                     f"{max_concurrent_sequences(H200, weights, per_token // 2, 32768)} |")
    return lines


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        label = f"{r['model']}: {'healed' if r['heal'] else 'training-free'}{', fp8 latent' if r['fp8'] else ''}"
        series.setdefault(label, []).append((r["bytes"] / r["source_bytes"], r["recovery"]))
    for label, points in series.items():
        points.sort()
        ax.plot(*zip(*points, strict=True), marker="o", label=label)
    anchor = sorted(PCA_ANCHOR.items())
    ax.plot([f for f, _ in anchor], [r for _, r in anchor], "k--", marker="x",
            label="stories260K: joint K|V PCA, RoPE kept (not absorbable; issue #11)")
    ax.set_xlabel("KV bytes per token / source's (BF16 cache)")
    ax.set_ylabel("recovery (ppl source / ppl)")
    ax.set_title("MLA conversion: KV cache against recovery")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paragraphs", type=int, default=200)
    parser.add_argument("--fractions", default="0.75,0.5,0.25")
    parser.add_argument("--heal-steps", type=int, default=MlaConversion.heal_steps)
    parser.add_argument("--smollm2", type=Path, default=None, help="a SmolLM2 HF checkpoint (to_hf.py) for its rows")
    parser.add_argument("--smollm2-only", action="store_true", help="skip the stories260K rows")
    parser.add_argument("--smollm2-rope-dims", default="64,128", help="rotary key widths of the SmolLM2 rows")
    parser.add_argument("--smollm2-heal-steps", type=int, default=0,
                        help="healing steps of 512 tokens for the SmolLM2 rows (0: training-free)")
    parser.add_argument("--decode", action="append", default=[], metavar="SOURCE_ART,MLA_ART",
                        help="time decode of these two artifacts instead (repeatable)")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--cached", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=ROOT / "artifacts" / "mla")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.decode:
        torch.set_num_threads(1)
        pairs = [tuple(Path(p) for p in pair.split(",")) for pair in args.decode]
        lines = decode_rows(pairs, [int(b) for b in args.batches.split(",")], args.cached)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "mla_decode.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        print(f"wrote {args.out / 'mla_decode.md'}")
        return
    fractions = [float(f) for f in args.fractions.split(",")]
    rows = []
    if args.smollm2_only and not args.smollm2:
        parser.error("--smollm2-only needs --smollm2 DIR")
    for fraction in [] if args.smollm2_only else fractions:
        for heal in (0, args.heal_steps):
            rows.append(run(STORIES, fraction, heal, False, args.paragraphs))
            print(rows[-1], flush=True)
    if not args.smollm2_only:
        rows.append(run(STORIES, 0.5, args.heal_steps, True, args.paragraphs))  # x0.25 with fp8 latents
        print(rows[-1], flush=True)
    if args.smollm2:  # the pass's default healing (600 x 2048 tokens) is over its heal_budget for 135M on CPU
        heal = {"heal_batch_tokens": 512, "heal_budget": 1e15}
        for fraction in fractions:
            for rope_dim in (int(d) for d in args.smollm2_rope_dims.split(",")):
                rows.append(run(args.smollm2, fraction, args.smollm2_heal_steps, False, args.paragraphs,
                                rope_dim=rope_dim, sensitivity_paragraphs=SMOLLM2_PROBE_PARAGRAPHS,
                                **(heal if args.smollm2_heal_steps else {})))
                print(rows[-1], flush=True)
    header = ("| model | budget | healing | cache | KV bytes/token | x source | recovery | KL | top-1 | layers "
              "(rotary+latent) | pass s | decode ms @1024 (source) |")
    lines = [header, "|---|---:|---:|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['fraction']} | {r['heal']} | {'fp8' if r['fp8'] else 'bf16'} | {r['bytes']} | "
                     f"{r['bytes'] / r['source_bytes']:.3f} | {r['recovery']:.4f} | {r['kl']:.4f} | {r['top1']:.4f} | "
                     f"{r['layers']} | {r['seconds']:.0f} | {r['decode_ms']:.2f} ({r['source_decode_ms']:.2f}) |")
    lines += ["", "Training-free PCA anchor (stories260K, issue #11): "
              + ", ".join(f"x{f}: {r}" for f, r in PCA_ANCHOR.items()), "",
              "Llama-3.1-8B-shaped (meta device: bytes and concurrency only; 16 GB of BF16 weights):", "",
              *meta_8b_rows(fractions)]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mla.md").write_text("\n".join(lines) + "\n")
    plot(rows, args.out / "mla.png")
    print("\n".join(lines))
    print(f"wrote {args.out / 'mla.md'} and {args.out / 'mla.png'}")


if __name__ == "__main__":
    main()
