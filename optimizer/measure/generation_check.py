"""The long-generation check: greedy continuations of held-out prompts, candidate against baseline.

Perplexity is scored with the true text as input (teacher forcing), so it cannot see what happens when a
model reads its own output: a model can score within 1% of its source and still fall into a loop after a few
dozen tokens (a known NVFP4 failure). This check decodes NEW_TOKENS greedily from each prompt (the first
PROMPT_TOKENS of a held-out paragraph; end-of-sequence does not stop it) with both models, through the runtime
and its KV cache, and reports per generation:

    agreement per quarter  of the candidate's tokens in each NEW_TOKENS/4 span, the fraction the baseline
                           would have chosen greedily after the same prefix (the candidate's own text,
                           teacher-forced through the baseline). Greedy paths of two close models part within
                           a few dozen tokens on a small model (near-ties), so the tokens at equal positions
                           stop being comparable; this asks instead whether the candidate still writes what
                           the baseline would, in the text it is writing. It falls when a model collapses.
    position agreement     the fraction of positions holding the same token in both generations (reported)
    distinct-4 ratio       distinct 4-grams / 4-grams of the candidate's generations, over the baseline's: a
                           loop repeats its 4-grams. Small greedy models repeat themselves too, hence the ratio.
    first divergence       the median position of the first token where the two generations differ

Each has a floor (GenerationFloors); the defaults pass the FP8, NVFP4 and MLA builds of stories260K and
SmolLM2 with a margin and fail a model that loops.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kiln.calibration.progress import stage
from kiln.kernels.errors import KilnError
from kiln.optimizer.measure.gate import Check
from kiln.runtime.engine import Engine

PROMPT_TOKENS = 16
NEW_TOKENS = 256
QUARTERS = 4
BATCH = 16
"""Prompts decoded together (one KV pool)."""


@dataclass(frozen=True)
class GenerationFloors:
    agreement: float = 0.80  # each quarter
    distinct4_ratio: float = 0.75
    first_divergence: float = 4.0  # median, tokens

    def __post_init__(self):
        for name in ("agreement", "distinct4_ratio"):
            value = getattr(self, name)
            if not 0 <= value <= 1.5:
                raise KilnError(f"the long-generation {name.replace('_', '-')} floor must be in [0, 1.5], got {value}")
        if not 0 <= self.first_divergence <= NEW_TOKENS * 64:
            raise KilnError(f"the first-divergence floor must be a number of tokens >= 0, got {self.first_divergence}")


@dataclass(frozen=True)
class LongGeneration:
    prompts: int
    new_tokens: int
    agreement: tuple[float, ...]  # per quarter
    position_agreement: tuple[float, ...]  # per quarter
    distinct4: float
    baseline_distinct4: float
    first_divergence: float  # median over prompts
    sample: str = ""  # the first candidate generation, decoded, for the report

    @property
    def distinct4_ratio(self) -> float:
        return self.distinct4 / self.baseline_distinct4 if self.baseline_distinct4 > 0 else 1.0

    def checks(self, floors: GenerationFloors) -> list[Check]:
        span = self.new_tokens // QUARTERS
        out = [Check(f"generation agreement, tokens {q * span}-{(q + 1) * span}", value, floors.agreement,
                     detail=f"position agreement {self.position_agreement[q]:.3f}")
               for q, value in enumerate(self.agreement)]
        out.append(Check("generation distinct-4 ratio", self.distinct4_ratio, floors.distinct4_ratio,
                         detail=f"candidate {self.distinct4:.3f}, baseline {self.baseline_distinct4:.3f}"))
        out.append(Check("generation first divergence (median token)", self.first_divergence,
                         floors.first_divergence))
        return out

    def to_json(self) -> dict:
        return {"prompts": self.prompts, "new_tokens": self.new_tokens, "agreement": list(self.agreement),
                "position_agreement": list(self.position_agreement), "distinct4": self.distinct4,
                "baseline_distinct4": self.baseline_distinct4, "distinct4_ratio": self.distinct4_ratio,
                "first_divergence": self.first_divergence}


def distinct_ngrams(tokens: Sequence[int], n: int = 4) -> float:
    """Distinct n-grams over n-grams (1.0 for a text too short to hold one)."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def generation_prompts(token_lists: Sequence[Sequence[int]], count: int,
                       prompt_tokens: int = PROMPT_TOKENS) -> list[list[int]]:
    """The first `prompt_tokens` of the first `count` paragraphs that hold that many."""
    prompts = [list(t[:prompt_tokens]) for t in token_lists if len(t) >= prompt_tokens][:count]
    if len(prompts) < count:
        raise KilnError(f"the long-generation check needs {count} paragraphs of at least {prompt_tokens} tokens; "
                        f"the data has {len(prompts)}: lower --generate or give more text")
    return prompts


