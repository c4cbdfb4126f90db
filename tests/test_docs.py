"""The README, docs/ and benchmarks/results/ point at files and headings that exist, and their `optimize`
command lines name only options the CLI has."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.test_ci_examples import check_options, optimize_commands

PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "benchmarks" / "results").glob("*.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"```bash\n(.*?)```", re.DOTALL)


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {anchor(line.lstrip("#")) for line in page.read_text().splitlines() if line.startswith("#")}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked offline
            continue
        path, _, fragment = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists() or fragment and (resolved.is_dir() or fragment not in anchors(resolved)):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_command_lines_use_real_options(page):
    for block in FENCE.findall(page.read_text()):
        for line in block.replace("\\\n", " ").splitlines():  # one command a line (the next may be lm_eval's)
            for command in optimize_commands(line):
                check_options(command)


def test_readme_keeps_the_two_commands_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert ". .venv/bin/activate && OMP_NUM_THREADS=1 python -m pytest -q" in readme
    assert "pip install -e '.[dev]' && optimize build --recipe fp8-weights -o artifacts/default-fp8 --overwrite" in readme
    assert len(readme.splitlines()) <= 150
