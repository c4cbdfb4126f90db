"""MLP layers: a gated dense MLP (SwiGLU, GeGLU) and a mixture of experts with softmax or grouped routing.

    mlp = DenseMlp(layer.mlp.linears, weights, activation=layer.mlp.activation)   # or MoeMlp(layer.mlp, weights)
    out = mlp(x)                                                                 # [..., C] -> [..., C]
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from kiln.runtime.activations import GATE_ACTIVATIONS, sigmoid
from kiln.runtime.model_weights import Weights, fused_split
from kiln.runtime.spec import LinearSpec, MlpSpec


class DenseMlp(nn.Module):
    """A gated MLP: down(act(gate(x)) * up(x)), act SiLU (SwiGLU) or tanh GELU (GeGLU)."""

    def __init__(self, linears: Mapping[str, LinearSpec], weights: Weights, prefix: str = "",
                 activation: str = "silu"):
        super().__init__()
        self.act = GATE_ACTIVATIONS[activation]
        down = linears[f"{prefix}down"]
        fused = linears.get(f"{prefix}gate_up")
        if fused is not None:  # passes/fuse.py: one GEMM, its output split into gate and up
            self.gate_up_split = fused_split(fused, ("gate", "up"), (down.in_features, down.in_features))
            self.gate_up_proj = weights.linear(fused)
        else:
            gate, up = linears[f"{prefix}gate"], linears[f"{prefix}up"]
            self.gate_up_proj = weights.siblings([gate, up])  # fused at load, if it can be
            if self.gate_up_proj is not None:
                self.gate_up_split = (gate.out_features, up.out_features)
            else:
                self.gate_proj = weights.linear(gate)
                self.up_proj = weights.linear(up)
        self.down_proj = weights.linear(down)

    def forward(self, x):
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).split(self.gate_up_split, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act(gate) * up)


class MoeMlp(nn.Module):
    def __init__(self, spec: MlpSpec, weights: Weights):
        super().__init__()
        self.spec = spec
        self.router = weights.linear(spec.linears["router"])
        self.experts = nn.ModuleList(DenseMlp(e, weights, activation=spec.activation) for e in spec.experts)
        self.shared = (DenseMlp(spec.linears, weights, "shared_", spec.activation) if "shared_down" in spec.linears
                       else None)
        self.shared_gate = weights.linear(spec.linears["shared_gate_router"]) if spec.shared_expert_gate else None
        bias = spec.score_correction_bias
        self.register_buffer("score_bias", weights.tensor(bias, (len(spec.experts),), "a router bias")
                             if bias and bias in weights.tensors else None)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [N, C] -> (weights [N, k], expert indices [N, k])
        s = self.spec
        logits = self.router(x).float()
        if s.routing == "softmax_topk":
            probs = logits.softmax(dim=-1)
            top_w, top_i = probs.topk(s.top_k, dim=-1)
            if s.norm_topk_prob:
                top_w = top_w / top_w.sum(dim=-1, keepdim=True)
            return top_w, top_i
        scores = sigmoid(logits)
        choice = scores + self.score_bias if self.score_bias is not None else scores
        n, E = choice.shape
        group_scores = choice.view(n, s.n_group, E // s.n_group).topk(min(2, E // s.n_group), dim=-1)[0].sum(-1)
        group_idx = group_scores.topk(s.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(n, s.n_group, E // s.n_group).reshape(n, E)
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        top_i = choice.topk(s.top_k, dim=-1, sorted=False)[1]
        top_w = scores.gather(1, top_i)
        if s.norm_topk_prob:
            top_w = top_w / (top_w.sum(dim=-1, keepdim=True) + 1e-20)
        return top_w * s.routed_scaling_factor, top_i

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        top_w, top_i = self.route(x)
        out = torch.zeros_like(x)
        for e in top_i.unique().tolist():
            token, slot = (top_i == e).nonzero(as_tuple=True)
            out.index_add_(0, token, self.experts[e](x[token]) * top_w[token, slot, None])
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                shared = shared * sigmoid(self.shared_gate(x))
            out = out + shared
        return out.view(shape)
