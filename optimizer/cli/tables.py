"""The tables `build`, `inspect` and `gate` print: gate figures per pass, the precision plan, the gate's checks.

    out.print(gate_table(manifest["passes"]))
"""

from __future__ import annotations

from rich.table import Table

from kiln.optimizer.report.artifact_report import floor_cell


def gate_table(records_json: list[dict]) -> Table:
    """One column per pass, one row per figure: stays whole in an 80-column terminal."""
    table = Table(title="accuracy gate (through the runtime)")
    table.add_column("")
    for p in records_json:
        table.add_column(p["name"], justify="right", overflow="fold")
    rows = [("decision", lambda p, g: p["decision"]),
            ("baseline ppl", lambda p, g: f"{g['baseline_perplexity']:.4f}"),
            ("perplexity", lambda p, g: f"{g['perplexity']:.4f}"),
            ("recovery", lambda p, g: f"{g['recovery']:.4f}"),
            ("recovery 95% interval", lambda p, g: f"{g['recovery_low']:.4f}-{g['recovery_high']:.4f}"
             if "recovery_low" in g else ""),
            ("pass recovery", lambda p, g: f"{g.get('pass_recovery', g['recovery']):.4f}"),
            ("KL nats/token", lambda p, g: f"{g['kl']:.5f}"),
            ("pass KL", lambda p, g: f"{g.get('pass_kl', g['kl']):.5f}"),
            ("top-1 agreement", lambda p, g: f"{g['top1']:.4f}"),
            ("pass top-1", lambda p, g: f"{g.get('pass_top1', g['top1']):.4f}"),
            ("recovery floor", lambda p, g: floor_cell(g, "recovery", "≥", g["floor"])),
            ("KL ceiling", lambda p, g: floor_cell(g, "kl", "≤", g.get("max_kl"))),
            ("top-1 floor", lambda p, g: floor_cell(g, "top1", "≥", g.get("min_top1"))),
            ("suspect", lambda p, g: g.get("suspect", ""))]
    names = sorted({m["name"] for p in records_json if p["gate"] for m in p["gate"].get("metrics", ())})
    rows += [(name, lambda p, g, name=name: next((f"{m['value']:.4g} ({'pass' if m['passed'] else 'FAIL'})"
                                                  for m in g.get("metrics", ()) if m["name"] == name), ""))
             for name in names]
    gates = [p["gate"] for p in records_json if p["gate"]]
    # a pass that ran first costs what it measures: its pass KL and top-1 would repeat the rows above them
    relative = any(g.get("pass_kl", g["kl"]) != g["kl"] or g.get("pass_top1", g["top1"]) != g["top1"] for g in gates)
    for label, cell in rows:
        if label == "suspect" and not any(g.get("suspect") for g in gates):
            continue
        if label in ("pass KL", "pass top-1") and not relative:
            continue
        table.add_row(label, *[cell(p, p["gate"]) if p["gate"] or label == "decision" else ""
                               for p in records_json])
    return table



def precision_table(precision: dict) -> Table:
    """One row per layer group: the format the precision pass chose, its measured KL, and why."""
    table = Table(title=f"{precision['pass']}: {precision['effective_bits']:.3f} effective bits "
                        f"({precision['weight_bytes']} bytes for {precision['weights']} weights)")
    for col in ("group", "format", "KL", "why"):
        table.add_column(col, justify="right" if col == "KL" else "left", overflow="fold")
    for group, entry in precision["groups"].items():
        table.add_row(group, entry["option"], f"{entry['kl']:.2e}", entry["reason"])
    return table


def checks_table(checks, title: str, passed: bool) -> Table:
    table = Table(title=title)
    for col in ("check", "value", "floor", "result", "detail"):
        table.add_column(col, justify="right" if col in ("value", "floor") else "left", overflow="fold")
    for c in checks:
        table.add_row(c.name, f"{c.value:.5g}", f"{c.relation} {c.floor:g}", "pass" if c.passed else "FAILED",
                      c.detail)
    table.caption = "passed" if passed else "FAILED"
    return table
