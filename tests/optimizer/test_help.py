"""Every command's --help at 80 columns shows each option's names whole and fits the width."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import typer

from kiln.optimizer.cli import app
from tests.conftest import ROOT

GROUP = typer.main.get_command(app)
COMMANDS = sorted(GROUP.commands)


def _help(*args: str) -> str:
    env = dict(os.environ, COLUMNS="80", TERM="dumb")
    proc = subprocess.run([sys.executable, "-m", "kiln.optimizer.cli", *args, "--help"], check=False,
                          capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_there_are_commands():
    assert {"build", "inspect", "eval", "generate", "serve", "gate", "export", "report"} <= set(COMMANDS)


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_shows_every_option_name_whole_at_80_columns(command):
    text = _help(*([command] if command else []))
    params = (GROUP if command is None else GROUP.commands[command]).params
    names = [name for p in params if getattr(p, "opts", None) and p.param_type_name == "option"
             for name in (*p.opts, *p.secondary_opts)]
    assert (names or command is None) and "--help" in text
    for name in names:
        assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text), f"{command}: {name} not whole:\n{text}"
    assert "…" not in text
    too_wide = [line for line in text.splitlines() if len(line) > 80]
    assert not too_wide, too_wide
    # a flag takes no value: no type placeholder beside it
    assert not re.search(r"<bool>", text), text
