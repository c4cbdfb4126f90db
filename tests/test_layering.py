"""Every import points down the floors of DESIGN.md: optimizer > passes > runtime|calibration > kernels.

One module of the runtime is shared upward on purpose: `runtime.spec`, the structural IR. Passes rewrite the
spec the runtime executes, so `passes` may import it, and nothing else of the runtime."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OURS = {"optimizer", "passes", "runtime", "calibration", "kernels"}
ALLOWED = {
    "optimizer": {"optimizer", "passes", "runtime", "spec", "calibration", "kernels"},
    "passes": {"passes", "spec", "calibration", "kernels"},
    "runtime": {"runtime", "spec", "kernels"},
    "calibration": {"calibration", "kernels"},
    "kernels": {"kernels"},
}


SHARED_IR = "kiln.runtime.spec"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
        else:
            continue
        # our packages install as kiln.<package>: the floor is the second component
        found |= {"spec" if m == SHARED_IR else m.split(".")[1] for m in modules
                  if m.startswith("kiln.") and m.count(".") >= 1}
        bare = {m.split(".")[0] for m in modules} & OURS
        assert not bare, f"{path.relative_to(ROOT)} imports {sorted(bare)} outside the kiln namespace"
    return found & (OURS | {"spec"})


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_point_down(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"{package} has no modules"
    for path in files:
        bad = _imports(path) - ALLOWED[package]
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"
