"""Every import points down the floors of DESIGN.md: optimizer > passes > runtime|calibration > kernels."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OURS = {"optimizer", "passes", "runtime", "calibration", "kernels"}
ALLOWED = {
    "optimizer": {"optimizer", "passes", "runtime", "calibration", "kernels"},
    "passes": {"passes", "calibration", "kernels"},
    "runtime": {"runtime", "kernels"},
    "calibration": {"calibration", "kernels"},
    "kernels": {"kernels"},
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & OURS


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_point_down(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"{package} has no modules"
    for path in files:
        bad = _imports(path) - ALLOWED[package]
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"
