"""The arithmetic of MLA conversion (passes/mla.py), one layer at a time, and the per-layer choice under a KV budget.

    unconvertible(attention)        why a layer cannot be converted, or None
    factorize(layer, wq, wk, wv, cov, sample, rope_dim)
                                    the RoRoPE head mixes, the kept rotary components and the latent's PCA basis
                                    (LayerFactors: enough to write the conversion at any rank)
    converted_layer(factors, wq, rank, eps, dtype)
                                    the converted layer's spec and tensors at latent rank `rank`
    install(graph, layer, tensors)  write them into the graph
    choose_ranks(options, budget)   exact multiple-choice knapsack: one option per layer, least total KL

The method and its reasons are the pass's module docstring.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from kiln.kernels.errors import KilnError
from kiln.passes.graph import ModelGraph
from kiln.runtime.spec import AttentionSpec, LayerSpec, LinearSpec, RotarySpec


def unconvertible(attention: AttentionSpec) -> str | None:
    """Why this layer's attention cannot be converted, or None."""
    if attention.kind == "mla":
        return "already MLA"
    lin = attention.linears
    if any(role not in lin for role in ("q", "k", "v", "o")):
        return "K/V are not plain q/k/v projections"
    if any(lin[role].bias for role in ("q", "k", "v")):
        return "q/k/v have biases (not in DeepSeek-V3's layout)"
    if attention.qk_norm:
        if attention.num_kv_heads == 1:  # Gemma 3 270M/1B: what a latent would share across KV heads is absent
            return ("per-head q/k norms act after the projection (not linear in x: W_uk cannot be absorbed), and "
                    "with one KV head there are no heads for a latent to share")
        return "per-head q/k norms act after the projection (not linear in x)"
    if attention.sliding_window is not None:
        return "sliding-window attention"
    if attention.rotary.dim != attention.head_dim or attention.rotary.interleaved:
        return "RoPE does not rotate the whole head in rotate-half layout"
    if attention.v_head_dim != attention.head_dim:
        return "V and K head dims differ"
    if attention.head_dim % 2:
        return "odd head dim (RoPE pairs dims)"
    if attention.num_heads % attention.num_kv_heads:
        return "query heads are not a multiple of KV heads"
    return None


@dataclass
class LayerFactors:
    """Everything needed to write one layer's conversion at any rank (from one pass over its inputs)."""

    layer: LayerSpec
    kept: list[tuple[int, int]]  # the rotary key's (frequency, head-mix component) pairs, in frequency order
    mix: torch.Tensor  # [D/2, G, G] per frequency, the heads' principal mixes (columns, by decreasing energy)
    w_rope: torch.Tensor  # [2f, C] κ = w_rope x
    w_z: torch.Tensor  # [2GD, C] z = [n; v] = w_z x
    encoder: torch.Tensor  # [2GD, 2GD] latent dim j = encoder[j] @ z, by decreasing importance
    decoder: torch.Tensor  # [2GD, 2GD] z ≈ decoder[:, :r] @ latent[:r]
    sample: torch.Tensor  # [tokens, C] inputs kept to fit the latent norm

    @property
    def source_values(self) -> int:
        a = self.layer.attention
        return a.num_kv_heads * (a.head_dim + a.v_head_dim)

    @property
    def rope_dim(self) -> int:
        return 2 * len(self.kept)

    @property
    def max_rank(self) -> int:
        return self.source_values - self.rope_dim


