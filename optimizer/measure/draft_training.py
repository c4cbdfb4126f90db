"""The draft head's training objective (`ModelRunner.draft_distillation`): self-distillation from the target.

For each position t of a training sequence, the draft module reads the target's feature f_t (its last layer's
output before the final norm) and the token at t+1, and is trained to give the target's own distribution of
the token at t+2 (KL to the target's logits there, not the text's next token) and to reproduce the target's
feature f_{t+1} (smooth L1, EAGLE's regression term), so its output can stand in for the feature when it drafts
the next token. Features get uniform noise (EAGLE) so the head tolerates its own imprecise features.
An EAGLE-3 head is held to the same regression, although EAGLE-3 trains on KL alone: its output is what it
feeds back, and pulling it toward the target's feature drafted better on stories260K
(benchmarks/results/speculative.md).

EAGLE-3's training-time test unrolls drafting: step j (1 < j <= `unroll`) feeds the head its own output of step
j - 1 one position earlier and trains the token after, attending as drafting does (`unroll_mask`): the first
step's keys up to the position the draft started from (what the target verified, run with its true features),
then one key of each later step, its own earlier drafts. Each step's terms weigh STEP_DECAY ** (j - 1).

The training text is the calibration paragraphs and the target's own greedy continuations of their first 16
tokens: the head learns the target's behaviour, which is what it must predict when drafting for it.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

from kiln.calibration.data import length_batches
from kiln.calibration.metrics import kl_terms
from kiln.kernels.errors import KilnError
from kiln.optimizer.lower import lower_tensors
from kiln.passes.graph import ModelGraph
from kiln.runtime.draft import draft_module
from kiln.runtime.linear import QuantLinear
from kiln.runtime.model import Transformer
from kiln.runtime.model_weights import Weights
from kiln.runtime.spec import ExtraModuleSpec

FEATURE_WEIGHT = 1.0
NOISE = 0.2  # uniform feature noise, +-NOISE/2 in units of the features' RMS (EAGLE: U(-0.1, 0.1) on ~unit RMS)
STEP_DECAY = 0.8  # the weight of step j's terms: STEP_DECAY ** (j - 1), as EAGLE-3's training-time test


class _Batch:
    def __init__(self, lists: Sequence[Sequence[int]]):
        T = max(len(t) for t in lists)
        self.tokens = torch.zeros(len(lists), T, dtype=torch.long)
        self.mask = torch.zeros(len(lists), T, dtype=torch.bool)
        for i, t in enumerate(lists):
            self.tokens[i, :len(t)] = torch.as_tensor(t, dtype=torch.long)
            self.mask[i, :len(t)] = True
        self.positions = torch.arange(T).expand(len(lists), -1)
        self.real = int(self.mask.sum())


class DraftDistillation:
    """`loss(step)` runs forward and backward on one batch (the caller zeroes gradients and steps Adam over
    `parameters`, tensor name -> trainable fp32 tensor)."""

    def __init__(self, graph: ModelGraph, module: ExtraModuleSpec, init: Mapping[str, torch.Tensor],
                 token_lists: Sequence[Sequence[int]], max_batch_tokens: int = 2048, seed: int = 0,
                 unroll: int = 2):
        if unroll < 1:
            raise KilnError(f"draft head: unroll counts the drafting steps trained, at least 1; got {unroll}")
        self.unroll = unroll
        tensors, formats = lower_tensors(graph)
        spec = graph.spec
        weights = Weights({**tensors, **{n: t.float() for n, t in init.items()}}, formats, spec)
        self.target = Transformer(spec, weights=weights).eval()
        for p in self.target.parameters():
            p.requires_grad_(False)
        if module.draft_vocab:
            head = f"{module.linears['lm_head'].name}.weight"
            if head not in weights.tensors:
                weights.tensors[head] = draft_head_rows(self.target, init[module.draft_vocab])
        self.module = draft_module(module, weights, self.target)
        self.spec = module
        own = trainable_tensors(module, self.module)
        # a draft vocabulary's head (the target's lm_head rows at its ids) and its d2t stay as given
        frozen = {head, module.draft_vocab} if module.draft_vocab else set()
        missing = sorted(set(init) - set(own) - frozen)
        if missing:
            raise KilnError(f"draft head: no trainable tensor for {missing[0]}")
        self.parameters: dict[str, torch.nn.Parameter] = {}
        for name, param in own.items():
            param.requires_grad_(True)
            self.parameters[name] = param
        lists = [list(t) for t in token_lists if len(t) >= 3]
        if not lists:
            raise KilnError("draft head: no training sequence of 3 tokens or more")
        groups = length_batches(lists, max_batch_tokens)
        random.Random(seed).shuffle(groups)
        self.batches = [_Batch([lists[i] for i in g]) for g in groups]
        self._features: list[torch.Tensor | None] = [None] * len(self.batches)
        self.generator = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return len(self.batches)

    def batch_tokens(self, step: int) -> int:
        return self.batches[step % len(self.batches)].real

    def loss(self, step: int) -> float:
        i = step % len(self.batches)
        b = self.batches[i]
        aux = self.module.aux_layers
        if self._features[i] is None:
            with torch.no_grad():
                self._features[i] = self.target.features(b.tokens, b.positions, collect=aux)
        feats, inputs = self._features[i] if aux else (self._features[i], self._features[i])
        with torch.no_grad():
            # over the draft vocabulary when the head has one (EAGLE-3's training): the head's own lm_head is
            # the target's rows there, so these are the target's logits restricted to it
            head = self.target.lm_head if self.module.vocab_ids is None else self.module.head
            teacher = torch.log_softmax(head(self.target.norm(feats)), dim=-1)
            scale = inputs.pow(2).mean().sqrt()
            noise = (torch.rand(inputs.shape, generator=self.generator) - 0.5) * NOISE * scale
        total = 0.0
        outs = self.unrolled((inputs + noise)[:, :-1], b.tokens[:, 1:], b.positions[:, :-1])
        steps = torch.arange(b.tokens.shape[1] - 2)
        for j, out in enumerate(outs, start=1):
            # step j at position t drafts token t+2 from the head's step j-1 output at t-1 (t >= j-1)
            valid = b.mask[:, 2:] & (steps >= j - 1)
            if valid.any():
                total = total + STEP_DECAY ** (j - 1) * self._terms(out[:, :-1], feats[:, 1:-1], teacher[:, 1:-1],
                                                                     valid)
        total.backward()
        return float(total.detach())

    def unrolled(self, inputs: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        """The training-time test: the head's outputs [B, T, C] of steps 1..unroll. Step 1 reads `inputs` (the
        target's features at positions t, before projection) and the tokens at t+1; step j > 1 at position t
        reads step j-1's output at t-1 and the same token, its attention masked as drafting's (`unroll_mask`)."""
        cache = _UnrollCache(inputs.shape[1])
        out = self.module(self.module.project(inputs), next_tokens, positions, cache)
        outs = [out]
        for _ in range(1, self.unroll):
            shifted = torch.cat([out.new_zeros(out[:, :1].shape), out[:, :-1]], dim=1)
            out = self.module(shifted, next_tokens, positions, cache)
            outs.append(out)
        return outs

    def _terms(self, out: torch.Tensor, target_features: torch.Tensor, teacher: torch.Tensor,
               valid: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(self.module.draft_logits(out[valid]), dim=-1)
        kl = kl_terms(teacher[valid], logp).sum(-1).mean()
        scale = target_features[valid].pow(2).mean().sqrt().clamp_min(1e-6)
        regression = F.smooth_l1_loss(out[valid] / scale, target_features[valid] / scale)
        return kl + FEATURE_WEIGHT * regression


@functools.lru_cache(maxsize=16)  # a batch's steps; masks are [T, step * T] booleans
def unroll_mask(length: int, step: int) -> torch.Tensor:
    """[length, step * length] (True: attend): step `step`'s query at position t against the keys of steps
    1..step, each `length` positions long, side by side. Step 1's keys up to t - (step - 1), the positions the
    target verified before this draft began; step m's (1 < m <= step) at t - (step - m) alone, the draft's own
    output m - 1 steps into it. Step 1 alone is causal."""
    t = torch.arange(length)[:, None]
    s = torch.arange(length)[None, :]
    blocks = [s <= t - (step - 1)] + [s == t - (step - m) for m in range(2, step + 1)]
    return torch.cat(blocks, dim=1)


class _UnrollCache:
    """The draft layer's keys and values of the steps unrolled so far, standing in for the paged cache: each
    step's `update` appends its own and returns all of them, and `explicit_mask` masks them as drafting would."""

    decode_kernel = False
    step_masks = None

    def __init__(self, length: int):
        self.length = length
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.explicit_mask: torch.Tensor | None = None

    def update(self, layer: int, kv, positions: torch.Tensor):
        k, v = kv
        self.keys.append(k)
        self.values.append(v)
        self.explicit_mask = unroll_mask(self.length, len(self.keys)).to(k.device)
        return torch.cat(self.keys, dim=1), torch.cat(self.values, dim=1)


