"""Tiny random MoE checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3) that `optimize build` can calibrate.

    python examples/tiny_moe.py OUT_DIR [--fp8-block]  # writes OUT_DIR/<model_type>/ for each
    optimize build OUT_DIR/deepseek_v3 --target blackwell --recipe production -o artifacts/tiny-dsv3

The weights are random (structure only: their accuracy figures mean nothing). Each checkpoint carries the
stories260K tokenizer when ../shared is present (else the generated default's), with the vocabulary sized to
it, so the default calibration and evaluation text tokenize for it.

--fp8-block also writes OUT_DIR/deepseek_v3_fp8/: the tiny DeepSeek-V3 laid out as DeepSeek's official FP8
release (`write_fp8_block_deepseek`): every attention and MLP linear (dense, shared and routed experts) as
float8_e4m3fn with a float32 `weight_scale_inv` per 16x16 block (DeepSeek uses 128x128; the tiny dims need
smaller blocks to have several, and kv_a_proj_with_mqa's 24 rows end in a partial one), the routers, norms,
embedding and lm_head in bfloat16, and quantization_config {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [16, 16]}. `optimize build` reads it back as its
dequantized weights (optimizer/prequantized.py).

OUT_DIR/deepseek_v3 carries one multi-token-prediction layer (`add_mtp_layer`, random like the rest), which
the runtime drafts with: `optimize generate ART PROMPT --speculative`.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kiln.optimizer.defaults import generated_checkpoint, shared_dir
from tests.tiny_models import TINY_CONFIGS, make_tiny_checkpoint

MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")
FP8_BLOCK = (16, 16)


def add_mtp_layer(path: Path, seed: int = 1) -> Path:
    """Give the DeepSeek-V3 checkpoint at `path` one multi-token-prediction layer, laid out as DeepSeek's
    official checkpoint stores it (transformers drops MTP weights when it saves): `num_nextn_predict_layers: 1`
    and, as layer N (N = num_hidden_layers), a decoder layer shaped like layer N-1 (random), enorm, hnorm,
    eh_proj [hidden, 2 hidden], shared_head.norm and shared_head.head, and its copy of the embedding."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((path / "config.json").read_text())
    n, hidden = config["num_hidden_layers"], config["hidden_size"]
    tensors = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    last, new = f"model.layers.{n - 1}.", f"model.layers.{n}."
    for name in [t for t in tensors if t.startswith(last)]:
        like = tensors[name]
        value = (torch.ones_like(like) if name.endswith("norm.weight") or "layernorm" in name
                 else torch.randn(like.shape, generator=gen, dtype=torch.float32).to(like.dtype) * float(like.float().std()))
        tensors[new + name[len(last):]] = value
    ones = torch.ones(hidden, dtype=tensors["model.norm.weight"].dtype)
    tensors.update({f"{new}enorm.weight": ones.clone(), f"{new}hnorm.weight": ones.clone(),
                    f"{new}shared_head.norm.weight": ones.clone(),
                    f"{new}eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=gen) * (2 * hidden) ** -0.5,
                    f"{new}shared_head.head.weight": tensors["lm_head.weight"].clone(),
                    f"{new}embed_tokens.weight": tensors["model.embed_tokens.weight"].clone()})
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def is_fp8_linear(name: str) -> bool:
    """Whether DeepSeek-V3's official FP8 checkpoint stores tensor `name` in FP8: the 2-D weights of the
    attention projections and of the MLPs (dense, shared and routed experts), not the router (`mlp.gate`), the
    norms, the embedding or lm_head."""
    module = name.removesuffix(".weight")
    return (name.endswith(".weight") and (".self_attn." in module or ".mlp." in module)
            and not module.endswith((".mlp.gate", "layernorm")))


def write_fp8_block_deepseek(path: Path, block_size: tuple[int, int] = FP8_BLOCK, seed: int = 0,
                             overrides: dict | None = None) -> Path:
    """Write the tiny DeepSeek-V3 (tests.tiny_models) to `path` as an FP8 block-scaled checkpoint (see the
    module docstring); return `path`. block_size: [rows, columns] of each scale block."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    from kiln.kernels.fp8 import fp8_quantize_blocks

    make_tiny_checkpoint("deepseek_v3", path, seed, overrides)
    tensors = load_file(str(path / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if is_fp8_linear(name) and t.ndim == 2:
            out[name], out[name.removesuffix(".weight") + ".weight_scale_inv"] = fp8_quantize_blocks(t, block_size)
        else:  # DeepSeek keeps its router bias in float32, the rest in bfloat16
            out[name] = t.float() if name.endswith("e_score_correction_bias") else t.to(torch.bfloat16)
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    for key in ("torch_dtype", "dtype"):
        if key in config:
            config[key] = "bfloat16"
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": list(block_size)}
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


def main(out: Path, fp8_block: bool = False) -> None:
    import json

    shared = shared_dir()
    source = shared / "models" / "stories260K" if shared else generated_checkpoint()
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    todo = [(model_type, model_type) for model_type in MOE_TYPES]
    if fp8_block:
        todo.append(("deepseek_v3", "deepseek_v3_fp8"))
    for model_type, name in todo:
        path = out / name
        if name == "deepseek_v3_fp8":
            write_fp8_block_deepseek(path, overrides={"vocab_size": vocab})
        else:
            make_tiny_checkpoint(model_type, path, overrides={"vocab_size": vocab})
            if model_type == "deepseek_v3":
                add_mtp_layer(path)  # speculative decoding drafts with it
        for file in TOKENIZER_FILES:
            if (source / file).is_file():
                shutil.copy(source / file, path / file)
        fp8_note = f", FP8 {FP8_BLOCK[0]}x{FP8_BLOCK[1]} blocks" if name == "deepseek_v3_fp8" else ""
        print(f"{path}  ({model_type}, {TINY_CONFIGS[model_type].get('num_hidden_layers')} layers{fp8_note}, "
              f"tokenizer of {source.name})")


if __name__ == "__main__":
    args = sys.argv[1:]
    flags = [a for a in args if a.startswith("-")]
    paths = [a for a in args if not a.startswith("-")]
    if len(paths) != 1 or set(flags) - {"--fp8-block"}:
        sys.exit(__doc__.splitlines()[2].strip())
    main(Path(paths[0]), fp8_block="--fp8-block" in flags)
