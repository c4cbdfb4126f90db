"""Sensitivity through the runtime (`ModelRunner.logit_kl`, optimizer.runner) and its picture (a layers x
formats heatmap).

    kl = LogitKl(source_graph, calibration_token_lists)
    kl(graph, paragraphs)  -> mean over next-token positions of KL(source || graph) of the final logits,
                              on the first `paragraphs` calibration paragraphs, computed by the runtime
                              (the graph is lowered exactly as the artifact would be, like the gate)
The source's log-probs are computed once per paragraph and kept (paragraphs x tokens x vocab fp32), so a
precision pass that probes every group in every format pays one candidate forward per probe.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence

import torch

from kiln.calibration.metrics import kl_terms
from kiln.calibration.sensitivity import SensitivityTable
from kiln.kernels.errors import KilnError
from kiln.optimizer.gate import engine_from_graph, log_probs
from kiln.optimizer.lower import kv_cache_table, lower_tensors, roundtrip
from kiln.passes.graph import ModelGraph
from kiln.runtime.engine import Engine


class LogitKl:
    """`RuntimeRunner.logit_kl` (optimizer.runner): KL of the final logits against the source."""

    def __init__(self, source: ModelGraph, token_lists: Sequence[Sequence[int]]):
        self.token_lists = [list(t) for t in token_lists if len(t) >= 2]
        # The source as it is now, by reference (passes replace tensors, never mutate them): the engine is
        # built on first use, so a build whose passes never ask pays nothing.
        tensors, formats = lower_tensors(source)
        self._source_state = (source.spec, tensors, formats, kv_cache_table(source))
        self._source: Engine | None = None
        self._baseline: list[torch.Tensor] = []

    def _source_engine(self) -> Engine:
        if self._source is None:
            spec, tensors, formats, kv_cache = self._source_state
            self._source = Engine(spec, roundtrip(tensors), formats, kv_cache=kv_cache)
            self._source_state = None
        return self._source

    def _baseline_upto(self, paragraphs: int) -> list[torch.Tensor]:
        if len(self._baseline) < paragraphs:
            missing = self.token_lists[len(self._baseline):paragraphs]
            computed: dict[int, torch.Tensor] = {}
            for i, lp, _ in log_probs(self._source_engine(), missing):
                computed[i] = lp
            self._baseline.extend(computed[i] for i in range(len(missing)))
        return self._baseline[:paragraphs]

    def __call__(self, graph: ModelGraph, paragraphs: int) -> float:
        if not self.token_lists:
            raise KilnError("sensitivity needs calibration text: pass --calib-data FILE")
        if paragraphs <= 0:
            raise KilnError(f"sensitivity paragraphs must be positive, got {paragraphs}")
        lists = self.token_lists[:paragraphs]
        baseline = self._baseline_upto(len(lists))
        kl, count = 0.0, 0
        for i, lp, _ in log_probs(engine_from_graph(graph), lists):
            base = baseline[i]
            kl += float(kl_terms(base, lp).sum())
            count += lp.shape[0]
        return kl / count


def render_heatmap(table: SensitivityTable, chosen: Mapping[str, str] | None = None, title: str = "") -> bytes:
    """PNG bytes: one row per group, one column per option, colour log10(KL); the chosen option is boxed.

    Entries a group was not measured in are blank; BF16 (KL 0) is drawn at the colour scale's floor.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    groups, options = table.groups(), table.options()
    if not groups or not options:
        raise KilnError("the sensitivity table is empty; nothing to draw")
    positive = [v for per in table.losses.values() for v in per.values() if v > 0]
    floor = math.log10(min(positive)) - 0.5 if positive else -8.0
    grid = np.full((len(groups), len(options)), np.nan)
    for r, g in enumerate(groups):
        for c, o in enumerate(options):
            v = table.losses[g].get(o)
            if v is not None:
                grid[r, c] = math.log10(v) if v > 0 else floor
    fig, ax = plt.subplots(figsize=(1.6 + 1.25 * len(options), 1.2 + 0.32 * len(groups)), dpi=110)
    cmap = matplotlib.colormaps["magma_r"].with_extremes(bad="#eeeeee")
    image = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap=cmap)
    ax.set_xticks(range(len(options)), options, rotation=30, ha="right", fontsize=8)
    ax.set_yticks(range(len(groups)), groups, fontsize=7)
    for r, g in enumerate(groups):
        for c, o in enumerate(options):
            v = table.losses[g].get(o)
            if v is None:
                continue
            text = "0" if v == 0 else f"{v:.1e}"
            shade = grid[r, c] > (np.nanmin(grid) + np.nanmax(grid)) / 2
            ax.text(c, r, text, ha="center", va="center", fontsize=6, color="white" if shade else "black")
            if chosen and chosen.get(g) == o:
                ax.add_patch(plt.Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, edgecolor="#00b050", lw=2))
    bar = fig.colorbar(image, ax=ax, fraction=0.04, pad=0.02)
    bar.set_label(f"log10 {table.metric} (nats/token)", fontsize=8)
    ax.set_title(title or f"sensitivity: {table.metric}, one group at a time ({table.tokens} tokens)"
                 + ("; box = chosen" if chosen else ""), fontsize=9)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()


