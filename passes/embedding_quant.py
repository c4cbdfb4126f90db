"""Quantize the embedding table, and so a tied lm_head, which reads the same stored tensor.

A tied embedding is often most of a small model's bytes (Gemma 3 270M: 168M of 268M parameters, a 262,144-token
vocabulary) and a large share of an 8B one's (128K x 4096). Rows are quantized independently, so the table is
stored once in a format both readers take: the lookup reads a token's row of it, and the tied lm_head multiplies
by the whole table as a weight-only linear of that format.

    format   "fp8"   E4M3 with one fp32 scale per row (per output channel of the head)
             "nvfp4" E2M1 in blocks of 16 along the hidden size, E4M3 block scales, one fp32 table scale
             "mxfp4" E2M1 in blocks of 32, E8M0 block scales
    method   "rtn" (round to nearest) or "mse" (each block's scale searched for the least squared error)

No calibration data is read: the table's rows are the values themselves (no activation multiplies them on the way
in), so the pass is data-free. The graph's embedding becomes the dequantized table in fp32 (the exact stored
values), which everything after it reads: calibration, the gate, a draft head. The stored tensors are
`graph.embedding_quant`; lowering writes them under the embedding's name with a format entry
(optimizer/lower.py), and the runtime dequantizes them once at load on the CPU (runtime/model_weights.py).

Reports: the table's bytes before (as stored in the source) and after, and what reads it (the tied head); the
gate after the pass measures the KL it adds through the runtime. Skipped, with the reason: an embedding an
earlier pass already quantized. Exports refuse a quantized embedding (no serving layout stores one):
optimizer/export/__init__.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kiln.calibration.quantize import quantize_weight
from kiln.kernels.errors import KilnError, check_choice
from kiln.kernels.nvfp4 import nvfp4_global_scale
from kiln.kernels.registry import parse_weight_format
from kiln.kernels.registry import weight_format as format_object
from kiln.passes.base import Pass, PassContext, PassResult
from kiln.passes.graph import ModelGraph, QuantizedWeight

EMBEDDING_FORMATS = ("fp8", "nvfp4", "mxfp4")
EMBEDDING_METHODS = ("rtn", "mse")
ROWS_PER_CHUNK = 16384  # rows quantized at once: an 8B model's 128K x 4096 table in 8 pieces of 256 MB (fp32)


def quantize_rows(w: torch.Tensor, fmt: str, method: str, rows_per_chunk: int = ROWS_PER_CHUNK) -> QuantizedWeight:
    """The stored tensors of a [rows, hidden] table, quantized row-wise in chunks of `rows_per_chunk` (one NVFP4
    table scale from the whole table's amax first), so the fp32 working copies are a chunk's, not the table's.
    Equal to quantizing the table at once: every scale but NVFP4's table scale belongs to one row."""
    stored = parse_weight_format(fmt, EMBEDDING_FORMATS)
    codec = format_object(stored)
    global_scale = None
    if codec.takes_global_scale:
        amax = max((w[i: i + rows_per_chunk].abs().amax().float() for i in range(0, w.shape[0], rows_per_chunk)),
                   key=float)
        global_scale = nvfp4_global_scale(amax.reshape(1))
    parts: dict[str, list[torch.Tensor]] = {}
    for start in range(0, w.shape[0], rows_per_chunk):
        chunk = w[start: start + rows_per_chunk].float()
        for key, t in quantize_weight(chunk, fmt, "per_channel", method=method, global_scale=global_scale).items():
            parts.setdefault(key, []).append(t)
    tensors = {}
    for key, pieces in parts.items():
        if pieces[0].ndim == 0 or pieces[0].shape[0] != min(rows_per_chunk, w.shape[0]):  # a table-wide scale
            tensors[key] = pieces[0]
        else:
            tensors[key] = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    return QuantizedWeight(stored, tensors, in_features=w.shape[1] if codec.blocked else None, method=method)


@dataclass(frozen=True)
class EmbeddingQuantization(Pass):
    """Store the embedding table (and so a tied lm_head) in FP8, NVFP4 or MXFP4, weight-only.

    Fields:
        format  "fp8" (a scale per row), "nvfp4" or "mxfp4"
        method  "rtn" or "mse" (scale search per row / block)
    """

    format: str = "fp8"
    method: str = "mse"

    name: ClassVar[str] = "embedding-quant"
    # the same floors as weight-only quantization of the linears in that format (passes/weight_quant.py)
    default_floor: ClassVar[float] = 0.97
    default_max_kl: ClassVar[float] = 0.05
    default_min_top1: ClassVar[float] = 0.89
    exclusive: ClassVar[str | None] = "embedding's format"  # embedding-fp8,embedding-nvfp4: one would silently win

    def __post_init__(self):
        check_choice("format", self.format, EMBEDDING_FORMATS)
        check_choice("method", self.method, EMBEDDING_METHODS)

    def apply(self, graph: ModelGraph, ctx: PassContext) -> PassResult:
        result = PassResult(self.name)
        name = graph.embedding
        module = name.removesuffix(".weight")
        if module == name:
            raise KilnError(f"embedding-quant: the embedding tensor {name!r} is not a module's .weight")
        if graph.embedding_quant is not None:
            result.skipped[module] = f"already stored {graph.embedding_quant.format} by an earlier pass"
            return result
        source = graph.tensors[name]
        q = quantize_rows(source, self.format, self.method)
        graph.tensors[name] = q.dequantize().reshape(source.shape)  # fp32: q * s is not in general a bf16 number
        graph.embedding_quant = q
        head = graph.linears.get(graph.spec.lm_head.name)
        tied = head is not None and head.tied_to == name and head.quant is None
        before, bf16 = source.numel() * source.element_size(), source.numel() * 2
        after = q.stored_bytes()
        readers = "the lookup and the tied lm_head" if tied else "the lookup"
        result.changed[module] = (f"{q.format} ({self.method}), read by {readers}: {after:,} bytes against "
                                  f"{bf16:,} in BF16 (saves {bf16 - after:,}, {1 - after / bf16:.1%}) and {before:,} "
                                  f"as the source stores it")
        result.metrics[f"{module}.bytes_source"] = float(before)
        result.metrics[f"{module}.bytes_bf16"] = float(bf16)
        result.metrics[f"{module}.bytes"] = float(after)
        if head is not None and head.tied_to == name and head.quant is not None:
            result.notes.append(f"the lm_head was stored {head.quant.format} on its own by an earlier pass: it "
                                "does not read the quantized table")
        elif not tied:
            result.notes.append("the lm_head is not tied to the embedding: only the token lookup reads this table")
        return result
