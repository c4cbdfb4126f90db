"""Engine artifact of an MLA-converted model -> a DeepSeek-V3-layout Hugging Face checkpoint ("hf"), which
transformers' DeepseekV3ForCausalLM loads with the runtime's logits (verified on every export).

vLLM's and SGLang's DeepSeek code paths rotate interleaved pairs, derive the frequencies from rope_theta (with
YaRN when scaled) rather than LongRoPE factors, and build the latent norm with the config's epsilon. So a
conversion whose rotary frequencies are theta-regular (every layer the same standard theta^(-2j/w), each once:
`layout: deepseek` of passes/mla.py) is written for them: rope_type default with the source's theta, the
rotary rows interleaved (`rope_interleave` true). Which engines' MLA kernels take the exported latent + rotary
width: `serving_engines` (MLA_KERNELS, read from vLLM 0.32's backends), written in the export's README.md and
shown by `optimize inspect`. vLLM's run of such an export: benchmarks/results/vllm.md.

    DIR/model.safetensors   unquantized weights (fp32; quantized linears dequantized), DeepSeek-V3 names
    DIR/config.json         model_type deepseek_v3: kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim,
                            first_k_dense_replace = every layer (dense MLPs), rope_interleave false
    DIR/tokenizer files, generation_config.json

DeepSeek-V3's config holds one latent rank, one rotary width and one set of rotary frequencies for every
layer, where the conversion chose them per layer. The export makes them uniform without changing what the
model computes:
  - latents are zero-padded to the largest rank; the latent norm's weight is scaled by sqrt(r / r_max), which
    undoes the padding's effect on the RMS, and kv_a by α with α² = 1e-6 r_max / (r eps), which turns
    transformers' fixed 1e-6 epsilon of that norm into the model's own; α also scales the rotary key, so kv_b
    takes α and q 1/α (the scores are unchanged), and o_proj 1/α (V grew by α): exact, and one factor per
    linear, which a quantized export folds into the linear's own scale (optimizer/export/deepseek_modelopt.py);
  - rotary slots: each frequency gets as many slots as the layer that uses it most; a layer's rotary dims go
    to slots of their own frequency, the rest of its query and key slots are zero;
  - the frequencies, in the order of the slots, are written as LongRoPE factors (`short_factor` =
    `long_factor`, factor 1: no attention scaling), the one standard RoPE type that takes any frequencies;
    theta-regular ones (`standard_theta`) as plain rope_theta, interleaved (what vLLM reads);
  - DeepSeek's softmax scale is (nope + rope width)^-1/2; each layer's own scale is folded into its query.
After writing, transformers loads the export and its logits must equal Kiln's runtime within 1e-4
(`verify_deepseek_export`).
A layer left as GQA, an MoE MLP, biases or an interleaved / scaled rotary have no place in this layout: the
export refuses them with one line.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import load_file, save_file

from kiln import runtime
from kiln.kernels.errors import KilnError
from kiln.optimizer.export.modelopt import copy_tokenizer_files
from kiln.optimizer.export.notes import stamp, write_readme
from kiln.optimizer.export.unfuse import unfuse_artifact
from kiln.optimizer.output_dir import atomic_directory, check_output, mark_export
from kiln.passes.fuse import unfuse_spec
from kiln.runtime.artifact import WEIGHTS, read_manifest
from kiln.runtime.spec import ModelSpec, spec_from_json
from kiln.runtime.weights import dequantize_weight

VERIFY_TOLERANCE = 1e-4
HF_LATENT_EPS = 1e-6  # transformers builds DeepseekV3's kv_a_layernorm with its default epsilon, not the config's


def check_expressible(spec: ModelSpec) -> None:
    """Refuse, with one line, a model DeepSeek-V3's layout cannot express."""
    first = spec.layers[0]
    for layer in spec.layers:
        a = layer.attention
        where = f"layer {layer.index}"
        if (a.num_heads, layer.mlp.intermediate_size) != (first.attention.num_heads, first.mlp.intermediate_size):
            raise KilnError(f"{where}: its head count or MLP width differs from layer 0's (one config for all layers)")
        if a.kind != "mla":
            raise KilnError(f"{where} is {a.kind.upper()} attention: a mixed GQA/MLA model has no DeepSeek-V3 layout "
                            "(convert every layer, or serve the artifact with Kiln's runtime)")
        if a.q_lora_rank is not None or layer.mlp.kind != "dense":
            raise KilnError(f"{where}: only MLA-converted models export (a low-rank query or MoE MLP is a source "
                            "DeepSeek model: use its own checkpoint)")
        if a.rotary.interleaved or a.rotary.attention_scaling != 1.0:
            raise KilnError(f"{where}: its rotary is interleaved or scaled, which the export does not map")
        if any(lin.bias for lin in a.linears.values()) or any(lin.bias for lin in layer.mlp.linears.values()):
            raise KilnError(f"{where} has biases, which DeepSeek-V3's layout does not")
        if a.qk_nope_head_dim != spec.layers[0].attention.qk_nope_head_dim or \
                a.v_head_dim != spec.layers[0].attention.v_head_dim:
            raise KilnError(f"{where}: head dims differ between layers")


