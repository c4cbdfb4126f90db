"""What `optimize gate` prints for CI: JSON, Markdown (a pull-request comment) or JUnit XML (one test case
per check, which every CI system shows as a test result).

Exit codes are the CLI's: 0 every check passed, 1 a check failed (or the result is implausible), 2 user error.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path

from kiln.optimizer.measure.gate import Check

FORMATS = ("text", "json", "markdown", "junit")


def _value(value: float) -> str:
    return f"{value:.6g}"


def junit_xml(checks: Sequence[Check], suite: str, seconds: float, failure: str | None = None) -> str:
    """A JUnit XML report: one <testcase> per check, failed ones with a <failure> saying value and floor.
    `failure`: a reason the whole gate failed that no check carries (an implausible result), as one more case."""
    cases = list(checks)
    failures = sum(not c.passed for c in cases) + (failure is not None)
    root = ET.Element("testsuites", name="kiln", tests=str(len(cases) + (failure is not None)),
                      failures=str(failures), time=f"{seconds:.3f}")
    node = ET.SubElement(root, "testsuite", name=suite, tests=root.get("tests"), failures=str(failures),
                         errors="0", skipped="0", time=f"{seconds:.3f}")
    for check in cases:
        case = ET.SubElement(node, "testcase", classname="kiln.gate", name=check.name, time="0")
        summary = f"{check.name}: {_value(check.value)} (floor {check.relation} {_value(check.floor)})"
        if not check.passed:
            fail = ET.SubElement(case, "failure", message=summary, type="BelowFloor")
            fail.text = check.detail or summary
        else:
            out = ET.SubElement(case, "system-out")
            out.text = summary + (f"; {check.detail}" if check.detail else "")
    if failure is not None:
        case = ET.SubElement(node, "testcase", classname="kiln.gate", name="plausibility", time="0")
        ET.SubElement(case, "failure", message=failure, type="Implausible").text = failure
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def is_kiln_junit(path: Path) -> bool:
    """Whether the file is a JUnit report `gate --junit` wrote (its root `<testsuites name="kiln"`), which a later
    gate may replace; any other file at --junit is the user's and is refused (optimizer.output_dir)."""
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError:
        return False
    return head.startswith(b"<?xml") and b'<testsuites name="kiln"' in head


def markdown(fields: dict, checks: Sequence[Check], title: str) -> str:
    """A Markdown summary: the headline figures with the interval, then one row per check."""
    passed = all(c.passed for c in checks) and not fields.get("suspect")
    lines = [f"## {title}: {'passed' if passed else 'FAILED'}", ""]
    if "recovery" in fields:
        lines.append(f"Recovery {fields['recovery']:.4f} (95% interval {fields['recovery_low']:.4f}–"
                     f"{fields['recovery_high']:.4f}, paired bootstrap over {fields['documents']} documents, "
                     f"{fields['resamples']} resamples, seed {fields['seed']}; decision: {fields['decision']}), "
                     f"perplexity {fields['perplexity']:.4f} against {fields['baseline_perplexity']:.4f}, "
                     f"{fields['tokens']} tokens.")
        lines.append("")
    if fields.get("suspect"):
        lines += [f"**Implausible:** {fields['suspect']}", ""]
    lines += ["| check | value | floor | result | detail |", "|---|---:|---:|---|---|"]
    lines += [f"| {c.name} | {_value(c.value)} | {c.relation} {_value(c.floor)} | "
              f"{'pass' if c.passed else '**FAIL**'} | {c.detail} |" for c in checks]
    return "\n".join(lines) + "\n"
