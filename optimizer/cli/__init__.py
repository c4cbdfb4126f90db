"""The `optimize` command line (typer): `app` holds the commands, `main` is the console script.

    optimize build CHECKPOINT --recipe fp8-weights -o ART
    python -m kiln.optimizer.cli gate ART --baseline CHECKPOINT --data TEXT --min-recovery 0.98

    app             the commands, in --help's order, and main (exit codes, one line per failure)
    build_export    build, export
    gate_eval       gate, eval
    serve_generate  generate, serve
    inspect_report  inspect, report
    options         help texts and the numeric options' ranges
    threads         the CPU thread count, chosen before torch starts
    tables          the tables build, inspect and gate print
    console         stdout and stderr, and the log line
    progress_view   kiln.calibration.progress drawn as bars or lines, and the timing table
"""

from kiln.optimizer.cli.app import app, main

__all__ = ["app", "main"]