def factorize(layer: LayerSpec, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, cov: torch.Tensor,
              sample: torch.Tensor, rope_dim: int, context: int = 256,
              frequencies: list[int] | None = None) -> LayerFactors:
    """The RoRoPE head mixes, the kept rotary components and the latent's PCA basis of one layer (fp64).
    `frequencies`: keep exactly these (one component each, the one of most mass) instead of the f of most mass."""
    a = layer.attention
    H, G, D = a.num_heads, a.num_kv_heads, a.head_dim
    half = D // 2
    wq, wk, wv, cov = (t.double() for t in (wq, wk, wv, cov))
    k3 = wk.view(G, D, -1)
    # per frequency i, the [G, G] energy of the heads' pair (i, i + D/2); its eigenvectors mix the heads
    kcov = torch.einsum("gdc,ce,hde->dgh", k3, cov, k3)  # [D, G, G] per dim
    evals, evecs = torch.linalg.eigh(kcov[:half] + kcov[half:])  # ascending
    evals, mix = evals.flip(-1).clamp_min(0), evecs.flip(-1)  # [D/2, G], [D/2, G, G] by decreasing energy
    mix = mix * torch.where(mix.sum(1, keepdim=True) < 0, -1.0, 1.0)  # a fixed sign (deterministic)
    # what dropping the rotation of a (frequency i, component m) costs: its attention mass |κ_im| Σ_h
    # |mix_i[g(h), m]| |q_h,i| (RMS over the tokens) times how far the rotation moves a score over the context,
    # E_d |1 - exp(iθ_i d)| = E_d 2|sin(θ_i d / 2)| for d uniform in 1..context (slow frequencies barely turn)
    q3 = wq.view(H, D, -1)
    qcov = torch.einsum("hdc,ce,hde->hd", q3, cov, q3)  # [H, D] E q²
    q_rms = (qcov[:, :half] + qcov[:, half:]).clamp_min(0).sqrt()  # [H, D/2]
    group = torch.arange(H) // (H // G)
    theta = torch.tensor(a.rotary.inv_freq, dtype=torch.float64)
    distance = torch.arange(1, context + 1, dtype=torch.float64)
    turn = (2 * (theta[:, None] * distance / 2).sin().abs()).mean(-1)  # [D/2]
    mass = torch.einsum("hi,ihm->im", q_rms, mix[:, group].abs()) * evals.sqrt() * turn[:, None]  # [D/2, G]
    f = min(rope_dim // 2, half * G)
    if frequencies is None:
        order = torch.argsort(mass.flatten(), descending=True)[:f].tolist()
        kept = sorted((j // G, j % G) for j in order)
    else:
        kept = [(i, int(mass[i].argmax())) for i in sorted(frequencies)]
        f = len(kept)
    rows = [mix[i, :, m] @ k3[:, i] for i, m in kept] + [mix[i, :, m] @ k3[:, i + half] for i, m in kept]
    w_rope = torch.stack(rows) if rows else k3.new_zeros(0, k3.shape[-1])  # [2f, C]
    resid = k3.clone()
    for j, (i, m) in enumerate(kept):
        resid[:, i] -= mix[i, :, m][:, None] * w_rope[j]
        resid[:, i + half] -= mix[i, :, m][:, None] * w_rope[f + j]
    n, v = resid.reshape(G * D, -1), wv
    w_z = torch.cat([n, v])
    zcov = w_z @ cov @ w_z.T
    # n scaled by 1/β so the residual keys and the values carry equal energy (TransMLA's balancing). Tried on
    # stories260K: weighing key errors by the queries' covariance and value errors by o_proj's instead gave a
    # higher KL on 3 of 5 layers at 32 values per token.
    n_energy, v_energy = zcov[: G * D, : G * D].trace(), zcov[G * D:, G * D:].trace()
    beta = float((n_energy / v_energy.clamp_min(1e-30)).sqrt()) if n_energy > 1e-12 * v_energy else 1.0
    scale = torch.cat([torch.full((G * D,), 1 / beta, dtype=torch.float64), torch.ones(G * D, dtype=torch.float64)])
    root, inverse = torch.diag(scale), torch.diag(1 / scale)
    wcov = root @ zcov @ root.T
    _, zvecs = torch.linalg.eigh((wcov + wcov.T) / 2)
    basis = zvecs.flip(-1)
    basis = basis * torch.where(basis.sum(0, keepdim=True) < 0, -1.0, 1.0)
    encoder, decoder = basis.T @ root, inverse @ basis
    return LayerFactors(layer, kept, mix, w_rope, w_z, encoder, decoder, sample)


def converted_layer(factors: LayerFactors, wq: torch.Tensor, rank: int, eps: float, dtype: torch.dtype
                    ) -> tuple[LayerSpec, dict[str, torch.Tensor]]:
    """The MLA layer at `rank` and its new tensors (q_proj replaced; kv_a, kv_b, the latent norm new)."""
    layer, a = factors.layer, factors.layer.attention
    H, G, D = a.num_heads, a.num_kv_heads, a.head_dim
    half, dr = D // 2, factors.rope_dim
    if not 1 <= rank <= factors.max_rank:
        raise KilnError(f"layer {layer.index}: latent rank {rank} outside 1..{factors.max_rank}")
    w_latent = factors.encoder[:rank] @ factors.w_z  # [r, C]
    # the latent norm's weight, per dim: least squares of w * c / rms(c) against c on the kept inputs
    c = factors.sample.double() @ w_latent.T
    rms = (c.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    norm_weight = (c.pow(2) / rms).sum(0) / (c.pow(2) / rms.pow(2)).sum(0).clamp_min(1e-30)
    norm_weight = torch.where(torch.isfinite(norm_weight) & (norm_weight > 0), norm_weight,
                              torch.ones_like(norm_weight))
    group = torch.arange(H) // (H // G)
    up = factors.decoder[:, :rank]
    n_up, v_up = up[: G * D].view(G, D, rank), up[G * D:].view(G, D, rank)
    kv_b = torch.cat([n_up[group], v_up[group]], dim=1).reshape(H * 2 * D, rank)
    new_scale = (D + dr) ** -0.5
    fold = a.softmax_scale / new_scale
    q3 = wq.double().view(H, D, -1)
    rope_rows = ([factors.mix[i, group, m][:, None] * q3[:, i] for i, m in factors.kept]
                 + [factors.mix[i, group, m][:, None] * q3[:, i + half] for i, m in factors.kept])
    q_rope = torch.stack(rope_rows, dim=1) if rope_rows else q3[:, :0]  # [H, 2f, C]
    q_nope = q3 * a.rotary.attention_scaling ** 2  # unrotated dims miss the rotary's cos/sin scaling
    q = (torch.cat([q_nope, q_rope], dim=1) * fold).reshape(H * (D + dr), -1)
    kv_a = torch.cat([w_latent, factors.w_rope])
    p = f"{layer.prefix}.self_attn"
    old = a.linears
    linears = {
        "q": LinearSpec(old["q"].name, "q", old["q"].in_features, H * (D + dr), layer.index),
        "kv_a": LinearSpec(f"{p}.kv_a_proj_with_mqa", "kv_a", old["k"].in_features, rank + dr, layer.index),
        "kv_b": LinearSpec(f"{p}.kv_b_proj", "kv_b", rank, H * 2 * D, layer.index),
        "o": old["o"],
    }
    rotary = RotarySpec(dr, tuple(a.rotary.inv_freq[i] for i, _ in factors.kept), a.rotary.attention_scaling)
    attention = AttentionSpec(kind="mla", num_heads=H, num_kv_heads=H, head_dim=D + dr, v_head_dim=D,
                              linears=linears, rotary=rotary, softmax_scale=new_scale, kv_lora_rank=rank,
                              qk_rope_head_dim=dr, qk_nope_head_dim=D)
    norm = f"{p}.kv_a_layernorm.weight"
    spec = dataclasses.replace(layer, attention=attention, norms=(*layer.norms, norm))
    tensors = {f"{old['q'].name}.weight": q, f"{linears['kv_a'].name}.weight": kv_a,
               f"{linears['kv_b'].name}.weight": kv_b, norm: norm_weight}
    return spec, {k: t.to(dtype).contiguous() for k, t in tensors.items()}


def install(graph: ModelGraph, layer: LayerSpec, tensors: dict[str, torch.Tensor]) -> None:
    """Put a converted layer in the graph: its tensors in, the old K/V weights out, the spec replaced."""
    old = graph.spec.layers[layer.index].attention.linears
    for role in ("k", "v"):
        graph.tensors.pop(f"{old[role].name}.weight", None)
    for name, t in tensors.items():
        graph.tensors[name] = t
    graph.replace_layer(layer)


def cached_values(attention: AttentionSpec) -> int:
    """KV values a layer caches per token."""
    return sum(heads * dim for _, heads, dim in attention.kv_streams())


def choose_ranks(options: dict[int, list[tuple[int, float, object]]], budget: int,
                 stated: int | None = None) -> dict[int, object]:
    """Exact multiple-choice knapsack: per layer one (values per token, KL, choice; None = keep) option, least
    total KL with total values <= budget. Raises KilnError when even the smallest options exceed it."""
    layers = sorted(options)
    least = sum(min(v for v, _, _ in options[i]) for i in layers)
    if least > budget:
        raise KilnError(f"KV budget of {stated if stated is not None else budget} values per token is below the "
                        f"smallest conversion this pass probes ({least} values: every layer at its lowest probed "
                        "rank, plus any layer it cannot convert)")
    budget = min(budget, sum(max(v for v, _, _ in options[i]) for i in layers))  # more cannot be used
    inf = float("inf")
    best = np.zeros(budget + 1)  # best[b]: least KL of the layers so far within b values
    picks: list[np.ndarray] = []
    for i in layers:
        new = np.full(budget + 1, inf)
        pick = np.full(budget + 1, -1)
        for k, (values, kl, _) in enumerate(options[i]):
            if values > budget:
                continue
            cand = np.full(budget + 1, inf)
            cand[values:] = best[: budget + 1 - values] + kl
            better = cand < new
            new[better], pick[better] = cand[better], k
        best = new
        picks.append(pick)
    b = int(np.argmin(best))
    out: dict[int, object] = {}
    for i, pick in zip(reversed(layers), reversed(picks), strict=True):
        k = int(pick[b])
        values, _, picked = options[i][k]
        out[i] = picked
        b -= values
    return out
