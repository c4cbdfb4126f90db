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

Recipe files may come from hostile hands. A file has only `name` (a string) and `passes` (a list of
mappings); it is at most MAX_RECIPE_BYTES, has no YAML aliases (nested ones are the "billion laughs") and a
bounded number and depth of nodes. A `module:Class` pass imports and runs that module's code, so it needs
an explicit opt-in (`allow_custom_passes`, the CLI's --allow-custom-passes); without it the recipe is
refused before anything is imported, and sys.path is extended only for the duration of the import.
Every refusal is a one-line KilnError of bounded length.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from kiln.kernels.errors import KilnError
from kiln.passes.auto_precision import AutoPrecision
from kiln.passes.base import Pass, Pipeline
from kiln.passes.draft_head import DraftHead
from kiln.passes.embedding_quant import EmbeddingQuantization
from kiln.passes.fuse import Fusion
from kiln.passes.kv_cache import KvCacheQuantization
from kiln.passes.mla import MlaConversion
from kiln.passes.production_precision import ProductionPrecision
from kiln.passes.weight_quant import WeightQuantization
from kiln.runtime.artifact import read_bounded

BUILTIN_PASSES: dict[str, type[Pass]] = {
    WeightQuantization.name: WeightQuantization,
    KvCacheQuantization.name: KvCacheQuantization,
    AutoPrecision.name: AutoPrecision,
    ProductionPrecision.name: ProductionPrecision,
    MlaConversion.name: MlaConversion,
    DraftHead.name: DraftHead,
    EmbeddingQuantization.name: EmbeddingQuantization,
    Fusion.name: Fusion,
}

BEST_TUNE_STEPS = 200  # end-to-end tuning steps of the uniform recipes (weight-quant) and production
# auto's tuning: what was measured, kept and tried is in benchmarks/results/tuning.md
AUTO_TUNE_STEPS = 600
AUTO_TUNE_SAMPLES = 6000
# The uniform FP8 recipes' tuning rate. FP8's grid is fine enough that tuning it is fine-tuning, at
# fine-tuning's rates: weight-quant's 5e-4 (made for FP4's coarse grid) diverges on SmolLM2 (figures:
# benchmarks/results/tuning.md). Beside FP4, in the mixed recipes, FP8 is not tuned (passes.precision_plan).
FP8_TUNE_LR = 5e-5

BUILTIN_RECIPES: dict[str, Callable[[], list[Pass]]] = {
    "none": list,
    # Uniform formats, calibrated on the calibration text (without it: data-free MSE scales and a warning; a
    # recipe file with `method: rtn` rounds to nearest): AWQ scales folded into norms / linears and GPTQ values,
    # block by block; FP4 then tunes its grid points end to end; MXFP4 W4A4 rotates each linear's input by a
    # 16-wide block Hadamard transform (online).
    # fp8-weights observes each block once (true_sequential=False): about the KL of observing every stage
    # through the ones quantized before it, at half the block forwards (benchmarks/results/precision.md).
    # The FP8 recipes then tune end to end (FP8_TUNE_LR), where the tuning budget allows (stories260K on the CPU;
    # SmolLM2's 200 steps only on a GPU, not yet run there)
    "fp8-weights": lambda: [WeightQuantization(format="fp8", method="gptq", awq=True, true_sequential=False,
                                               tune_steps=BEST_TUNE_STEPS, tune_lr=FP8_TUNE_LR)],
    # fp8 (W8A8): GPTQ values, one observation per block, beat MSE scales on both models in a third of the
    # time. A 64-wide input Hadamard rotation (rotation_block=64) is not the default: it costs an online
    # rotation per linear and lowers in-domain recovery on SmolLM2 (benchmarks/results/precision.md)
    "fp8": lambda: [WeightQuantization(format="fp8", activations="dynamic", method="gptq", awq=True,
                                       true_sequential=False, tune_steps=BEST_TUNE_STEPS, tune_lr=FP8_TUNE_LR)],
    "nvfp4-w4a16": lambda: [WeightQuantization(format="nvfp4", method="gptq", act_order=False,
                                               tune_steps=BEST_TUNE_STEPS)],
    "mxfp4-w4a16": lambda: [WeightQuantization(format="mxfp4", method="gptq", tune_steps=BEST_TUNE_STEPS)],
    "nvfp4": lambda: [WeightQuantization(format="nvfp4", activations="dynamic", method="gptq", act_order=False,
                                         awq=True, tune_steps=BEST_TUNE_STEPS)],
    "mxfp4": lambda: [WeightQuantization(format="mxfp4", activations="dynamic", method="gptq", awq=True,
                                         rotation_block=16, tune_steps=BEST_TUNE_STEPS)],
    "fp8-kv": lambda: [KvCacheQuantization(format="fp8", scaling="per_tensor")],
    # what the serving engines' FP8 KV caches hold (vLLM's kv_cache_dtype="fp8"): a scale per tensor and no
    # calibrated offset, so `optimize export` writes it (kv_cache_scheme / kv_cache_quant_algo)
    "fp8-kv-export": lambda: [KvCacheQuantization(format="fp8", scaling="per_tensor", center=False)],
    "nvfp4-kv": lambda: [KvCacheQuantization(format="nvfp4")],
    # FP4 MLPs/experts (NVFP4 W4A4 on Blackwell, W4A16 on Hopper), FP8 attention, 2 most sensitive groups BF16;
    # GPTQ values, then 200 steps of end-to-end tuning (the best calibration there is; a recipe file with
    # method: rtn and tune_steps: 0 builds in seconds)
    "production": lambda: [ProductionPrecision(method="gptq", tune_steps=BEST_TUNE_STEPS)],
    # an EAGLE-style draft head self-distilled from the target (after the passes that change the target), or a
    # DeepSeek-V3 checkpoint's own MTP layer; its gate metric is tau, tokens per target call
    "draft-head": lambda: [DraftHead()],
    # q/k/v and gate/up as single linears in their stored formats, plus the kernel fusions a GPU runtime launches
    # (norm + activation quantization, SwiGLU + quantization, RoPE + KV write); last in any recipe
    "fuse": lambda: [Fusion()],
    # the embedding table (and a tied lm_head, which reads it) stored weight-only, data-free (MSE scales); after
    # the linears' recipe, e.g. fp8-weights,embedding-fp8
    "embedding-fp8": lambda: [EmbeddingQuantization(format="fp8")],
    "embedding-nvfp4": lambda: [EmbeddingQuantization(format="nvfp4")],
    "embedding-mxfp4": lambda: [EmbeddingQuantization(format="mxfp4")],
}

# Recipes that take the weight budget (--weight-bits / --weight-bytes); the budget matches nothing else.
BUDGET_RECIPES: dict[str, Callable[[float | None, int | None], list[Pass]]] = {
    "auto": lambda bits, nbytes: [AutoPrecision(weight_bits=bits, weight_bytes=nbytes, method="gptq",
                                                tune_steps=AUTO_TUNE_STEPS, tune_embedding=True,
                                                tune_samples=AUTO_TUNE_SAMPLES)],
}

# Recipes that take the KV budget (--kv-fraction / --kv-bytes-per-token); the budget matches nothing else.
KV_BUDGET_RECIPES: dict[str, Callable[[float | None, int | None], list[Pass]]] = {
    "mla": lambda fraction, nbytes: [MlaConversion(kv_fraction=fraction, kv_bytes_per_token=nbytes)],
}


@dataclass(frozen=True)
class Recipe:
    name: str
    passes: tuple[Pass, ...]


MAX_RECIPE_BYTES = 1 << 20
"""Largest recipe file read (a recipe is a few lines; this bounds parsing time and memory)."""
MAX_RECIPE_NODES = 20_000
"""Most YAML nodes (scalars, lists, mappings) a recipe file may hold."""
MAX_RECIPE_DEPTH = 32
"""Deepest nesting of lists and mappings in a recipe file."""
RECIPE_KEYS = ("name", "passes")
MAX_MESSAGE = 300
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def _clip(value: object, limit: int = 80) -> str:
    """`value` as one line of at most `limit` characters, for error messages (control characters escaped)."""
    text = str(value)
    if not text.isprintable():
        text = text.encode("unicode_escape", "backslashreplace").decode("ascii")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _r(value: object, limit: int = 60) -> str:
    """A short repr of a value from a recipe."""
    if isinstance(value, str):
        return _clip(repr(value[: limit + 1]), limit)
    if isinstance(value, dict | list | tuple):
        return f"a {type(value).__name__}"
    return _clip(repr(value), limit)


class _RecipeYamlError(Exception):
    """A recipe document this loader refuses (aliases, too many nodes, too deep); the message is one line."""


class _RecipeLoader(yaml.SafeLoader):
    """SafeLoader without aliases (a recipe never needs them; nested ones expand exponentially: the
    "billion laughs") and with a bound on the number of nodes and on their nesting depth."""

    def __init__(self, stream):
        super().__init__(stream)
        self._nodes = 0
        self._depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise _RecipeYamlError(f"YAML aliases (*name) are not allowed in recipe files (line {mark.line + 1})")
        self._nodes += 1
        if self._nodes > MAX_RECIPE_NODES:
            raise _RecipeYamlError(f"more than {MAX_RECIPE_NODES} YAML nodes")
        self._depth += 1
        try:
            if self._depth > MAX_RECIPE_DEPTH:
                raise _RecipeYamlError(f"nested deeper than {MAX_RECIPE_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _parse_recipe_yaml(path: Path) -> object:
    where = _clip(path)
    data = read_bounded(path, MAX_RECIPE_BYTES, f"recipe file {where}", "a recipe lists a few passes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise KilnError(f"recipe file {where} is not UTF-8 text") from None
    loader = _RecipeLoader(text)
    try:
        return loader.get_single_data()
    except _RecipeYamlError as exc:
        raise KilnError(f"recipe file {where}: {exc}") from None
    except yaml.YAMLError as exc:
        lines = str(exc).strip().splitlines()
        raise KilnError(f"{where} is not valid YAML: {_clip(lines[0] if lines else 'parse error', 120)}") from None
    except (RecursionError, ValueError, OverflowError) as exc:  # constructors of odd scalars (dates, ...)
        raise KilnError(f"{where} is not valid YAML: {_clip(type(exc).__name__ + ': ' + str(exc), 120)}") from None
    finally:
        loader.dispose()


@contextlib.contextmanager
def _import_path(dirs: list[str]) -> Iterator[None]:
    """`dirs` appended to sys.path for the duration of the block only (the caller's own entries win)."""
    added = [d for d in dict.fromkeys(dirs) if d not in sys.path]
    sys.path.extend(added)
    try:
        yield
    finally:
        for d in added:
            with contextlib.suppress(ValueError):
                sys.path.remove(d)


def _import_pass(ref: str, base_dir: Path | None) -> type[Pass]:
    module_name, _, class_name = ref.partition(":")
    if not _MODULE.fullmatch(module_name) or not _IDENTIFIER.fullmatch(class_name):
        raise KilnError(f"custom pass {_r(ref)} must be written module:Class (a dotted module path, a class name)")
    dirs = [str(Path.cwd())]
    if base_dir is not None:
        dirs += [str(base_dir), str(base_dir.parent)]
    try:
        with _import_path(dirs):
            module = importlib.import_module(module_name)
            cls = getattr(module, class_name, None)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 -- the user's module: any failure is one line
        lines = str(exc).strip().splitlines()
        detail = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
        raise KilnError(f"cannot import custom pass module {_r(module_name)}: {_clip(detail, 150)}") from None
    if not (isinstance(cls, type) and issubclass(cls, Pass) and dataclasses.is_dataclass(cls)):
        raise KilnError(f"{_r(ref)} is not a Pass dataclass (subclass kiln.passes.base.Pass, decorate with @dataclass)")
    return cls


def build_pass(entry: dict, base_dir: Path | None = None, allow_custom_passes: bool = False) -> Pass:
    """One configured pass from a recipe entry `{pass: NAME, field: value, ...}`.

    NAME is a built-in pass or `module:Class`; a custom pass's module is imported (running its code, from
    the cwd, `base_dir` or its parent) only with `allow_custom_passes`, and refused before any import
    without it."""
    if not isinstance(entry, dict) or "pass" not in entry:
        raise KilnError(f"each recipe entry must be a mapping with a 'pass' key, got {_r(entry)}")
    bad_keys = [k for k in entry if not isinstance(k, str)]
    if bad_keys:
        raise KilnError(f"recipe entry keys must be field names, got {_r(bad_keys[0])}")
    ref = entry["pass"]
    if not isinstance(ref, str):
        raise KilnError(f"a recipe entry's 'pass' must be a pass name, got {_r(ref)}")
    config = {k: v for k, v in entry.items() if k != "pass"}
    if ":" in ref:
        if not allow_custom_passes:
            raise KilnError(f"custom pass {_r(ref)} names Python code from outside Kiln; importing it needs "
                            "--allow-custom-passes")
        cls = _import_pass(ref, base_dir)
    elif ref in BUILTIN_PASSES:
        cls = BUILTIN_PASSES[ref]
    else:
        raise KilnError(f"unknown pass {_r(ref)}; built-in passes: {', '.join(sorted(BUILTIN_PASSES))} "
                        "(or module:Class for a custom pass)")
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(config) - fields)
    if unknown:
        shown = ", ".join(_clip(k, 40) for k in unknown[:5]) + (f" (+{len(unknown) - 5} more)" if len(unknown) > 5 else "")
        raise KilnError(f"pass {_r(ref)} has no field(s) {shown}; its fields: {', '.join(sorted(fields))}")
    config = {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()}
    try:
        return cls(**config)
    except (TypeError, ValueError) as exc:
        lines = str(exc).strip().splitlines()
        raise KilnError(f"pass {_r(ref)}: {_clip(lines[0] if lines else type(exc).__name__, 160)}") from None


def load_recipe_file(path: Path, allow_custom_passes: bool = False) -> Recipe:
    """A recipe file: a mapping with `passes` (a list of entries, see `build_pass`) and optionally `name`.

    Hostile files are refused with one line: bigger than MAX_RECIPE_BYTES, YAML aliases, too many or too
    deeply nested nodes, keys other than name/passes, custom passes without `allow_custom_passes`."""
    path = Path(path)
    where = _clip(path)
    data = _parse_recipe_yaml(path)
    if not isinstance(data, dict):
        raise KilnError(f"recipe file {where} must be a mapping with a 'passes' list, got {_r(data)}")
    if "target" in data:
        raise KilnError(f"recipe file {where} sets 'target': recipe files do not set the target; pass --target")
    unknown = [k for k in data if k not in RECIPE_KEYS]
    if unknown:
        raise KilnError(f"recipe file {where} has unknown key {_r(unknown[0])}"
                        f"{f' (+{len(unknown) - 1} more)' if len(unknown) > 1 else ''}; "
                        f"a recipe file has only {' and '.join(RECIPE_KEYS)}")
    if not isinstance(data.get("passes"), list):
        raise KilnError(f"recipe file {where} needs a 'passes' list, got {_r(data.get('passes'))}")
    name = data.get("name", path.stem)
    if not isinstance(name, str) or not name.strip():
        raise KilnError(f"recipe file {where}: 'name' must be a non-empty string, got {_r(name)}")
    passes = []
    for i, entry in enumerate(data["passes"]):
        try:
            passes.append(build_pass(entry, path.parent.resolve(), allow_custom_passes))
        except KilnError as exc:
            prefix = f"recipe file {_clip(path, 60)}, pass {i + 1}: "
            raise KilnError(prefix + _clip(exc, MAX_MESSAGE - len(prefix))) from None
    try:
        return _checked(Recipe(name, tuple(passes)))
    except KilnError as exc:
        prefix = f"recipe file {_clip(path, 60)}: "
        raise KilnError(prefix + _clip(exc, MAX_MESSAGE - len(prefix))) from None


def _checked(recipe: Recipe) -> Recipe:
    """`recipe` once its passes' order and compatibility hold (Pipeline's rules: an order, a pass that must be
    last, two passes that claim the same part of the model), so that a conflict is refused when the recipe is
    named, before a checkpoint is read or a calibration runs."""
    Pipeline(recipe.passes)
    return recipe


def resolve_recipe(spec: str, weight_bits: float | None = None, weight_bytes: int | None = None,
                   allow_custom_passes: bool = False, kv_fraction: float | None = None,
                   kv_bytes_per_token: int | None = None) -> Recipe:
    """A built-in name, a comma-separated list of built-in names, or a YAML file.

    `weight_bits` / `weight_bytes` are the budget of the `auto` recipe, `kv_fraction` / `kv_bytes_per_token`
    that of the `mla` recipe; giving one to a recipe without that budget is an error, not a silent no-op. `allow_custom_passes` lets a recipe file import `module:Class`
    passes (running their code); without it such a recipe is refused before anything is imported."""
    spec = str(spec)
    path = Path(spec)
    budget = weight_bits is not None or weight_bytes is not None
    kv_budget = kv_fraction is not None or kv_bytes_per_token is not None
    try:
        is_file = path.is_file()
    except (OSError, ValueError):  # a name too long to be a path, ...
        is_file = False
    if path.suffix in (".yaml", ".yml") or is_file:
        if not is_file:
            raise KilnError(f"recipe file {_clip(spec)} not found")
        if budget:
            raise KilnError("--weight-bits/--weight-bytes apply to the built-in 'auto' recipe; in a recipe file, "
                            "set weight_bits or weight_bytes on the auto-precision pass")
        if kv_budget:
            raise KilnError("--kv-fraction/--kv-bytes-per-token apply to the built-in 'mla' recipe; in a recipe "
                            "file, set kv_fraction or kv_bytes_per_token on the mla pass")
        return load_recipe_file(path, allow_custom_passes)
    passes: list[Pass] = []
    used_budget = used_kv_budget = False
    for name in (n.strip() for n in spec.split(",")):
        if name in KV_BUDGET_RECIPES:
            if not kv_budget:
                raise KilnError(f"recipe {_r(name)} needs a KV budget: --kv-fraction F (e.g. 0.5) or "
                                "--kv-bytes-per-token N")
            passes.extend(KV_BUDGET_RECIPES[name](kv_fraction, kv_bytes_per_token))
            used_kv_budget = True
            continue
        if name in BUDGET_RECIPES:
            passes.extend(BUDGET_RECIPES[name](weight_bits, weight_bytes))
            used_budget = True
            continue
        if name not in BUILTIN_RECIPES:
            known = sorted([*BUILTIN_RECIPES, *BUDGET_RECIPES, *KV_BUDGET_RECIPES])
            raise KilnError(f"unknown recipe {_r(name)}; built-in recipes: {', '.join(known)} (or a .yaml file)")
        passes.extend(BUILTIN_RECIPES[name]())
    if budget and not used_budget:
        raise KilnError(f"--weight-bits/--weight-bytes apply to the 'auto' recipe; recipe {_r(spec)} has no budget")
    if kv_budget and not used_kv_budget:
        raise KilnError(f"--kv-fraction/--kv-bytes-per-token apply to the 'mla' recipe; recipe {_r(spec)} has no "
                        "KV budget")
    return _checked(Recipe(spec, tuple(passes)))
