"""KV-cache number formats: FP8 E4M3 with static or per-token scales, and NVFP4 blocks along head_dim.

A cached stream (K, V, or an MLA latent) is a tensor [N, H, D]: N tokens, H heads, D values per head.

    FP8 E4M3, static scale s (per tensor: 0-dim; per KV head: [H, 1], calibrated offline):
        q = cast_e4m3(clamp(x / s, -448, 448))          # float8_e4m3fn, one byte per value
        x' = float(q) * s
        s = amax / 448 over the calibration activations (per tensor, or per head)
    FP8 E4M3, dynamic per token: s[n] = max(|x[n, :, :]|) / 448, stored as fp32 beside the token
    NVFP4: per stream a calibrated fp32 global scale g = amax / (6 * 448); per token, head and block of 16
        values along D an E4M3 block scale and 16 E2M1 codes packed two a byte (kernels/nvfp4.py's
        arithmetic, applied to the [N * H, D] matrix), so D must be a multiple of 16.
Values above a calibrated amax saturate (at 448 or at 6 * 448 * g); they never become NaN or inf.
Optionally a calibrated per-channel offset mu [H, D] (the mean over calibration tokens) is subtracted before
quantizing and added back on reading: x' = dequantize(quantize(x - mu)) + mu. Post-RoPE keys carry large,
nearly constant means in their slowly rotating channels; without the offset FP8's relative rounding error
lands on those means instead of on the signal. It costs nothing per token: softmax is shift-invariant per
query, so a kernel may drop the K offset (q . mu is the same for every key), and the V offset is added
once to the attention output (the weights sum to 1).
Every function here is what the runtime's paged cache stores and reads with. Reading decodes through
256-entry tables (byte -> fp32 value, or byte -> the two E2M1 values it packs) with the per-tensor scale
folded in: the same fp32 products as float(q) * scale, one lookup per byte instead of a slow float8 cast.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kiln.kernels.errors import KilnError
from kiln.kernels.formats import KvFormat
from kiln.kernels.fp4 import e2m1_decode
from kiln.kernels.fp8 import E4M3_MAX, FP8_DTYPE
from kiln.kernels.nvfp4 import NVFP4_BLOCK_SIZE, nvfp4_quantize

KV_FP8_SCALINGS = ("per_tensor", "per_head", "dynamic")
"""How FP8 KV scales are chosen: one calibrated scale per tensor or per KV head, or one per token."""

_BYTES = torch.arange(256, dtype=torch.uint8)
E4M3_VALUES = _BYTES.view(FP8_DTYPE).float()
"""fp32 value of every float8_e4m3fn bit pattern (0x7F and 0xFF are NaN; quantizing never stores them)."""
E2M1_PAIR_VALUES = torch.stack((e2m1_decode(_BYTES & 0x0F), e2m1_decode(_BYTES >> 4)), dim=-1)
"""[256, 2]: the two E2M1 values a packed byte holds, low nibble (element 2i) first."""


_E4M3_ON: dict[torch.device, Tensor] = {}  # copies of the tables on other devices than the CPU
_E2M1_PAIRS_ON: dict[torch.device, Tensor] = {}


def _table(table: Tensor, copies: dict[torch.device, Tensor], device: torch.device) -> Tensor:
    """A lookup table on `device`: the CPU one, or its copy there (made once; a compiled step finds it made)."""
    if device.type == "cpu":
        return table
    copy = copies.get(device)
    if copy is None:
        copy = copies[device] = table.to(device)
    return copy


def _lookup(table: Tensor, codes: Tensor) -> Tensor:
    """table[codes] for uint8 codes of any shape -> [*codes.shape, *table.shape[1:]]."""
    return table.index_select(0, codes.reshape(-1).long()).view(*codes.shape, *table.shape[1:])


def _positive(scale: Tensor) -> Tensor:
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def fp8_kv_scale(amax: Tensor) -> Tensor:
    """Static FP8 scale(s) from calibrated amax: 0-dim (per tensor) or [H] -> [H, 1] (per head); fp32."""
    scale = _positive(amax.float() / E4M3_MAX)
    return scale.reshape(()) if scale.numel() == 1 and scale.dim() == 0 else scale.reshape(-1, 1)


def fp8_kv_quantize(x: Tensor, scale: Tensor) -> Tensor:
    """[N, H, D] -> float8_e4m3fn [N, H, D] with a static scale (0-dim or [H, 1]), saturating."""
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


def fp8_kv_quantize_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    """[N, H, D] -> (float8_e4m3fn [N, H, D], fp32 scale [N, 1, 1]): one dynamic scale per token."""
    x = x.float()
    scale = _positive(x.abs().amax(dim=(-2, -1), keepdim=True) / E4M3_MAX)
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE), scale


def fp8_kv_dequantize(q: Tensor, scale: Tensor) -> Tensor:
    """float8 [..., H, D] times a broadcastable scale (0-dim, [H, 1] or per token [N, 1, 1]) -> fp32."""
    codes = q.view(torch.uint8)
    values = _table(E4M3_VALUES, _E4M3_ON, codes.device)
    if scale.numel() == 1:
        return _lookup(values * scale.reshape(()), codes)
    return _lookup(values, codes) * scale


def nvfp4_kv_global_scale(amax: Tensor) -> Tensor:
    """Per-stream NVFP4 global scale from a calibrated amax: amax / (6 * 448), 1.0 for zero; fp32 0-dim."""
    return _positive(amax.float().reshape(()) / (6.0 * E4M3_MAX))


def nvfp4_kv_quantize(x: Tensor, global_scale: Tensor) -> tuple[Tensor, Tensor]:
    """[N, H, D] (D % 16 == 0) -> (packed uint8 [N, H, D/2], E4M3 block scales [N, H, D/16])."""
    n, h, d = x.shape
    if d % NVFP4_BLOCK_SIZE != 0:
        raise ValueError(f"NVFP4 KV needs a head dim that is a multiple of {NVFP4_BLOCK_SIZE}, got {d}")
    q = nvfp4_quantize(x.reshape(n * h, d).float(), global_scale=global_scale)
    return q.packed.reshape(n, h, d // 2), q.block_scale.reshape(n, h, d // NVFP4_BLOCK_SIZE)


def nvfp4_kv_dequantize(packed: Tensor, block_scale: Tensor, global_scale: Tensor) -> Tensor:
    """(packed [..., D/2], block scales [..., D/16], global scale) -> fp32 [..., D]; as nvfp4_dequantize."""
    values = _lookup(_table(E2M1_PAIR_VALUES, _E2M1_PAIRS_ON, packed.device), packed).flatten(-2)  # [..., D]
    scales = _lookup(_table(E4M3_VALUES, _E4M3_ON, packed.device) * global_scale.reshape(()),
                     block_scale.view(torch.uint8))  # [..., D/16]
    blocks = values.view(*values.shape[:-1], -1, NVFP4_BLOCK_SIZE)
    return (blocks * scales.unsqueeze(-1)).view(values.shape)


def kv_fake_quantize(x: Tensor, fmt: str, scaling: str, scale: Tensor | None,
                     offset: Tensor | None = None) -> Tensor:
    """Store-then-read of [N, H, D] in a KV format, in fp32 (what attention sees); for error measurement."""
    codec = KV_CODECS.get(fmt)
    if codec is None:
        raise ValueError(f"unknown KV format {fmt!r}; known: {', '.join(KvFormat)}")
    if not codec.quantized:
        return x.float()
    centered = x.float() if offset is None else x.float() - offset
    out = codec.fake_quantize(centered, scaling, scale)
    return out if offset is None else out + offset


# --- the KV formats as objects ----------------------------------------------------------------------------
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


class Fp8KvCodec(KvCodec):
    """FP8 E4M3 values with a calibrated scale per tensor or per KV head, or a dynamic one per token."""

    name, label, scalings = KvFormat.FP8_E4M3, "FP8 E4M3", KV_FP8_SCALINGS
    kernel_format = 1

    def bytes_per_token(self, values: int, scaling: str) -> int:
        return values + (4 if scaling == "dynamic" else 0)  # dynamic: one fp32 scale per token

    def static_scale(self, scaling: str) -> bool:
        return scaling != "dynamic"

    def token_scales(self, scaling: str) -> bool:
        return scaling == "dynamic"

    def calibrated_scale(self, x: Tensor, scaling: str) -> tuple[Tensor | None, Tensor | None]:
        """(0-dim or [H] to store, 0-dim or [H, 1] to compute with); none for dynamic scaling."""
        if scaling == "dynamic":
            return None, None
        amax = x.abs().amax() if scaling == "per_tensor" else x.abs().amax(dim=(0, 2))
        scale = amax.float() / E4M3_MAX
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return scale, (scale if scaling == "per_tensor" else scale.reshape(-1, 1))

    def fake_quantize(self, centered: Tensor, scaling: str, scale: Tensor | None) -> Tensor:
        if scaling == "dynamic":
            return fp8_kv_dequantize(*fp8_kv_quantize_per_token(centered))
        return fp8_kv_dequantize(fp8_kv_quantize(centered, scale), scale)

    def pool_layout(self, name, heads, dim, scaling, scale, dtype) -> tuple:
        data = ("data", (heads, dim), torch.float8_e4m3fn, 0.0)
        if scaling == "dynamic":
            return (data, ("token_scale", (1, 1), torch.float32, 1.0))
        if scale is None:
            raise KilnError(f"FP8 KV stream {name!r} ({scaling}) has no scale")
        return (data,)

    def store(self, storage, slots, x, scale) -> None:
        # index_copy_ has no float8 kernel on CPU: copy the bytes
        if "token_scale" in storage:
            q, token_scale = fp8_kv_quantize_per_token(x)
            storage["data"].view(torch.uint8).index_copy_(0, slots, q.view(torch.uint8))
            storage["token_scale"].index_copy_(0, slots, token_scale)
        else:
            storage["data"].view(torch.uint8).index_copy_(0, slots, fp8_kv_quantize(x, scale).view(torch.uint8))

    def load(self, storage, slots, scale) -> Tensor:
        if "token_scale" in storage:
            scale = storage["token_scale"].index_select(0, slots)
        return fp8_kv_dequantize(storage["data"].index_select(0, slots), scale)

    def kernel_tensors(self, storage, scale) -> tuple:
        return storage["data"], storage.get("token_scale", scale), None

    def check_pool(self, data, scale, global_scale) -> None:
        if data.dtype != torch.float8_e4m3fn or scale is None:
            raise ValueError("an FP8 KV pool needs float8_e4m3fn data and a scale")
        slots, heads = data.shape[:2]
        if tuple(scale.shape) not in ((), (heads, 1), (slots, 1, 1)):
            raise ValueError(f"an FP8 KV scale is 0-dim, [{heads}, 1] or [{slots}, 1, 1], got {tuple(scale.shape)}")

    def read_pool(self, rows, data, scale, global_scale) -> Tensor:
        return fp8_kv_dequantize(rows(data), rows(scale) if scale.ndim == 3 else scale.cpu())

    def kernel_operands(self, data, scale, global_scale, dummy) -> tuple:
        mode = {0: KERNEL_PER_TENSOR, 2: KERNEL_PER_HEAD, 3: KERNEL_PER_TOKEN}[scale.ndim]
        return data.view(torch.uint8), scale.float().contiguous(), dummy, mode


class Nvfp4KvCodec(KvCodec):
    """NVFP4: E2M1 values in 16-value blocks along D, an E4M3 scale per block, a calibrated global scale."""

    name, label, scalings = KvFormat.NVFP4, "NVFP4", ("e4m3_block16",)
    dim_multiple = NVFP4_BLOCK_SIZE
    packing = 2
    kernel_format = 2

    def bytes_per_token(self, values: int, scaling: str) -> int:
        return values // 2 + values // NVFP4_BLOCK_SIZE  # two E2M1 a byte + one E4M3 scale per 16

    def static_scale(self, scaling: str) -> bool:
        return True

    def calibrated_scale(self, x: Tensor, scaling: str) -> tuple[Tensor | None, Tensor | None]:
        g = nvfp4_kv_global_scale(x.abs().amax())
        return g, g

    def fake_quantize(self, centered: Tensor, scaling: str, scale: Tensor | None) -> Tensor:
        return nvfp4_kv_dequantize(*nvfp4_kv_quantize(centered, scale), scale)

    def pool_layout(self, name, heads, dim, scaling, scale, dtype) -> tuple:
        if scale is None:
            raise KilnError(f"NVFP4 KV stream {name!r} has no global scale")
        if dim % NVFP4_BLOCK_SIZE:
            raise KilnError(f"NVFP4 KV stream {name!r}: dim {dim} is not a multiple of {NVFP4_BLOCK_SIZE}")
        return (("packed", (heads, dim // 2), torch.uint8, 0.0),
                ("block_scale", (heads, dim // NVFP4_BLOCK_SIZE), torch.float8_e4m3fn, 0.0))

    def store(self, storage, slots, x, scale) -> None:
        packed, block_scale = nvfp4_kv_quantize(x, scale)
        storage["packed"].index_copy_(0, slots, packed)
        storage["block_scale"].view(torch.uint8).index_copy_(0, slots, block_scale.view(torch.uint8))

    def load(self, storage, slots, scale) -> Tensor:
        return nvfp4_kv_dequantize(storage["packed"].index_select(0, slots),
                                   storage["block_scale"].index_select(0, slots), scale)

    def kernel_tensors(self, storage, scale) -> tuple:
        return storage["packed"], storage["block_scale"], scale

    def check_pool(self, data, scale, global_scale) -> None:
        expected = (*data.shape[:2], data.shape[2] * 2 // NVFP4_BLOCK_SIZE)
        scale_ok = scale is not None and scale.dtype == torch.float8_e4m3fn and tuple(scale.shape) == expected
        if data.dtype != torch.uint8 or not scale_ok or global_scale is None:
            raise ValueError(f"an NVFP4 KV pool needs packed uint8 data, float8_e4m3fn block scales "
                             f"{expected} and a global scale")

    def read_pool(self, rows, data, scale, global_scale) -> Tensor:
        return nvfp4_kv_dequantize(rows(data), rows(scale), global_scale.cpu())

    def kernel_operands(self, data, scale, global_scale, dummy) -> tuple:
        return data, scale.view(torch.uint8), global_scale.float().reshape(1), KERNEL_PER_TENSOR


BF16_KV, FP8_E4M3_KV, NVFP4_KV = Bf16KvCodec(), Fp8KvCodec(), Nvfp4KvCodec()
KV_CODECS: dict[str, KvCodec] = {codec.name: codec for codec in (BF16_KV, FP8_E4M3_KV, NVFP4_KV)}
"""The KV formats by manifest name (kernels/registry.py's `kv_format` also takes the recipes' spellings)."""
