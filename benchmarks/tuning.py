"""Does end-to-end tuning generalise? In-domain and out-of-domain KL against the number of tuning steps.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/tuning.py [--checkpoint DIR] [--recipes nvfp4-w4a16,fp8,auto]
        [--steps 0,50,100,200,400] [--ood-data FILE] [--paragraphs 600] [--weight-bits 5.0]

For each recipe and step count, the recipe is built exactly as `optimize build --recipe R` builds it, with
its `tune_steps` replaced, then scored through Kiln's runtime against the fp32 source on evaluation.txt
(in-domain, first --paragraphs) and on the out-of-domain text (benchmarks/ood_text.py writes one: the
model's own samples from prompts in styles TinyStories lacks). Rows print as they finish; the table goes to
stdout as Markdown. Round-to-nearest (method rtn, no AWQ, no tuning) is the reference row of each recipe.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kiln.optimizer.defaults import CALIBRATION_TEXT, EVALUATION_TEXT, STORIES260K


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, default=STORIES260K)
    ap.add_argument("--recipes", default="nvfp4-w4a16")
    ap.add_argument("--steps", default="0,50,100,200,400")
    ap.add_argument("--ood-data", type=Path, required=True)
    ap.add_argument("--paragraphs", type=int, default=600)
    ap.add_argument("--target", default="blackwell")
    ap.add_argument("--weight-bits", type=float, default=5.0, help="the budget of the auto recipe")
    args = ap.parse_args()

    import torch

    from kiln.calibration.data import load_token_lists
    from kiln.optimizer.build import build
    from kiln.optimizer.loader import load_checkpoint
    from kiln.optimizer.measure.gate import AccuracyGate, engine_from_graph
    from kiln.optimizer.recipes import BUDGET_RECIPES, Recipe, resolve_recipe
    from kiln.runtime.engine import load_tokenizer

    torch.set_num_threads(1)
    source = load_checkpoint(args.checkpoint)
    tokenizer = load_tokenizer(source.source.path)
    base = engine_from_graph(source)
    gates = {"in-domain": AccuracyGate(base, load_token_lists(tokenizer, EVALUATION_TEXT, args.paragraphs)),
             "ood": AccuracyGate(base, load_token_lists(tokenizer, args.ood_data, None))}
    rows = []
    print("| recipe | calibration | in-domain recovery | in-domain KL | OOD recovery | OOD KL | build s |")
    print("|---|---|---|---|---|---|---|")
    for name in args.recipes.split(","):
        passes = resolve_recipe(name, args.weight_bits if name in BUDGET_RECIPES else None).passes

        def rtn(p):
            fields = {f.name for f in dataclasses.fields(p)}
            return dataclasses.replace(p, **{k: v for k, v in (("method", "rtn"), ("awq", False), ("tune_steps", 0))
                                             if k in fields})

        variants = [("rtn", tuple(rtn(p) for p in passes))]
        variants += [(f"{passes[0].method} + {s} steps", tuple(dataclasses.replace(p, tune_steps=s) for p in passes))
                     for s in (int(x) for x in args.steps.split(","))]
        for label, variant in variants:
            start = time.perf_counter()
            result = build(args.checkpoint, args.target, Recipe(f"{name} {label}", variant), None, gate=False,
                           calib_data=CALIBRATION_TEXT)
            seconds = time.perf_counter() - start
            candidate = engine_from_graph(result.graph)
            scores = {k: g.compare(candidate, 0.0) for k, g in gates.items()}
            i, o = scores["in-domain"], scores["ood"]
            rows.append((name, label, i, o, seconds))
            print(f"| {name} | {label} | {i.recovery:.4f} | {i.kl:.5f} | {o.recovery:.4f} | {o.kl:.5f} | "
                  f"{seconds:.0f} |", flush=True)


if __name__ == "__main__":
    main()
