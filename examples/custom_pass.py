"""A custom pass, run from Python and from a YAML recipe.

    python examples/custom_pass.py
    optimize build ../shared/models/stories260K --recipe examples/custom_recipe.yaml --allow-custom-passes \
        -o artifacts/custom
"""

from dataclasses import dataclass
from typing import ClassVar

import torch

from kiln.kernels.errors import KilnError
from kiln.passes.base import Pass, PassContext, PassResult
from kiln.passes.graph import ModelGraph


@dataclass(frozen=True)
class RoundNorms(Pass):
    """Round every norm weight to a narrower float (values only; storage stays the source dtype)."""

    dtype: str = "bfloat16"  # bfloat16 or float16
    name: ClassVar[str] = "round-norms"
    default_floor: ClassVar[float] = 0.99

    def __post_init__(self):
        if self.dtype not in ("bfloat16", "float16"):
            raise KilnError(f"dtype={self.dtype!r} is not allowed; choose bfloat16 or float16")

    def apply(self, graph: ModelGraph, ctx: PassContext) -> PassResult:
        result = PassResult(self.name)
        norms = [n for block in graph.blocks for n in block.norms] + [graph.final_norm]
        for name in norms:
            w = graph.tensors[name]
            rounded = w.to(getattr(torch, self.dtype)).to(w.dtype)
            if torch.equal(rounded, w):
                result.skipped[name] = f"already exact in {self.dtype}"
                continue
            graph.tensors[name] = rounded  # replace, never mutate in place: revert stays free
            result.changed[name] = f"rounded to {self.dtype}"
        return result


if __name__ == "__main__":
    from kiln.optimizer.build import build
    from kiln.optimizer.defaults import default_checkpoint, default_data
    from kiln.optimizer.recipes import Recipe
    from kiln.passes.weight_quant import WeightQuantization

    checkpoint, message = default_checkpoint()
    print(message)
    recipe = Recipe("custom-python", (RoundNorms(), WeightQuantization(format="fp8")))
    result = build(checkpoint, "hopper", recipe, None, eval_data=default_data("evaluation"), paragraphs=200)
    for record in result.records:
        g = record.gate
        print(f"{record.name:14s} {record.decision:10s} changed {len(record.result.changed):3d} "
              f"recovery {g.recovery:.4f} kl {g.kl:.5f} top1 {g.top1:.4f}")