def check_unquantized_numerics(manifest: dict) -> None:
    """The export is unquantized: weight-only formats dequantize exactly, but activation quantization and a
    quantized KV cache would change what the model computes, so such an artifact is refused up front."""
    for module, entry in manifest["formats"].items():
        if entry.get("activation", "none") != "none":
            raise KilnError(f"{module} quantizes its activations ({entry['activation']}), which an unquantized "
                            "DeepSeek-V3 export cannot express: export an artifact with weight-only formats")
    quantized = [layer for layer, entry in (manifest.get("kv_cache") or {}).items()
                 if entry.get("format", "bf16") != "bf16"]
    if quantized:
        raise KilnError(f"layer {quantized[0]}'s KV cache is {manifest['kv_cache'][quantized[0]]['format']}, which an "
                        "unquantized DeepSeek-V3 export cannot express: export an artifact with a BF16 cache")


# latent + rotary width (kv_lora_rank + qk_rope_head_dim) -> the engines whose MLA kernels take it, from
# vLLM 0.32's backends' get_supported_head_sizes: cpu_mla/amx_mla [576]; flashattn_mla [576]; cutlass_mla
# asserts latent 512 + rotary 64; MLACommonBackend (FlashMLA, FlashInfer MLA) declares [320, 512, 576];
# triton_mla and rocm_aiter_mla [] (any).
MLA_KERNELS: dict[int, tuple[str, ...]] = {
    576: ("vLLM CPU (cpu_mla, amx_mla)", "vLLM FlashAttn MLA", "vLLM CUTLASS MLA (512 + 64 only)",
          "vLLM FlashMLA", "vLLM FlashInfer MLA"),
    512: ("vLLM FlashMLA", "vLLM FlashInfer MLA"),
    320: ("vLLM FlashMLA", "vLLM FlashInfer MLA"),
}
MLA_ANY_SIZE = ("vLLM Triton MLA", "vLLM ROCm AITER MLA")


def serving_engines(latent: int, rope: int) -> str:
    """One line: which serving engines' MLA kernels take a cache of `latent` + `rope` values a token."""
    takes = [*MLA_KERNELS.get(latent + rope, ()), *MLA_ANY_SIZE]
    if latent + rope == 576 and (latent, rope) != (512, 64):
        takes.remove("vLLM CUTLASS MLA (512 + 64 only)")
    return (f"latent {latent} + rotary {rope} = {latent + rope}: taken by " + ", ".join(takes)
            + ("" if latent + rope in MLA_KERNELS else " only (vLLM's CPU build takes 576 only)"))


def standard_theta(spec: ModelSpec) -> float | None:
    """The rope_theta whose standard frequencies theta^(-2j/w) every layer's rotary key has, each once, in
    order (what serving engines derive from the config); None when the frequencies are any other set."""
    freqs = {layer.attention.rotary.inv_freq for layer in spec.layers}
    if len(freqs) != 1:
        return None
    (inv,) = freqs
    width = 2 * len(inv)
    if len(inv) < 2 or inv[0] != 1.0 or any(layer.attention.rotary.attention_scaling != 1.0 for layer in spec.layers):
        return None
    theta = float(round(inv[1] ** (-width / 2)))
    expected = 1.0 / (theta ** (torch.arange(0, width, 2, dtype=torch.int64).float() / width))
    got = torch.tensor(inv, dtype=torch.float64)
    return theta if torch.allclose(expected.double(), got, rtol=1e-6, atol=0) else None


