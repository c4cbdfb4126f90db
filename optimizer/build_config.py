"""BuildConfig: what one build is asked to do, typed and checked before anything loads.

    config = BuildConfig("../shared/models/stories260K", "hopper", "fp8-weights", Path("artifacts/s260k"))
    config.pipeline      # the recipe's passes, ordering rules checked
    config.place         # the torch device the gate and calibration run on

`optimizer.build.build()` takes the same fields as keyword arguments (the Python API) and runs one of these.
Every refusal is a one-line KilnError, in the order the build has always checked them: the target, a budget
given beside a Recipe object, the recipe itself, its passes' ordering, the floors, the device, the counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from kiln.calibration.data import DEFAULT_PARAGRAPHS
from kiln.kernels.errors import KilnError
from kiln.kernels.targets import Target, get_target
from kiln.optimizer.defaults import default_data
from kiln.optimizer.measure.gate import check_floors
from kiln.optimizer.recipes import Recipe, resolve_recipe
from kiln.passes.base import Pipeline
from kiln.runtime.engine import resolve_placement


@dataclass(frozen=True)
class BuildConfig:
    """One build: CHECKPOINT, TARGET and RECIPE, written to OUTPUT (None: not written). The fields are
    `optimizer.build.build()`'s arguments (its docstring says what each does); `eval_data` and `calib_data`
    left None become the embedded texts (optimizer.defaults.default_data), the gate's only when it runs."""

    checkpoint: str | Path
    target: str
    recipe: str | Recipe
    output: Path | str | None
    eval_data: Path | str | None = None
    calib_data: Path | str | None = None
    paragraphs: int = DEFAULT_PARAGRAPHS
    calib_paragraphs: int = 256
    calib_tokens: int | None = None
    min_recovery: float | None = None
    max_kl: float | None = None
    min_top1: float | None = None
    strict: bool = False
    gate: bool = True
    reproducible: bool = False
    overwrite: bool = False
    trust_remote_code: bool = False
    allow_custom_passes: bool = False
    force: bool = False
    weight_bits: float | None = None
    weight_bytes: int | None = None
    kv_fraction: float | None = None
    kv_bytes_per_token: int | None = None
    device: str = "cpu"
    # resolved from the fields above by __post_init__
    target_spec: Target = field(init=False, repr=False, compare=False)
    resolved_recipe: Recipe = field(init=False, repr=False, compare=False)
    pipeline: Pipeline = field(init=False, repr=False, compare=False)
    place: torch.device = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        def set_(name: str, value: object) -> None:  # frozen: the resolved fields are set once, here
            object.__setattr__(self, name, value)

        set_("target_spec", get_target(self.target))
        set_("resolved_recipe", self._resolve_recipe())
        set_("pipeline", Pipeline(self.resolved_recipe.passes))  # ordering rules checked here
        check_floors(self.min_recovery, self.max_kl, self.min_top1)
        place, _, _ = resolve_placement(self.device, None, None)  # an unknown device, or cuda without a GPU
        if place.type not in ("cpu", "cuda"):
            raise KilnError(f"a build runs on cpu or cuda, not {place.type}")
        set_("place", place)
        if self.paragraphs <= 0 or self.calib_paragraphs <= 0:
            raise KilnError(f"paragraph counts must be positive, got {self.paragraphs} and {self.calib_paragraphs}")
        if self.calib_tokens is not None and self.calib_tokens <= 0:
            raise KilnError(f"calib_tokens (--calib-tokens) must be positive, got {self.calib_tokens}")
        if self.gate and self.eval_data is None:
            set_("eval_data", default_data("evaluation"))
        if self.calib_data is None:
            set_("calib_data", default_data("calibration"))

    def _resolve_recipe(self) -> Recipe:
        if not isinstance(self.recipe, Recipe):
            return resolve_recipe(self.recipe, self.weight_bits, self.weight_bytes,
                                  allow_custom_passes=self.allow_custom_passes, kv_fraction=self.kv_fraction,
                                  kv_bytes_per_token=self.kv_bytes_per_token)
        if self.weight_bits is not None or self.weight_bytes is not None:
            raise KilnError("weight_bits/weight_bytes configure the built-in 'auto' recipe; a Recipe object carries "
                            "its own passes (set the budget on its AutoPrecision pass)")
        if self.kv_fraction is not None or self.kv_bytes_per_token is not None:
            raise KilnError("kv_fraction/kv_bytes_per_token configure the built-in 'mla' recipe; a Recipe object "
                            "carries its own passes (set the budget on its MlaConversion pass)")
        return self.recipe

    @property
    def inputs(self) -> list[str | Path | None]:
        """What the output may not be, nor be inside, nor hold (optimizer.output_dir.check_output)."""
        return [self.checkpoint, self.eval_data, self.calib_data, self.recipe if isinstance(self.recipe, str) else None]
