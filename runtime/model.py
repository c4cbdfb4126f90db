"""The model the runtime executes: plain torch, fp32 on CPU, one small module per block.

    model = Transformer(spec, tensors, manifest["formats"]).eval().place(device, dtype)
    logits = model(tokens, positions, cache)                      # [B, T] -> [B, T, V]

Shapes: B batch, T new tokens, S cached tokens, C hidden, H heads, Hkv KV heads, D head dim.
A block is attention (runtime.attention: GQA or MLA) and an MLP (runtime.mlp: dense or MoE) between RMSNorms;
every linear is a `QuantLinear` holding the dequantized fp32 weight and the activation fake-quantizer its
format asks for, or a `PackedLinear` over the stored bytes (runtime.linear), resolved by `Weights`
(runtime.model_weights). A fused linear (`qkv`, `gate_up`: passes/fuse.py) is one F.linear whose output is
split; the runtime's dequantized path fuses an unfused artifact's siblings so at load (Weights.siblings).
The kernel fusions a layer's spec lists (norm + activation quantization, SwiGLU + quantization, RoPE +
KV-cache write) are for GPU kernels; here they run one operation after another, which is what they compute.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from kiln.runtime.attention import GqaAttention, LayerRotaries, MlaAttention
from kiln.runtime.mlp import DenseMlp, MoeMlp
from kiln.runtime.model_weights import RMSNorm, Weights
from kiln.runtime.spec import LayerSpec, ModelSpec


class Block(nn.Module):
    """Pre-norm residual block; with output norms (Gemma's sandwich), each sublayer's output is normed before
    its residual add."""

    def __init__(self, attention: nn.Module, mlp: nn.Module, input_norm: RMSNorm, post_norm: RMSNorm,
                 output_norms: tuple[RMSNorm, RMSNorm] | None = None):
        super().__init__()
        self.attention, self.mlp = attention, mlp
        self.input_norm, self.post_norm = input_norm, post_norm
        self.attention_out_norm, self.mlp_out_norm = output_norms if output_norms is not None else (None, None)

    def forward(self, x, rope, positions, cache, layer):
        if self.attention_out_norm is None:
            x = x + self.attention(self.input_norm(x), rope, positions, cache, layer)
            return x + self.mlp(self.post_norm(x))
        x = x + self.attention_out_norm(self.attention(self.input_norm(x), rope, positions, cache, layer))
        return x + self.mlp_out_norm(self.mlp(self.post_norm(x)))


def build_block(layer: LayerSpec, weights: Weights) -> Block:
    """One decoder layer as its spec says (a model may mix GQA and MLA layers, dense and MoE MLPs)."""
    a = layer.attention
    attention = MlaAttention(a, weights, layer.prefix) if a.kind == "mla" else GqaAttention(a, weights, layer.prefix)
    if layer.mlp.kind == "dense":
        mlp = DenseMlp(layer.mlp.linears, weights, activation=layer.mlp.activation)
    else:
        mlp = MoeMlp(layer.mlp, weights)
    output_norms = tuple(weights.norm(name) for name in layer.output_norms) or None
    return Block(attention, mlp, weights.norm(layer.norms[0]), weights.norm(layer.norms[1]), output_norms)


def place(module: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Move `module` to `device`, its floating parameters (embedding, norms, dequantized weights, biases) to the
    compute `dtype`; buffers (packed weight bytes and their scales, rotary frequencies) keep their dtypes.
    Parameters that share storage (an lm_head tied to the embedding) still share one copy after."""
    moved: dict[tuple, torch.Tensor] = {}  # by storage: one copy of what several parameters view
    replaced: dict[int, nn.Parameter] = {}  # by parameter: a module shared by two owners is replaced once
    for owner in module.modules():
        for name, param in owner.named_parameters(recurse=False):
            if id(param) not in replaced:
                replaced[id(param)] = param
                if param.is_floating_point() and (param.device != device or param.dtype != dtype):
                    key = (param.data_ptr(), param.device, tuple(param.shape), param.stride(), param.dtype)
                    if key not in moved:
                        moved[key] = param.detach().to(device, dtype)
                    replaced[id(param)] = nn.Parameter(moved[key], requires_grad=False)
            setattr(owner, name, replaced[id(param)])
    return module.to(device)  # the buffers


def scale_embedding(rows: torch.Tensor, scale: float) -> torch.Tensor:
    """Embedding rows times `scale` (ModelSpec.embedding_scale) as an fp32 scalar cast to the rows' dtype, as
    transformers' Gemma3TextScaledWordEmbedding."""
    return rows if scale == 1.0 else rows * torch.tensor(scale, dtype=torch.float32).to(rows.dtype)


class Transformer(nn.Module):
    """The whole model. Built from the artifact's tensors and format table, or from a `Weights` the caller
    made (the calibrator passes one that records which module each linear became). `packed`: linears keep
    their stored bytes and run kiln.kernels.gpu (PackedLinear) where their format has a kernel. `fuse`: sibling
    linears (q/k/v, gate/up) become one product at load where they can (Weights.siblings); `fused_groups`
    counts them."""

    def __init__(self, spec: ModelSpec, tensors: Mapping[str, torch.Tensor] | None = None,
                 formats: Mapping[str, Mapping] | None = None, *, weights: Weights | None = None,
                 packed: bool = False, fuse: bool = False):
        super().__init__()
        self.spec = spec
        weights = weights if weights is not None else Weights(tensors, formats, spec, packed, fuse)
        self.embed = nn.Parameter(weights.embedding(), requires_grad=False)
        self.rotary = LayerRotaries(spec.layers)
        self.blocks = nn.ModuleList(build_block(layer, weights) for layer in spec.layers)
        self.norm = weights.norm(spec.final_norm)
        self.lm_head = weights.linear(spec.lm_head)
        self.fused_groups = weights.fused_groups

    def stream_shapes(self) -> list[tuple[tuple[int, int], ...]]:
        return [b.attention.stream_shapes() for b in self.blocks]

    def place(self, device: torch.device, dtype: torch.dtype) -> Transformer:
        """On `device`, computing in `dtype` (see `place`): fp32 on CPU is the reference."""
        return place(self, device, dtype)

    def features(self, tokens: torch.Tensor, positions: torch.Tensor, cache=None,
                 collect: tuple[int, ...] = ()):
        """tokens, positions: [B, T] -> the last layer's output before the final norm [B, T, C] (what an MTP
        layer or a draft head reads: transformers' hidden_states[-1] is after the norm). With `collect`, also
        the outputs of those layers concatenated ([B, T, len(collect) * C], an EAGLE-3 head's input)."""
        x = self.embed_tokens(tokens)
        ropes = self.rotary(positions)
        kept = {}
        for i, block in enumerate(self.blocks):
            x = block(x, ropes[i], positions, cache, i)
            if i in collect:
                kept[i] = x
        return (x, torch.cat([kept[i] for i in collect], dim=-1)) if collect else x

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] -> the first layer's input [B, T, C]: the embedding rows (times the spec's
        embedding_scale, in the embedding's dtype, as transformers' Gemma3TextScaledWordEmbedding)."""
        return scale_embedding(F.embedding(tokens, self.embed), self.spec.embedding_scale)

    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor, cache=None) -> torch.Tensor:
        # tokens, positions: [B, T] -> the final norm's output [B, T, C]
        return self.norm(self.features(tokens, positions, cache))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache=None) -> torch.Tensor:
        # tokens, positions: [B, T] -> logits [B, T, V]
        return self.lm_head(self.hidden(tokens, positions, cache))
