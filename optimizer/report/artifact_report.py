"""report.md: a readable summary of an artifact's manifest (sizes, data, gate table, formats)."""

from __future__ import annotations

from collections import Counter

from kiln.optimizer.report.kv_report import kv_markdown


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def format_counts(formats: dict) -> Counter:
    return Counter(f"{e['format']}" + (f"+{e['activation']}" if e.get("activation", "none") != "none" else "")
                   for e in formats.values())


def calibration_summary(cal: dict) -> str:
    """What a build calibrated on (manifest["calibration"]), in one sentence for the report and the build log."""
    budget = f"a budget of {cal['token_budget']} tokens" if cal["token_budget"] is not None else "no token budget"
    text = f"{cal['paragraphs']} paragraphs, {cal['tokens']} tokens ({budget}; whole paragraphs in file order)"
    if "observation" in cal:
        obs = cal["observation"]
        text += (f"; observation, K/V capture and sensitivity use the first {obs['paragraphs']} paragraphs "
                 f"({obs['tokens']} tokens), end-to-end tuning all")
    return text


def data_lines(manifest: dict) -> list[str]:
    """The report's Data section: each data file's path and sha256, what the build used of it, and the budgets."""
    cal, ev = manifest.get("calibration"), manifest.get("evaluation")
    if not cal and not ev:
        return []
    lines = ["## Data", ""]
    if cal:
        lines.append(f"- calibration: `{cal['path']}` (sha256 `{cal['sha256']}`): {calibration_summary(cal)}")
    if ev:
        lines.append(f"- held-out (the gate): `{ev['path']}` (sha256 `{ev['sha256']}`): {ev['paragraphs']} paragraphs "
                     f"(budget {ev['paragraph_budget']}), {ev['tokens']} scored tokens; baseline perplexity "
                     f"{ev['baseline_perplexity']:.4f}")
    return [*lines, ""]


def floor_cell(gate: dict, key: str, relation: str, floor: float | None) -> str:
    """A gate floor and whether it held (`gate["held"][key]`), e.g. "≥ 0.99 held"; blank for a manifest that
    records no such floor."""
    if floor is None:
        return ""
    held = (gate.get("held") or {}).get(key)
    return f"{relation} {floor:g}" + ("" if held is None else " held" if held else " FAILED")


def _interval(gate: dict) -> str:
    """ (low-high): the 95% paired-bootstrap interval on recovery, where the gate recorded one."""
    return f" ({gate['recovery_low']:.4f}-{gate['recovery_high']:.4f})" if "recovery_low" in gate else ""


def embedding_lines(manifest: dict) -> list[str]:
    """What quantizing the embedding table saved and cost (the embedding-quant pass): bytes against BF16 from its
    result, KL and top-1 from its own gate, one line per such pass."""
    out = []
    for p in manifest["passes"]:
        if p["name"] != "embedding-quant" or not p["result"]["changed"]:
            continue
        module, what = next(iter(p["result"]["changed"].items()))
        g = p["gate"]
        cost = ("not gated" if g is None else f"KL +{g.get('pass_kl', g['kl']):.5f} nats/token, top-1 "
                f"{g.get('pass_top1', g['top1']):.4f}, recovery {g.get('pass_recovery', g['recovery']):.4f} (its gate)")
        out.append(f"embedding {module}: {what}; {cost}; {p['decision']}")
    return out


def render_report(manifest: dict) -> str:
    sizes = manifest["sizes"]
    src, now = sizes["source_weight_bytes"], sizes["weight_bytes"]
    lines = [
        "# Kiln engine artifact",
        "",
        f"- source: `{manifest['source']['checkpoint']}` ({manifest['source']['model_type']})",
        f"- target: {manifest['target']}",
        f"- recipe: {manifest['recipe']['name']}",
        "",
        "## Sizes",
        "",
        "| | bytes | human |",
        "|---|---:|---:|",
        f"| source weights | {src} | {human_bytes(src)} |",
        f"| artifact weights | {now} | {human_bytes(now)} |",
        f"| ratio | {now / src:.3f} | |",
        "",
        *data_lines(manifest),
        "## Gate",
        "",
    ]
    lines += [("Recovery, KL and top-1 are against the source (recovery with its 95% paired-bootstrap interval over "
               "the scored paragraphs); the floors apply to what each pass costs itself "
               "(its figures against the graph it started from: the pass columns)."), "",
              ("| pass | decision | baseline ppl | ppl | recovery | pass recovery | KL | pass KL | top-1 | pass top-1 "
               "| recovery floor | KL ceiling | top-1 floor |"),
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in manifest["passes"]:
        g = p["gate"]
        if g is None:
            lines.append(f"| {p['name']} | {p['decision']} |" + " |" * 11)
        else:
            lines.append(f"| {p['name']} | {p['decision']} | {g['baseline_perplexity']:.4f} | {g['perplexity']:.4f} | "
                         f"{g['recovery']:.4f}{_interval(g)} | {g.get('pass_recovery', g['recovery']):.4f} | {g['kl']:.5f} | "
                         f"{g.get('pass_kl', g['kl']):.5f} | {g['top1']:.4f} | {g.get('pass_top1', g['top1']):.4f} | "
                         f"{floor_cell(g, 'recovery', '≥', g['floor'])} | {floor_cell(g, 'kl', '≤', g.get('max_kl'))} | "
                         f"{floor_cell(g, 'top1', '≥', g.get('min_top1'))} |")
    if not manifest["passes"]:
        lines.append("| (no passes) |" + " |" * 12)
    checks = [(p["name"], m) for p in manifest["passes"] if p["gate"] for m in p["gate"].get("metrics", ())]
    if checks:
        lines += ["", "Each pass's own gate metrics (measured through the runtime against the graph before it):", "",
                  "| pass | metric | value | floor | passed |", "|---|---|---:|---:|---|"]
        lines += [f"| {name} | {m['name']} | {m['value']:.6g} | {'≥' if m['higher_is_better'] else '≤'} "
                  f"{m['floor']:g} | {m['passed']} |" for name, m in checks]
    embedding = embedding_lines(manifest)
    if embedding:
        lines += ["", "## Embedding", "", *(f"- {line}" for line in embedding)]
    if manifest.get("kv_budget"):
        lines += ["", *kv_markdown(manifest["kv_budget"])]
    if manifest.get("precision"):
        from kiln.optimizer.measure.logit_kl import (
            precision_markdown,  # lazy: logit_kl imports torch and the runtime
        )

        lines += ["", *precision_markdown(manifest["precision"])]
    lines += ["", "## Formats", "", "| format | linears |", "|---|---:|"]
    for fmt, n in sorted(format_counts(manifest["formats"]).items()):
        lines.append(f"| {fmt} | {n} |")
    for p in manifest["passes"]:
        skipped = p["result"]["skipped"]
        if skipped:
            lines += ["", f"### {p['name']}: skipped", ""]
            reasons = Counter(skipped.values())
            lines += [f"- {reason}: {n}" for reason, n in sorted(reasons.items())]
        if p["result"]["notes"]:
            lines += ["", f"### {p['name']}: notes", ""] + [f"- {n}" for n in p["result"]["notes"]]
    return "\n".join(lines) + "\n"