def precision_files(precision: Mapping | None) -> dict[str, bytes]:
    """The artifact files a precision pass adds: sensitivity.json (the table and every group's choice) and
    sensitivity.png (the heatmap). Nothing when no precision pass ran."""
    if not precision:
        return {}
    import json

    table = SensitivityTable.from_json(precision["sensitivity"])
    chosen = {g: entry["option"] for g, entry in precision["groups"].items()}
    document = {"pass": precision["pass"], "sensitivity": precision["sensitivity"], "chosen": chosen,
                "effective_bits": precision["effective_bits"]}
    files = {"sensitivity.json": (json.dumps(document, indent=2, sort_keys=True) + "\n").encode()}
    if table.groups():
        files["sensitivity.png"] = render_heatmap(
            table, chosen, f"{precision['pass']}: KL per group and format ({table.tokens} calibration tokens); "
                           f"box = chosen, {precision['effective_bits']:.3f} effective bits")
    return files


def precision_markdown(precision: Mapping) -> list[str]:
    """report.md lines: every linear's final format and why it got it, from the manifest's "precision"."""
    policy = precision.get("policy", {})
    lines = ["## Precision per layer", ""]
    head = (f"`{precision['pass']}`: {precision['effective_bits']:.3f} effective bits per weight "
            f"({precision['weight_bytes']} bytes of weights and scales for {precision['weights']} weights)")
    if policy.get("kind") == "budget":
        head += f"; budget {policy['budget_bits']:.3f} bits ({policy['budget_bytes']} bytes)"
        if precision["weight_bytes"] > policy["budget_bytes"]:
            head += ", exceeded because the gate's back-off promoted groups"
    lines += [head + ".", "",
              (f"Sensitivity: {precision['sensitivity']['metric']} on {precision['sensitivity']['tokens']} "
               "calibration tokens, one group at a time (`sensitivity.json`, heatmap `sensitivity.png`)."), ""]
    experts = precision.get("experts") or {}
    if experts.get("total"):
        lines += [f"Routed experts quantized: {experts.get('quantized', 0)} of {experts['total']}"
                  + (f"; {experts['without_calibration_tokens']} saw no calibration tokens (weight-only "
                     "statistics)" if experts.get("without_calibration_tokens") else "") + ".", ""]
    lines += ["| module | group | format | KL | why |", "|---|---|---|---:|---|"]
    for name, entry in precision["linears"].items():
        kl = precision["groups"][entry["group"]]["kl"]
        lines.append(f"| {name} | {entry['group']} | {entry['option']} | {kl:.2e} | {entry['reason']} |")
    for name, why in precision.get("kept", {}).items():
        lines.append(f"| {name} | | source precision | | {why} |")
    return lines
