"""Plain-torch references of the Triton kernels (kernels/triton_*.py), built from the format references.

They need no Triton: the kernel tests compare against them, and kernels/gpu.py falls back on them where Triton
or CUDA is missing. Each is what Kiln's runtime computes today (fake-quantized activations times dequantized
weights in fp32; attention over the cache's dequantized reads), so a kernel that matches its reference runs
the numerics the accuracy gate measured.

    rmsnorm_ref, quantize_{fp8,nvfp4,mxfp4}_ref    the bytes and scales kernels/triton_quant.py must write
    fp8_gemm_ref, fp8_linear_ref                   kernels/triton_fp8_gemm.py
    fp4_w4a16_ref, fp4_w4a4_ref                    kernels/triton_fp4_gemm.py
    fp6_w6a16_ref                                  kernels/triton_fp6_gemm.py
    KvPool, paged_decode_attention_ref             kernels/triton_paged_attention.py
    mla_decode_attention_ref                       kernels/triton_mla_decode.py
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.kernels.fp8 import (
    fp8_dequantize,
    fp8_fake_quantize_per_tensor,
    fp8_fake_quantize_per_token,
    fp8_quantize_per_channel,
    fp8_quantize_per_tensor,
)
from kiln.kernels.kv_codec import KvCodec
from kiln.kernels.mxfp4 import Mxfp4Weight, mxfp4_dequantize, mxfp4_fake_quantize, mxfp4_quantize
from kiln.kernels.mxfp6 import Mxfp6Weight, mxfp6_dequantize
from kiln.kernels.nvfp4 import (
    Nvfp4Weight,
    nvfp4_dequantize,
    nvfp4_fake_quantize,
    nvfp4_global_scale,
    nvfp4_quantize,
)
from kiln.kernels.registry import KV_FORMATS


@dataclass(frozen=True)
class QuantizedActivation:
    """A quantized [M, K] activation.

    Attributes:
        data: fp8 -> float8_e4m3fn [M, K]; nvfp4/mxfp4 -> uint8 [M, Kp / 2] (element 2i in the low nibble).
        scale: fp8 per token -> fp32 [M, 1]; fp8 static -> fp32 0-dim; nvfp4 -> float8_e4m3fn [M, Kp / 16];
            mxfp4 -> uint8 E8M0 [M, Kp / 32].
        global_scale: nvfp4's fp32 0-dim per-tensor scale; None for the other formats.
        normed: the fp32 RMSNorm output y [M, K] when asked for (`return_normed=True`), else None.
    """

    data: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor | None = None
    normed: torch.Tensor | None = None


# --- activation quantization (kernels/triton_quant.py) --------------------------------------------------


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """runtime.model_weights.RMSNorm: weight * (x * rsqrt(mean(x^2) + eps)) in fp32."""
    x = x.float()
    return weight.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def quantize_fp8_ref(y: torch.Tensor, input_scale: torch.Tensor | None = None) -> QuantizedActivation:
    """kernels/fp8.py: per token is per channel of the [M, K] matrix; static is per tensor (given scale)."""
    if input_scale is None:
        q, scale = fp8_quantize_per_channel(y.float())
    else:
        q, scale = fp8_quantize_per_tensor(y.float(), input_scale)
    return QuantizedActivation(q, scale)


def quantize_nvfp4_ref(y: torch.Tensor, global_scale: torch.Tensor | None = None) -> QuantizedActivation:
    """kernels/nvfp4.py's quantize of the [M, K] activation (global scale computed when not given)."""
    g = nvfp4_global_scale(y) if global_scale is None else global_scale
    q = nvfp4_quantize(y.float(), global_scale=g)
    return QuantizedActivation(q.packed, q.block_scale, q.global_scale)


def quantize_mxfp4_ref(y: torch.Tensor) -> QuantizedActivation:
    """kernels/mxfp4.py's quantize of the [M, K] activation."""
    q = mxfp4_quantize(y.float())
    return QuantizedActivation(q.packed, q.scale_e8m0)


# --- GEMMs (kernels/triton_fp8_gemm.py, kernels/triton_fp4_gemm.py) -------------------------------------


def fp8_gemm_ref(qx: torch.Tensor, x_scale: torch.Tensor, qw: torch.Tensor,
                 w_scale: torch.Tensor) -> torch.Tensor:
    """Dequantize both operands (kernels/fp8.py) and multiply in fp32."""
    return fp8_dequantize(qx, x_scale.reshape(-1, 1) if x_scale.numel() > 1 else x_scale) @ \
        fp8_dequantize(qw, w_scale).T


