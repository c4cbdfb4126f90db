"""Engine artifact of an MLA-converted, quantized model -> a DeepSeek-V3-layout ModelOpt unified checkpoint
("hf-modelopt" on a converted model): optimizer/export/deepseek.py's layout, with every quantized linear kept in
its stored format under ModelOpt's names and algorithms (optimizer/export/modelopt.py).

    DIR/model.safetensors     DeepSeek-V3 names; quantized linears as <module>.weight / .weight_scale /
                              .weight_scale_2 / .input_scale, every other tensor fp32
    DIR/hf_quant_config.json  as optimizer/export/modelopt.py writes it
    DIR/config.json           export_deepseek's DeepSeek-V3 config plus "quantization_config"

The layout moves and pads rows of q, kv_a and kv_b and multiplies q, kv_a, kv_b and o_proj by one factor each
(export_deepseek.deepseek_layouts). On stored quantized tensors this is exact:
  - rows are gathered with their codes and per-row block scales; an inserted row is all zero codes;
  - a linear's factor goes into its own scale (FP8 weight_scale, per tensor or per channel; NVFP4
    weight_scale_2; an MXFP4 power of two into its E8M0 exponents, any other factor a one-line refusal), and
    o_proj's calibrated input_scale takes the factor on its input;
  - kv_b's padded latent columns are zero codes.

After writing, the export is dequantized as a serving engine reads it (dequantize_hf_modelopt) and must equal
the artifact's weights in the same layout (up to the rounding of a folded scale, rtol 1e-6). When no linear
quantizes its activations (transformers has no FP8/FP4 activation path), transformers' DeepseekV3ForCausalLM on
those dequantized weights must also give the runtime's logits within 1e-4.
A quantized KV cache is refused, as in export_modelopt.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from kiln.kernels.errors import KilnError
from kiln.kernels.registry import weight_format
from kiln.optimizer.export.deepseek import (
    RowLayout,
    check_expressible,
    check_logits,
    deepseek_config,
    deepseek_layouts,
    deepseek_tensors,
    relayout_dense,
    relayout_others,
)
from kiln.optimizer.export.modelopt import (
    dequantize_hf_modelopt,
    export_tensors,
    hf_quant_config,
    write_modelopt_files,
)
from kiln.optimizer.export.unfuse import unfuse_artifact
from kiln.optimizer.output_dir import atomic_directory, check_output
from kiln.passes.fuse import unfuse_spec
from kiln.runtime.artifact import WEIGHTS, read_manifest
from kiln.runtime.spec import ModelSpec, spec_from_json
from kiln.runtime.weights import stored_weight

SCALE_RTOL = 1e-6  # a factor folded into a stored scale rounds once: code * (scale * f) vs (code * scale) * f


def _gather_rows(t: torch.Tensor, layout: RowLayout, fill: float) -> torch.Tensor:
    raw = t.view(torch.uint8) if t.dtype.itemsize == 1 else t  # byte formats (fp8, codes) gathered as bytes
    out = raw[layout.rows.clamp(min=0)].clone()
    out[layout.rows < 0] = fill
    return out.view(t.dtype)


def _pad_columns(t: torch.Tensor, width: int, fill: int) -> torch.Tensor:
    raw = t.view(torch.uint8)
    pad = raw.new_full((raw.shape[0], width - raw.shape[1]), fill)
    return torch.cat([raw, pad], dim=1).view(t.dtype)


def relayout_stored(name: str, fmt: str, stored: dict[str, torch.Tensor], layout: RowLayout
                    ) -> dict[str, torch.Tensor]:
    """`name`'s stored tensors (its format's names) in the export's layout, exactly (module docstring)."""
    out = dict(stored)
    codec = weight_format(fmt)
    if "hf-modelopt" not in codec.export_names:
        raise KilnError(f"{name}: format {fmt} is not mapped onto the DeepSeek-V3 layout")
    if not codec.blocked:  # FP8: a scale per tensor or per output channel
        out["weight"] = _pad_columns(_gather_rows(stored["weight"], layout, 0), layout.in_features, 0)
        scale = stored["weight_scale"]
        out["weight_scale"] = (_gather_rows(scale, layout, 1.0) if scale.numel() > 1 else scale) * layout.factor
        return out
    block = codec.grid_block_size(layout.in_features)
    padded = -(-layout.in_features // block) * block
    if codec.takes_global_scale:  # NVFP4: the factor goes into the global scale; an empty block scale is E4M3 zero
        empty_scale = 0
        out["weight_scale_2"] = stored["weight_scale_2"] * layout.factor
    else:  # MXFP4: E8M0 block scales (an empty one is 1.0) take the factor as an exponent shift
        empty_scale = 127
        exponent = torch.tensor(layout.factor, dtype=torch.float64).log2()
        if exponent != exponent.round():
            raise KilnError(f"{name}: MXFP4 scales are powers of two and cannot take the DeepSeek-V3 layout's "
                            f"factor {layout.factor:.6g} exactly; export with --format hf")
        shifted = stored["weight_scale"].int() + int(exponent)
        if int(shifted.min()) < 0 or int(shifted.max()) > 254:
            raise KilnError(f"{name}: its MXFP4 exponents overflow when scaled by {layout.factor:g}")
        out["weight_scale"] = shifted.to(torch.uint8)
    # K grows to layout.in_features (kv_b's padded latent): zero codes, past the stored codes' own zero padding
    out["weight"] = _pad_columns(_gather_rows(out["weight"], layout, 0), padded // 2, 0)
    out["weight_scale"] = _pad_columns(_gather_rows(out["weight_scale"], layout, empty_scale), padded // block,
                                       empty_scale)
    return out


def deepseek_modelopt_tensors(spec: ModelSpec, manifest: dict, tensors: dict[str, torch.Tensor]
                              ) -> dict[str, torch.Tensor]:
    """Every tensor of the export: quantized linears as stored, in the layout; the rest fp32."""
    layouts, norms = deepseek_layouts(spec)
    linears: dict[str, torch.Tensor] = {}
    for lin in spec.linears():
        if lin.name == "lm_head" and spec.lm_head_tied(tensors):
            continue
        entry = manifest["formats"].get(lin.name, {"format": "dense"})
        fmt, stored, _ = stored_weight(lin.name, entry, tensors, (lin.out_features, lin.in_features))
        row_layout = layouts.get(lin.name)
        if not weight_format(fmt).dequantizes:
            weight = stored["weight"].float()
            linears[f"{lin.name}.weight"] = relayout_dense(weight, row_layout) if row_layout else weight
            continue
        if row_layout is not None:
            stored = relayout_stored(lin.name, fmt, stored, row_layout)
        linears.update({f"{lin.name}.{k}": v for k, v in stored.items()})
        if f"{lin.name}.input_scale" in tensors:  # a calibrated activation scale takes the input's factor
            factor = row_layout.input_factor if row_layout is not None else 1.0
            linears[f"{lin.name}.input_scale"] = tensors[f"{lin.name}.input_scale"] * factor
    return export_tensors(manifest, relayout_others(spec, tensors, linears, norms))


def export_deepseek_modelopt(artifact: Path | str, output: Path | str, overwrite: bool = False) -> Path:
    """Write an MLA-converted artifact as a DeepSeek-V3 ModelOpt unified checkpoint in `output` (atomically),
    verified (module docstring)."""
    artifact, output = Path(artifact), Path(output)
    manifest = read_manifest(artifact)
    check_output(output, overwrite, [artifact])
    spec = unfuse_spec(spec_from_json(manifest["architecture"]))
    check_expressible(spec)
    manifest, tensors = unfuse_artifact(manifest, load_file(str(artifact / WEIGHTS)))
    formats = manifest["formats"]
    # refuses formats ModelOpt has no algorithm for, and a quantized KV cache
    hf_quant = hf_quant_config(manifest, tensors, spec.embedding.removesuffix(".weight"),
                               [lin.name for lin in spec.linears()])
    exported = deepseek_modelopt_tensors(spec, manifest, tensors)
    config = deepseek_config(spec, json.loads((artifact / "config.json").read_text()))
    reference = deepseek_tensors(spec, tensors, formats)
    weight_only = all(entry.get("activation", "none") == "none" for entry in formats.values())
    with atomic_directory(output, overwrite, [artifact]) as tmp:
        write_modelopt_files(tmp, artifact, exported, hf_quant, config)
        verify_deepseek_modelopt(tmp, artifact, reference, weight_only)
    return output


def dequantized_model(export: Path, linears: dict[str, torch.Tensor] | None = None):
    """transformers' DeepseekV3ForCausalLM holding the export's weights as a serving engine dequantizes them
    (`linears`: dequantize_hf_modelopt(export), when the caller has it already)."""
    from transformers import (  # lazy: transformers takes seconds to import
        AutoModelForCausalLM,
        DeepseekV3Config,
    )

    config = json.loads((export / "config.json").read_text())
    config.pop("quantization_config", None)
    model = AutoModelForCausalLM.from_config(DeepseekV3Config(**config), dtype=torch.float32).eval()
    state = {k: v.float() for k, v in load_file(str(export / "model.safetensors")).items()}
    linears = dequantize_hf_modelopt(export) if linears is None else linears
    state.update({f"{name}.weight": w for name, w in linears.items()})
    expected = model.state_dict().keys()
    model.load_state_dict({k: v for k, v in state.items() if k in expected}, strict=False)
    missing = [k for k in expected if k not in state and not (k == "lm_head.weight" and config["tie_word_embeddings"])]
    if missing:
        raise KilnError(f"export check failed: the export has no {missing[0]}")
    model.tie_weights()
    return model


def verify_deepseek_modelopt(export: Path, artifact: Path, reference: dict[str, torch.Tensor],
                             weight_only: bool) -> None:
    linears = dequantize_hf_modelopt(export)
    for name, weight in linears.items():
        expected = reference.get(f"{name}.weight")
        if expected is None:  # a tied lm_head: the embedding
            continue
        if weight.shape != expected.shape or not torch.allclose(weight, expected, rtol=SCALE_RTOL, atol=0):
            raise KilnError(f"export check failed: {name} dequantizes differently from the artifact's weight in "
                            "the DeepSeek-V3 layout")
    if weight_only:
        check_logits(dequantized_model(export, linears), artifact, "the dequantized export")
