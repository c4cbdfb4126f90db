"""lm-eval's model `kiln`: any lm-eval task through an engine artifact, with Kiln's runtime numerics.

    kiln-lm-eval --model kiln --model_args artifact=DIR --tasks TASK --include_path examples/tasks

`KilnLM` is `EngineLM` (kiln.optimizer.tasks, the adapter `optimize gate --tasks` uses) over the engine of the
artifact `DIR`: the same tokenization as lm-eval's HFLM, loglikelihood and rolling windows scored by the
engine, greedy decoding; a request for sampling is refused. Its `--model_args`:

    artifact=DIR        the artifact directory (required); a missing or damaged one is a one-line KilnError
    max_length=N        bound every forward sequence to N tokens (default: the model's context)
    batch_tokens=N      tokens per forward batch, padding included (default: kiln.optimizer.gate.BATCH_TOKENS)

Kiln batches by tokens, not requests: lm-eval's `batch_size` (an integer, `auto` or `auto:N`) and
`max_batch_size` are accepted and change nothing (results do not depend on them). lm-eval's `device` (its
command line passes `cuda:0` unless told otherwise) is accepted and not used: the runtime places the engine.

Registration. The model is declared where lm-eval's plugin guide puts out-of-tree models, the entry-point
group `lm_eval.models` (pyproject.toml: `kiln = "kiln.optimizer.lm_eval_model:KilnLM"`), so `lm_eval --model
kiln` finds it in the lm-eval releases that read that group. lm-eval 0.4.13, the version Kiln pins, reads no
entry points: its registry knows only the names in lm_eval/models/__init__.py and those a `@register_model`
already imported has added. For it, `register()` records the declared entry point in lm-eval's registry (a
lazy placeholder, as later releases record it), and `kiln-lm-eval` is lm-eval's own command line
(`lm_eval.__main__.cli_evaluate`, the same arguments) run after `register()`. In Python:

    from kiln.optimizer.lm_eval_model import register
    register()
    lm_eval.simple_evaluate(model="kiln", model_args="artifact=DIR", tasks=[...], task_manager=...)
"""

from __future__ import annotations

import sys
from pathlib import Path

from kiln import runtime
from kiln.kernels.errors import KilnError
from kiln.optimizer.gate import BATCH_TOKENS
from kiln.optimizer.tasks import engine_lm_class

MODEL_NAME = "kiln"
ENTRY_POINT_GROUP = "lm_eval.models"
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
        super().__init__(runtime.load(Path(str(artifact)).expanduser()), max_length, batch_tokens)


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
    """Record the entry point `kiln` of the group `lm_eval.models` in lm-eval's model registry, unless lm-eval
    (a release that reads the group) already has the name. lm-eval's own models are registered first: its
    `get_model` registers them only while the registry is empty."""
    from importlib.metadata import entry_points

    import lm_eval.models  # noqa: F401 -- fills the registry with lm-eval's own names
    from lm_eval.api.registry import model_registry

    if MODEL_NAME in model_registry:
        return
    declared = list(entry_points(group=ENTRY_POINT_GROUP, name=MODEL_NAME))
    if not declared:
        raise KilnError(f"no entry point {MODEL_NAME!r} in the group {ENTRY_POINT_GROUP}: reinstall Kiln "
                        "(pip install -e .) so its pyproject.toml declarations are installed")
    model_registry.register(MODEL_NAME, target=declared[0])


def main() -> None:
    """`kiln-lm-eval ARGS`: lm-eval's command line (`lm_eval ARGS`) with the model `kiln` registered; a
    KilnError (a missing or damaged artifact, a request Kiln refuses) is one line on stderr, exit code 2."""
    from lm_eval.__main__ import cli_evaluate

    try:
        register()
        cli_evaluate()
    except KilnError as exc:
        line = " ".join(f"error: {exc}".split())
        print(line if len(line) <= MAX_MESSAGE else line[: MAX_MESSAGE - 1] + "…", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
