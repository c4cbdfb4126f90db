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
from kiln.passes.base import Pass
from kiln.passes.draft_head import DraftHead
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
    Fusion.name: Fusion,
}

BEST_TUNE_STEPS = 200  # end-to-end tuning steps of the uniform recipes (weight-quant) and production
# auto at 5.0 bits on stories260K (Blackwell, 600 paragraphs; OOD: benchmarks/ood_text.py samples): 400 steps
# 0.9853 (KL 0.0177, OOD KL 0.0362) on one thread, 0.9830 (KL 0.0175) on two: tuning amplifies the
# floating-point order, so recovery moves by about 0.002 between machines. Tried, none clearly better:
# 800 steps 0.9834 (KL 0.0164, OOD KL 0.0349); lr 2e-4 x 800 steps 0.9829 (KL 0.0168, OOD KL 0.0346);
# 8192-token steps 0.9827 (KL 0.0170, OOD KL 0.0347); lr 1e-3 0.9826; NVFP4 block scales tuned too (LSQ
# gradient on log-scales, lr 1e-3): 0.9774 (KL 0.0244)
# With the source model's samples and the embedding tuned (below), 600 steps (same machine, one thread, 600
# paragraphs; OOD: benchmarks/ood_text.py): recovery 0.9875, KL 0.01458, top-1 0.945, OOD 0.9861, KL 0.0278;
# 400 steps with 3000 samples 0.9851, KL 0.01573 (OOD 0.9811, 0.0293); neither 0.9830, KL 0.01749 (OOD 0.9754,
# 0.0355); 3000 samples alone KL 0.01656 (OOD 0.0333). 800 steps on 3000 samples: KL 0.0146 but 0.9844: at equal
# KL recovery moves by about 0.002 with the samples' seed. The build: 4 min 13 s and 0.74 GB peak RSS without,
# 22 min and 1.42 GB with (three builds sharing the 2 cores; sampling 6000 paragraphs is about 7 min of it).
# The built-in recipe through the CLI gives the same 0.9875 / 0.01458 / 0.9446 (13 min, 1.43 GB). Ending at the
# mean of the last 25% of the steps (tail averaging) instead: 0.9858, KL 0.01503, so it was not kept; lr 5e-4:
# 0.9871, KL 0.01496. Samples and batch order from seed 1 instead of 0: 0.9866, KL 0.01508.
# Also tried (seeds 0 / 1, which give 0.9875 / 0.9866 as is): latents in grid units (V / block scale, so each
# block moves at its own scale; lr 7.5e-3, the median block's equal) 0.9858 / 0.9858, KL 0.01545 / 0.01538;
# the norms at 3x the lr 0.9883 / 0.9846 (KL 0.01463 / 0.01481), at 10x 0.9847 (seed 0). At KL 0.0146-0.0155
# recovery spans 0.9846-0.9883: the evaluation's own noise at a fixed KL. Twice the steps on twice the samples
# (1200 on 12000, the CPU tuning budget raised to fit) is no better: 0.9837 / 0.9836, KL 0.01513 / 0.01496,
# 28-29 min (one thread each, two builds sharing the 2 cores), 2.16 GB. Adding the calibration paragraphs'
# next-token cross-entropy to the KL (weight 0.1 / 0.3, seed 0) buys recovery by fitting TinyStories, not the
# source: 0.9923 / 1.0061 while KL rises to 0.01503 / 0.01627 and top-1 falls to 0.9418 / 0.9399, so not kept.
# Adding each block's output error (relative MSE to the source's, summed over blocks, weight 0.3 / 1) to the KL
# is worse too: 0.9838 / 0.9796, KL 0.01601 / 0.01941. The shipped recipe on two threads (the CLI, as is):
# 0.9832, KL 0.01486, top-1 0.9422. The nearest miss: the NVFP4 block scales tuned beside the grid points
# (a log-scale latent per block, straight-through its E4M3 rounding, LSQ's gradient q(u) - u, Adam lr 1e-4 so a
# scale crosses at most about one E4M3 step) gives, seeds 0 / 1, 0.9888 / 0.9885, KL 0.01449 / 0.01466, top-1
# 0.9446 / 0.9445, and on two threads 0.9859, KL 0.01516, top-1 0.9425: recovery above the shipped recipe's in
# all three pairs (+0.0013 to +0.0027) but KL only in two, and under 0.987 on two threads; at lr 3e-4 0.9835, KL
# 0.01634 (the old 1e-3 attempt: 0.9774). Out of domain (benchmarks/ood_text.py) its KL is 0.02849 / 0.02776 /
# 0.02837 against the shipped recipe's 0.02778 / 0.02911 / 0.02635 (seed 0, seed 1, two threads): no better
# there, so not in the code. All of the above ran on AVX-512 code paths. With ATen and oneDNN pinned to AVX2, MKL in
# strict mode and tuning on one thread, the shipped recipe stored the same weights on one and two threads and gave
# 0.9829, KL 0.01502, top-1 0.9431 (the shipped pin is MKL's alone: optimizer.cli.pin_cpu_numerics). Also tried since (seed 0, AVX-512): latents started at
# GPTQ's pre-rounding values (so they sit where GPTQ left them, near or far from a rounding threshold): the
# tuning's batch KL rose to 0.033 by step 300 (0.021 as is), stopped; each latent pulled toward its grid point
# by 0.5% / 2% of its offset after every step (oscillation damping): KL 0.01679 / 0.02569, recovery 0.9850 /
# 0.9792, as the pull freezes the grid points before the cosine tail, which is where the shipped tuning drops
# from about 0.019 to 0.0146; 8192-token steps (twice the tokens): 0.9845 / 0.9854 (seeds 0 / 1), KL 0.01492 /
# 0.01498 - the plateau is not gradient noise either.
# Also tried since (one thread, MKL pinned, seed 0; the shipped recipe: 0.9851, KL 0.01488): FP8 on layers.4's
# gate_up and o instead of the three qkv the solver picks (its best other fit in the budget): tuning batch KL 0.0240
# against 0.0197 at step 250, stopped; a continuous gain per NVFP4 tensor (its fp32 global scale) and per FP8 row
# (its fp32 channel scale), tuned with the FP8 grid points (lr 5e-5): 0.9856, KL 0.01457, 2% lower, within the
# noise; after a 20-step trial tuning, moving the grid points whose first-order loss change is most negative to
# that neighbour (even 32 at once) raised the batch KL from 0.043 to 0.07 or more: second-order effects undo the
# first-order choice (not tried after the full 600 steps). Untuned NVFP4 W4A16 (600 paragraphs): KL 0.0610 as is, 0.0622 with a 16-wide Hadamard input
# rotation, 0.0611 with AWQ: neither helps. With SiLU thread-invariant and OpenBLAS pinned (optimizer.cli) the
# shipped recipe gives 0.9852, KL 0.01495, top-1 0.9445. What moved it was a format, not the tuning: with MXFP6
# (6.25 bits, near FP8's error) among the candidates the solver lifts six groups above FP4 instead of three (and
# drops four to MXFP4 to pay for it): 0.9884, KL 0.01241, top-1 0.9473 (Blackwell, one thread; out of domain KL
# 0.02369 against 0.026-0.029). Screened first with round to nearest and no tuning (300 paragraphs): KL 0.0817
# with FP8 as the only step up, 0.0629 with MXFP6 too, at 5.0 bits; 0.0654 / 0.0394 at 5.5 bits.
AUTO_TUNE_STEPS = 600
AUTO_TUNE_SAMPLES = 6000
# The uniform FP8 recipes' tuning rate. FP8's grid is fine enough that tuning it is fine-tuning, at
# fine-tuning's rates: at weight-quant's 5e-4 (made for FP4's coarse grid) SmolLM2 fp8-weights diverged (30
# steps of 1024 tokens on 10,000 calibration tokens: KL 0.0029 -> 0.087 on its own batches, held-out KL 0.160
# and top-1 0.778); at 5e-5 it gains (held-out KL 0.00377 -> 0.00327, top-1 0.958 -> 0.963, recovery 1.0006
# -> 0.9989; out of domain KL 0.01196 -> 0.01183, top-1 0.938 -> 0.936). stories260K, 200 steps (600
# paragraphs; out of domain: benchmarks/ood_text.py): fp8-weights KL 0.00481 -> 0.00236 (0.00216 at 5e-4),
# top-1 0.9644 -> 0.9767, OOD KL 0.00764 -> 0.00465; fp8 (W8A8) KL 0.00941 -> 0.00734 (0.00704 at 5e-4), OOD
# KL 0.01419 -> 0.01192. Beside FP4, in the mixed recipes, FP8 is not tuned (passes.precision_plan).
FP8_TUNE_LR = 5e-5

