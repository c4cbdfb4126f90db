"""MLA conversion: each GQA/MHA layer's K and V become one shared latent per token (DeepSeek-V3's multi-head
latent attention), initialised from calibration activations, ranked per layer under a KV budget, healed.

Preconditions: a loaded graph of GQA/MHA layers with rotate-half RoPE over the whole head, and calibration
text (`ctx.runner`). Run before quantization (`runs_after` of weight and KV passes name it): the new
projections are then quantized like any other linear and the KV pass sees the latent's dims.

Per layer, with G KV heads of dim D, H query heads, x the attention's input:

1. Decoupled RoPE, the TransMLA route ("RoRoPE"), chosen over MHA2MLA's per-head partial RoPE because
   DeepSeek-V3's layout (and so vLLM's and SGLang's MLA kernels) has one rotary key shared by all heads. RoPE
   turns each frequency's pair of dims (i, i + D/2) the same way in every head, so an orthogonal mix of the G
   heads per frequency commutes with it: per frequency i, the eigenvectors of the heads' pair energy on
   calibration keys give components κ_im = Σ_g mix_i[g, m] k_g[i], exact under rotation. The rotary key κ
   (`rope_dim` = 2f dims) keeps the f (frequency, component) pairs whose loss of rotation would cost most:
   attention mass |κ_im| Σ_h |mix_i[g(h), m]| |q_h,i| (MHA2MLA's 2-norm criterion) times how far the frequency
   turns a score over the context (slow frequencies barely move). The residual n_g = k_g - (what κ carries)
   loses its rotation and joins the latent. The rotation of the residual, not the latent's rank, is what the
   budget pays for first (benchmarks/results/mla.md), so the width is chosen per layer.
2. The latent c = encoder [n; v] of rank r: PCA of the calibration covariance of the residual keys and values,
   n scaled by 1/β so both carry equal energy (TransMLA's balancing; weighing key errors by the queries and
   value errors by o_proj instead was worse on 3 of 5 stories260K layers). kv_b (the decoder) rebuilds every
   head's n_g and v_g; the query keeps its D nope dims and gains 2f rotary dims mix_i[g, m] q_h[i].
3. DeepSeek's layout normalises the latent (kv_a_layernorm, RMSNorm): its weight is fitted per dim by least
   squares so that norm(c) ≈ c on the calibration tokens; healing adapts to what remains.
4. The softmax scale becomes (D + 2f)^-½ as DeepSeek-V3 computes it; the old scale is folded into the query.
At full rank with every K dim rotary the conversion is exact but for the latent norm (tests/passes/test_mla.py).

Budget: each layer is probed at every split (rotary width 2f in D/2, D, 2D, ... up to G·D; latent rank r) of
1/8, 2/8, ... 7/8 of its source KV values per token: the KL of the final logits on calibration text
(`ctx.runner.logit_kl`, one layer converted at a time). An exact multiple-choice knapsack then picks one
split per layer, or no conversion, for the least total KL within the budget (`kv_fraction` of the source's
KV values, or `kv_bytes_per_token` at BF16). A layer the solver leaves, or one this pass cannot convert
(biases, q/k norms, a sliding window, partial or interleaved RoPE), stays GQA and the result says why: a
mixed GQA/MLA model is legal (but has no DeepSeek-V3 export).

Healing (`heal_steps` > 0): Adam on the converted layers' q, kv_a, kv_b weights and latent norms only, by
KL(source || converted) on the calibration text (`session.distillation`), cosine decay; 0 skips it, and so
does a model over `heal_budget` (the note says so).

Cache per converted layer: r + 2f values per token (the latent and κ), against 2·G·D before.

`layout: deepseek` targets DeepSeek-V3's own shape instead of the knapsack: every layer converted at latent
rank 512 + rotary key 64 (576 values a token, the one size every vLLM MLA kernel takes: docs/mla.md), the
rotary key one component per frequency at every (D/64)th frequency, so its 32 frequencies are the standard
theta^(-2j/64) a serving engine derives from rope_theta. No probes; refused in one line before any work when a
layer cannot be converted, caches fewer than 576 values a token, has a head dim that is not a multiple of 64,
or the budget is below 576 a layer.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch

from kiln.calibration import progress
from kiln.calibration.tuning import tune
from kiln.kernels.errors import KilnError
from kiln.kernels.targets import Target
from kiln.passes.base import (
    MAX_BATCH_TOKENS,
    MAX_LR,
    MAX_PARAGRAPHS,
    MAX_STEPS,
    STEPS_WHY,
    Pass,
    PassContext,
    PassResult,
    check_range,
)
from kiln.passes.end_to_end_tuning import check_tune_budget, over_budget
from kiln.passes.graph import ModelGraph
from kiln.passes.mla_factorize import (
    LayerFactors,
    cached_values,
    choose_ranks,
    converted_layer,
    factorize,
    install,
    unconvertible,
)
from kiln.runtime.spec import AttentionSpec, LayerSpec

BF16_BYTES = 2
PROBE_EIGHTHS = (1, 2, 3, 4, 5, 6, 7)  # KV values per token probed per layer: these eighths of its source's
LAYOUTS = ("kiln", "deepseek")
DEEPSEEK_RANK, DEEPSEEK_ROPE = 512, 64  # DeepSeek-V3's kv_lora_rank and qk_rope_head_dim
NORM_SAMPLE_ROWS = 4096  # calibration tokens per layer kept to fit the latent norm
# the projections the conversion wrote: what healing trains (o_proj too was not better:
# benchmarks/results/mla.md)
HEALED_ROLES = ("q", "kv_a", "kv_b")


@dataclass(frozen=True)
class MlaConversion(Pass):
    """Convert GQA/MHA attention to multi-head latent attention under a KV budget.

    Fields:
        kv_fraction         the converted model's KV values per token as a fraction of the source's (all layers)
        kv_bytes_per_token  or the budget in bytes per token with a BF16 cache (2 bytes a value)
        rope_dim            dims of the shared rotary key (qk_rope_head_dim); None: the head dim (all frequencies)
        heal_steps          distillation steps on the new projections after conversion (0: none)
        heal_lr             Adam's learning rate for healing (cosine decay)
        heal_batch_tokens   calibration tokens per healing step
        heal_budget         skip healing (and say so) when steps x batch tokens x the model's linear weights exceed
                            it (None: the device's, end_to_end_tuning.TUNE_BUDGETS): distillation holds the source
                            and the student whole in fp32
        sensitivity_paragraphs  calibration paragraphs each rank probe's KL is measured on
        layers              layer indices to consider (None: all)
        layout              kiln: per-layer rotary width and rank from the probes and the budget; deepseek:
                            DeepSeek-V3's rank 512 + rotary 64 in every layer (module docstring)
    """

    kv_fraction: float | None = None
    kv_bytes_per_token: int | None = None
    rope_dim: int | None = None
    # healing's length, batch and rate: the best measured on stories260K at x0.5 (benchmarks/results/mla.md)
    heal_steps: int = 600
    heal_lr: float = 3e-3
    heal_batch_tokens: int = 2048
    heal_budget: float | None = None
    sensitivity_paragraphs: int = 32
    layers: tuple[int, ...] | None = None
    layout: str = "kiln"

    name: ClassVar[str] = "mla"
    exclusive: ClassVar[str | None] = "attention's structure (MLA)"  # a second one finds no GQA/MHA layer left
    # a lossy rewrite by design: judged against what the budget can buy (stories260K at x0.5, healed:
    # benchmarks/results/mla.md)
    default_floor: ClassVar[float] = 0.95
    default_max_kl: ClassVar[float] = 0.1
    default_min_top1: ClassVar[float] = 0.8

    def __post_init__(self):
        if (self.kv_fraction is None) == (self.kv_bytes_per_token is None):
            raise KilnError("mla takes one budget: kv_fraction (e.g. 0.5) or kv_bytes_per_token")
        check_range("kv_fraction", self.kv_fraction, 0, 1, low_open=True, optional=True)
        check_range("kv_bytes_per_token", self.kv_bytes_per_token, 1, integer=True, optional=True)
        check_range("rope_dim", self.rope_dim, 0, integer=True, optional=True)
        if self.rope_dim is not None and self.rope_dim % 2:
            raise KilnError(f"rope_dim must be an even non-negative integer, got {self.rope_dim!r}")
        check_tune_budget(self.heal_budget, "heal_budget")
        check_range("heal_steps", self.heal_steps, 0, MAX_STEPS, integer=True, why=STEPS_WHY)
        check_range("heal_batch_tokens", self.heal_batch_tokens, 1, MAX_BATCH_TOKENS, integer=True)
        check_range("sensitivity_paragraphs", self.sensitivity_paragraphs, 1, MAX_PARAGRAPHS, integer=True,
                    why="each rank probe runs on them")
        check_range("heal_lr", self.heal_lr, 0, MAX_LR, low_open=True)
        if self.layers is not None:
            for layer in self.layers:
                check_range("layers entry (a layer index)", layer, 0, integer=True)
            object.__setattr__(self, "layers", tuple(sorted(set(self.layers))))
        if self.layout not in LAYOUTS:
            raise KilnError(f"mla: layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if self.layout == "deepseek" and (self.layers is not None or self.rope_dim not in (None, DEEPSEEK_ROPE)):
            raise KilnError(f"mla: layout deepseek converts every layer at rotary width {DEEPSEEK_ROPE}: "
                            "drop layers and rope_dim")

    def check(self, graph: ModelGraph, target: Target) -> None:
        known = {b.index for b in graph.blocks}
        if self.layers is not None and set(self.layers) - known:
            raise KilnError(f"mla: layers {sorted(set(self.layers) - known)[:5]} are not in this model "
                            f"(it has 0..{len(known) - 1})")
        for b in graph.blocks:
            a = b.attention
            if unconvertible(a) is None and self.rope_dim is not None and self.rope_dim > a.num_kv_heads * a.head_dim:
                raise KilnError(f"mla: rope_dim {self.rope_dim} exceeds layer {b.index}'s K dims "
                                f"({a.num_kv_heads} heads x {a.head_dim})")
        if self.layout == "deepseek":
            self._check_deepseek(graph)

    def _check_deepseek(self, graph: ModelGraph) -> None:
        """Refuse, in one line and before any work, a model DeepSeek-V3's 512 + 64 layout cannot take."""
        width = DEEPSEEK_RANK + DEEPSEEK_ROPE
        for b in graph.blocks:
            a = b.attention
            why = unconvertible(a)
            if why is not None:
                raise KilnError(f"mla layout deepseek: layer {b.index} cannot be converted ({why}), and DeepSeek-V3's "
                                "layout has every layer MLA")
            if cached_values(a) < width:
                raise KilnError(f"mla layout deepseek: layer {b.index} caches {cached_values(a)} KV values a token "
                                f"({a.num_kv_heads} KV heads x {a.head_dim} x 2), fewer than DeepSeek's {width} "
                                f"({DEEPSEEK_RANK} latent + {DEEPSEEK_ROPE} rotary): nothing to cut")
            if a.head_dim % DEEPSEEK_ROPE:
                raise KilnError(f"mla layout deepseek: layer {b.index}'s head dim {a.head_dim} is not a multiple of "
                                f"{DEEPSEEK_ROPE}, so no {DEEPSEEK_ROPE}-wide rotary key has the standard frequencies")
        need, stated = width * len(graph.blocks), self.budget(graph)
        if stated < need:
            raise KilnError(f"mla layout deepseek: KV budget of {stated} values per token is below {need} "
                            f"({DEEPSEEK_RANK} latent + {DEEPSEEK_ROPE} rotary in each of {len(graph.blocks)} layers)")

    def budget(self, graph: ModelGraph) -> int:
        """KV values per token the converted model may cache, all layers."""
        source = sum(cached_values(b.attention) for b in graph.blocks)
        if self.kv_fraction is not None:
            return math.floor(self.kv_fraction * source + 1e-9)
        return self.kv_bytes_per_token // BF16_BYTES

    def apply(self, graph: ModelGraph, ctx: PassContext) -> PassResult:
        result = PassResult(self.name)
        if ctx.runner is None:
            raise KilnError("mla needs calibration text (its latent is a PCA of activations): pass --calib-data")
        candidates = []
        for b in graph.blocks:
            why = unconvertible(b.attention)
            if self.layers is not None and b.index not in self.layers:
                why = "not in the pass's layers"
            if why is None:
                candidates.append(b)
            else:
                result.skipped[f"{b.prefix}.self_attn"] = why
        if not candidates:
            return result
        session = ctx.runner.session(graph)  # opened on the source: the healing teacher
        factors = self._factorize(graph, session, candidates)
        if self.layout == "deepseek":
            return self._apply_deepseek(graph, session, factors, ctx, result)
        options = self._probe(graph, ctx, factors)
        for b in candidates:
            if b.index not in options:
                result.skipped[f"{b.prefix}.self_attn"] = "no rotary width and latent rank fit under its KV values"
        fixed = sum(cached_values(b.attention) for b in graph.blocks if b.index not in options)
        stated = self.budget(graph)
        if stated < fixed:
            raise KilnError(f"KV budget of {stated} values per token is below the {fixed} the layers this pass "
                            "cannot convert keep")
        if not options:
            return result
        choice = choose_ranks(options, stated - fixed, stated)
        eps = graph.spec.rms_norm_eps
        converted, record = [], {}
        for i, picked in choice.items():
            layer = graph.spec.layers[i]
            name = f"{layer.prefix}.self_attn"
            record[str(i)] = {"source_values": cached_values(layer.attention), "rope_dim": None, "rank": None,
                              "probe_kl": {f"{rd}+{r}": kl for _, kl, (rd, r) in
                                           (o for o in options[i] if o[2] is not None)}}
            if picked is None:
                result.skipped[name] = "budget solver kept it GQA (converting costs more KL than it saves)"
                continue
            rope_dim, rank = picked
            f = factors[(i, rope_dim)]
            wq = graph.tensors[f"{layer.attention.linears['q'].name}.weight"]
            install(graph, *converted_layer(f, wq, rank, eps, wq.dtype))
            converted.append(i)
            kl = next(kl for _, kl, p in options[i] if p == picked)
            result.changed[name] = (f"mla: latent rank {rank} + rotary key {rope_dim}: KV values/token "
                                    f"{f.source_values} -> {rank + rope_dim} (probe KL {kl:.4g})")
            result.metrics[f"{name}.probe_kl"] = kl
            record[str(i)].update(rope_dim=rope_dim, rank=rank, rope_components=[list(k) for k in f.kept])
        graph.metadata["mla"] = record
        if converted and self.heal_steps:
            result.notes.append(self._heal(graph, session, converted, ctx))
        return result

    def _apply_deepseek(self, graph: ModelGraph, session, factors: dict[tuple[int, int], LayerFactors],
                        ctx: PassContext, result: PassResult) -> PassResult:
        """Every layer at rank 512 + rotary 64 (checked to fit by `check`)."""
        eps = graph.spec.rms_norm_eps
        converted, record = [], {}
        for (i, rope_dim), f in sorted(factors.items()):
            layer = graph.spec.layers[i]
            wq = graph.tensors[f"{layer.attention.linears['q'].name}.weight"]
            install(graph, *converted_layer(f, wq, DEEPSEEK_RANK, eps, wq.dtype))
            converted.append(i)
            result.changed[f"{layer.prefix}.self_attn"] = (
                f"mla (layout deepseek): latent rank {DEEPSEEK_RANK} + rotary key {rope_dim}: KV values/token "
                f"{f.source_values} -> {DEEPSEEK_RANK + rope_dim}")
            record[str(i)] = {"source_values": f.source_values, "rope_dim": rope_dim, "rank": DEEPSEEK_RANK,
                              "layout": "deepseek", "rope_components": [list(k) for k in f.kept]}
        graph.metadata["mla"] = record
        if converted and self.heal_steps:
            result.notes.append(self._heal(graph, session, converted, ctx))
        return result

    def back_offs(self, graph: ModelGraph, result: PassResult) -> Iterator[Pass]:
        """A larger budget, an eighth of the source's KV at a time, up to the source's (layout deepseek has
        one shape: nothing to back off to)."""
        if self.layout == "deepseek":
            return
        source = sum(cached_values(b.attention) for b in graph.blocks)
        fraction = self.kv_fraction if self.kv_fraction is not None else self.budget(graph) / max(source, 1)
        while fraction + 0.125 < 1:
            fraction += 0.125
            yield dataclasses.replace(self, kv_fraction=round(fraction, 6), kv_bytes_per_token=None)

    # --- steps ----------------------------------------------------------------------------------------------
    def _rope_dims(self, attention: AttentionSpec) -> list[int]:
        """Rotary key widths tried per layer: the requested one, else half a head, a head, 2, 4, ... heads."""
        if self.rope_dim is not None:
            return [self.rope_dim]
        out, width = [], max(2, attention.head_dim // 2 // 2 * 2)  # even: a rotary dim pairs with another
        while width <= attention.num_kv_heads * attention.head_dim:
            out.append(width)
            width *= 2
        return out

    def _factorize(self, graph: ModelGraph, session, blocks: list[LayerSpec]) -> dict[tuple[int, int], LayerFactors]:
        """(layer, rotary key width) -> the layer's factors, from one observation of its inputs."""
        out = {}
        context = min(256, graph.spec.max_position_embeddings)
        with progress.stage("mla: observe attention inputs", total=len(blocks), unit="layers") as task:
            for b in blocks:
                a = b.attention
                width = a.linears["k"].in_features
                cov = torch.zeros(width, width, dtype=torch.float64)
                kept: list[torch.Tensor] = []
                count = [0]

                def callback(_name, x, cov=cov, kept=kept, count=count):
                    x = x.to("cpu", torch.float64)  # from the session's device
                    cov.addmm_(x.T, x)
                    count[0] += x.shape[0]
                    room = NORM_SAMPLE_ROWS - sum(t.shape[0] for t in kept)
                    if room > 0:
                        kept.append(x[:room].float())

                session.observe([a.linears["k"].name], callback)
                if not count[0]:
                    raise KilnError(f"mla: no calibration tokens reached layer {b.index}")
                cov /= count[0]
                weights = [graph.tensors[f"{a.linears[r].name}.weight"] for r in ("q", "k", "v")]
                if self.layout == "deepseek":  # every (D/64)th frequency: theta^(-2j/64), j < 32
                    stride = a.head_dim // DEEPSEEK_ROPE
                    out[(b.index, DEEPSEEK_ROPE)] = factorize(
                        b, *weights, cov, torch.cat(kept), DEEPSEEK_ROPE, context,
                        frequencies=list(range(0, a.head_dim // 2, stride)))
                    task.advance()
                    continue
                for rope_dim in self._rope_dims(a):
                    out[(b.index, rope_dim)] = factorize(b, *weights, cov, torch.cat(kept), rope_dim, context)
                task.advance()
        return out

    def _probe(self, graph: ModelGraph, ctx: PassContext, factors: dict[tuple[int, int], LayerFactors]
               ) -> dict[int, list[tuple[int, float, tuple[int, int] | None]]]:
        """Per layer: (values per token, KL, (rotary width, rank)) at each probed split of each probed total
        (eighths of its source values), and (source values, 0, None) to keep it."""
        eps = graph.spec.rms_norm_eps
        paragraphs = min(self.sensitivity_paragraphs, len(ctx.runner.calibration_tokens))
        plan: dict[int, list[tuple[int, int]]] = {}
        for (i, rope_dim), f in factors.items():
            totals = {e * f.source_values // 8 for e in PROBE_EIGHTHS}
            plan.setdefault(i, []).extend((rope_dim, t - rope_dim) for t in sorted(totals)
                                          if 1 <= t - rope_dim <= f.max_rank)
        options: dict[int, list[tuple[int, float, tuple[int, int] | None]]] = {}
        with progress.stage("mla: rank probes", total=sum(map(len, plan.values())), unit="probes") as task:
            for i, splits in sorted(plan.items()):
                if not splits:
                    continue
                layer = graph.spec.layers[i]
                options[i] = [(cached_values(layer.attention), 0.0, None)]
                wq = graph.tensors[f"{layer.attention.linears['q'].name}.weight"]
                for rope_dim, rank in splits:
                    state = graph.snapshot()
                    # a probe's tensors stay in memory (one layer's): the spill file only grows, and hundreds of
                    # probes of an 8B model would write about 100 GB to it
                    graph.tensors.spill = None
                    try:
                        install(graph, *converted_layer(factors[(i, rope_dim)], wq, rank, eps, wq.dtype))
                        kl = ctx.runner.logit_kl(graph, paragraphs)
                    finally:
                        graph.restore(state)
                    options[i].append((rank + rope_dim, max(float(kl), 0.0), (rope_dim, rank)))
                    task.advance()
                best: dict[int, tuple[float, tuple[int, int]]] = {}
                for values, kl, split in options[i][1:]:
                    if values not in best or kl < best[values][0]:
                        best[values] = (kl, split)
                ctx.log(f"mla: layer {i} least KL by KV values (rotary + latent): "
                        + ", ".join(f"{v} ({s[0]}+{s[1]}): {kl:.4g}" for v, (kl, s) in sorted(best.items())))
        return options

    def _heal(self, graph: ModelGraph, session, layers: list[int], ctx: PassContext) -> str:
        """Distil the converted layers' new projections and latent norms toward the source's logits."""
        note = over_budget(graph, self.heal_steps, self.heal_batch_tokens, self.heal_budget, session.device,
                           "not healed", "healing", "heal_budget")
        if note is not None:
            ctx.log(note)
            return note
        start = time.perf_counter()
        device = session.device  # where the distillation runs: its parameters live there, the graph on the CPU
        params: dict[str, torch.nn.Parameter] = {}
        norms: dict[str, torch.nn.Parameter] = {}
        for i in layers:
            a = graph.spec.layers[i].attention
            for role in HEALED_ROLES:
                name = a.linears[role].name
                params[name] = torch.nn.Parameter(graph.tensors[f"{name}.weight"].to(device, torch.float32, copy=True))
            norm = graph.spec.layers[i].norms[-1]
            norms[norm] = torch.nn.Parameter(graph.tensors[norm].to(device, torch.float32, copy=True))
        objective = session.distillation({n: (lambda p=p: p) for n, p in params.items()}, norms,
                                         self.heal_batch_tokens)
        history = tune([*params.values(), *norms.values()], objective.loss, self.heal_steps, self.heal_lr,
                       log=ctx.log)
        for name, p in params.items():
            graph.tensors[f"{name}.weight"] = p.detach().to("cpu", graph.tensors[f"{name}.weight"].dtype).contiguous()
        for name, p in norms.items():
            graph.tensors[name] = p.detach().to("cpu", graph.tensors[name].dtype).contiguous()
        tokens = sum(objective.batch_tokens(s) for s in range(self.heal_steps))
        return (f"healed {self.heal_steps} steps ({tokens} calibration tokens) in {time.perf_counter() - start:.1f} s: "
                f"KL {history[0]:.5f} -> {history[-1]:.5f} (last step)")