def _greedy(engine: Engine, prompts: list[list[int]], new_tokens: int, task) -> list[list[int]]:
    out = []
    for start in range(0, len(prompts), BATCH):
        batch = prompts[start:start + BATCH]
        out += [tokens for tokens, _ in engine.generate_ids(batch, new_tokens, stop_ids=())]
        task.advance(len(batch))
    return out


@torch.inference_mode()
def _baseline_choices(baseline: Engine, prompts: list[list[int]], generations: list[list[int]]) -> list[list[int]]:
    """The baseline's greedy choice at each generated position, reading the candidate's prompt + generation."""
    choices = []
    for start in range(0, len(prompts), BATCH):
        rows = [p + g[:-1] for p, g in zip(prompts[start:start + BATCH], generations[start:start + BATCH],
                                             strict=True)]
        for prompt, hidden in zip(prompts[start:start + BATCH], baseline.hidden_states(rows), strict=True):
            picked = hidden[len(prompt) - 1:]
            choices.append(baseline.head_logits(picked).argmax(-1).tolist())
    return choices


def long_generation(candidate: Engine, baseline: Engine, prompts: list[list[int]],
                    new_tokens: int = NEW_TOKENS) -> LongGeneration:
    if new_tokens < QUARTERS or new_tokens % QUARTERS:
        raise KilnError(f"--generate-tokens must be a positive multiple of {QUARTERS}, got {new_tokens}")
    context = min(candidate.spec.max_position_embeddings, baseline.spec.max_position_embeddings)
    longest = max(len(p) for p in prompts)
    if longest + new_tokens > context:
        raise KilnError(f"prompts of {longest} tokens + {new_tokens} generated exceed the model's context "
                        f"{context}: lower --generate-tokens")
    with stage("long generation", total=2 * len(prompts), unit="prompts") as task:
        base = _greedy(baseline, prompts, new_tokens, task)
        cand = _greedy(candidate, prompts, new_tokens, task)
    choices = _baseline_choices(baseline, prompts, cand)
    span = new_tokens // QUARTERS

    def per_quarter(pairs) -> tuple[float, ...]:
        return tuple(statistics.fmean(sum(a[t] == b[t] for t in range(q * span, (q + 1) * span)) / span
                                      for a, b in pairs) for q in range(QUARTERS))

    divergence = [next((t for t in range(new_tokens) if b[t] != c[t]), new_tokens) for b, c in zip(base, cand)]
    sample = candidate.tokenizer.decode(prompts[0] + cand[0]) if candidate.tokenizer is not None else ""
    return LongGeneration(
        prompts=len(prompts), new_tokens=new_tokens,
        agreement=per_quarter(list(zip(cand, choices, strict=True))),
        position_agreement=per_quarter(list(zip(cand, base, strict=True))),
        distinct4=statistics.fmean(distinct_ngrams(c) for c in cand),
        baseline_distinct4=statistics.fmean(distinct_ngrams(b) for b in base),
        first_divergence=float(statistics.median(divergence)), sample=sample)
