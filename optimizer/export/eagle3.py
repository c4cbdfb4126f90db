"""`optimize export ART --format eagle3`: an artifact's EAGLE-3 draft head as the draft checkpoint vLLM and
SGLang load beside the target (vLLM: speculative_config {"method": "eagle3", "model": DIR}), in the layout of
ModelOpt's speculative export (`modelopt.torch.export.export_speculative_decoding`):

    model.safetensors   fc.weight [C, 3C], layers.0.{input_layernorm, hidden_norm, post_attention_layernorm}.weight,
                        layers.0.self_attn.{q,k,v}_proj.weight [.., 2C], o_proj, layers.0.mlp.{gate,up,down}_proj,
                        norm.weight, lm_head.weight (the target's, the full vocabulary; or, with a draft
                        vocabulary, the head's own [D, C] with d2t [D] int64 and t2d [V] bool)
    config.json         LlamaForCausalLMEagle3, the layer's dims, draft_vocab_size (D, or vocab_size), the target's rope,
                        eagle_config (ModelOpt's, eagle_aux_hidden_state_layer_ids as ModelOpt counts them: the
                        output of layer i) and a top-level eagle_aux_hidden_state_layer_ids as vLLM counts them
                        (before layer j: i + 1)

The head's numerics are vLLM's: the attention reads [input_layernorm(embedding), hidden_norm(hidden)].
(ModelOpt's own EAGLE-3 module norms the hidden half twice, hidden_norm(input_layernorm(hidden)); a head
trained there and served by vLLM runs differently. Kiln trains and runs what vLLM serves.)

The target is exported separately (compressed-tensors or hf-modelopt); only an EAGLE-3 head (`draft-head`
with `architecture: eagle3`) has this layout: an MTP-shaped head or a DeepSeek MTP layer is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kiln.kernels.errors import KilnError
from kiln.kernels.registry import weight_format
from kiln.optimizer.export.notes import stamp, write_readme
from kiln.optimizer.output_dir import atomic_directory, check_output, mark_export
from kiln.runtime.artifact import WEIGHTS, read_manifest
from kiln.runtime.spec import ModelSpec, spec_from_json

ARCHITECTURE = "LlamaForCausalLMEagle3"


def eagle3_module(spec: ModelSpec):
    module = next((m for m in spec.extra_modules if m.kind == "eagle3"), None)
    if module is None:
        kinds = [m.kind for m in spec.extra_modules]
        raise KilnError("--format eagle3 exports an EAGLE-3 draft head, and this artifact has "
                        + (f"a {kinds[0]} module instead: build with a recipe file passing "
                           "`architecture: eagle3` to draft-head" if kinds else "no draft head: build with "
                           "draft-head (architecture: eagle3)"))
    return module


def _quantized(entry: dict) -> bool:
    return weight_format(entry.get("format", "dense")).dequantizes


def eagle3_tensors(spec: ModelSpec, tensors: dict[str, torch.Tensor], formats: dict) -> dict[str, torch.Tensor]:
    module = eagle3_module(spec)
    prefix = module.name + "."
    names = sorted(n for n in spec.tensor_names() if n.startswith(prefix))
    quantized = [n for n in names if _quantized(formats.get(n.rsplit(".", 1)[0], {}))]
    if quantized:
        raise KilnError(f"--format eagle3 writes the head unquantized; {quantized[0]} is quantized")
    out = {n[len(prefix):]: tensors[n].contiguous() for n in names}
    if module.draft_vocab:  # its own lm_head over the draft vocabulary, d2t (which vLLM reads), t2d beside it
        d2t = out["d2t"]
        t2d = torch.zeros(spec.vocab_size, dtype=torch.bool)
        t2d[torch.arange(d2t.numel()) + d2t] = True
        out["t2d"] = t2d
        return out
    head = spec.lm_head
    if _quantized(formats.get(head.name, {})):
        raise KilnError("--format eagle3 copies the target's lm_head into the draft, and it is quantized here")
    lm_head = tensors.get(f"{head.name}.weight")
    if lm_head is None:  # tied to the embedding
        lm_head = tensors[spec.embedding]
    out["lm_head.weight"] = lm_head.to(out["fc.weight"].dtype).contiguous()
    return out


def eagle3_config(spec: ModelSpec, source: dict, dtype: torch.dtype) -> dict:
    module = eagle3_module(spec)
    attention, mlp = module.layer.attention, module.layer.mlp
    aux = list(module.aux_layers)
    return {
        "architectures": [ARCHITECTURE], "model_type": "llama",
        "bos_token_id": spec.bos_token_id, "eos_token_id": list(spec.eos_token_ids) or None,
        "hidden_act": "silu", "hidden_size": spec.hidden_size,
        "intermediate_size": mlp.linears["gate"].out_features, "max_position_embeddings": spec.max_position_embeddings,
        "num_attention_heads": attention.num_heads, "num_key_value_heads": attention.num_kv_heads,
        "head_dim": attention.head_dim, "num_hidden_layers": 1, "rms_norm_eps": spec.rms_norm_eps,
        "vocab_size": spec.vocab_size,
        "draft_vocab_size": module.linears["lm_head"].out_features if module.draft_vocab else spec.vocab_size,
        "rope_theta": source.get("rope_theta", (source.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        "rope_scaling": source.get("rope_scaling"), "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."), "attention_bias": False, "attention_dropout": 0.0,
        "mlp_bias": False, "pretraining_tp": 1, "use_cache": True,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True,
                         "use_input_layernorm_in_first_layer": True, "use_last_layernorm": True,
                         "use_mtp_layernorm": False, "next_layer_regular": True, "parallel_draft_step": 1,
                         "parallel_draft_heads_num_layers": 1},
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in aux],  # vLLM: captured before layer j
    }


def export_eagle3(artifact: Path | str, output: Path | str, overwrite: bool = False) -> Path:
    artifact, output = Path(artifact), Path(output)
    manifest = read_manifest(artifact)
    check_output(output, overwrite, [artifact])
    spec = spec_from_json(manifest["architecture"])
    eagle3_module(spec)
    tensors = load_file(str(artifact / WEIGHTS))
    exported = eagle3_tensors(spec, tensors, manifest["formats"])
    source = json.loads((artifact / "config.json").read_text()) if (artifact / "config.json").is_file() else {}
    config = eagle3_config(spec, source, exported["fc.weight"].dtype)
    with atomic_directory(output, overwrite, [artifact]) as tmp:
        mark_export(tmp, artifact, "eagle3")
        write_readme(tmp, "eagle3", artifact)
        save_file(exported, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(stamp(config), indent=2) + "\n")
        back = load_file(str(tmp / "model.safetensors"))
        if set(back) != set(exported) or any(not torch.equal(back[n], exported[n]) for n in exported):
            raise KilnError("eagle3 export: the written tensors do not read back equal")
    return output
