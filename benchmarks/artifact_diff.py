"""Two artifacts' stored tensors against each other: which differ, and for FP4 codes how many elements.

    python benchmarks/artifact_diff.py ART_A ART_B

Reads both `model.safetensors` one tensor at a time (an 8B artifact never sits in memory twice). Per kind of
tensor (FP4 codes, FP8 values, scales, other), it prints a table: tensors, tensors unequal, elements, and
elements unequal. FP4 codes are counted per element, two to a byte. Used for
benchmarks/results/backoff.md: what a back-off step stores against a full calibration with the same linears
kept. Exit 0 when every tensor is equal, 1 when some differ, 2 when the two hold different tensor names.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from safetensors import safe_open


def kind(name: str, tensor: torch.Tensor) -> str:
    """What a stored tensor is, by its name and dtype (ModelOpt's unified names: weight, weight_scale, ...)."""
    if "scale" in name.rsplit(".", 1)[-1]:
        return "scales"
    if tensor.dtype == torch.uint8 and name.endswith(".weight"):
        return "FP4 codes (two a byte)"
    if tensor.dtype == torch.float8_e4m3fn:
        return "FP8 values"
    return "other"


def unequal_elements(a: torch.Tensor, b: torch.Tensor, fp4: bool) -> tuple[int, int]:
    """(elements, elements that differ); FP4 bytes count as their two codes."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return a.numel() * (2 if fp4 else 1), a.numel() * (2 if fp4 else 1)
    if fp4:
        x, y = a.view(torch.uint8), b.view(torch.uint8)
        return 2 * x.numel(), int(((x & 15) != (y & 15)).sum() + ((x >> 4) != (y >> 4)).sum())
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)  # bytes: -0 and +0 differ as stored
    return a.numel(), int((a != b).sum())


def compare(path_a: Path, path_b: Path) -> dict[str, list[int]] | str:
    """Per kind: [tensors, tensors unequal, elements, elements unequal]; or why the two cannot be compared."""
    rows: dict[str, list[int]] = {}
    with safe_open(str(path_a), "pt") as fa, safe_open(str(path_b), "pt") as fb:
        names_a, names_b = set(fa.keys()), set(fb.keys())
        if names_a != names_b:
            only = sorted(names_a ^ names_b)
            return f"the two hold different tensors ({len(only)}, e.g. {only[0]})"
        for name in sorted(names_a):
            a, b = fa.get_tensor(name), fb.get_tensor(name)
            k = kind(name, a)
            elements, differ = unequal_elements(a, b, fp4=k.startswith("FP4"))
            row = rows.setdefault(k, [0, 0, 0, 0])
            row[0] += 1
            row[1] += differ > 0
            row[2] += elements
            row[3] += differ
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    args = ap.parse_args()
    paths = [p / "model.safetensors" for p in (args.a, args.b)]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        print(f"error: no weights at {missing[0]}", file=sys.stderr)
        return 2
    rows = compare(*paths)
    if isinstance(rows, str):
        print(f"error: {rows}", file=sys.stderr)
        return 2
    table = Table(title=f"{args.a} against {args.b}")
    for column in ("stored tensors", "tensors", "unequal", "elements", "elements unequal"):
        table.add_column(column, justify="left" if column == "stored tensors" else "right")
    for k, (n, nd, e, ed) in rows.items():
        table.add_row(k, f"{n:,}", f"{nd:,}", f"{e:,}", f"{ed:,} ({100 * ed / max(e, 1):.2f}%)")
    Console().print(table)
    return 0 if all(row[1] == 0 for row in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
