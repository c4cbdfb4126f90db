"""Floor 4: the driver. Loader (checkpoint -> graph), recipes, build (passes + gates), gate, lower, CLI."""

__version__ = "0.1.0"
