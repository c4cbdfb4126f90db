"""The economics report as text: report.md's "## Economics" section and the command's rich tables.

    lines = economics_markdown(report)          # report.md lines; the waterfall PNG linked by name
    for table in economics_tables(report): console.print(table)
    print(not_modelled_text(report))
"""

from __future__ import annotations

from collections.abc import Callable

from rich.table import Table

from kiln.optimizer.report.roofline import CONCURRENCY_CONTEXTS
from kiln.optimizer.report.serving_section import serving_markdown, serving_rows, serving_title
from kiln.optimizer.report.waterfall_plot import WATERFALL_PNG


def _num(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "does not fit"
    return f"{value:.{digits}g}" if abs(value) < 10**digits else f"{value:,.0f}"


def _gb(n: int) -> str:
    return f"{n / 1e9:.3g} GB" if n >= 10**8 else f"{n / 1e6:.3g} MB" if n >= 10**5 else f"{n} B"


def _cost_cell(row: dict) -> str:
    if not row["applied"]:
        return "-"
    if row["usd_per_mtok"] is None:
        return "does not fit"
    factor = "" if row["factor"] is None else f" (x{row['factor']:.3g})"
    return f"${_num(row['usd_per_mtok'])} @{row['batch']}{factor}"


def summary_rows(report: dict) -> tuple[list[str], list[list[str]]]:
    """The per-GPU figures, one column a GPU."""
    gpus = list(report["gpus"].values())
    c = report["decode_context"]

    def row(name: str, cell: Callable[[dict], str]) -> list[str]:
        return [name, *[cell(g) for g in gpus]]

    rows = [
        row("$ per GPU-hour (* default)",
            lambda g: f"{g['price_per_hour']:.2f}" + ("*" if g["price"] == "default" else "")),
        row("weight bytes", lambda g: f"{g['weight_bytes']} ({_gb(g['weight_bytes'])})"),
        row("KV bytes per token", lambda g: str(g["kv_bytes_per_token"])),
        *[row(f"max sequences @{k}", lambda g, k=k: str(g["max_concurrency"][k]))
          for k in map(str, CONCURRENCY_CONTEXTS)],
        row(f"decode tok/s, batch 1 @{c}", lambda g: _num(g["decode_tokens_per_s_batch1"])),
        row("$/Mtok, batch 1", lambda g: _num(g["usd_per_mtok_batch1"])),
        row(f"max batch @{c}", lambda g: str(g["max_batch"])),
        row("decode tok/s, max batch", lambda g: _num(g["decode_tokens_per_s_max_batch"])),
        row("$/Mtok, max batch", lambda g: _num(g["usd_per_mtok_max_batch"])),
        row("bound (batch 1 / max)", lambda g: f"{g['bound_batch1'] or '-'} / {g['bound_max_batch'] or '-'}"),
        row("prefill ms per 1K tokens", lambda g: f"{g['prefill_seconds_per_1k_tokens'] * 1e3:.3g}"),
    ]
    return ["", *[g["device"] for g in gpus]], rows


def waterfall_rows(report: dict) -> tuple[list[str], list[list[str]]]:
    """The waterfall, one column a GPU: $/Mtok @ batch (factor against the step before)."""
    gpus = list(report["gpus"].values())
    rows = [[step["label"], step["against"] or "-", *[_cost_cell(g["waterfall"][i]) for g in gpus]]
            for i, step in enumerate(gpus[0]["waterfall"])]
    rows.append(["total", "the source as served", *[("x" + _num(g["total_factor"])) if g["total_factor"] else "-"
                                                    for g in gpus]])
    return ["step", "against", *[g["device"] for g in gpus]], rows


def waterfall_notes(report: dict) -> list[str]:
    return [f"{step['label']}: {step['note']}" for step in next(iter(report["gpus"].values()))["waterfall"]]


def economics_markdown(report: dict, png: str | None = WATERFALL_PNG) -> list[str]:
    """report.md's "## Economics" section."""
    n = report["gpus_per_replica"]
    per = f" per {n}-GPU replica" if n > 1 else ""
    lines = ["## Economics", "",
             (f"Decode roofline of `{report['target']}` ({report['kind']}, {report['model_type']}){per}: every "
              f"sequence holds {report['decode_context']} tokens of KV cache; $/Mtok = 277.78 x $/h"
              f"{f' x {n} GPUs' if n > 1 else ''} / tokens/s. "
              f"{report['price_note']} (* = default price.)"), ""]
    head, rows = summary_rows(report)
    lines += ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", f"### What each pass buys (at each step's largest batch, context {report['decode_context']})", "",
              "Cells: $/Mtok @ batch (factor against the step before, on the same GPU).", ""]
    head, rows = waterfall_rows(report)
    lines += ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", *[f"- {note}" for note in waterfall_notes(report)]]
    if png:
        lines += ["", f"![waterfall]({png})"]
    if any(g["capacity_tiers"] for g in report["gpus"].values()):
        lines += ["", "### Capacity tiers (the served model at its largest batch; baseline: neocloud on-demand)", "",
                  ("| GPU | tier | $/h billed | interruptions/h | restart min | serving | $/h serving | $/Mtok | "
                   "vs on-demand |"), "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {g['device']} | {t['tier']} | {t['price_per_hour']:.2f} | {t['interruptions_per_hour']:g} | "
                  f"{t['restart_minutes']:g} | {t['available']:.1%} | {t['effective_price_per_hour']:.2f} | "
                  f"{_num(t['usd_per_mtok'])} | x{t['factor_vs_on_demand']:.2f} |"
                  for g in report["gpus"].values() for t in g["capacity_tiers"]]
    if "serving" in report:
        lines += serving_markdown(report)
    if report["mla_layers"]:
        lines += ["", "### MLA per layer (KV bytes/token: the source's BF16 GQA cache -> as served)", "",
                  "| layer | attention | before | after | ratio |", "|---:|---|---:|---:|---:|"]
        lines += [f"| {r['layer']} | {r['attention']} | {r['source_bytes_per_token']} | {r['bytes_per_token']} | "
                  f"{r['bytes_per_token'] / r['source_bytes_per_token']:.3f} |" for r in report["mla_layers"]]
    lines += ["", "### Assumptions", "", *[f"- {a}" for a in report["assumptions"]],
              "", "### Not modelled", "", *[f"- {a}" for a in report["not_modelled"]]]
    return lines


