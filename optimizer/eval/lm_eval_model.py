"""lm-eval's model `kiln`: any lm-eval task through an engine artifact, with Kiln's runtime numerics.

    kiln-lm-eval --model kiln --model_args artifact=DIR --tasks TASK --include_path examples/tasks

`KilnLM` is `EngineLM` (kiln.optimizer.eval.tasks, the adapter `optimize gate --tasks` uses) over the engine of the
artifact `DIR`: the same tokenization as lm-eval's HFLM, loglikelihood and rolling windows scored by the
engine, greedy decoding; a request for sampling is refused. Its `--model_args`:

    artifact=DIR        the artifact directory (required); a missing or damaged one is a one-line KilnError
    max_length=N        bound every forward sequence to N tokens (default: the model's context)
    batch_tokens=N      tokens per forward batch, padding included (default: kiln.optimizer.measure.gate.BATCH_TOKENS)

Kiln batches by tokens, not requests: lm-eval's `batch_size` (an integer, `auto` or `auto:N`) and
`max_batch_size` are accepted and change nothing (results do not depend on them). lm-eval's `device` (its
command line passes `cuda:0` unless told otherwise) places the engine: a CUDA device runs it on the GPU where one
exists (runtime.Engine), and the CPU reference runs otherwise.

Registration. The model is declared where lm-eval's plugin guide puts out-of-tree models, the entry-point
group `lm_eval.models` (pyproject.toml: `kiln = "kiln.optimizer.eval.lm_eval_model:KilnLM"`). lm-eval 0.4.13, the
version Kiln pins, reads no entry points, so installing Kiln also installs a .pth hook
(kiln.optimizer.eval.lm_eval_plugin) that adds the same placeholder to lm-eval's registry when lm-eval fills it:
`lm_eval --model kiln ...` works as it stands. `register()` does the same explicitly (for an environment where
site.py skipped .pth files, e.g. `python -S`), and `kiln-lm-eval` is lm-eval's own command line
(`lm_eval.__main__.cli_evaluate`, the same arguments) that prints a KilnError as one line. In Python:

    import lm_eval
    lm_eval.simple_evaluate(model="kiln", model_args="artifact=DIR", tasks=[...], task_manager=...)
"""

from __future__ import annotations

import sys
from importlib.metadata import version
from pathlib import Path

import torch

from kiln import runtime
from kiln.kernels.errors import KilnError
from kiln.optimizer.eval.lm_eval_plugin import MODEL_NAME, register_placeholder
from kiln.optimizer.eval.tasks import engine_lm_class
from kiln.optimizer.measure.gate import BATCH_TOKENS

MODEL_ARGS = ("artifact", "max_length", "batch_tokens", "batch_size", "max_batch_size", "device")
MAX_MESSAGE = 300  # the longest error line kiln-lm-eval prints, as the optimize command line bounds its own


class KilnLM(engine_lm_class()):
    """lm-eval's model `kiln`: `EngineLM` over `runtime.load(artifact)` (see the module docstring)."""

    def __init__(self, artifact: str | Path | None = None, max_length: int | None = None,
                 batch_tokens: int = BATCH_TOKENS, batch_size: int | str | None = None,
                 max_batch_size: int | None = None, device: str | None = None, **unknown):
        if unknown:
            raise KilnError(f"lm-eval model {MODEL_NAME}: unknown model_args {', '.join(sorted(unknown))}; it takes "
                            f"{', '.join(MODEL_ARGS)}")
        if artifact is None or str(artifact).strip() == "":
            raise KilnError(f"lm-eval model {MODEL_NAME} needs an artifact directory: --model_args artifact=DIR")
        _check_batch_size(batch_size)
        if max_batch_size is not None and (isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int)
                                           or max_batch_size < 1):
            raise KilnError(f"max_batch_size must be a positive integer, got {max_batch_size!r}")
        engine = runtime.load(Path(str(artifact)).expanduser(), device=_device(device))
        super().__init__(engine, max_length, batch_tokens)


def _device(device: str | None) -> str:
    """lm-eval's device as the runtime's: a CUDA device where one exists (packed weights, bf16 activations),
    else the CPU reference (lm-eval passes cuda:0 unless told otherwise, GPU or not, as its HF model falls back)."""
    wanted = str(device or "cpu")
    return wanted if not wanted.startswith("cuda") or torch.cuda.is_available() else "cpu"


def _check_batch_size(batch_size) -> None:
    """lm-eval's batch size: None, a positive integer (maybe as text), `auto` or `auto:N`."""
    if batch_size is None:
        return
    if isinstance(batch_size, int) and not isinstance(batch_size, bool):
        valid = batch_size >= 1
    elif isinstance(batch_size, str):
        head, _, times = batch_size.partition(":")
        valid = (batch_size.isdigit() and int(batch_size) >= 1) or (head == "auto" and (not times or times.isdigit()))
    else:
        valid = False
    if not valid:
        raise KilnError(f"batch_size must be a positive integer, auto or auto:N, got {batch_size!r}")


def register() -> None:
    """Make sure lm-eval's model registry has `kiln` (the .pth hook has normally added it already): lm-eval's
    own models are registered first, as its `get_model` registers them only while the registry is empty."""
    # lazy: lm-eval is the optional `tasks` extra; importing lm_eval.models fills the registry with its own names
    # (and, through the hook, kiln)
    import lm_eval.models  # noqa: F401

    if not register_placeholder():
        raise KilnError(f"lm-eval's model registry refused the name {MODEL_NAME!r}: lm-eval "
                        f"{_lm_eval_version()} is not the 0.4.13 Kiln is tested with")


def _lm_eval_version() -> str:
    return version("lm-eval")


def main() -> None:
    """`kiln-lm-eval ARGS`: lm-eval's command line (`lm_eval ARGS`) with the model `kiln` registered; a
    KilnError (a missing or damaged artifact, a request Kiln refuses) is one line on stderr, exit code 2."""
    from lm_eval.__main__ import cli_evaluate  # lazy: lm-eval is the optional `tasks` extra

    try:
        register()
        cli_evaluate()
    except KilnError as exc:
        line = " ".join(f"error: {exc}".split())
        print(line if len(line) <= MAX_MESSAGE else line[: MAX_MESSAGE - 1] + "…", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