def fp8_linear_ref(x: torch.Tensor, qw: torch.Tensor, w_scale: torch.Tensor,
                   input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """What the runtime computes: the activation fake-quantized as runtime.weights does, times the dequantized
    weight, in fp32."""
    xq = fp8_fake_quantize_per_token(x.float()) if input_scale is None else \
        fp8_fake_quantize_per_tensor(x.float(), input_scale)
    return xq @ fp8_dequantize(qw, w_scale).T


def dequantize_fp4_weight(weight: Nvfp4Weight | Mxfp4Weight) -> torch.Tensor:
    return nvfp4_dequantize(weight) if isinstance(weight, Nvfp4Weight) else mxfp4_dequantize(weight)


def fp4_w4a16_ref(x: torch.Tensor, weight: Nvfp4Weight | Mxfp4Weight) -> torch.Tensor:
    """x in fp32 times the reference-dequantized weight, in fp32."""
    return x.float() @ dequantize_fp4_weight(weight).T


def fp6_w6a16_ref(x: torch.Tensor, weight: Mxfp6Weight) -> torch.Tensor:
    """x in fp32 times the reference-dequantized MXFP6 weight, in fp32."""
    return x.float() @ mxfp6_dequantize(weight).T


def fp4_w4a4_ref(x: torch.Tensor, weight: Nvfp4Weight | Mxfp4Weight,
                 input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """What the runtime computes: x fake-quantized (runtime.weights' activation quantizer) times the
    dequantized weight, in fp32."""
    if isinstance(weight, Nvfp4Weight):
        xq = nvfp4_fake_quantize(x.float(), input_scale)
    else:
        xq = mxfp4_fake_quantize(x.float())
    return xq @ dequantize_fp4_weight(weight).T


# --- paged decode attention (kernels/triton_paged_attention.py) -----------------------------------------


@dataclass(frozen=True)
class KvPool:
    """One stream's pool of token slots, as runtime/kv_pools.py holds it.

    Attributes:
        format: a KV format's manifest name (kernels/registry.py `KV_FORMATS`): bf16 (any float dtype),
            fp8_e4m3 or nvfp4.
        data: dense [slots, KVH, D]; fp8 float8_e4m3fn [slots, KVH, D]; nvfp4 packed uint8 [slots, KVH, D/2].
        scale: fp8 -> fp32 0-dim, [KVH, 1] or [slots, 1, 1]; nvfp4 -> float8_e4m3fn block scales
            [slots, KVH, D/16]; dense -> None.
        global_scale: nvfp4's fp32 0-dim global scale; None otherwise.
        offset: the stream's calibrated offset [KVH, D] (added back on reading), or None.
    """

    format: str
    data: torch.Tensor
    scale: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None
    offset: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.format not in KV_FORMATS:
            raise ValueError(f"unknown KV format {self.format!r}; known: {', '.join(KV_FORMATS)}")
        if self.data.ndim != 3:
            raise ValueError(f"a KV pool is [slots, kv_heads, D'], got shape {tuple(self.data.shape)}")
        self.codec.check_pool(self.data, self.scale, self.global_scale)
        if self.offset is not None and tuple(self.offset.shape) != (self.kv_heads, self.head_dim):
            raise ValueError(f"the offset must be [{self.kv_heads}, {self.head_dim}], "
                             f"got {tuple(self.offset.shape)}")

    @property
    def codec(self) -> KvCodec:
        """Its format's object (kernels/kv_codec.py)."""
        return KV_FORMATS[self.format]

    @property
    def kv_heads(self) -> int:
        return self.data.shape[1]

    @property
    def head_dim(self) -> int:
        return self.data.shape[2] * self.codec.packing

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """fp32 [len(slots), KVH, D]: what runtime/kv_pools.py's pools return for these slots.

        Dequantizes on the CPU, where kernels/kv_codec.py keeps the lookup tables, and returns the values on
        the pool's device."""
        slots = slots.long()

        def rows(t: torch.Tensor) -> torch.Tensor:  # float8 has no index_select everywhere: move its bytes
            if t.dtype == torch.float8_e4m3fn:
                return t.view(torch.uint8).index_select(0, slots.to(t.device)).cpu().view(torch.float8_e4m3fn)
            return t.index_select(0, slots.to(t.device)).cpu()

        values = self.codec.read_pool(rows, self.data, self.scale, self.global_scale)
        values = values if self.offset is None else values + self.offset.cpu()
        return values.to(self.data.device)


def check_block_table(block_table: torch.Tensor, context_lens: torch.Tensor, batch: int) -> None:
    """What the paged decode kernels index: block_table int32 [batch, max_blocks], context_lens int32 [batch]."""
    if block_table.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise TypeError(f"block_table and context_lens must be int32, got {block_table.dtype} and "
                        f"{context_lens.dtype}")
    if block_table.ndim != 2 or block_table.shape[0] != batch or tuple(context_lens.shape) != (batch,):
        raise ValueError(f"block_table must be [{batch}, max_blocks] and context_lens [{batch}], got "
                         f"{tuple(block_table.shape)} and {tuple(context_lens.shape)}")


def sequence_slots(table_row: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """The cache slots of a sequence's first `length` tokens through its block-table row: slot of token t =
    table_row[t // block_size] * block_size + t % block_size."""
    t = torch.arange(length, device=table_row.device)
    return table_row.long()[t // block_size] * block_size + t % block_size


def paged_decode_attention_ref(q: torch.Tensor, k_pool: KvPool, v_pool: KvPool, block_table: torch.Tensor,
                               context_lens: torch.Tensor, block_size: int,
                               sm_scale: float | None = None) -> torch.Tensor:
    """Gather each sequence's slots, dequantize (the KV format objects, offsets added back), repeat the KV heads
    for GQA, and run torch's scaled_dot_product_attention in fp32. Returns fp32 [B, H, D]."""
    batch, heads, dim = q.shape
    group = heads // k_pool.kv_heads
    out = torch.zeros(batch, heads, dim, dtype=torch.float32, device=q.device)
    for b in range(batch):
        slots = sequence_slots(block_table[b], int(context_lens[b]), block_size)
        if not len(slots):
            continue
        k = k_pool.read(slots).repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
        v = v_pool.read(slots).repeat_interleave(group, dim=1).transpose(0, 1)
        out[b] = torch.nn.functional.scaled_dot_product_attention(
            q[b].float().unsqueeze(1), k, v, scale=sm_scale).squeeze(1)
    return out


# --- MLA absorbed decode attention (kernels/triton_mla_decode.py) ---------------------------------------


def check_mla_decode_inputs(q_latent: torch.Tensor, q_rot: torch.Tensor, latent_pool: KvPool,
                            rot_pool: KvPool, block_table: torch.Tensor, context_lens: torch.Tensor,
                            block_size: int) -> None:
    """Refuse inputs the MLA decode (kernel or reference) cannot serve, naming the bad value."""
    if q_latent.ndim != 3 or q_rot.ndim != 3 or q_latent.shape[:2] != q_rot.shape[:2]:
        raise ValueError(f"q_latent must be [B, H, r] and q_rot [B, H, rope] with the same B and H, got "
                         f"{tuple(q_latent.shape)} and {tuple(q_rot.shape)}")
    if not q_latent.is_floating_point() or q_rot.dtype != q_latent.dtype:
        raise ValueError(f"q_latent and q_rot must share one float dtype, got {q_latent.dtype} and "
                         f"{q_rot.dtype}")
    batch, _, rank = q_latent.shape
    rope = q_rot.shape[2]
    if latent_pool.kv_heads != 1 or rot_pool.kv_heads != 1:
        raise ValueError(f"MLA pools hold one KV head shared by all query heads, got {latent_pool.kv_heads} "
                         f"(latent) and {rot_pool.kv_heads} (rotary key)")
    if latent_pool.head_dim != rank or rot_pool.head_dim != rope:
        raise ValueError(f"q is r={rank}, rope={rope}; the pools hold a latent of {latent_pool.head_dim} "
                         f"and a rotary key of {rot_pool.head_dim}")
    if latent_pool.data.shape[0] != rot_pool.data.shape[0]:
        raise ValueError(f"the latent and rotary-key pools must have the same slots, got "
                         f"{latent_pool.data.shape[0]} and {rot_pool.data.shape[0]}")
    if rank == 0 or rank % 2 or rope % 2:
        raise ValueError(f"the latent rank must be even and positive and the rotary width even, got "
                         f"r={rank}, rope={rope}")
    check_block_table(block_table, context_lens, batch)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")


def mla_decode_attention_ref(q_latent: torch.Tensor, q_rot: torch.Tensor, latent_pool: KvPool,
                             rot_pool: KvPool, block_table: torch.Tensor, context_lens: torch.Tensor,
                             block_size: int, sm_scale: float) -> torch.Tensor:
    """MLA's absorbed decode over a paged latent cache: one KV head in latent space. Returns fp32 [B, H, r].

    q_latent [B, H, r] (W_uk already folded in), q_rot [B, H, rope]; the pools [slots, 1, r] and
    [slots, 1, rope] in any KvPool format. Per sequence: gather its slots, dequantize (offsets added back),
    key = [latent, k_rot], value = latent, softmax(sm_scale * q . key) in fp32. sm_scale has no default: it is
    the unabsorbed head's 1 / sqrt(qk_nope + rope) (times any YaRN factor), which r does not tell."""
    check_mla_decode_inputs(q_latent, q_rot, latent_pool, rot_pool, block_table, context_lens, block_size)
    batch, heads, rank = q_latent.shape
    out = torch.zeros(batch, heads, rank, dtype=torch.float32, device=q_latent.device)
    for b in range(batch):
        slots = sequence_slots(block_table[b], int(context_lens[b]), block_size)
        if not len(slots):
            continue
        latent = latent_pool.read(slots)[:, 0]  # [L, r]
        key = torch.cat([latent, rot_pool.read(slots)[:, 0]], dim=-1)  # [L, r + rope]
        q = torch.cat([q_latent[b], q_rot[b]], dim=-1).float()  # [H, r + rope]
        weights = torch.softmax(sm_scale * (q @ key.T), dim=-1)  # [H, L]
        out[b] = weights @ latent
    return out
