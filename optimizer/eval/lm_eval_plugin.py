"""lm-eval finds the model `kiln` by name, with no change to lm-eval and no extra step for the user.

lm-eval 0.4.13 has no plugin discovery: its registry is filled by `lm_eval/models/__init__.py` from a fixed
table (EleutherAI/lm-evaluation-harness#3282 and #1621 ask for one). So installing Kiln writes a one-line
`.pth` file, `kiln-lm-eval.pth`, that runs this file's source at interpreter start (setup.py embeds it, as
pytest-cov shipped its own .pth). It runs in a namespace of its own, imports no kiln module (a process that
never uses lm-eval loads nothing of Kiln's) and nothing outside the standard library, costs about a
millisecond, and adds one import hook to `sys.meta_path`. The hook acts once, on the first import of
`lm_eval.models`: after that module has filled the registry with lm-eval's own names, it adds `kiln` as a lazy
placeholder (`MODEL_TARGET`, the entry point pyproject.toml declares in the group `lm_eval.models`), which
lm-eval loads only when asked for it. Kiln's `register()` (kiln.optimizer.eval.lm_eval_model) imports this module
the usual way.

    lm_eval --model kiln --model_args artifact=DIR --tasks TASK --include_path examples/tasks

The hook never imports lm-eval itself, never imports torch, and never raises: a failure leaves lm-eval as it
was (`--model kiln` is then lm-eval's "unknown model" error, and `kiln-lm-eval` still works).
"""

from __future__ import annotations

import sys

HOOKED_MODULE = "lm_eval.models"  # the module whose import fills lm-eval's model registry
MODEL_NAME = "kiln"
MODEL_TARGET = "kiln.optimizer.eval.lm_eval_model:KilnLM"  # as [project.entry-points."lm_eval.models"] declares


def register_placeholder() -> bool:
    """Add `kiln` to lm-eval's model registry as a lazy `module:object` placeholder unless a name `kiln` is
    there already; True when the registry has the name afterwards."""
    try:
        from lm_eval.api.registry import model_registry  # lazy: only once lm-eval itself is being imported

        if MODEL_NAME not in model_registry:
            model_registry.register(MODEL_NAME, target=MODEL_TARGET)
        return MODEL_NAME in model_registry
    except Exception:  # noqa: BLE001 -- an lm-eval whose registry differs: leave it as it is
        return False


class _RegisteringLoader:
    """`lm_eval.models`'s own loader, followed by `register_placeholder`."""

    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        register_placeholder()

    def __getattr__(self, name):  # get_resource_reader, is_package, get_code, ...: the inner loader's
        return getattr(self._inner, name)


class LmEvalModelsHook:
    """Finds `lm_eval.models` through the other finders and wraps its loader; removes itself after that."""

    def find_spec(self, fullname, path, target=None):
        if fullname != HOOKED_MODULE:
            return None
        import importlib.util  # lazy: this source runs at every interpreter start; only lm-eval's import needs it

        uninstall()
        try:
            spec = importlib.util.find_spec(fullname)
        except Exception:  # noqa: BLE001 -- let the import system report it as it would without the hook
            return None
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisteringLoader(spec.loader)
        return spec


def install() -> None:
    """Add the hook, once; where lm-eval's models are imported already, register straight away."""
    if HOOKED_MODULE in sys.modules:
        register_placeholder()
    elif not any(_is_hook(finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, LmEvalModelsHook())


def uninstall() -> None:
    sys.meta_path[:] = [finder for finder in sys.meta_path if not _is_hook(finder)]


def _is_hook(finder) -> bool:
    # by name: the .pth's copy of this source and an imported kiln.optimizer.eval.lm_eval_plugin define two classes
    return type(finder).__name__ == LmEvalModelsHook.__name__


install()
