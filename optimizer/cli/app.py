"""The `optimize` application: its commands, in the order --help lists them, and `main`, which turns every
outcome into an exit code and one line on stderr.

    optimize build | inspect | eval | generate | serve | gate | export | report

Exit codes are a promise to CI: 0 pass, 1 below a floor (or --strict met a reverted pass), 2 user error
(bad input, usage error), 130 interrupted (SIGINT), 143 terminated (SIGTERM). Every failure is one line on
stderr. Heavy libraries (torch, transformers) are imported inside the commands that need them, so
`--help` and `inspect` stay fast.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

import typer

from kiln.calibration import progress
from kiln.kernels.errors import KilnError
from kiln.optimizer.cli.build_export import build, export_
from kiln.optimizer.cli.console import console
from kiln.optimizer.cli.gate_eval import eval_, gate
from kiln.optimizer.cli.inspect_report import inspect, report_
from kiln.optimizer.cli.progress_view import reporter_for
from kiln.optimizer.cli.serve_generate import generate, serve
from kiln.optimizer.cli.threads import use_threads
from kiln.optimizer.errors import BelowFloor
from kiln.optimizer.numerics import pin_cpu_numerics

# rich_markup_mode=None: click's plain help, which gives each option's names their own line when they are long;
# typer's rich panels cut long names at 80 columns (`--no-trust-remote…`) and show `<bool>` on every flag
# (tests/optimizer/test_help.py renders every command at 80 columns)
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Kiln: optimize a Hugging Face causal LM into an engine artifact for Hopper or Blackwell.")
app.command()(build)  # in the order --help lists them
app.command()(inspect)
app.command("eval")(eval_)
app.command()(generate)
app.command()(serve)
app.command()(gate)
app.command("export")(export_)
app.command("report")(report_)

MAX_MESSAGE = 300
"""Longest error line printed: a message built from hostile input must not flood a CI log."""


class Interrupted(BaseException):
    """SIGINT or SIGTERM. A BaseException like KeyboardInterrupt, so it unwinds through every cleanup
    (temporary directories are removed), but not KeyboardInterrupt itself, which typer would swallow."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _on_signal(signum, frame):
    # a second Ctrl-C must not interrupt the cleanup of the first
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Interrupted(signum)


def _one_line(message: str) -> str:
    line = " ".join(str(message).split())
    return line if len(line) <= MAX_MESSAGE else line[: MAX_MESSAGE - 1] + "…"


def _click_exception_type() -> type[Exception]:
    # typer >= 0.29 vendors click as typer._click: find its ClickException through a public name
    return next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def _fail(code: int, message: str) -> None:
    print(_one_line(message), file=sys.stderr)
    sys.exit(code)


def _quiet_libraries() -> None:
    """Silence what is not the user's business: torchao's optional CUDA extensions failing to load on a CPU
    machine, and torch's deprecation notes about how torchao registers its enums."""
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    pin_cpu_numerics()  # before torch is imported by a command (they import it lazily)
    use_threads()  # likewise: OMP_NUM_THREADS is read when torch starts its thread pool
    _quiet_libraries()
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    try:
        with progress.reporting(reporter_for(console)):  # bars on a terminal, a line per stage otherwise
            code = app(standalone_mode=False)  # --help returns 0; a KeyboardInterrupt typer saw returns 130
    except Interrupted as exc:
        _fail(130 if exc.signum == signal.SIGINT else 143,
              f"{'interrupted' if exc.signum == signal.SIGINT else 'terminated'}: nothing was written")
    except KeyboardInterrupt:
        _fail(130, "interrupted: nothing was written")
    except KilnError as exc:
        _fail(2, f"error: {exc}")
    except BelowFloor as exc:
        _fail(1, f"gate failed: {exc}")
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        _fail(2, "error: aborted (no input)")
    except Exception as exc:
        if not isinstance(exc, _click_exception_type()):
            raise  # a bug: keep its traceback
        ctx = getattr(exc, "ctx", None)
        hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        # no arguments: click's NoArgsIsHelpError carries the whole help as its message (plain help mode)
        message = "" if type(exc).__name__ == "NoArgsIsHelpError" else exc.format_message()
        _fail(2, f"error: {message or 'no command given'}{hint}")
    if code == 130:
        _fail(130, "interrupted: nothing was written")
    sys.exit(code if isinstance(code, int) else 0)
