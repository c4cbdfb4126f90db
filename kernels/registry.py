"""The number formats Kiln knows, by name: one line per format, each its module's object.

    weight_format("fp8")           the object of a spelling (recipes' "fp8" and the manifest's "fp8_e4m3" are
                                   one), or a one-line KilnError naming the known ones
    WEIGHT_FORMATS                 name -> object, in the order messages list them
    quantized_spellings()          what the quantization passes and calibration take ("fp8", "nvfp4", ...)

    kv_format("fp8")               the KV-cache format object (a `KvCodec`, kernels/kv_codec.py) of a spelling,
                                   or a one-line KilnError naming the known ones
    KV_FORMATS                     manifest name -> KV format object

Adding a format is its module (a `WeightCodec` or `KvCodec` subclass and its instance) and one line here.
"""

from __future__ import annotations

from collections.abc import Iterable

from kiln.kernels.dense import DENSE_FORMAT
from kiln.kernels.errors import KilnError
from kiln.kernels.formats import KV_SPELLINGS, WeightFormat, parse_spelling
from kiln.kernels.formats import WEIGHT_SPELLINGS as ENUM_SPELLINGS
from kiln.kernels.fp8 import FP8_E4M3_FORMAT
from kiln.kernels.fp8_e5m2 import FP8_E5M2_FORMAT
from kiln.kernels.kv_codec import BF16_KV, KvCodec
from kiln.kernels.kv_fp8 import FP8_E4M3_KV
from kiln.kernels.kv_nvfp4 import NVFP4_KV
from kiln.kernels.mxfp4 import MXFP4_FORMAT
from kiln.kernels.mxfp6 import MXFP6_FORMAT
from kiln.kernels.nvfp4 import NVFP4_FORMAT
from kiln.kernels.weight_codec import WeightCodec

WEIGHT_FORMATS: dict[str, WeightCodec] = {codec.name: codec for codec in (
    DENSE_FORMAT,
    FP8_E4M3_FORMAT,
    NVFP4_FORMAT,
    MXFP4_FORMAT,
    MXFP6_FORMAT,
    FP8_E5M2_FORMAT,
)}

WEIGHT_SPELLINGS: dict[str, WeightCodec] = {s: codec for codec in WEIGHT_FORMATS.values() for s in codec.spellings}


def weight_format(name: object) -> WeightCodec:
    """The format object a spelling names; a KilnError naming the known formats for anything else."""
    codec = WEIGHT_SPELLINGS.get(name) if isinstance(name, str) else None
    if codec is None:
        raise KilnError(f"unknown stored weight format {name!r}; known: {', '.join(WEIGHT_FORMATS)}")
    return codec


def parse_weight_format(value, allowed: Iterable[str] | None = None) -> WeightFormat:
    """The WeightFormat a spelling names ("fp8" and "fp8_e4m3" are one); `allowed`: the spellings this
    caller takes (default: all). A format registered beyond the enum parses to its name."""
    spellings = {**{s: codec.name for s, codec in WEIGHT_SPELLINGS.items()}, **ENUM_SPELLINGS}
    return parse_spelling("weight format", value, spellings, allowed)


def quantized_spellings() -> tuple[str, ...]:
    """The spellings the quantization passes and calibration take, one per quantized format."""
    return tuple(codec.recipe_name for codec in WEIGHT_FORMATS.values() if codec.recipe_name is not None)


KV_FORMATS: dict[str, KvCodec] = {codec.name: codec for codec in (BF16_KV, FP8_E4M3_KV, NVFP4_KV)}


def kv_format(name: object) -> KvCodec:
    """The KV-cache format object a spelling names ("fp8" and "fp8_e4m3" are one); a KilnError otherwise."""
    codec = KV_FORMATS.get(KV_SPELLINGS.get(name)) if isinstance(name, str) else None
    if codec is None:
        raise KilnError(f"unknown KV format {name!r}; known: {', '.join(KV_FORMATS)}")
    return codec
