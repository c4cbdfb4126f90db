"""report.md: a readable summary of an artifact's manifest (sizes, gate table, formats)."""

from __future__ import annotations

from collections import Counter


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def format_counts(formats: dict) -> Counter:
    return Counter(f"{e['format']}" + (f"+{e['activation']}" if e.get("activation", "none") != "none" else "")
                   for e in formats.values())


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
        "## Gate",
        "",
    ]
    ev = manifest.get("evaluation")
    if ev:
        lines += [f"Held-out data: {ev['paragraphs']} paragraphs of `{ev['data']}`, {ev['tokens']} tokens; "
                  f"baseline perplexity {ev['baseline_perplexity']:.4f}.", ""]
    lines += ["Recovery is against the source; the floor applies to each pass's own recovery (against the graph "
              "it started from).", "",
              "| pass | decision | baseline ppl | ppl | recovery | pass recovery | KL | top-1 | floor |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for p in manifest["passes"]:
        g = p["gate"]
        if g is None:
            lines.append(f"| {p['name']} | {p['decision']} | | | | | | | |")
        else:
            lines.append(f"| {p['name']} | {p['decision']} | {g['baseline_perplexity']:.4f} | {g['perplexity']:.4f} | "
                         f"{g['recovery']:.4f} | {g.get('pass_recovery', g['recovery']):.4f} | {g['kl']:.5f} | "
                         f"{g['top1']:.4f} | {g['floor']} |")
    if not manifest["passes"]:
        lines.append("| (no passes) | | | | | | | | |")
    checks = [(p["name"], m) for p in manifest["passes"] if p["gate"] for m in p["gate"].get("metrics", ())]
    if checks:
        lines += ["", "Each pass's own gate metrics (measured through the runtime against the graph before it):", "",
                  "| pass | metric | value | floor | passed |", "|---|---|---:|---:|---|"]
        lines += [f"| {name} | {m['name']} | {m['value']:.6g} | {'≥' if m['higher_is_better'] else '≤'} "
                  f"{m['floor']:g} | {m['passed']} |" for name, m in checks]
    if manifest.get("kv_budget"):
        from kiln.optimizer.kv_report import kv_markdown

        lines += ["", *kv_markdown(manifest["kv_budget"])]
    if manifest.get("precision"):
        from kiln.optimizer.sensitivity import precision_markdown

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