def trainable_tensors(module: ExtraModuleSpec, draft: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The draft module's own tensors, by their names in the artifact: what training fits (its fc or eh_proj,
    norms and decoder layer; not the target's embedding, nor a draft vocabulary's frozen lm_head rows)."""
    m = draft
    if module.kind == "eagle3":
        own = {module.norms[0]: m.hidden_norm.weight, module.norms[1]: m.norm.weight,
               f"{module.linears['fc'].name}.weight": m.fc.weight}
        layer_modules, norm_modules = m, (m.input_norm, m.post_norm)
    else:
        own = {module.norms[0]: m.enorm.weight, module.norms[1]: m.hnorm.weight,
               f"{module.linears['eh_proj'].name}.weight": m.eh_proj.weight}
        layer_modules, norm_modules = m.block, (m.block.input_norm, m.block.post_norm)
    # the layer's norms in LayerSpec order: input, MLP input, then q/k (Qwen3, Gemma); then the output norms
    attention = layer_modules.attention
    norm_modules = (*norm_modules, *((attention.q_norm, attention.k_norm) if attention.q_norm is not None
                                     else ()))
    own.update({name: norm.weight for name, norm in zip(module.layer.norms, norm_modules, strict=True)})
    if module.layer.output_norms:
        outs = (layer_modules.attention_out_norm, layer_modules.mlp_out_norm)
        own.update({name: norm.weight for name, norm in zip(module.layer.output_norms, outs, strict=True)})
    for lin in module.layer.linears():
        own[f"{lin.name}.weight"] = _find_linear(layer_modules, lin.name, module)
    return own


def draft_head_rows(target: Transformer, d2t: torch.Tensor) -> torch.Tensor:
    """The rows of the target's lm_head, as the runtime computes with it, at a draft vocabulary's target ids
    (draft id i -> i + d2t[i]): the draft head's own lm_head, which then scores exactly what the target does."""
    head = target.lm_head
    if not isinstance(head, QuantLinear) or head.input_quantizer is not None:
        raise KilnError("draft-head: a draft vocabulary copies rows of the target's lm_head, whose activations "
                        "are quantized here; keep the lm_head's activations unquantized or set draft_vocab: 0")
    return head.weight.detach()[torch.arange(d2t.numel()) + d2t].clone()


def _find_linear(block, name: str, module: ExtraModuleSpec) -> torch.nn.Parameter:
    """The weight parameter of the draft layer's linear `name` (`block`: what holds .attention and .mlp)."""
    a, m = module.layer.attention, module.layer.mlp
    for role, lin in a.linears.items():
        if lin.name == name:
            return getattr(block.attention, f"{role}_proj").weight
    for role, lin in m.linears.items():
        if lin.name == name:
            return getattr(block.mlp, f"{role}_proj").weight
    raise KilnError(f"draft head: linear {name} is not in its decoder layer")