def rotary_slots(spec: ModelSpec) -> list[float]:
    """The export's rotary frequencies, one per slot: each frequency as often as the layer using it most."""
    need: Counter = Counter()
    for layer in spec.layers:
        for freq, count in Counter(layer.attention.rotary.inv_freq).items():
            need[freq] = max(need[freq], count)
    return sorted(need.elements(), reverse=True)


def _slot_map(layer_freqs: tuple[float, ...], slots: list[float]) -> list[int]:
    taken: set[int] = set()
    out = []
    for freq in layer_freqs:
        slot = next(i for i, f in enumerate(slots) if f == freq and i not in taken)
        taken.add(slot)
        out.append(slot)
    return out


class RowLayout(NamedTuple):
    """Where one linear's rows go in the export: `rows[i]` is the source row of export row i (-1: a zero row);
    `factor` multiplies the whole weight, `input_factor` its input (so an activation scale takes it too);
    `in_features` is the export's K (extra columns are zero)."""

    rows: torch.Tensor  # long [N']
    factor: float
    in_features: int
    input_factor: float = 1.0


def deepseek_layouts(spec: ModelSpec) -> tuple[dict[str, RowLayout], dict[str, float]]:
    """How each MLA layer's q, kv_a, kv_b and o_proj map onto the uniform layout (module docstring), and the
    factor on each latent norm's weight. Every factor covers a whole linear, so a quantized weight takes it
    exactly in its own per-tensor scale."""
    slots = rotary_slots(spec)
    f_all, rank = len(slots), max(layer.attention.kv_lora_rank for layer in spec.layers)
    interleave = standard_theta(spec) is not None
    layouts: dict[str, RowLayout] = {}
    norms: dict[str, float] = {}
    for layer in spec.layers:
        a = layer.attention
        H, nope, f, r = a.num_heads, a.qk_nope_head_dim, a.qk_rope_head_dim // 2, a.kv_lora_rank
        place = torch.tensor(_slot_map(a.rotary.inv_freq, slots), dtype=torch.long)
        # our [first halves, second halves] -> their slots: [first, second] halves, or interleaved pairs
        rope_index = torch.cat([2 * place, 2 * place + 1] if interleave else [place, place + f_all])
        q, kv_a, kv_b, o = (a.linears[k] for k in ("q", "kv_a", "kv_b", "o"))
        # α on kv_a makes transformers' fixed-epsilon latent norm compute the model's (it also scales the
        # rotary key); α on kv_b and 1/α on q restore the scores, 1/α on o_proj the output
        alpha = (HF_LATENT_EPS * rank / (r * spec.rms_norm_eps)) ** 0.5
        head = torch.full((nope + 2 * f_all,), -1, dtype=torch.long)
        head[:nope] = torch.arange(nope)
        head[nope + rope_index] = nope + torch.arange(2 * f)
        rows = torch.cat([torch.where(head >= 0, head + h * (nope + 2 * f), -1) for h in range(H)])
        q_scale = a.softmax_scale / (nope + 2 * f_all) ** -0.5  # DeepSeek's softmax scale, folded into q
        layouts[q.name] = RowLayout(rows, q_scale / alpha, q.in_features)
        rows = torch.full((rank + 2 * f_all,), -1, dtype=torch.long)
        rows[:r] = torch.arange(r)
        rows[rank + rope_index] = r + torch.arange(2 * f)
        layouts[kv_a.name] = RowLayout(rows, alpha, kv_a.in_features)
        layouts[kv_b.name] = RowLayout(torch.arange(kv_b.out_features), alpha, rank)
        layouts[o.name] = RowLayout(torch.arange(o.out_features), 1 / alpha, o.in_features, input_factor=alpha)
        norms[f"{layer.prefix}.self_attn.kv_a_layernorm.weight"] = (r / rank) ** 0.5
    return layouts, norms


def relayout_dense(weight: torch.Tensor, layout: RowLayout) -> torch.Tensor:
    """A dense [N, K] weight in the export's layout."""
    out = weight[layout.rows.clamp(min=0)] * layout.factor
    out[layout.rows < 0] = 0
    return torch.cat([out, out.new_zeros(len(out), layout.in_features - out.shape[1])], dim=1)


