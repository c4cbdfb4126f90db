"""How stable greedy decoding with FP8 rounding at run time (W8A8, an FP8 KV cache) is against a last-bit change
upstream of the rounding, inside Kiln alone.

    python benchmarks/w8a8_greedy_fragility.py ARTIFACT [--data TEXT]

Decodes the first 16 tokens of 16 evaluation paragraphs greedily for 64 tokens, twice: as shipped, and with the
dynamic per-token FP8 activation quantizer computing x * (1/scale) instead of x / scale, a last-bit change (an
engine that multiplies by the reciprocal, or sums its GEMMs in another order, makes such changes).
It prints how many continuations stay identical, where the others part, and at each parting the margin by
which the shipped engine's whole-prefix forward prefers its own token over the changed run's (log-probability
difference, nats). That is the baseline for reading another engine's greedy tokens on such an export
(benchmarks/vllm_check.py): a parting whose margin is within what a last-bit change produces here is of the
same kind.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from kiln import runtime
from kiln.calibration.data import load_token_lists, token_cap
from kiln.kernels import fp8

EVALUATION_TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinystories" / "evaluation.txt"


def prompts_of(engine, data: Path) -> list[list[int]]:
    tokens = load_token_lists(engine.require_tokenizer(), data, 200, token_cap(engine.spec.max_position_embeddings))
    return [t[:16] for t in tokens if len(t) >= 16][:16]


def greedy(engine, prompts: list[list[int]]) -> list[list[int]]:
    return [out for out, _ in engine.generate_ids(prompts, 64, repetition_penalty=1.0)]


def reciprocal_per_token(x):
    scale = fp8._safe_scale(x.abs().amax(dim=-1, keepdim=True))
    return fp8._cast_e4m3(x.float() * (1.0 / scale)).float() * scale


def margin(engine, prefix: list[int], ours: int, theirs: int) -> float:
    """log p(ours) - log p(theirs) after `prefix`, from the engine's whole-prefix forward."""
    logp = torch.log_softmax(engine.logits([prefix])[0][-1].float(), -1)
    return float(logp[ours] - logp[theirs])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--data", type=Path, default=EVALUATION_TEXT)
    opts = parser.parse_args()
    engine = runtime.load(opts.artifact)
    prompts = prompts_of(engine, opts.data)
    shipped = greedy(engine, prompts)
    quantizer = fp8.fp8_fake_quantize_per_token
    fp8.fp8_fake_quantize_per_token = reciprocal_per_token  # read at load: the engine below uses it
    try:
        changed = greedy(runtime.load(opts.artifact), prompts)
    finally:
        fp8.fp8_fake_quantize_per_token = quantizer
    partings = []
    for i, (prompt, x, y) in enumerate(zip(prompts, shipped, changed, strict=True)):
        at = next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), None)
        if at is not None:
            partings.append((i, at, margin(engine, prompt + x[:at], x[at], y[at])))
    print("| prompts | identical | first differing token of the others |\n|---|---|---|")
    print(f"| {len(shipped)} | {len(shipped) - len(partings)} | {', '.join(str(at) for _, at, _ in partings)} |")
    if partings:
        print("\n| prompt | parts at token | shipped margin for its token, nats |\n|---|---|---|")
        for i, at, m in partings:
            print(f"| {i} | {at} | {m:.3f} |")
        values = [m for _, _, m in partings]
        print(f"\nmargins: {min(values):.3f} to {max(values):.3f} nats, median {statistics.median(values):.3f}")


if __name__ == "__main__":
    main()
