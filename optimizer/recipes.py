"""Recipes: named lists of configured passes, or YAML files listing passes and their configs.

    --recipe fp8-weights                 a built-in
    --recipe nvfp4-w4a16,fp8-kv          built-ins applied in order
    --recipe my_recipe.yaml              a file:
        name: my-recipe
        passes:
          - pass: weight-quant           # a built-in pass...
            format: fp8
          - pass: examples.custom_pass:ScaleEmbedding   # ...or module:Class (resolved from the cwd too)
            factor: 1.0
The built-in tables are plain dicts filled here, explicitly; nothing registers itself on import.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from kernels.errors import KilnError
from passes.base import Pass
from passes.kv_cache import KvCacheQuantization
from passes.mixed_precision import WeightQuantization
from passes.mixed_precision_auto import AutoPrecision, ProductionPrecision

BUILTIN_PASSES: dict[str, type[Pass]] = {
    WeightQuantization.name: WeightQuantization,
    KvCacheQuantization.name: KvCacheQuantization,
    AutoPrecision.name: AutoPrecision,
    ProductionPrecision.name: ProductionPrecision,
}

BEST_TUNE_STEPS = 200  # end-to-end tuning steps of the FP4 recipes (weight-quant, production)
AUTO_TUNE_STEPS = 400  # auto: its mixed assignment measured 0.982-0.983 after 200 steps, 0.986 after 400 (5.0 bits)

BUILTIN_RECIPES: dict[str, Callable[[], list[Pass]]] = {
    "none": lambda: [],
    # Uniform formats, calibrated on the calibration text (without it: data-free MSE scales and a warning; a
    # recipe file with `method: rtn` rounds to nearest): AWQ scales folded into norms / linears and GPTQ values
    # (FP8 W8A8: MSE scales, which measured better there), block by block; FP4 then tunes its grid points end
    # to end; MXFP4 W4A4 rotates each linear's input by a 16-wide block Hadamard transform (online).
    "fp8-weights": lambda: [WeightQuantization(format="fp8", method="gptq", awq=True)],
    "fp8": lambda: [WeightQuantization(format="fp8", activations="dynamic", method="mse", awq=True)],
    "nvfp4-w4a16": lambda: [WeightQuantization(format="nvfp4", method="gptq", act_order=False,
                                               tune_steps=BEST_TUNE_STEPS)],
    "mxfp4-w4a16": lambda: [WeightQuantization(format="mxfp4", method="gptq", tune_steps=BEST_TUNE_STEPS)],
    "nvfp4": lambda: [WeightQuantization(format="nvfp4", activations="dynamic", method="gptq", act_order=False,
                                         awq=True, tune_steps=BEST_TUNE_STEPS)],
    "mxfp4": lambda: [WeightQuantization(format="mxfp4", activations="dynamic", method="gptq", awq=True,
                                         rotation_block=16, tune_steps=BEST_TUNE_STEPS)],
    "fp8-kv": lambda: [KvCacheQuantization(format="fp8", scaling="per_tensor")],
    "nvfp4-kv": lambda: [KvCacheQuantization(format="nvfp4")],
    # FP4 MLPs/experts (NVFP4 W4A4 on Blackwell, W4A16 on Hopper), FP8 attention, 2 most sensitive groups BF16;
    # GPTQ values, then 200 steps of end-to-end tuning (the best calibration there is; a recipe file with
    # method: rtn and tune_steps: 0 builds in seconds)
    "production": lambda: [ProductionPrecision(method="gptq", tune_steps=BEST_TUNE_STEPS)],
}

# Recipes that take the weight budget (--weight-bits / --weight-bytes); the budget matches nothing else.
BUDGET_RECIPES: dict[str, Callable[[float | None, int | None], list[Pass]]] = {
    "auto": lambda bits, nbytes: [AutoPrecision(weight_bits=bits, weight_bytes=nbytes, method="gptq",
                                                tune_steps=AUTO_TUNE_STEPS)],
}


@dataclass(frozen=True)
class Recipe:
    name: str
    passes: tuple[Pass, ...]


def _import_pass(ref: str, base_dir: Path | None) -> type[Pass]:
    module_name, _, class_name = ref.partition(":")
    if not module_name or not class_name:
        raise KilnError(f"custom pass {ref!r} must be written module:Class")
    for extra in (str(Path.cwd()), str(base_dir) if base_dir else None, str(base_dir.parent) if base_dir else None):
        if extra and extra not in sys.path:
            sys.path.append(extra)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise KilnError(f"cannot import custom pass module {module_name!r}: {exc}") from None
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Pass) and dataclasses.is_dataclass(cls)):
        raise KilnError(f"{ref} is not a Pass dataclass (subclass passes.base.Pass, decorate with @dataclass)")
    return cls


def build_pass(entry: dict, base_dir: Path | None = None) -> Pass:
    if not isinstance(entry, dict) or "pass" not in entry:
        raise KilnError(f"each recipe entry needs a 'pass' key, got {entry!r}")
    config = {k: v for k, v in entry.items() if k != "pass"}
    ref = str(entry["pass"])
    if ":" in ref:
        cls = _import_pass(ref, base_dir)
    elif ref in BUILTIN_PASSES:
        cls = BUILTIN_PASSES[ref]
    else:
        raise KilnError(f"unknown pass {ref!r}; built-in passes: {', '.join(sorted(BUILTIN_PASSES))} "
                        "(or module:Class for a custom pass)")
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(config) - fields)
    if unknown:
        raise KilnError(f"pass {ref!r} has no field(s) {', '.join(unknown)}; its fields: {', '.join(sorted(fields))}")
    config = {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()}
    try:
        return cls(**config)
    except (TypeError, ValueError) as exc:
        raise KilnError(f"pass {ref!r}: {exc}") from None


def load_recipe_file(path: Path) -> Recipe:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise KilnError(f"{path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict) or not isinstance(data.get("passes"), list):
        raise KilnError(f"{path}: a recipe file needs a 'passes' list")
    passes = tuple(build_pass(entry, path.parent.resolve()) for entry in data["passes"])
    return Recipe(str(data.get("name", path.stem)), passes)


def resolve_recipe(spec: str, weight_bits: float | None = None, weight_bytes: int | None = None) -> Recipe:
    """A built-in name, a comma-separated list of built-in names, or a YAML file.

    `weight_bits` / `weight_bytes` are the budget of the `auto` recipe; giving one to a recipe without a
    budget is an error, not a silent no-op."""
    path = Path(spec)
    budget = weight_bits is not None or weight_bytes is not None
    if path.suffix in (".yaml", ".yml") or path.is_file():
        if not path.is_file():
            raise KilnError(f"recipe file {spec} not found")
        if budget:
            raise KilnError("--weight-bits/--weight-bytes apply to the built-in 'auto' recipe; in a recipe file, "
                            "set weight_bits or weight_bytes on the auto-precision pass")
        return load_recipe_file(path)
    passes: list[Pass] = []
    used_budget = False
    for name in (n.strip() for n in spec.split(",")):
        if name in BUDGET_RECIPES:
            passes.extend(BUDGET_RECIPES[name](weight_bits, weight_bytes))
            used_budget = True
            continue
        if name not in BUILTIN_RECIPES:
            known = sorted([*BUILTIN_RECIPES, *BUDGET_RECIPES])
            raise KilnError(f"unknown recipe {name!r}; built-in recipes: {', '.join(known)} (or a .yaml file)")
        passes.extend(BUILTIN_RECIPES[name]())
    if budget and not used_budget:
        raise KilnError(f"--weight-bits/--weight-bytes apply to the 'auto' recipe; recipe {spec!r} has no budget")
    return Recipe(spec, tuple(passes))
