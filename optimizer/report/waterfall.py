"""The waterfall: a model priced step by step from the source as served to the model as served (economics.py
lists the steps and their baselines).

    scn = scenario("name", "artifact", spec, source_spec, formats, kv_table, lm_head_tied, speculation)
    price_steps(scn.steps, device, price_per_hour, context)      # one row a step, factor against the step before
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kiln.kernels.formats import ActivationFormat, WeightFormat
from kiln.kernels.registry import WEIGHT_FORMATS
from kiln.kernels.targets import Device
from kiln.optimizer.report.figures import LinearCost, ModelFigures, linear_cost, spec_figures
from kiln.optimizer.report.roofline import Speculation, decode_step, max_batch, usd_per_mtok
from kiln.runtime.kv_format import kv_bytes_per_token
from kiln.runtime.spec import LinearSpec, ModelSpec

FP8_STEP_FORMAT = WeightFormat.FP8_E4M3
"""The "weights FP8" step's format: what it prices the FP4/FP6 linears as (the FP4 step's baseline). Its note
counts every 8-bit linear (E4M3 and E5M2) as its own."""


# --- the waterfall --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    """One step of the waterfall: the served model after it, or None where it does not apply (`note` says why)."""

    name: str
    label: str
    against: str
    figures: ModelFigures | None
    speculation: Speculation | None = None
    note: str = ""


def price_steps(steps: Sequence[Step], device: Device, price_per_hour: float, context: int) -> list[dict]:
    """Each step at its own largest batch on `device`; factor = $/Mtok before / after (1 where not applied)."""
    rows, current, before = [], None, None
    for step in steps:
        applied = step.figures is not None
        if applied:
            current = (step.figures, step.speculation)
        figures, speculation = current
        batch = max_batch(figures, device, context)
        cost = tps = None
        if batch >= 1:
            tps = decode_step(figures, device, batch, context, speculation).tokens_per_second
            cost = usd_per_mtok(price_per_hour, tps)
        factor = None  # the source's row, or a step whose cost or baseline does not fit
        if rows and not applied:
            factor = 1.0
        elif rows and before is not None and cost is not None:
            factor = before / cost
        rows.append({"step": step.name, "label": step.label, "against": step.against, "applied": applied,
                     "note": step.note, "batch": batch, "tokens_per_s": tps, "usd_per_mtok": cost, "factor": factor})
        before = cost
    return rows


def _element_bits(fmt: str) -> int | None:
    """Bits of one stored value of `fmt` (kernels' WeightCodec.element_bits); None for a name no format has, which
    linear_cost refuses."""
    codec = WEIGHT_FORMATS.get(fmt)
    return None if codec is None else codec.element_bits


def _below_fp8(fmt: str) -> bool:
    """Whether the "weights FP4" step prices `fmt` (against FP8 on the same linears): below 8 bits a value."""
    bits = _element_bits(fmt)
    return bits is not None and bits < 8


def _quantized(fmt: str) -> bool:
    """Whether `fmt` stores a weight quantized, not as its values (dense); an unknown name counts, for linear_cost
    to refuse."""
    codec = WEIGHT_FORMATS.get(fmt)
    return codec is None or codec.dequantizes


def _format_of(formats: Mapping[str, Mapping], lin: LinearSpec) -> Mapping:
    return formats.get(lin.name) or {"format": WeightFormat.DENSE, "activation": ActivationFormat.NONE}


def _cost(formats: Mapping[str, Mapping], fp4_as_fp8: bool) -> Callable[[LinearSpec], LinearCost]:
    def cost(lin: LinearSpec) -> LinearCost:
        e = _format_of(formats, lin)
        if fp4_as_fp8 and _below_fp8(e["format"]):  # the FP8 baseline: same linears, same activation choice
            act = (ActivationFormat.NONE if e.get("activation", "none") == "none"
                   else ActivationFormat.FP8_DYNAMIC_PER_TOKEN)
            return linear_cost(lin, FP8_STEP_FORMAT, act)
        return linear_cost(lin, e["format"], e.get("activation", ActivationFormat.NONE), e.get("in_features"))
    return cost


def _format_summary(formats: Mapping[str, Mapping]) -> str:
    counts = Counter((e["format"], e.get("activation", "none")) for e in formats.values())
    return ", ".join(f"{n} linears {fmt}" + ("" if act == "none" else f" with {act} activations")
                     for (fmt, act), n in sorted(counts.items()))


@dataclass(frozen=True)
class Scenario:
    """What a report prices: the steps from the source as served to the model as served (the last applied)."""

    name: str
    kind: str  # "artifact" or "config"
    model_type: str
    steps: tuple[Step, ...]
    kv_layers: tuple[dict, ...] = ()  # per layer: KV bytes/token of the source and of the served model
    notes: tuple[str, ...] = field(default=())

    @property
    def served(self) -> Step:
        return [s for s in self.steps if s.figures is not None][-1]


def scenario(name: str, kind: str, spec: ModelSpec, source_spec: ModelSpec, formats: Mapping[str, Mapping],
             kv_table: Mapping | None, lm_head_tied: bool, speculation: Speculation | None,
             notes: Sequence[str] = ()) -> Scenario:
    """The waterfall of a model: `spec` and its per-linear `formats` and KV table, from `source_spec`."""
    bf16 = _cost({}, False)
    kv_source = kv_bytes_per_token(source_spec, None)
    kv_bf16 = kv_bytes_per_token(spec, None)
    kv_served = kv_bytes_per_token(spec, kv_table)
    windowed = any(layer.attention.sliding_window for layer in source_spec.layers)
    window_sizes = sorted({layer.attention.sliding_window for layer in source_spec.layers} - {None})
    local = sum(1 for layer in source_spec.layers if layer.attention.sliding_window)
    table_entry = formats.get(spec.embedding.removesuffix(".weight"))
    if not table_entry or table_entry.get("role") != "embedding" or not _quantized(table_entry["format"]):
        table_entry = None

    def table(fp4_as_fp8: bool) -> LinearCost | None:
        """The embedding table stored quantized, priced like a weight-only linear of its shape (the LM head's)."""
        if table_entry is None:
            return None
        if fp4_as_fp8 and _below_fp8(table_entry["format"]):
            return linear_cost(spec.lm_head, FP8_STEP_FORMAT, ActivationFormat.NONE)
        return linear_cost(spec.lm_head, table_entry["format"], ActivationFormat.NONE, table_entry.get("in_features"))

    table_note = ("" if table_entry is None else f"; the embedding table {table_entry['format']}"
                  + (" (the tied LM head reads it)" if lm_head_tied else ""))
    quantized = {k: e for k, e in formats.items() if _quantized(e["format"]) and e.get("role") != "embedding"}
    fp4 = {k: e for k, e in quantized.items() if _below_fp8(e["format"])}
    fp8 = {k: e for k, e in quantized.items() if _element_bits(e["format"]) == 8}
    # the weight steps apply when only the table is quantized, too
    weights_step = bool(quantized) or table_entry is not None
    fp4_step = bool(fp4) or (table_entry is not None and _below_fp8(table_entry["format"]))
    restructured = [a.attention.kind for a in source_spec.layers] != [b.attention.kind for b in spec.layers]
    served = _cost(formats, False)
    kinds = sorted({layer.attention.kind.upper() for layer in source_spec.layers})
    steps = [
        Step("source", "source as served" + (", full attention" if windowed else ""), "",
             spec_figures(source_spec, bf16, kv_source, lm_head_tied, windows=False),
             note=(f"BF16 weights and GEMMs, paged BF16 KV cache of its own {'/'.join(kinds)} attention, "
                   "no speculation" + ("; every layer attends and caches the whole context (the sliding-window "
                                       "step's baseline)" if windowed else ""))),
        Step("window", "sliding-window attention", "full attention on every layer",
             spec_figures(source_spec, bf16, kv_source, lm_head_tied) if windowed else None,
             note=(f"{local} of {len(source_spec.layers)} layers keep only their last "
                   f"{'/'.join(map(str, window_sizes))} tokens (the serving engine frees the blocks leaving the "
                   "window, as vLLM does)" if windowed else "not applied: every layer attends the whole context")),
        Step("mla", "MLA (KV structure)", "the paged GQA source (BF16)",
             spec_figures(spec, bf16, kv_bf16, lm_head_tied) if restructured else None,
             note=(f"KV bytes/token {sum(kv_source.values())} -> {sum(kv_bf16.values())} (BF16); per layer in the MLA "
                   "table" if restructured else
                   "not applied: no MLA conversion" + (" (the source's own attention is MLA)"
                                                       if "MLA" in kinds else ""))),
        Step("fp8", "weights FP8", "BF16 weights",
             spec_figures(spec, _cost(formats, True), kv_bf16, lm_head_tied, table=table(True)) if weights_step
             else None,
             note=(("FP8 in place of the FP4/FP6 linears (the FP4 step's baseline); " if fp4_step else "")
                   + (_format_summary(fp8) or "no FP8 linears of its own")
                   + table_note if weights_step else "not applied: every linear BF16")),
        Step("fp4", "weights FP4/FP6" if any(_element_bits(e["format"]) == 6 for e in fp4.values())
             else "weights FP4", "FP8 on the same GPU",
             spec_figures(spec, served, kv_bf16, lm_head_tied, table=table(False)) if fp4_step else None,
             note=(_format_summary(fp4) or "no FP4 linears of its own") + table_note if fp4_step
             else "not applied: no FP4 weights"),
        Step("kv", "KV-cache quantization", "a BF16 KV cache",
             spec_figures(spec, served, kv_served, lm_head_tied, table=table(False)) if kv_served != kv_bf16 else None,
             note=(f"KV bytes/token {sum(kv_bf16.values())} -> {sum(kv_served.values())}" if kv_served != kv_bf16
                   else "not applied: BF16 KV cache")),
    ]
    final = spec_figures(spec, served, kv_served, lm_head_tied, table=table(False))
    steps.append(Step("speculation", "speculation", "no speculation, at the same max batch",
                      final if speculation else None, speculation,
                      note=speculation_note(speculation)))
    layers = ()
    if restructured:
        before, after = kv_bytes_per_token(source_spec, None), kv_bytes_per_token(spec, kv_table)
        layers = tuple({"layer": i, "attention": spec.layers[i].attention.kind,
                        "source_bytes_per_token": before[i], "bytes_per_token": after[i]} for i in sorted(after))
    return Scenario(name, kind, spec.model_type, tuple(steps), layers, tuple(notes))


def speculation_note(speculation: Speculation | None) -> str:
    if speculation is None:
        return "not applied: no draft head (no tau recorded)"
    note = f"tau {speculation.tau:g} tokens per verification of {speculation.draft_tokens} drafts"
    if speculation.break_even is not None:
        note += (f", measured below the break-even batch {speculation.break_even}: from that batch on it is off and "
                 "the step decodes plainly (factor 1.00)")
    return note + (f" ({speculation.source})" if speculation.source else "")
