"""Pass `draft-head`: attach an EAGLE-style draft head for speculative decoding, trained by self-distillation.

The head has DeepSeek-V3's multi-token-prediction shape (runtime.draft), so the runtime drafts with a Kiln
head and a DeepSeek MTP layer alike:

    eh_proj([enorm(embed(token t+1)), hnorm(target feature t)]) -> one decoder layer -> the target's final
    norm and lm_head (shared, not copied)

The decoder layer has the target's last layer's shape (attention and a dense MLP), initialised at random
(initialising it from the target's last layer did not help: the issue's measurement). Training
(optimizer.measure.draft_training) distils the target itself: KL to its logits and regression on its features, on
calibration.txt and on the target's own greedy continuations of calibration prompts, after every pass that
changes the target (so the head drafts for the model that ships). The target is untouched: the gate's
recovery is exact, and the pass's own gate metric is tau, tokens per target call at `draft_tokens` drafts
(greedy, on the gate's held-out paragraphs: each one's first 16 tokens, 64 new tokens), drafting a tree of
`tree_width` candidates per depth (the runtime's default for an artifact built with it).

A DeepSeek-V3 checkpoint with an MTP layer keeps it as its draft: nothing is trained, tau is measured.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from kiln.calibration.tuning import tune
from kiln.kernels.errors import KilnError, clip
from kiln.passes.base import (
    MAX_BATCH_TOKENS,
    MAX_LR,
    MAX_SAMPLES,
    MAX_SEED,
    MAX_STEPS,
    STEPS_WHY,
    Pass,
    PassContext,
    PassResult,
    check_range,
)
from kiln.passes.gate_result import PassMetric
from kiln.passes.graph import ModelGraph
from kiln.runtime.spec import ExtraModuleSpec, LayerSpec, LinearSpec, norm_size

PREFIX = "draft_head"
DRAFT_KINDS = ("mtp", "draft_head", "eagle3")
PROMPT_TOKENS = 16
TAU_NEW_TOKENS = 64
TAU_PROMPTS = 64  # held-out paragraphs tau is measured on


def _tau(k: int, prompts: int, tree_width: int):
    def measure(candidate, before, token_lists: Sequence[Sequence[int]]) -> float:
        heads = [list(t[:PROMPT_TOKENS]) for t in token_lists if len(t) >= PROMPT_TOKENS][:prompts]
        if not heads:
            raise KilnError(f"tau needs held-out paragraphs of at least {PROMPT_TOKENS} tokens")
        _, stats = candidate.speculative_ids(heads, TAU_NEW_TOKENS, k, candidate.drafter("head", tree_width=tree_width))
        return stats.tau
    return measure


def draft_layer(graph: ModelGraph, prefix: str = f"{PREFIX}.layer") -> LayerSpec:
    """A decoder layer shaped like the target's last, renamed under `prefix`, with a dense MLP."""
    last = graph.spec.layers[-1]
    index = len(graph.spec.layers)
    if last.attention.kind != "gqa":
        raise KilnError(f"draft-head copies the shape of the target's last layer, which has {last.attention.kind} "
                        "attention; only GQA/MHA is supported (a DeepSeek-V3 checkpoint brings its MTP layer)")
    if last.mlp.kind != "dense":
        raise KilnError("draft-head copies the shape of the target's last layer, whose MLP is a mixture of experts; "
                        "only a dense MLP is supported (a DeepSeek-V3 checkpoint brings its MTP layer)")

    def rename(lin: LinearSpec) -> LinearSpec:
        return dataclasses.replace(lin, name=lin.name.replace(last.prefix, prefix, 1), layer=index)

    attention = dataclasses.replace(last.attention, linears={r: rename(lin) for r, lin in last.attention.linears.items()},
                                    sliding_window=None)
    mlp = dataclasses.replace(last.mlp, linears={r: rename(lin) for r, lin in last.mlp.linears.items()})
    norms = tuple(n.replace(last.prefix, prefix, 1) for n in last.norms)
    output_norms = tuple(n.replace(last.prefix, prefix, 1) for n in last.output_norms)
    return LayerSpec(index, prefix, attention, mlp, norms, output_norms=output_norms)


ARCHITECTURES = ("mtp", "eagle3")