def deepseek_tensors(spec: ModelSpec, tensors: dict[str, torch.Tensor], formats: dict) -> dict[str, torch.Tensor]:
    """The artifact's weights, dequantized, in DeepSeek-V3's uniform layout (fp32)."""
    layouts, norms = deepseek_layouts(spec)
    linears = {f"{name}.weight": relayout_dense(w, layouts[name]) if name in layouts else w
               for name, w in _dense_linears(spec, tensors, formats).items()}
    return relayout_others(spec, tensors, linears, norms)


def _dense_linears(spec: ModelSpec, tensors: dict[str, torch.Tensor], formats: dict) -> dict[str, torch.Tensor]:
    out = {}
    for lin in spec.linears():
        if lin.name == "lm_head" and spec.lm_head_tied(tensors):
            continue
        entry = formats.get(lin.name, {"format": "dense"})
        if entry.get("input_rotation"):
            raise KilnError(f"{lin.name}: its input is rotated online (Hadamard block {entry['input_rotation']}), "
                            "which an unquantized export does not undo; export a recipe without rotation")
        out[lin.name] = dequantize_weight(lin.name, entry, tensors, (lin.out_features, lin.in_features))
    return out


def relayout_others(spec: ModelSpec, tensors: dict[str, torch.Tensor], linears: dict[str, torch.Tensor],
                    norms: dict[str, float]) -> dict[str, torch.Tensor]:
    """The export's tensor dict: `linears` (every linear's tensors by their names, already in the export's
    layout), then every other tensor of the model (fp32), latent norms padded to the uniform rank."""
    rank = max(layer.attention.kv_lora_rank for layer in spec.layers)
    out = dict(linears)
    for name in spec.tensor_names():
        if name not in out and name in tensors:
            out[name] = tensors[name].float()
    for norm, factor in norms.items():
        out[norm] = torch.cat([out[norm] * factor, out[norm].new_ones(rank - len(out[norm]))])
    return {k: v.contiguous() for k, v in out.items()}


def longrope_factors(freqs: list[float], theta: float, width: int) -> list[float]:
    """LongRoPE factors with which transformers' float32 arithmetic, 1 / (factor * theta ** (2j / width)),
    gives exactly `freqs` as float32: from the float64 solution, nudged an ulp at a time where rounding
    differs (positions up to 128K turn by freq x position, so one ulp there is a visible phase)."""
    shape = torch.arange(0, width, 2, dtype=torch.int64).float() / width
    powers = theta ** shape  # float32, as transformers computes it
    target = torch.tensor(freqs, dtype=torch.float32)
    factors = (1.0 / (torch.tensor(freqs, dtype=torch.float64) * powers.double())).float()
    for _ in range(8):
        got = 1.0 / (factors * powers)
        if torch.equal(got, target):
            break
        # a larger factor gives a smaller frequency
        factors = torch.where(got > target, torch.nextafter(factors, torch.tensor(float("inf"))),
                              torch.where(got < target, torch.nextafter(factors, torch.tensor(0.0)), factors))
    return [float(x) for x in factors]


