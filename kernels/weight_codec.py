"""What every stored weight format answers: the interface the formats' objects implement.

A weight format is one object (its class lives in the format's own module: kernels/fp8.py, nvfp4.py, ...) and
kernels/registry.py lists them. Whoever needs something format-specific asks the object, never its name:

    codec.quantize(w, granularity, global_scale)   fp32 [N, K] -> stored tensors (round to nearest)
    codec.dequantize(tensors, in_features)          stored tensors -> fp32 [N, K]
    codec.stored_tensors(out, in_features, w_shape) the stored tensors' names, dtypes and shapes (the layout check)
    codec.bits_per_weight                           storage cost, scales included
    codec.activations                               the activation formats its GPU linear runs with
    codec.packed_weight / codec.gpu_kernel          the GPU linear: the stored tensors as the kernel takes them,
                                                    and which of kernels.gpu.PACKED_LINEARS multiplies x by them
    codec.grid_*                                    the calibration grid: block width, rounding, scales, pack
    codec.export_names                              its name per export layout ({} and `export_refusal`: none)

The interface only: the formats know their arithmetic; this module imports nothing of theirs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from kiln.kernels.errors import KilnError
from kiln.kernels.formats import ActivationFormat


@dataclass(frozen=True)
class StoredTensor:
    """One tensor a format stores per linear, as the runtime checks it at load.

    Attributes:
        key: the short name (ModelOpt's): "weight", "weight_scale", "weight_scale_2".
        what: how a dtype error names it ("packed FP4 codes", "an FP8 weight scale").
        dtypes: the dtypes allowed; () any floating-point dtype; None: not checked.
        shapes: the shapes allowed; None: not checked.
        ndim: a required number of dimensions (checked when shapes is None); None: not checked.
        shape_first: check the shape before the dtype.
    """

    key: str
    what: str = ""
    dtypes: tuple[torch.dtype, ...] | None = None
    shapes: tuple[tuple[int, ...], ...] | None = None
    ndim: int | None = None
    shape_first: bool = False


class WeightCodec:
    """One stored weight format. Subclasses set the class attributes and implement the methods they support."""

    name: str = ""
    """The manifest's spelling ("fp8_e4m3")."""
    spellings: tuple[str, ...] = ()
    """Every spelling recipes and configs may use for it (the name included)."""
    recipe_name: str | None = None
    """The spelling the quantization passes and calibration take ("fp8"); None: not a quantized format."""
    tensor_names: tuple[str, ...] = ("weight",)
    """The keys of its stored tensors."""
    blocked: bool = False
    """Whether its layout depends on in_features (K padded to whole blocks): the manifest entry records K."""
    bits_per_weight: float = 16.0
    """Stored bits per weight, scales included (per-channel scales: negligible)."""
    activations: tuple[str, ...] = ()
    """The activation formats its GPU linear runs with; () has no packed kernel."""
    dequantizes: bool = True
    """False for a weight stored as its values (dense)."""
    weight_only: bool = False
    """True: activations stay as they are (no activation format of its own)."""
    weight_only_targets: tuple[str, ...] = ()
    """The targets (kernels/targets.py) that run it weight-only (decoded to BF16 inside the GEMM)."""
    weight_activation_targets: tuple[str, ...] = ()
    """The targets whose tensor cores run it with activations in the same format."""
    takes_global_scale: bool = False
    """Whether quantize takes a per-tensor scale shared by fused siblings (NVFP4's weight_scale_2)."""
    export_names: Mapping[str, object] = {}
    """Its name in each export layout that takes it ("hf-modelopt": quant_algo, ...)."""

    # --- codec -------------------------------------------------------------------------------------------------
    def quantize(self, w: Tensor, granularity: str = "per_channel",
                 global_scale: Tensor | None = None) -> dict[str, Tensor]:
        raise NotImplementedError(f"{self.name} does not quantize")

    def dequantize(self, tensors: Mapping[str, Tensor], in_features: int | None = None) -> Tensor:
        raise NotImplementedError

    def stored_tensors(self, out: int | None, in_features: int | None,
                       weight_shape: tuple[int, ...]) -> tuple[StoredTensor, ...]:
        """What to check, in order: `out` and `in_features` from the architecture (None: unknown, then only
        what the stored weight's own shape implies is checked)."""
        raise NotImplementedError

    def stored_bytes(self, out: int, in_features: int, recorded_in_features: int | None = None) -> int:
        """Bytes of one [out, in_features] weight with its scales, as a deployment stores it (bias not included);
        `recorded_in_features`: the padded width an artifact recorded, when wider than the format's own padding."""
        raise NotImplementedError

    def stored_granularity(self, tensors: Mapping[str, Tensor]) -> str:
        """The scale granularity of stored tensors ("per_channel" or "per_tensor")."""
        return "per_channel"

    # --- activations -----------------------------------------------------------------------------------------------
    def activation_fake_quantizer(self, mode: str):
        """What the runtime applies to a linear's input for `mode` "dynamic" or "static" (static: from x's
        maximum), for searches that must see it."""
        raise KilnError(f"{self.recipe_name} is weight-only: its activations stay as they are (activations='none')")

    def activation_format(self, mode: str) -> str:
        """The artifact's activation entry (kernels.formats.ActivationFormat) for a recipe's activations mode
        ("none", "dynamic", "static")."""
        if mode == "none":
            return ActivationFormat.NONE
        raise KilnError(f"{self.recipe_name} is weight-only: its activations stay as they are (activations='none')")

    def static_input_scale(self, absmax: Tensor) -> Tensor:
        """The stored per-tensor activation scale for a calibrated input maximum."""
        raise KilnError(f"{self.recipe_name} has no static activation scale")

    # --- GPU linear ----------------------------------------------------------------------------------------------
    def packed_weight(self, tensors: Mapping[str, Tensor], in_features: int | None) -> object:
        raise NotImplementedError(f"{self.name} has no packed kernel")

    gpu_kernel: str | None = None
    """The kernel family that multiplies x [..., K] by `packed_weight`'s result (a key of kernels.gpu.PACKED_LINEARS:
    "fp8", "fp4", "fp6", or "dequantize": the weight dequantized in x's dtype for each product); None: no packed
    linear (the runtime keeps the weight dequantized)."""

    # --- calibration grid ------------------------------------------------------------------------------------------
    grid_max: float = 0.0
    """The grid's largest magnitude (FP8 E4M3: 448): a per-channel scale search's candidates are amax / grid_max
    times a ratio."""

    def grid_block_size(self, in_features: int) -> int:
        """Values per scale along K (K itself: one scale per row)."""
        return in_features

    def grid_round_(self, scaled: Tensor) -> Tensor:
        """Nearest grid value (saturating) of values already divided by their multiplier, in place."""
        raise NotImplementedError

    def grid_absmax_scales(self, w: Tensor, w_padded: Tensor, granularity: str,
                           global_scale: Tensor | None) -> tuple[Tensor, dict[str, Tensor]]:
        """The kernel's default scales: (fp32 multiplier [N, blocks], stored scale tensors)."""
        raise NotImplementedError

    def grid_scales(self, stored: Mapping[str, Tensor], granularity: str,
                    rows: int | None) -> tuple[Tensor, dict[str, Tensor]]:
        """(multiplier, stored) from stored scale tensors (extra keys ignored)."""
        raise NotImplementedError

    def grid_pack(self, values: Tensor, stored_scales: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Stored tensors for fp32 values already on the grid of `stored_scales`."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<weight format {self.name}>"

    # --- what the quantization passes ask --------------------------------------------------------------------------
    per_tensor_weight_scale: bool = False
    """Whether granularity "per_tensor" stores one weight_scale for every row: stacked siblings are then
    quantized one by one, and fused parts keep or repeat their scale instead of concatenating rows."""
    static_activation_refusal: str | None = None
    """Why activations='static' is refused for a format that quantizes activations (None: allowed)."""
    absmax_ranks_like_mse: bool = False
    """Weight-only, whether absmax scales rank AWQ's candidate scalings as the MSE scale search does (a grid
    fine enough that the search moves little), so AWQ searches with them at a fraction of the cost."""
    gptq_act_order_default: bool = True
    """GPTQ's act-order unless a recipe says (False: block scales are chosen as GPTQ reaches each block)."""
    coarse_grid: bool = False
    """A 4-bit grid: its quantized activations lose enough that weight-only is a rung above them, and end-to-end
    tuning of its grid points pays (a finer grid's tuning fits the calibration text instead)."""
    power_of_two_block_scales: bool = False
    """Whether its block scales are E8M0 exponents: the MSE scale search tries the neighbouring exponents."""
    element_bits: int = 16
    """Bits of one stored value, scales not counted (FP8: 8, FP6: 6, FP4: 4; dense: BF16's 16)."""
    scaled_activations: tuple[str, ...] = ()
    """The activation formats (of `activations`) whose packed kernel takes the linear's calibrated input scale."""
    # --- exports -------------------------------------------------------------------------------------------------
    # export_names (above) per layout: "compressed-tensors" its weight kind (or {scale granularity: kind}),
    # "hf-modelopt" {activation format, or "activation+condition" ("+per_tensor", "+input_scale"): quant_algo},
    # "onnx" how the graph stores it ("FLOAT8E4M3FN", "FLOAT4E2M1+E8M0", ...).
    export_refusals: Mapping[str, str] = {}
    """Why an export layout cannot take it, as the end of a one-line refusal ("MXFP6 (W6A16), which ..."): keyed by
    the layout ("onnx"), or by the layout and an activation format ("hf-modelopt none") when only that pair is out."""
