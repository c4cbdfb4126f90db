"""Where the `optimize` commands write: `out` (stdout: tables, results) and `console` (stderr: progress, log).

    from kiln.optimizer.cli.console import console, log, out
    out.print(table)
    log("warning: ...")          # one line on stderr, yellow for a warning, dim otherwise
"""

from __future__ import annotations

import sys

from rich.console import Console
from rich.text import Text

# Tables stay readable when piped (rich would otherwise wrap them to 80 columns).
console = Console(stderr=True, width=None if sys.stderr.isatty() else 120)
out = Console(width=None if sys.stdout.isatty() else 120)


def log(message: str) -> None:
    # Text, not markup: a path or tensor name in brackets must print as written
    # soft_wrap: one message stays one line in a CI log, whatever the width, so `grep warning:` finds it whole
    console.print(Text(message, style="yellow" if message.startswith("warning:") else "dim"), soft_wrap=True)
