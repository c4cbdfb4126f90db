"""KV-cache formats as objects: the `KvCodec` every KV format is, BF16 (the unquantized one), and the lookup
tables the quantized formats read with.

A cached stream (K, V, or an MLA latent) is a tensor [N, H, D]: N tokens, H heads, D values per head. Each
format is one object (kernels/kv_fp8.py `FP8_E4M3_KV`, kernels/kv_nvfp4.py `NVFP4_KV`, `BF16_KV` here; by
name: kernels/registry.py `kv_format`), which answers what a stream stored in it costs per token, which
scales and offsets it takes, what tensors the paged cache allocates, and how it stores and reads them:

    codec = kv_format("fp8")
    codec.bytes_per_token(heads * dim, "dynamic")       # values + one fp32 scale per token
    codec.pool_layout("k", heads, dim, scaling, scale, dtype)   # (stored name, shape, dtype, fill), ...
    codec.store(storage, slots, x, scale); codec.load(storage, slots, scale)

Optionally a calibrated per-channel offset mu [H, D] (the mean over calibration tokens) is subtracted before
quantizing and added back on reading: x' = dequantize(quantize(x - mu)) + mu. Post-RoPE keys carry large,
nearly constant means in their slowly rotating channels; without the offset FP8's relative rounding error
lands on those means instead of on the signal. It costs nothing per token: softmax is shift-invariant per
query, so a kernel may drop the K offset (q . mu is the same for every key), and the V offset is added
once to the attention output (the weights sum to 1).
Reading decodes through 256-entry tables (byte -> fp32 value, or byte -> the two E2M1 values it packs) with
the per-tensor scale folded in: the same fp32 products as float(q) * scale, one lookup per byte instead of a
slow float8 cast.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kiln.kernels.formats import KvFormat
from kiln.kernels.fp4 import e2m1_decode
from kiln.kernels.fp8 import FP8_DTYPE

_BYTES = torch.arange(256, dtype=torch.uint8)
E4M3_VALUES = _BYTES.view(FP8_DTYPE).float()
"""fp32 value of every float8_e4m3fn bit pattern (0x7F and 0xFF are NaN; quantizing never stores them)."""
E2M1_PAIR_VALUES = torch.stack((e2m1_decode(_BYTES & 0x0F), e2m1_decode(_BYTES >> 4)), dim=-1)
"""[256, 2]: the two E2M1 values a packed byte holds, low nibble (element 2i) first."""


E4M3_ON: dict[torch.device, Tensor] = {}  # copies of the tables on other devices than the CPU
E2M1_PAIRS_ON: dict[torch.device, Tensor] = {}


def table_on(table: Tensor, copies: dict[torch.device, Tensor], device: torch.device) -> Tensor:
    """A lookup table on `device`: the CPU one, or its copy there (made once; a compiled step finds it made)."""
    if device.type == "cpu":
        return table
    copy = copies.get(device)
    if copy is None:
        copy = copies[device] = table.to(device)
    return copy


def lookup(table: Tensor, codes: Tensor) -> Tensor:
    """table[codes] for uint8 codes of any shape -> [*codes.shape, *table.shape[1:]]."""
    return table.index_select(0, codes.reshape(-1).long()).view(*codes.shape, *table.shape[1:])


def positive(scale: Tensor) -> Tensor:
    """The scale with zeros (an all-zero stream) replaced by 1."""
    return torch.where(scale > 0, scale, torch.ones_like(scale))


KERNEL_PER_TENSOR, KERNEL_PER_HEAD, KERNEL_PER_TOKEN = 0, 1, 2
"""The paged-attention kernels' SCALE_MODE: one scale, one per KV head, one per token."""


