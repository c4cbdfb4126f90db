"""Attention layers: rotary tables, masks, grouped-query attention and DeepSeek's multi-head latent attention.

    attention = GqaAttention(layer.attention, weights, layer.prefix)     # or MlaAttention for kind "mla"
    out = attention(x, rope, positions, cache, layer_index)              # x [B, T, C] -> [B, T, C]

Shapes: B batch, T new tokens, S cached tokens, C hidden, H heads, Hkv KV heads, D head dim. `cache` is a
paged KV cache (runtime.paged_kv_cache) or None (attend over the new tokens only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.runtime.model_weights import Weights, fused_split
from kiln.runtime.spec import AttentionSpec, RotarySpec


class Rotary(nn.Module):
    """cos/sin tables of one RotarySpec for given positions (fp32; apply_rope casts them to the activations')."""

    def __init__(self, spec: RotarySpec):
        super().__init__()
        self.register_buffer("inv_freq", torch.tensor(spec.inv_freq, dtype=torch.float32), persistent=False)
        self.attention_scaling = spec.attention_scaling

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


class LayerRotaries(nn.Module):
    """Each layer's rotary tables for one forward: layers with the same RotarySpec share one computation."""

    def __init__(self, layers):
        super().__init__()
        specs = [layer.attention.rotary for layer in layers]
        distinct = list(dict.fromkeys(specs))
        self.index = [distinct.index(spec) for spec in specs]
        self.rotaries = nn.ModuleList(Rotary(spec) for spec in distinct)

    def forward(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        tables = [rotary(positions) for rotary in self.rotaries]
        return [tables[i] for i in self.index]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    # x: [B, T, H, D]; cos/sin: [B, T, D] (fp32, applied in x's dtype)
    cos, sin = cos.unsqueeze(2).to(x.dtype), sin.unsqueeze(2).to(x.dtype)
    if interleaved:
        # DeepSeek: pairs (x0, x1), (x2, x3), ...; output de-interleaved as transformers does
        half = cos.shape[-1] // 2
        cos, sin = cos[..., :half], sin[..., :half]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return x * cos + _rotate_half(x) * sin


def step_mask(cache, positions: torch.Tensor, key_positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """The cache's explicit mask for this forward (tree verification: each node sees the cached prefix and its
    own ancestors; a window layer only those in its window), else causal by position."""
    explicit = getattr(cache, "explicit_mask", None) if cache is not None else None
    memo = getattr(cache, "step_masks", None)  # a paged cache keeps the masks of the prepared forward
    if explicit is not None:
        if window is None:
            return explicit
        # a window layer sees only its window, counted in model positions (a tree node's key is at its depth's)
        if ("explicit", window) not in memo:
            keys = cache.explicit_key_positions
            memo["explicit", window] = explicit & attention_mask(positions, keys, window)
        return memo["explicit", window]
    if memo is None:
        return attention_mask(positions, key_positions, window)
    if window not in memo:
        mask = attention_mask(positions, key_positions, window)
        # on CPU an all-true mask is dropped (e.g. one sequence decoding: SDPA runs faster without one); on a GPU
        # that test would cost a host sync every forward
        memo[window] = None if mask.device.type == "cpu" and bool(mask.all()) else mask
    return memo[window]


def attention_mask(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None) -> torch.Tensor:
    # [B, 1, T, S]: a query attends keys at positions <= its own (and within the sliding window)
    q = query_positions[:, None, :, None]
    k = key_positions[:, None, None, :]
    mask = k <= q
    if window is not None:
        mask &= k > q - window
    return mask


class GqaAttention(nn.Module):
    def __init__(self, spec: AttentionSpec, weights: Weights, layer_prefix: str):
        super().__init__()
        self.spec = spec
        self.o_proj = weights.linear(spec.linears["o"])
        if "qkv" in spec.linears:  # fused (passes/fuse.py): one GEMM, its output split into q, k, v
            sizes = (spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim,
                     spec.num_kv_heads * spec.v_head_dim)
            self.qkv_split = fused_split(spec.linears["qkv"], ("q", "k", "v"), sizes)
            self.qkv_proj = weights.linear(spec.linears["qkv"])
        else:
            parts = [spec.linears.get(role) for role in ("q", "k", "v")]
            self.qkv_proj = weights.siblings(parts) if None not in parts else None  # fused at load, if it can be
            if self.qkv_proj is not None:
                self.qkv_split = tuple(p.out_features for p in parts)
            else:
                self.q_proj = weights.linear(spec.linears["q"])
                self.k_proj, self.v_proj = _projection(spec, weights, "k"), _projection(spec, weights, "v")
        self.q_norm = weights.norm(f"{layer_prefix}.self_attn.q_norm.weight") if spec.qk_norm else None
        self.k_norm = weights.norm(f"{layer_prefix}.self_attn.k_norm.weight") if spec.qk_norm else None
        # what the paged decode kernel serves: head dims a power of two >= 32, K's and V's equal, no window
        d = spec.head_dim
        self.kernel_decodes = (d >= 32 and not d & (d - 1) and spec.v_head_dim == d and spec.sliding_window is None
                               and spec.num_heads % spec.num_kv_heads == 0)

    def stream_shapes(self) -> tuple[tuple[int, int], ...]:
        return ((self.spec.num_kv_heads, self.spec.head_dim), (self.spec.num_kv_heads, self.spec.v_head_dim))

    def forward(self, x, rope, positions, cache, layer):
        B, T, _ = x.shape
        s = self.spec
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split(self.qkv_split, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(B, T, s.num_heads, s.head_dim)
        k = k.view(B, T, s.num_kv_heads, s.head_dim)
        v = v.view(B, T, s.num_kv_heads, s.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.kernel_decodes and cache is not None and getattr(cache, "decode_kernel", False):
            out = cache.decode_attention(layer, q, (k, v), s.softmax_scale)  # reads the pools as stored
            return self.o_proj(out.reshape(B, T, s.num_heads * s.v_head_dim))
        key_positions = positions
        if cache is not None:
            k, v = cache.update(layer, (k, v), positions)
            key_positions = torch.arange(k.shape[1], device=k.device).expand(B, -1)
        out = _attend(q, k, v, step_mask(cache, positions, key_positions, s.sliding_window), s.softmax_scale)
        return self.o_proj(out.reshape(B, T, s.num_heads * s.v_head_dim))


def _projection(spec: AttentionSpec, weights: Weights, role: str) -> nn.Module:
    """K or V: one linear, or a low-rank pair `{role}_down` [r, hidden] then `{role}_up` [kv dim, r] that a
    structural pass put in its place (the cache still holds the full K/V)."""
    if role in spec.linears:
        return weights.linear(spec.linears[role])
    return nn.Sequential(weights.linear(spec.linears[f"{role}_down"]), weights.linear(spec.linears[f"{role}_up"]))


class MlaAttention(nn.Module):
    """DeepSeek-V3 multi-head latent attention; the cache holds the normed latent and the roped key part.

    Two equal ways to attend (tests hold them within 1e-5 of each other and of transformers'):
      expanded  kv_b_proj turns every key's latent into per-head K_nope and V, then plain attention: for
                prefill and scoring, where the new tokens are all the keys;
      absorbed  W_uk (kv_b's K rows) folds into the query and W_uv (its V rows) applies after the weighted sum
                of latents, so a step never expands the cache: per head, S x (rank + rope) multiply-adds for
                the scores and S x rank for the output, whatever the heads' dims. Used when the cache already
                holds tokens before the new ones (decode, chunked prefill, draft verification).
    `absorb` None chooses as above; True / False forces one (tests)."""

    def __init__(self, spec: AttentionSpec, weights: Weights, layer_prefix: str):
        super().__init__()
        self.spec = spec
        lin = spec.linears
        p = f"{layer_prefix}.self_attn"
        if spec.q_lora_rank is None:
            self.q_proj = weights.linear(lin["q"])
        else:
            self.q_a_proj = weights.linear(lin["q_a"])
            self.q_a_layernorm = weights.norm(f"{p}.q_a_layernorm.weight")
            self.q_b_proj = weights.linear(lin["q_b"])
        self.kv_a_proj = weights.linear(lin["kv_a"])
        self.kv_a_layernorm = weights.norm(f"{p}.kv_a_layernorm.weight")
        # never packed: absorbed decode reads kv_b's weight per head (W_uk into the query, W_uv after the mix)
        self.kv_b_proj = weights.linear(lin["kv_b"], packable=False)
        self.o_proj = weights.linear(lin["o"])
        self.absorb: bool | None = None
        # the absorbed decode kernel reads raw latents: no activation quantizer or bias on kv_b to apply first
        self.kernel_decodes = (getattr(self.kv_b_proj, "input_quantizer", None) is None
                               and self.kv_b_proj.bias is None)

    def stream_shapes(self) -> tuple[tuple[int, int], ...]:
        return ((1, self.spec.kv_lora_rank), (1, self.spec.qk_rope_head_dim))

    def forward(self, x, rope, positions, cache, layer):
        B, T, _ = x.shape
        s = self.spec
        H, nope, rope_dim = s.num_heads, s.qk_nope_head_dim, s.qk_rope_head_dim
        if s.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, T, H, nope + rope_dim)
        q_pass, q_rot = q.split([nope, rope_dim], dim=-1)
        latent, k_rot = self.kv_a_proj(x).split([s.kv_lora_rank, rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent).view(B, T, 1, s.kv_lora_rank)
        cos, sin = rope
        q_rot = apply_rope(q_rot, cos, sin, s.rotary.interleaved)
        k_rot = apply_rope(k_rot.view(B, T, 1, rope_dim), cos, sin, s.rotary.interleaved)
        if self.kernel_decodes and cache is not None and getattr(cache, "decode_kernel", False):
            w = self.kv_b_proj.weight.view(H, nope + s.v_head_dim, s.kv_lora_rank)
            q_latent = torch.einsum("bthn,hnr->bthr", q_pass, w[:, :nope])
            mixed = cache.decode_attention(layer, (q_latent, q_rot), (latent, k_rot), s.softmax_scale)
            out = torch.einsum("bthr,hvr->bthv", mixed, w[:, nope:])
            return self.o_proj(out.reshape(B, T, H * s.v_head_dim))
        key_positions = positions
        if cache is not None:
            latent, k_rot = cache.update(layer, (latent, k_rot), positions)
            key_positions = torch.arange(latent.shape[1], device=latent.device).expand(B, -1)
        S = latent.shape[1]
        mask = step_mask(cache, positions, key_positions, None)
        absorb = self.absorb if self.absorb is not None else (cache is not None and S > T)
        if absorb and self.kv_b_proj.bias is None:
            out = self._absorbed(q_pass, q_rot, latent.view(B, S, s.kv_lora_rank), k_rot.view(B, S, rope_dim), mask)
        else:
            kv = self.kv_b_proj(latent.view(B, S, s.kv_lora_rank)).view(B, S, H, nope + s.v_head_dim)
            k_pass, v = kv.split([nope, s.v_head_dim], dim=-1)
            k = torch.cat([k_pass, k_rot.expand(B, S, H, rope_dim)], dim=-1)
            q = torch.cat([q_pass, q_rot], dim=-1)
            out = _attend(q, k, v, mask, s.softmax_scale)
        return self.o_proj(out.reshape(B, T, H * s.v_head_dim))

    def _absorbed(self, q_pass, q_rot, latent, k_rot, mask):
        # q_pass [B, T, H, nope], q_rot [B, T, H, rope], latent [B, S, r], k_rot [B, S, rope] -> [B, T, H, v]
        # One-KV-head attention in latent space: queries [W_uk q_nope, q_rot], the key [latent, k_rot], the
        # value the latent itself; W_uv then maps each head's mix of latents to its values.
        s = self.spec
        w = self.kv_b_proj.weight.view(s.num_heads, s.qk_nope_head_dim + s.v_head_dim, s.kv_lora_rank)
        if self.kv_b_proj.input_quantizer is not None:  # kv_b's activation format acts on each latent row
            latent = self.kv_b_proj.input_quantizer(latent)
        B, T, H = q_pass.shape[:3]
        q_latent = torch.einsum("bthn,hnr->bthr", q_pass, w[:, : s.qk_nope_head_dim])
        # every head reads the same key and value: the T x H queries attend as the rows of one head
        rows_mask = None if mask is None else mask.repeat_interleave(H, dim=2)  # [B, 1, T * H, S]
        if T == 1:
            mixed = _latent_decode(q_latent.view(B, H, -1), q_rot.reshape(B, H, -1), latent, k_rot,
                                   None if rows_mask is None else rows_mask[:, 0], s.softmax_scale)
        else:  # SDPA: a chunk of queries never materialises its [T x H, S] scores on the fused backends
            q = torch.cat([q_latent, q_rot], dim=-1).reshape(B, 1, T * H, -1)
            k = torch.cat([latent, k_rot], dim=-1).unsqueeze(1)  # [B, 1, S, r + rope]
            mixed = F.scaled_dot_product_attention(q, k, latent.unsqueeze(1), attn_mask=rows_mask,
                                                   scale=s.softmax_scale)
        return torch.einsum("bthr,hvr->bthv", mixed.view(B, T, H, -1), w[:, s.qk_nope_head_dim:])


def _latent_decode(q_latent, q_rot, latent, k_rot, mask, scale):
    """One decode step of absorbed MLA: q_latent [B, H, r], q_rot [B, H, rope], latent [B, S, r], k_rot
    [B, S, rope], mask [B, H, S] (True: attend) or None -> [B, H, r]. The latent and rotary scores are two
    batched matmuls into one buffer: no [S, r + rope] key is concatenated per step, which costs SDPA 2-3x on a
    CPU at decode shapes. A row with nothing to attend gives zeros, as SDPA does."""
    scores = torch.baddbmm(torch.bmm(q_rot, k_rot.transpose(1, 2)), q_latent, latent.transpose(1, 2))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores * scale, dim=-1)
    if mask is not None:
        probs = probs.nan_to_num(0.0)
    return torch.bmm(probs, latent)


def _attend(q, k, v, mask, scale):
    # q: [B, T, H, D]; k: [B, S, Hkv, D]; v: [B, S, Hkv, Dv]; mask: [B, 1, T, S] -> [B, T, H, Dv]
    # GQA: each KV head serves H / Hkv query heads without being copied (SDPA's enable_gqa)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)
