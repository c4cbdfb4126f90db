"""Draft modules the runtime runs for speculative decoding: a DeepSeek-V3 multi-token-prediction layer, or a
draft head Kiln's `draft-head` pass attaches. Two shapes (ExtraModuleSpec.kind):

"mtp" and "draft_head" (DeepSeek's MTP shape):

    x   = eh_proj([enorm(embed(token[t+1])), hnorm(feature[t])])     # [2C] -> [C]
    f̂   = decoder layer(x), causal attention over the module's own KV cache, rotary at position t
    logits of token[t+2] = head(head_norm(f̂))                       # the target's norm and lm_head unless
                                                                     # the module has its own (MTP's shared head)

feature[t] is the target's last-layer output at position t before its final norm (Transformer.features). The
module's output f̂ stands in for feature[t+1] when it drafts the next token, so one module drafts k tokens.

"eagle3" (EAGLE-3, as vLLM's Eagle3LlamaForCausalLM runs it):

    h   = fc([output of target layer a, b, c])        # [3C] -> [C]; a chained step feeds its own h instead
    x   = [input_layernorm(embed(token[t+1])), hidden_norm(h)]         # [2C]: q/k/v take 2C
    h'  = h + attention(x);  out = h' + mlp(post_attention_layernorm(h'))
    logits = lm_head(norm(out)); out is the next step's h
    with a draft vocabulary (`draft_vocab`: EAGLE-3's d2t), lm_head is the head's own [D, C] and scores D
    tokens; the drafter sees them at their target ids and -inf elsewhere

`project(features)` maps what the target gives (its features, or the aux layers' outputs) to the module's
input; a chained step passes the module's own output unprojected.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.kernels.errors import KilnError
from kiln.runtime.attention import GqaAttention, Rotary
from kiln.runtime.mlp import DenseMlp
from kiln.runtime.model import Transformer, build_block, scale_embedding
from kiln.runtime.model_weights import Weights
from kiln.runtime.spec import ExtraModuleSpec
from kiln.runtime.weights import need_tensor

DRAFT_KINDS = ("mtp", "draft_head", "eagle3")


def draft_module(module: ExtraModuleSpec, weights: Weights, target: Transformer) -> nn.Module:
    return Eagle3Module(module, weights, target) if module.kind == "eagle3" else DraftModule(module, weights, target)


class DraftModule(nn.Module):
    def __init__(self, module: ExtraModuleSpec, weights: Weights, target: Transformer):
        super().__init__()
        if module.kind not in DRAFT_KINDS or module.layer is None or "eh_proj" not in module.linears:
            raise KilnError(f"extra module {module.name!r} ({module.kind}) is not a draft module: it needs a "
                            "decoder layer and an eh_proj")
        self.spec = module
        self.enorm, self.hnorm = weights.norm(module.norms[0]), weights.norm(module.norms[1])
        self.eh_proj = weights.linear(module.linears["eh_proj"])
        self.block = build_block(module.layer, weights)
        self.rotary = Rotary(module.layer.attention.rotary)
        self.head_norm = weights.norm(module.norms[2]) if len(module.norms) > 2 else target.norm
        self.head = weights.linear(module.linears["head"]) if "head" in module.linears else target.lm_head
        own = [t for t in module.tensors if t.endswith("embed_tokens.weight")]
        self.embed = (nn.Parameter(weights.tensor(own[0], tuple(target.embed.shape), "the MTP embedding"),
                                   requires_grad=False) if own else target.embed)
        self.embedding_scale = target.spec.embedding_scale

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return scale_embedding(F.embedding(tokens, self.embed), self.embedding_scale)

    aux_layers: tuple[int, ...] = ()  # the target's last layer output is the feature

    def stream_shapes(self) -> tuple[tuple[int, int], ...]:
        return self.block.attention.stream_shapes()

    def project(self, features: torch.Tensor) -> torch.Tensor:
        return features

    def forward(self, features: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
                cache=None) -> torch.Tensor:
        """features [B, T, C] at `positions`, the tokens one position later [B, T] -> draft features [B, T, C]
        (each standing in for the target's feature one position later)."""
        x = self.eh_proj(torch.cat([self.enorm(self.embed_tokens(next_tokens)), self.hnorm(features)], -1))
        return self.block(x, self.rotary(positions), positions, cache, 0)

    vocab_ids = None  # the whole vocabulary

    def logits(self, draft_features: torch.Tensor) -> torch.Tensor:
        return self.head(self.head_norm(draft_features))

    draft_logits = logits


class Eagle3Module(nn.Module):
    def __init__(self, module: ExtraModuleSpec, weights: Weights, target: Transformer):
        super().__init__()
        layer = module.layer
        if module.kind != "eagle3" or layer is None or "fc" not in module.linears or len(module.aux_layers) < 1:
            raise KilnError(f"extra module {module.name!r} is not an EAGLE-3 head: it needs fc, a layer and aux layers")
        self.spec = module
        self.aux_layers = module.aux_layers
        self.fc = weights.linear(module.linears["fc"])
        self.input_norm, self.post_norm = weights.norm(layer.norms[0]), weights.norm(layer.norms[1])
        self.hidden_norm, self.norm = weights.norm(module.norms[0]), weights.norm(module.norms[1])
        self.attention = GqaAttention(layer.attention, weights, layer.prefix)
        self.mlp = DenseMlp(layer.mlp.linears, weights, activation=layer.mlp.activation)
        self.rotary = Rotary(layer.attention.rotary)
        self.head = weights.linear(module.linears["lm_head"]) if "lm_head" in module.linears else target.lm_head
        self.embed = target.embed
        self.embedding_scale = target.spec.embedding_scale
        self.vocab_size = target.spec.vocab_size
        self.vocab_ids = (draft_vocab_ids(module, weights, self.vocab_size) if module.draft_vocab else None)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return scale_embedding(F.embedding(tokens, self.embed), self.embedding_scale)

    def stream_shapes(self) -> tuple[tuple[int, int], ...]:
        return self.attention.stream_shapes()

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """The aux layers' outputs [.., len(aux) * C] -> the module's hidden input [.., C]."""
        return self.fc(features)

    def forward(self, hidden: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
                cache=None) -> torch.Tensor:
        x = torch.cat([self.input_norm(self.embed_tokens(next_tokens)), self.hidden_norm(hidden)], -1)
        h = hidden + self.attention(x, self.rotary(positions), positions, cache, 0)
        return h + self.mlp(self.post_norm(h))

    def draft_logits(self, draft_features: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (the whole vocabulary when the head has none)."""
        return self.head(self.norm(draft_features))

    def logits(self, draft_features: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary: a draft vocabulary's scores at their target ids, -inf elsewhere
        (as vLLM's Eagle3LlamaForCausalLM.compute_logits), so a drafter never proposes a token outside it."""
        logits = self.draft_logits(draft_features)
        if self.vocab_ids is None:
            return logits
        out = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        out[..., self.vocab_ids] = logits
        return out


def draft_vocab_ids(module: ExtraModuleSpec, weights: Weights, vocab_size: int) -> torch.Tensor:
    """The target ids of an EAGLE-3 draft vocabulary (draft id i -> i + d2t[i]), checked: each inside the
    vocabulary, strictly increasing (so none is drafted twice)."""
    d2t = need_tensor(weights.tensors, module.draft_vocab)
    ids = torch.arange(d2t.numel()) + d2t.long()
    outside = ids[(ids < 0) | (ids >= vocab_size)]
    if outside.numel():
        raise KilnError(f"{module.draft_vocab}: a draft id maps to target id {int(outside[0])}, outside the "
                        f"vocabulary of {vocab_size}")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise KilnError(f"{module.draft_vocab}: the draft vocabulary's target ids must be strictly increasing "
                        "(EAGLE-3's d2t maps each draft id to a distinct target id, in order)")
    return ids
