"""The exception that carries exit code 1: the driver's gates raise it, the CLI turns it into one line.

    BelowFloor     a gate measured the artifact below its floor (or --strict met a reverted pass): exit 1

Only the optimizer measures against floors, so it lives here; `KilnError` (bad input, exit 2) is raised on
every floor and lives on the lowest, in kiln.kernels.errors. This module imports nothing, so the CLI loads it
at start-up.
"""


class BelowFloor(Exception):
    """An accuracy floor was not met. The message is one line."""