class KvCodec:
    """One KV-cache number format: what a stream stored in it costs, holds and reads back as.

    `name` is the manifest's "format" (a KvFormat); `scalings` the manifest "scaling" values it takes (the first
    is what a layer gets when the requested scaling is not one of them); `quantized` False: held in the model's
    dtype, read back as written; `dim_multiple`: what every cached dim must be a multiple of; `packing`: values
    per stored data element; `kernel_format`: the paged-attention kernels' FORMAT code."""

    name: KvFormat
    label: str
    scalings: tuple[str, ...]
    quantized = True
    dim_multiple = 1
    packing = 1
    kernel_format: int

    def bytes_per_token(self, values: int, scaling: str) -> int:
        """Deployment bytes a token's `values` cost (per-token scales included; static scales are not)."""
        raise NotImplementedError

    def static_scale(self, scaling: str) -> bool:
        """Whether a stream reads a calibrated scale tensor (the manifest entry's "scale_tensors")."""
        return False

    def token_scales(self, scaling: str) -> bool:
        """Whether a stream stores one scale per token beside its values."""
        return False

    def unaligned_dims(self, streams) -> list[str]:
        """"name dim D" for each (name, heads, dim) stream whose dim this format cannot store."""
        return [f"{name} dim {dim}" for name, _, dim in streams if dim % self.dim_multiple]

    def calibrated_scale(self, x: Tensor, scaling: str) -> tuple[Tensor | None, Tensor | None]:
        """(scale to store, scale to compute with) from calibration activations x [N, H, D]; None: none."""
        return None, None

    def fake_quantize(self, centered: Tensor, scaling: str, scale: Tensor | None) -> Tensor:
        """Store-then-read of an offset-free [N, H, D] stream, in fp32."""
        return centered.float()

    def pool_layout(self, name: str, heads: int, dim: int, scaling: str, scale: Tensor | None,
                    dtype: torch.dtype) -> tuple:
        """The paged cache's tensors per token slot: (stored name, shape per slot, dtype, fill value), ..."""
        return (("data", (heads, dim), dtype, 0.0),)

    def store(self, storage: dict[str, Tensor], slots: Tensor, x: Tensor, scale: Tensor | None) -> None:
        """Write an offset-free fp32 [len(slots), H, D] into a pool's tensors at `slots`."""
        raise NotImplementedError

    def load(self, storage: dict[str, Tensor], slots: Tensor, scale: Tensor | None) -> Tensor:
        """fp32 [len(slots), H, D] read back from a pool's tensors at `slots` (offset not added)."""
        raise NotImplementedError

    def kernel_tensors(self, storage: dict[str, Tensor], scale: Tensor | None) -> tuple:
        """(data, scale, global scale) as kernels/torch_refs.py's KvPool holds them for this pool."""
        raise NotImplementedError

    def check_pool(self, data: Tensor, scale: Tensor | None, global_scale: Tensor | None) -> None:
        """A ValueError unless a KvPool's tensors are what this format stores."""

    def read_pool(self, rows, data: Tensor, scale: Tensor | None, global_scale: Tensor | None) -> Tensor:
        """fp32 values of a KvPool's slots on the CPU; `rows(t)` gathers t's slots there."""
        raise NotImplementedError

    def kernel_operands(self, data: Tensor, scale: Tensor | None, global_scale: Tensor | None,
                        dummy: Tensor) -> tuple:
        """(data, scale, global scale, scale mode) as the paged-attention kernels read them."""
        raise NotImplementedError

    def scale_shape(self, heads: int, scaling: str) -> tuple[int, ...]:
        """The shape a stream's calibrated scale is computed with: () for one scale."""
        return ()


class Bf16KvCodec(KvCodec):
    """Unquantized: BF16 (2 bytes a value) at deployment; the runtime holds the model's compute dtype."""

    name, label, scalings = KvFormat.BF16, "BF16", ("none",)
    quantized = False
    kernel_format = 0

    def bytes_per_token(self, values: int, scaling: str) -> int:
        return 2 * values

    def kernel_operands(self, data, scale, global_scale, dummy) -> tuple:
        return data, dummy, dummy, KERNEL_PER_TENSOR

    def read_pool(self, rows, data, scale, global_scale) -> Tensor:
        return rows(data).float()


BF16_KV = Bf16KvCodec()