def deepseek_config(spec: ModelSpec, source: dict) -> dict:
    """config.json of the export: DeepSeek-V3 with every layer dense, non-interleaved LongRoPE frequencies."""
    first = spec.layers[0]
    a, mlp = first.attention, first.mlp
    slots = rotary_slots(spec)
    width = 2 * len(slots)
    standard = standard_theta(spec)
    theta = 10000.0
    factors = longrope_factors(slots, theta, width) if standard is None else None
    rope = ({"rope_parameters": {"rope_type": "default", "rope_theta": standard}, "rope_interleave": True}
            if standard is not None else
            {"rope_interleave": False,
             "rope_parameters": {"rope_type": "longrope", "rope_theta": theta, "factor": 1.0,
                                 "short_factor": factors, "long_factor": factors,
                                 "original_max_position_embeddings": spec.max_position_embeddings}})
    keep = {k: source[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in source}
    return {
        **keep,
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
        "intermediate_size": mlp.intermediate_size, "moe_intermediate_size": mlp.intermediate_size,
        "num_hidden_layers": len(spec.layers), "num_attention_heads": a.num_heads,
        "num_key_value_heads": a.num_heads, "first_k_dense_replace": len(spec.layers),
        "n_routed_experts": 1, "num_experts_per_tok": 1, "n_shared_experts": 0, "n_group": 1, "topk_group": 1,
        "q_lora_rank": None, "kv_lora_rank": max(layer.attention.kv_lora_rank for layer in spec.layers),
        "qk_rope_head_dim": width, "qk_nope_head_dim": a.qk_nope_head_dim, "v_head_dim": a.v_head_dim,
        "hidden_act": "silu", "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.rms_norm_eps, "tie_word_embeddings": spec.tie_word_embeddings,
        "attention_bias": False, **rope,
        "torch_dtype": "float32",
    }


def export_deepseek(artifact: Path | str, output: Path | str, overwrite: bool = False) -> Path:
    """Write an MLA-converted artifact as a DeepSeek-V3 HF checkpoint in `output` (atomically), verified."""
    artifact, output = Path(artifact), Path(output)
    manifest = read_manifest(artifact)
    check_output(output, overwrite, [artifact])
    spec = unfuse_spec(spec_from_json(manifest["architecture"]))  # fused linears are written as their parts
    check_expressible(spec)
    check_unquantized_numerics(manifest)
    manifest, tensors = unfuse_artifact(manifest, load_file(str(artifact / WEIGHTS)))
    exported = deepseek_tensors(spec, tensors, manifest["formats"])
    config = deepseek_config(spec, json.loads((artifact / "config.json").read_text()))
    with atomic_directory(output, overwrite, [artifact]) as tmp:
        mark_export(tmp, artifact, "hf")
        write_readme(tmp, "hf", artifact)
        with (tmp / "README.md").open("a") as readme:
            readme.write(f"\nMLA kernels: {serving_engines(config['kv_lora_rank'], config['qk_rope_head_dim'])}"
                         + ("" if config["rope_interleave"] else "; its rotary is LongRoPE, which vLLM's and "
                            "SGLang's DeepSeek code does not read (convert with `layout: deepseek`)") + ".\n")
        save_file(exported, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(stamp(config), indent=2) + "\n")
        copy_tokenizer_files(artifact, tmp)
        verify_deepseek_export(tmp, artifact)
    return output


def export_logit_difference(export: Path | str, artifact: Path | str, token_lists: list[list[int]]) -> float:
    """Largest |logit| difference between transformers' DeepseekV3ForCausalLM on the export and Kiln's runtime on
    the artifact, over `token_lists`."""
    from transformers import (
        AutoModelForCausalLM,  # lazy: transformers takes seconds to import; only checks use it
    )

    return logit_difference(AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32).eval(), artifact,
                            token_lists)


def logit_difference(model, artifact: Path | str, token_lists: list[list[int]], relative: bool = False) -> float:
    """Largest |logit| difference between a transformers `model` and Kiln's runtime on `artifact`; `relative`:
    each sequence's divided by its largest |logit| (at least 1), since fp32 rounding grows with the logits."""
    engine = runtime.load(artifact)
    worst = 0.0
    with torch.no_grad():
        for tokens in token_lists:
            ref = model(torch.tensor([tokens])).logits[0]
            ours = engine.logits([tokens])[0]
            scale = max(1.0, float(ref.abs().max())) if relative else 1.0
            worst = max(worst, float((ref - ours).abs().max()) / scale)
    return worst


def verify_deepseek_export(export: Path, artifact: Path) -> None:
    from transformers import (
        AutoModelForCausalLM,  # lazy: transformers takes seconds to import; only checks use it
    )

    check_logits(AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32).eval(), artifact, "the export")


def check_logits(model, artifact: Path, what: str) -> None:
    """transformers' `model` must give the artifact's logits on two random sequences, within VERIFY_TOLERANCE of
    their largest magnitude (the two multiply in different fp32 orders: oneDNN's or MKL's, by the CPU)."""
    spec = spec_from_json(read_manifest(artifact)["architecture"])
    gen = torch.Generator().manual_seed(0)
    length = min(24, spec.max_position_embeddings)
    tokens = [torch.randint(0, spec.vocab_size, (length,), generator=gen).tolist() for _ in range(2)]
    diff = logit_difference(model, artifact, tokens, relative=True)
    if not diff <= VERIFY_TOLERANCE:
        raise KilnError(f"export check failed: transformers' logits on {what} differ from the artifact's by "
                        f"{diff:.3g} of their largest magnitude (> {VERIFY_TOLERANCE})")