def eagle3_aux_layers(num_layers: int) -> tuple[int, ...]:
    """The three target layers an EAGLE-3 head reads (their outputs, before the final norm): ModelOpt's
    default {1, L//2 - 1, L - 4}, which vLLM's default (2, L//2, L-3), counted before the layer, names too;
    where that gives fewer than three (vLLM's fc takes exactly three), L//4, L//2 and the last layer."""
    ids = sorted({1, max(0, num_layers // 2 - 1), max(0, num_layers - 4)})
    if len(ids) == 3 and ids[-1] < num_layers:
        return tuple(ids)
    if num_layers < 3:
        raise KilnError(f"an EAGLE-3 head reads three target layers; this model has {num_layers}")
    spread = sorted({num_layers // 4, num_layers // 2, num_layers - 1})  # the last layer's output included
    return tuple(spread) if len(spread) == 3 else (0, 1, 2)


def eagle3_carries(spec) -> bool:
    """Whether an EAGLE-3 head (a Llama decoder layer, as vLLM and SGLang load it) fits the target's shape: not
    with (1 + w) norms or sandwich norms (Gemma 3), which a Llama layer does not have."""
    return not spec.norm_offset and not any(layer.output_norms for layer in spec.layers)


def head_module(graph: ModelGraph, architecture: str = "mtp", draft_vocab: int = 0) -> ExtraModuleSpec:
    """The draft head's spec for `graph`.

    "mtp": eh_proj, enorm, hnorm and a decoder layer shaped like the target's last (`draft_layer`).
    "eagle3": EAGLE-3 as vLLM and SGLang load it: fc over three target layers' outputs, a decoder layer whose
    q/k/v read [input_layernorm(embedding), hidden_norm(hidden)] (2 x hidden), a final norm; the target's
    lm_head, or with `draft_vocab` its own lm_head over that many tokens and their d2t offsets."""
    hidden, vocab = graph.spec.hidden_size, graph.spec.vocab_size
    if draft_vocab and architecture != "eagle3":
        raise KilnError("draft-head: draft_vocab is EAGLE-3's draft vocabulary; set architecture: eagle3 or "
                        "draft_vocab: 0")
    if draft_vocab >= vocab:
        raise KilnError(f"draft-head: draft_vocab {draft_vocab} is not smaller than the vocabulary's {vocab}; "
                        "0 drafts over the whole vocabulary")
    if architecture == "eagle3":
        if not eagle3_carries(graph.spec):
            raise KilnError(f"draft-head: an EAGLE-3 head is a Llama decoder layer as vLLM and SGLang load it; "
                            f"{graph.spec.model_type}'s (1 + w) and sandwich norms do not carry over; use "
                            "architecture: mtp")
        layer = draft_layer(graph, f"{PREFIX}.layers.0")
        wide = {role: dataclasses.replace(lin, in_features=2 * hidden) if role in ("q", "k", "v") else lin
                for role, lin in layer.attention.linears.items()}
        layer = dataclasses.replace(layer, attention=dataclasses.replace(layer.attention, linears=wide))
        aux = eagle3_aux_layers(len(graph.spec.layers))
        linears = {"fc": LinearSpec(f"{PREFIX}.fc", "draft_proj", len(aux) * hidden, hidden, layer.index)}
        if draft_vocab:
            linears["lm_head"] = LinearSpec(f"{PREFIX}.lm_head", "draft_proj", hidden, draft_vocab, layer.index)
        return ExtraModuleSpec(
            "eagle3", PREFIX, layer, linears,
            (f"{PREFIX}.layers.0.hidden_norm.weight", f"{PREFIX}.norm.weight"), aux_layers=aux,
            draft_vocab=f"{PREFIX}.d2t" if draft_vocab else None)
    layer = draft_layer(graph)
    return ExtraModuleSpec(
        "draft_head", PREFIX, layer,
        {"eh_proj": LinearSpec(f"{PREFIX}.eh_proj", "draft_proj", 2 * hidden, hidden, layer.index)},
        (f"{PREFIX}.enorm.weight", f"{PREFIX}.hnorm.weight"))


def draft_vocabulary(token_lists: Sequence[Sequence[int]], size: int, vocab: int) -> tuple[torch.Tensor, float]:
    """EAGLE-3's draft vocabulary: the `size` tokens most frequent in `token_lists` (ties: the lower id; too
    few distinct tokens: the lowest unseen ids fill it), as d2t offsets (draft id i -> target id i + d2t[i], the
    ids ascending), and the fraction of the lists' tokens it holds."""
    counts = token_counts(token_lists, vocab)
    order = sorted(range(vocab), key=lambda i: (-int(counts[i]), i))  # stable: ties by id
    ids = torch.tensor(sorted(order[:size]), dtype=torch.long)
    total = int(counts.sum())
    return ids - torch.arange(size), (int(counts[ids].sum()) / total if total else 0.0)


def token_counts(token_lists: Sequence[Sequence[int]], vocab: int) -> torch.Tensor:
    counts = torch.zeros(vocab, dtype=torch.long)
    for t in token_lists:
        counts += torch.bincount(torch.as_tensor(t, dtype=torch.long), minlength=vocab)[:vocab]
    return counts


def vocabulary_coverage(token_lists: Sequence[Sequence[int]], d2t: torch.Tensor) -> float:
    """The fraction of the lists' tokens a draft vocabulary (d2t offsets) holds."""
    ids = torch.arange(d2t.numel()) + d2t.long()
    counts = token_counts(token_lists, int(ids.max()) + 1 if ids.numel() else 1)
    total = sum(len(t) for t in token_lists)
    return int(counts[ids].sum()) / total if total else 0.0


def attach(graph: ModelGraph, module: ExtraModuleSpec, tensors: dict[str, torch.Tensor]) -> None:
    """Put the head's tensors (floating ones stored in the embedding's dtype; the d2t ids as int64) and spec
    into `graph`."""
    dtype = graph.tensors[graph.embedding].dtype
    for name, value in tensors.items():
        value = value.detach()
        graph.tensors[name] = (value.to(dtype) if value.is_floating_point() else value).contiguous()
    graph.set_spec(dataclasses.replace(graph.spec, extra_modules=(*graph.spec.extra_modules, module)))


def init_tensors(module: ExtraModuleSpec, hidden: int, seed: int, norm_offset: float = 0.0) -> dict[str, torch.Tensor]:
    """Random linears (std 0.02, the usual init), unit norms (stored as 1 - norm_offset: Gemma's scale by 1 + w);
    the input projection starts by passing the target's feature through (MTP shape: eh_proj = [0, I]; EAGLE-3:
    fc reads the last aux layer), so the untrained head predicts what the target's own head would say at t+1's
    input."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for lin in module.layer.linears():
        out[f"{lin.name}.weight"] = torch.randn(lin.out_features, lin.in_features, generator=gen) * 0.02
    for name in (*module.layer.norms, *module.layer.output_norms, *module.norms):
        out[name] = torch.full((norm_size(name, module.layer.attention, hidden),), 1.0 - norm_offset)
    proj = module.linears["fc" if module.kind == "eagle3" else "eh_proj"]
    weight = torch.randn(hidden, proj.in_features, generator=gen) * 0.02
    weight[:, -hidden:] += torch.eye(hidden)
    out[f"{proj.name}.weight"] = weight
    return out


@dataclass(frozen=True)
class DraftHead(Pass):
    draft_tokens: int = 4  # k: drafts per verification, for the gate's tau
    tree_width: int = 3  # greedy tree drafting: the top-3 tokens at each depth verified together (1: a chain)
    # eagle3: EAGLE-3, which `optimize export --format eagle3` writes for vLLM / SGLang; mtp: DeepSeek's MTP
    # shape, which drafts a little better on stories260K (benchmarks/results/speculative.md) but no serving
    # engine loads beside a Llama target; auto: eagle3 where its Llama layer carries the target's norms, else
    # mtp (Gemma 3's (1 + w) and sandwich norms)
    architecture: str = "auto"
    train_steps: int = 1200
    batch_tokens: int = 2048
    lr: float = 2e-3
    generated: int = 256  # calibration prompts the target continues greedily for the training text
    generated_tokens: int = 128
    min_tau: float = 1.5  # the gate's floor on tau
    seed: int = 0
    # EAGLE-3's draft vocabulary: the head scores only the `draft_vocab` tokens most frequent in its training
    # text (its own lm_head: the target's rows there, frozen), which cuts each draft step's lm_head by
    # vocab / draft_vocab; 0: the whole vocabulary through the target's lm_head
    draft_vocab: int = 0
    # drafting steps unrolled in training (EAGLE-3's training-time test: the head trains on its own outputs,
    # attending as it drafts); each costs about one more forward and backward of the head, and holds its own
    # [batch_tokens, vocabulary] logits until the backward (a large vocabulary: use draft_vocab, or lower
    # batch_tokens); 0: draft_tokens
    unroll: int = 0
    # a Kiln artifact built from the same model whose draft head, of this recipe's shape, starts training in
    # place of the random init (its draft vocabulary too): train_steps more steps on a head that is underfit
    init_from: str = ""

    name: ClassVar[str] = "draft-head"
    exclusive: ClassVar[str | None] = "draft module"  # the runtime drafts with one; a second would replace it
    default_floor: ClassVar[float] = 0.9999  # the target is untouched: its figures must not move
    default_max_kl: ClassVar[float] = 1e-6
    default_min_top1: ClassVar[float] = 0.9999
    # the head drafts for the model that ships: every pass that changes the target runs first
    runs_after: ClassVar[frozenset[str]] = frozenset({"mla", "weight-quant", "kv-cache", "auto-precision",
                                                      "production-precision"})

    def __post_init__(self):
        check_range("draft-head: draft_tokens", self.draft_tokens, 1, 16, integer=True)
        check_range("draft-head: tree_width", self.tree_width, 1, 8, integer=True, why="1: a chain")
        check_range("draft-head: train_steps", self.train_steps, 0, MAX_STEPS, integer=True, why=STEPS_WHY)
        check_range("draft-head: batch_tokens", self.batch_tokens, 1, MAX_BATCH_TOKENS, integer=True)
        check_range("draft-head: generated", self.generated, 0, MAX_SAMPLES, integer=True,
                    why="each is a generation by the target")
        check_range("draft-head: generated_tokens", self.generated_tokens, 0, 1 << 16, integer=True,
                    why="tokens each generation decodes")
        check_range("draft-head: lr", self.lr, 0, MAX_LR, low_open=True)
        check_range("draft-head: seed", self.seed, 0, MAX_SEED, integer=True)
        check_range("draft-head: draft_vocab", self.draft_vocab, 0, 1 << 24, integer=True,
                    why="0: the whole vocabulary")
        check_range("draft-head: unroll", self.unroll, 0, 16, integer=True, why="0: draft_tokens")
        if not isinstance(self.init_from, str):
            raise KilnError(f"draft-head: init_from must be an artifact's path, got {self.init_from!r}")
        if self.architecture not in (*ARCHITECTURES, "auto"):
            raise KilnError(f"draft-head: architecture={self.architecture!r} is not allowed; choose one of "
                            f"{', '.join(ARCHITECTURES)}, auto")
        tau = self.min_tau
        if isinstance(tau, bool) or not isinstance(tau, int | float) or not 1 <= tau <= self.draft_tokens + 1:
            raise KilnError(f"draft-head: min_tau must be >= 1 (tau counts the target's own token) and <= "
                            f"draft_tokens + 1 = {self.draft_tokens + 1} (every draft accepted), got {tau!r}")

    def resolved(self, graph: ModelGraph) -> str:
        """The architecture to attach: `architecture`, "auto" resolved for `graph`."""
        if self.architecture != "auto":
            return self.architecture
        return "mtp" if not eagle3_carries(graph.spec) else "eagle3"

    def metrics(self) -> tuple[PassMetric, ...]:
        return (PassMetric("tau", self.min_tau, _tau(self.draft_tokens, TAU_PROMPTS, self.tree_width)),)

    def check(self, graph: ModelGraph, target) -> None:
        if not any(m.kind in DRAFT_KINDS for m in graph.spec.extra_modules):
            # refuses a shape it cannot copy, or a draft vocabulary it cannot have, before anything runs
            head_module(graph, self.resolved(graph), self.draft_vocab)  # init_from: the build's check_init_from

    def apply(self, graph: ModelGraph, ctx: PassContext) -> PassResult:
        result = PassResult(self.name)
        existing = [m for m in graph.spec.extra_modules if m.kind in DRAFT_KINDS]
        if existing:
            graph.set_spec(dataclasses.replace(graph.spec, extra_modules=tuple(
                dataclasses.replace(m, tree_width=self.tree_width) if m is existing[0] else m
                for m in graph.spec.extra_modules)))
            result.changed[existing[0].name] = (f"the checkpoint's own {existing[0].kind} module is the draft; "
                                                "nothing trained")
            result.notes.append(f"speculative decoding drafts with {existing[0].name} ({existing[0].kind})")
            return result
        if ctx.runner is None:
            raise KilnError("draft-head trains on calibration text: give --calib-data (or keep ../shared's)")
        hidden = graph.spec.hidden_size
        architecture = self.resolved(graph)
        started = time.perf_counter()
        calibration = [list(t) for t in ctx.runner.all_token_lists]  # every paragraph, not observation's few
        prompts = [t[:PROMPT_TOKENS] for t in calibration if len(t) >= PROMPT_TOKENS][: self.generated]
        if len(prompts) < self.generated:
            result.notes.append(f"generated {len(prompts)} continuations, not {self.generated}: the calibration text "
                                f"has {len(prompts)} paragraphs of {PROMPT_TOKENS}+ tokens to prompt with "
                                f"(of {len(calibration)})")
        generations = []
        if prompts and self.generated_tokens:
            context = graph.spec.max_position_embeddings
            new = max(0, min(self.generated_tokens, context - PROMPT_TOKENS))
            generations = [p + g for p, g in zip(prompts, ctx.runner.generate(graph, prompts, new), strict=True)]
        module = dataclasses.replace(head_module(graph, architecture, self.draft_vocab), tree_width=self.tree_width)
        init = init_tensors(module, hidden, self.seed, graph.spec.norm_offset)
        coverage = None
        if self.init_from:
            if module.draft_vocab:  # its shape for the template; the artifact's ids replace it
                init[module.draft_vocab] = torch.zeros(self.draft_vocab, dtype=torch.long)
            init, resumed = ctx.runner.resumed_head(self.init_from, graph, module, init)
            result.notes.append(resumed)
            if module.draft_vocab:
                coverage = vocabulary_coverage([*calibration, *generations], init[module.draft_vocab])
        elif module.draft_vocab:
            init[module.draft_vocab], coverage = draft_vocabulary([*calibration, *generations], self.draft_vocab,
                                                                  graph.spec.vocab_size)
        unroll = self.unroll or self.draft_tokens
        objective = ctx.runner.draft_distillation(graph, module, init, generations, self.batch_tokens, unroll)
        history = tune(list(objective.parameters.values()), objective.loss, self.train_steps, self.lr,
                       log=ctx.log)
        trained = dict(objective.parameters)
        if module.draft_vocab:  # the frozen head rows and the id map ship with it
            trained[f"{module.linears['lm_head'].name}.weight"] = objective.module.head.weight
            trained[module.draft_vocab] = init[module.draft_vocab]
        attach(graph, module, trained)
        seconds = time.perf_counter() - started
        params = sum(p.numel() for p in objective.parameters.values())
        tokens = sum(objective.batch_tokens(s) for s in range(self.train_steps))
        result.changed[PREFIX] = (f"{architecture} draft head attached: {params} parameters"
                                  + (f", reading layers {list(module.aux_layers)}" if module.aux_layers else "")
                                  + (f", drafting over {self.draft_vocab} tokens" if module.draft_vocab else ""))
        result.metrics.update({"parameters": params, "train_steps": self.train_steps, "train_tokens": tokens,
                               "generated": len(generations), "unrolled_steps": unroll,
                               "train_seconds": round(seconds, 1)})
        if coverage is not None:
            result.metrics.update({"draft_vocab": self.draft_vocab, "draft_vocab_coverage": round(coverage, 5)})
            chosen = (f"{clip(self.init_from)}'s" if self.init_from
                      else "the most frequent in the training text:")
            result.notes.append(f"draft vocabulary: {self.draft_vocab} of {graph.spec.vocab_size} tokens, {chosen} "
                                f"{coverage:.2%} of the training text's tokens; a token outside it is never drafted "
                                "(the target still emits it)")
        if history:
            result.metrics["final_loss"] = history[-1]
        result.notes.append(f"self-distilled on the calibration text and {len(generations)} "
                            f"of the target's own continuations: {self.train_steps} steps, {tokens} tokens, "
                            f"{unroll} drafting steps unrolled, "
                            f"{seconds:.0f} s; "
                            + ("its own final norm; its lm_head the target's rows over the draft vocabulary"
                               if module.draft_vocab else "its own final norm; the target's lm_head"
                               if architecture == "eagle3" else "lm_head and final norm shared with the target"))
        return result
