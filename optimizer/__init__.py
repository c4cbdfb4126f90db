"""Floor 4: the driver. Loader (checkpoint -> graph), recipes, build (passes + gates), gate, lower, CLI."""

__version__ = "0.1.0"

from kiln.optimizer.numerics import pin_for_python as _pin

_pin()  # the CLI's CPU numerics (MKL, OpenBLAS) before anything of the driver imports torch: the API builds its bytes
