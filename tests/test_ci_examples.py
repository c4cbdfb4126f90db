"""The CI gate examples name only commands and options the CLI has (they are run by users, not by us)."""

from __future__ import annotations

import shlex

import pytest
import typer
import yaml

from kiln.optimizer.cli import app
from tests.conftest import ROOT


def optimize_commands(script: str) -> list[list[str]]:
    words = shlex.split(script.replace("\\\n", " "), comments=True)
    commands, current = [], None
    for word in words:
        if word == "optimize":
            current = []
            commands.append(current)
        elif word in (";", "&&", ">>", ">", "|") or word.startswith("$("):
            current = None
        elif current is not None:
            current.append(word)
    return commands


def check_options(args: list[str]) -> None:
    group = typer.main.get_command(app)
    command = group.commands[args[0]]
    known = {opt for p in command.params for opt in (*p.opts, *p.secondary_opts)}
    unknown = [a for a in args[1:] if a.startswith("--") and a.split("=")[0] not in known]
    assert not unknown, f"optimize {args[0]}: no such option {unknown}"


def test_github_actions_example_builds_and_gates_with_real_options():
    workflow = yaml.safe_load((ROOT / "examples" / "ci" / "github-actions.yml").read_text())
    steps = workflow["jobs"]["gate"]["steps"]
    runs = [optimize_commands(s["run"]) for s in steps if "run" in s]
    commands = [c for r in runs for c in r]
    assert [c[0] for c in commands] == ["build", "gate"]
    for command in commands:
        check_options(command)
    gate = commands[1]
    assert "--junit" in gate and "--decision" in gate and gate[gate.index("--decision") + 1] == "lower"


@pytest.mark.parametrize("path", [".ci/run"])
def test_the_repository_ci_gates_a_fresh_artifact(path):
    commands = optimize_commands((ROOT / path).read_text())
    assert [c[0] for c in commands] == ["build", "gate"]
    for command in commands:
        check_options(command)
