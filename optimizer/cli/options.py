"""What the commands' options share: help texts, and the ranges of the numeric options, refused while the
command line is parsed (before any work) in one line naming the value and the range (exit 2).

    paragraphs: Annotated[int, typer.Option(callback=PARAGRAPHS, help="first N paragraphs")] = 600
"""

from __future__ import annotations

import math

from kiln.kernels.errors import KilnError

DATA_FORMATS = "a text file (paragraphs split at blank lines), or .jsonl/.json/.parquet (a 'text' field per record)"
DEVICE_HELP = ("cpu: the fp32 reference, weights dequantized once; cuda: weights packed on the GPU (FP8 bytes, FP4 "
               "nibbles and their scales, through the Triton kernels), bf16 activations, KV cache and sampling "
               "on the GPU")
BUILD_DEVICE_HELP = ("where calibration runs (block forwards, K/V capture, sensitivity probes, tuning, in fp32) and "
                     "the gate: cpu (the fp32 reference) or cuda (the gate through the GPU runtime: packed weights, "
                     "bf16 activations); the weight searches (GPTQ, AWQ) run on the CPU either way")


MAX_SEED = 2**32 - 1
"""Largest seed an option takes: every generator Kiln seeds takes it (torch's, numpy's), and seed + i too."""
MAX_PARAGRAPHS = 1_000_000
"""Most paragraphs a command scores: far above any held-out set's, far below a run that never ends."""


def bounded(flag: str, low: float | None = None, high: float | None = None, *, integer: bool = False,
            low_open: bool = False, why: str = ""):
    """A typer callback that refuses, while the command line is parsed (before any work), a numeric option
    outside its range: finite, within [low, high] (or (low, high] when `low_open`); `high` bounds an option
    whose cost grows with it, and `why` says what grows. One line naming the value and the range (exit 2);
    None (an option left unset) passes. Typer has already checked that an int option holds an integer."""
    def check(value):
        if value is None:
            return value
        ok = not isinstance(value, float) or math.isfinite(value)  # an int is compared as it is, however large
        ok = ok and (low is None or (value > low if low_open else value >= low)) and (high is None or value <= high)
        if not ok:
            kind = "an integer" if integer else "a finite number"
            if low is not None and high is not None:
                where = f"in {'(' if low_open else '['}{_num(low)}, {_num(high)}]"
            else:
                where = f"{'>' if low_open else '>='} {_num(low)}" if low is not None else f"<= {_num(high)}"
            raise KilnError(f"{flag} must be {kind} {where}{f' ({why})' if why else ''}, got {_num(value)}")
        return value
    return check


def _num(value: float) -> str:
    """An int as written (a seed of 2^32 - 1 is 4294967295, not 4.29497e+09), a float in its shortest form."""
    return str(value) if isinstance(value, int) else f"{value:g}"


# The numeric options' ranges, checked while the command line is parsed (report's --context and --price-per-hour
# are checked by optimizer.report.economics, the gate floors by optimizer.measure.gate.check_floors, both before any work)
PARAGRAPHS = bounded("--paragraphs", 1, MAX_PARAGRAPHS, integer=True, why="each is scored")
CALIB_TOKENS = bounded("--calib-tokens", 1, integer=True)
WEIGHT_BITS = bounded("--weight-bits", 0, 16, low_open=True)
WEIGHT_BYTES = bounded("--weight-bytes", 1, integer=True)
KV_FRACTION = bounded("--kv-fraction", 0, 1, low_open=True)
KV_BYTES = bounded("--kv-bytes-per-token", 1, integer=True)
DRAFT_TOKENS = bounded("--draft-tokens", 1, 16, integer=True)
TREE_WIDTH = bounded("--tree-width", 1, 8, integer=True, why="1: a chain")
MAX_NEW_TOKENS = bounded("--max-new-tokens", 0, 1 << 20, integer=True, why="each is a decode step")
TEMPERATURE = bounded("--temperature", 0, why="0: greedy")
TOP_P = bounded("--top-p", 0, 1, low_open=True)
SEED = bounded("--seed", 0, MAX_SEED, integer=True)
REPETITION_PENALTY = bounded("--repetition-penalty", 0, low_open=True)
PORT = bounded("--port", 0, 65535, integer=True)
MAX_QUEUE = bounded("--max-queue", 1, 1 << 20, integer=True, why="each waiting request holds its prompt")
MAX_NUM_SEQS = bounded("--max-num-seqs", 1, 4096, integer=True, why="each holds KV cache blocks")
MAX_BATCHED = bounded("--max-num-batched-tokens", 1, 1 << 20, integer=True, why="a step's activations grow with it")
REQUEST_TIMEOUT = bounded("--request-timeout", 0, low_open=True)
SLO = bounded("--ttft-slo/--tpot-slo", 0, low_open=True)
RESAMPLES = bounded("--resamples", 1, 100_000, integer=True, why="the bootstrap's time and memory grow with it")
GENERATE = bounded("--generate", 0, 10_000, integer=True, why="each prompt is decoded by both models")
GENERATE_TOKENS = bounded("--generate-tokens", 1, 1 << 16, integer=True, why="each is a decode step of both models")
TASK_LIMIT = bounded("--task-limit", 1, integer=True)
TAU = bounded("--tau", 1)
GPUS_PER_REPLICA = bounded("--gpus-per-replica", 1, 1024, integer=True)