BUILTIN_RECIPES: dict[str, Callable[[], list[Pass]]] = {
    "none": list,
    # Uniform formats, calibrated on the calibration text (without it: data-free MSE scales and a warning; a
    # recipe file with `method: rtn` rounds to nearest): AWQ scales folded into norms / linears and GPTQ values,
    # block by block; FP4 then tunes its grid points end to end; MXFP4 W4A4 rotates each linear's input by a
    # 16-wide block Hadamard transform (online).
    # fp8-weights observes each block once (true_sequential=False): stories260K KL 0.00481 against 0.00465 with
    # every stage observed through the ones quantized before it, at half the block forwards.
    # The FP8 recipes then tune end to end (FP8_TUNE_LR), where the tuning budget allows (stories260K on the CPU;
    # SmolLM2's 200 steps only on a GPU, not yet run there)
    "fp8-weights": lambda: [WeightQuantization(format="fp8", method="gptq", awq=True, true_sequential=False,
                                               tune_steps=BEST_TUNE_STEPS, tune_lr=FP8_TUNE_LR)],
    # fp8 (W8A8): GPTQ values, one observation per block, beat MSE scales on both models: stories260K KL 0.00944
    # vs 0.01091; SmolLM2 KL 0.0154 vs 0.0252 (recovery 0.9850 vs 0.9787, 200 paragraphs), in a third of the time
    # With each input rotated by a 64-wide block Hadamard (rotation_block=64) SmolLM2 gives KL 0.0126 and top-1
    # 0.9229 but recovery 0.9803 (against 0.0157, 0.9215, 0.9869 without); out of domain 0.9844, KL 0.0211, top-1
    # 0.915 (against 0.9733, 0.0246, 0.910): better there on all three, yet an online rotation per linear and
    # in-domain recovery 0.0066 lower, so not the default
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
    return Recipe(name, tuple(passes))


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
    return Recipe(spec, tuple(passes))
