"""A deliberately destructive pass for gate tests: it scrambles linear weights, and its back-offs
scramble fewer of them, yet never few enough to pass a sane floor."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from kiln.passes.base import Pass, PassContext, PassResult
from kiln.passes.graph import ModelGraph


@dataclass(frozen=True)
class Scramble(Pass):
    noise: float = 1.0  # relative noise added to every selected weight
    layers: int = 99  # how many layers (from the first) are scrambled
    name: ClassVar[str] = "scramble"
    default_floor: ClassVar[float] = 0.95

    def apply(self, graph: ModelGraph, ctx: PassContext) -> PassResult:
        result = PassResult(self.name)
        gen = torch.Generator().manual_seed(0)
        for lin in graph.iter_linears(("q", "k", "v", "o", "gate", "up", "down")):
            if lin.layer >= self.layers:
                result.skipped[lin.name] = "beyond the layers this config scrambles"
                continue
            w = graph.weight(lin)
            graph.tensors[lin.weight_name] = w + self.noise * w.std() * torch.randn(w.shape, generator=gen)
            result.changed[lin.name] = f"noise {self.noise}"
        return result

    def back_offs(self, graph: ModelGraph, result: PassResult) -> Iterator[Pass]:
        yield replace(self, noise=self.noise / 2)
        yield replace(self, noise=self.noise / 2, layers=1)


@dataclass(frozen=True)
class Stall(Pass):
    """Touches a marker file, then waits: a fixed point at which a test interrupts a running build."""

    marker: str = ""
    seconds: float = 120.0
    name: ClassVar[str] = "stall"

    def apply(self, graph: ModelGraph, ctx: PassContext) -> PassResult:
        import pathlib
        import time

        pathlib.Path(self.marker).touch()
        time.sleep(self.seconds)
        return PassResult(self.name)
