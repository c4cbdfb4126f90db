"""A fused artifact seen as the unfused one: the view the Hugging Face exports write.

`fuse` (passes/fuse.py) stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`. vLLM, SGLang and
TensorRT-LLM load the separate Hugging Face names (q_proj, k_proj, v_proj, gate_proj, up_proj) and fuse them
themselves, so the exports write the parts back: `unfuse_artifact(manifest, tensors)` splits every fused
linear's stored tensors by its parts' output rows (runtime.spec.LinearSpec.parts), restores their format entries
(an FP8 part that was per-tensor gets its one scale back) and the unfused architecture (no kernel fusions), and
checks that the parts dequantize, concatenated, to the fused weight bit for bit. An artifact without fused
linears comes back as it was.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kiln.kernels.errors import KilnError
from kiln.passes.fuse import SHARED_TENSORS, is_fused, split_stored, unfuse_spec
from kiln.runtime.spec import spec_from_json
from kiln.runtime.weights import dequantize_weight

STORED_KEYS = ("weight", "weight_scale", *SHARED_TENSORS)


def artifact_is_fused(manifest: Mapping) -> bool:
    return is_fused(spec_from_json(manifest["architecture"]))


def unfuse_artifact(manifest: dict, tensors: Mapping[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """(manifest, tensors) with every fused linear written back as its parts (see the module docstring)."""
    spec = spec_from_json(manifest["architecture"])
    if not is_fused(spec):
        return manifest, dict(tensors)
    out = dict(tensors)
    formats = {}
    fused = {lin.name: lin for lin in spec.linears() if lin.parts}
    for module, entry in manifest["formats"].items():
        lin = fused.get(module)
        if lin is None:
            formats[module] = entry
            continue
        rows = [part.out_features for part in lin.parts]
        stored = {key: out.pop(f"{module}.{key}") for key in STORED_KEYS if f"{module}.{key}" in out}
        pieces = split_stored(entry["format"], stored, rows, entry.get("part_scales", ()))
        bias = out.pop(f"{module}.bias", None)
        biases = bias.split(rows) if bias is not None else [None] * len(rows)
        for part, piece, part_bias in zip(lin.parts, pieces, biases, strict=True):
            out.update({f"{part.name}.{key}": value for key, value in piece.items()})
            if part.bias:
                out[f"{part.name}.bias"] = part_bias.clone()
            formats[part.name] = {**{k: v for k, v in entry.items() if k != "part_scales"}, "role": part.role}
        whole = dequantize_weight(module, entry, {f"{module}.{k}": v for k, v in stored.items()},
                                  (lin.out_features, lin.in_features))
        parts = torch.cat([dequantize_weight(p.name, formats[p.name], out, (p.out_features, p.in_features))
                           for p in lin.parts])
        if not torch.equal(whole, parts):
            raise KilnError(f"{module}: its parts do not dequantize to the fused weight; the artifact is malformed")
    tables = {"architecture": unfuse_spec(spec).to_json(), "formats": formats,
              "tensors": {name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                          for name, t in sorted(out.items())}}
    return {**manifest, **tables}, out
