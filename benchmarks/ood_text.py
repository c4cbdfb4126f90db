"""An out-of-domain evaluation text for a model: its own samples at temperature 0.8 from prompts in styles the
calibration text (TinyStories) does not have.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ood_text.py CHECKPOINT OUT.txt [--paragraphs 96] [--tokens 96]

Why samples: a text the model never saw in calibration, that is still its own language (so its perplexity is
far from the vocabulary size and the gate does not refuse it as foreign), and that exists for any model with
no download. The prompts open news, science, code, letters, recipes, law, dialogue, history...; each is
continued with a fixed seed through Kiln's runtime on the source checkpoint (fp32), so the file is the same
on every run. Paragraphs are written prompt + continuation, separated by blank lines (the gate's format).
The precision benchmark (benchmarks/precision.py --ood-data) scores every recipe on it beside evaluation.txt.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPTS = (
    "Breaking news: the city council voted on Tuesday to",
    "The mitochondria is the part of the cell that",
    "def parse_config(path):\n    \"\"\"Read the configuration file and",
    "Dear Mr. Thompson,\n\nI am writing to inform you that",
    "Preheat the oven to 180 degrees. In a large bowl, combine",
    "In 1848, a wave of revolutions spread across Europe, and",
    "The defendant argued that the contract was void because",
    "Q: What is the difference between a virus and a bacterium?\nA:",
    "To install the package, first make sure that",
    "The stock market fell sharply this morning after",
    "Photosynthesis converts light energy into chemical energy by",
    "Step 3: Remove the four screws holding the back panel, then",
    "The committee's annual report shows that spending on",
    "In mathematics, a prime number is",
    "The quarterly earnings call began with the CEO explaining",
    "Chapter 12. The theory of supply and demand predicts that",
    "Patients who experience these symptoms should",
    "The new smartphone features a larger battery and",
    "According to the survey, most voters believe that",
    "SELECT name, email FROM users WHERE",
    "The treaty, signed in Vienna, established",
    "Abstract. We propose a method for",
    "Thank you for contacting customer support. Your ticket",
    "The volcano erupted at dawn, sending ash",
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--paragraphs", type=int, default=96, help="paragraphs to write (prompts cycle, seeds differ)")
    ap.add_argument("--tokens", type=int, default=96, help="new tokens per paragraph (at most)")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch

    from kiln.optimizer.loader import load_checkpoint
    from kiln.optimizer.measure.gate import engine_from_graph
    from kiln.runtime.engine import load_tokenizer

    torch.set_num_threads(1)
    graph = load_checkpoint(args.checkpoint)
    tokenizer = load_tokenizer(graph.source.path)
    engine = engine_from_graph(graph, tokenizer)
    limit = graph.spec.max_position_embeddings
    paragraphs = []
    for start in range(0, args.paragraphs, len(PROMPTS)):
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(start, min(start + len(PROMPTS), args.paragraphs))]
        ids = [tokenizer(p)["input_ids"] for p in prompts]
        new = max(1, min(args.tokens, limit - max(len(i) for i in ids)))
        out = engine.generate_ids(ids, new, temperature=args.temperature, seed=args.seed + start,
                                  stop_ids=graph.spec.eos_token_ids)
        for prompt_ids, (tokens, _) in zip(ids, out, strict=True):
            text = tokenizer.decode(list(prompt_ids) + tokens, skip_special_tokens=True).strip()
            # one paragraph each: blank lines inside a sample would split it
            paragraphs.append("\n".join(line for line in text.splitlines() if line.strip()))
        print(f"{len(paragraphs)}/{args.paragraphs} paragraphs", file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
    print(f"wrote {args.out}: {len(paragraphs)} paragraphs")


if __name__ == "__main__":
    main()
