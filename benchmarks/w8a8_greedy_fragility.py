"""How stable W8A8 greedy decoding is against a last-bit change in the activation quantizer, inside Kiln alone.

    python benchmarks/w8a8_greedy_fragility.py ARTIFACT [--data TEXT]

Decodes the first 16 tokens of 16 evaluation paragraphs greedily for 64 tokens, twice: as shipped, and with the
dynamic per-token FP8 quantizer computing x * (1/scale) instead of x / scale. It prints how many continuations
stay identical and where the others part: the baseline for reading another engine's greedy tokens on a W8A8
export (benchmarks/vllm_check.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kiln import runtime
from kiln.calibration.data import load_token_lists, token_cap
from kiln.kernels import fp8

EVALUATION_TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinystories" / "evaluation.txt"


def greedy(artifact: Path, data: Path) -> list[list[int]]:
    engine = runtime.load(artifact)
    tokens = load_token_lists(engine.require_tokenizer(), data, 200, token_cap(engine.spec.max_position_embeddings))
    prompts = [t[:16] for t in tokens if len(t) >= 16][:16]
    return [out for out, _ in engine.generate_ids(prompts, 64, repetition_penalty=1.0)]


def reciprocal_per_token(x):
    scale = fp8._safe_scale(x.abs().amax(dim=-1, keepdim=True))
    return fp8._cast_e4m3(x.float() * (1.0 / scale)).float() * scale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--data", type=Path, default=EVALUATION_TEXT)
    opts = parser.parse_args()
    shipped = greedy(opts.artifact, opts.data)
    fp8.fp8_fake_quantize_per_token = reciprocal_per_token  # read at load: the engine below uses it
    changed = greedy(opts.artifact, opts.data)
    parts = [next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(shipped, changed)]
    print("| prompts | identical | first differing token of the others |\n|---|---|---|")
    print(f"| {len(shipped)} | {sum(p is None for p in parts)} | {', '.join(str(p) for p in parts if p is not None)} |")


if __name__ == "__main__":
    main()