def economics_tables(report: dict) -> list:
    """The command's rich tables: the per-GPU figures and the waterfall."""
    per = f", {report['gpus_per_replica']} GPUs a replica" if report["gpus_per_replica"] > 1 else ""
    tables = []
    for title, (head, rows) in (
            (f"economics of {report['target']} (decode context {report['decode_context']}{per})", summary_rows(report)),
            ("what each pass buys: $/Mtok @ max batch (x factor against the step before)", waterfall_rows(report))):
        table = Table(title=title)
        for col in head:
            table.add_column(col, justify="left" if col in ("", "step", "against") else "right")
        for r in rows:
            table.add_row(*r)
        tables.append(table)
    if any(g["capacity_tiers"] for g in report["gpus"].values()):
        table = Table(title="capacity tiers: the served model at its largest batch (baseline: neocloud on-demand)")
        for col in ("GPU", "tier", "$/h billed", "serving", "$/h serving", "$/Mtok", "vs on-demand"):
            table.add_column(col, justify="left" if col in ("GPU", "tier") else "right")
        for g in report["gpus"].values():
            for t in g["capacity_tiers"]:
                table.add_row(g["device"], t["tier"], f"{t['price_per_hour']:.2f}", f"{t['available']:.1%}",
                              f"{t['effective_price_per_hour']:.2f}", _num(t["usd_per_mtok"]),
                              f"x{t['factor_vs_on_demand']:.2f}")
        tables.append(table)
    if "serving" in report:
        head, rows = serving_rows(report)
        verdicts = "\n".join(f"{g['device']}: {g['serving']['verdict']}" for g in report["gpus"].values())
        table = Table(title=serving_title(report), caption=verdicts, caption_justify="left")
        for col in head:
            table.add_column(col, justify="left" if col in ("GPU", "deployment") else "right")
        for r in rows:
            table.add_row(*r)
        tables.append(table)
    return tables


def not_modelled_text(report: dict) -> str:
    """What the command prints under its tables."""
    serving = report.get("serving")
    return "\n".join(["Steps: " + "; ".join(waterfall_notes(report)) + ".",
                      "Not modelled: " + "; ".join(report["not_modelled"]) + ".",
                      "Assumptions: " + "; ".join(report["assumptions"]) + ".", report["price_note"],
                      *([f"Serving model assumptions: {'; '.join(serving['assumptions'])}.",
                         f"Serving model, not modelled: {'; '.join(serving['not_modelled'])}."] if serving else [])])
