"""One call per operation: the Triton kernel where it can run, the plain-torch reference everywhere else.

    fp8_linear(x, qw, w_scale, input_scale)            W8A8: x quantized per token (or static), FP8 GEMM
    fp4_linear(x, weight, activation, input_scale)     NVFP4/MXFP4 weight; activation "none" (W4A16) or the
                                                       weight's own format (W4A4)
    fp6_linear(x, weight)                              MXFP6 weight, W6A16
    rmsnorm_quantize(x, norm_weight, eps, activation, input_scale)   fused RMSNorm + activation quantization
    paged_decode_attention(q, k_pool, v_pool, block_table, context_lens, block_size, sm_scale)
    mla_decode_attention(q_latent, q_rot, latent_pool, rot_pool, block_table, context_lens, block_size,
                         sm_scale)                     MLA's absorbed decode over the latent cache

Triton runs when it is installed and the inputs are CUDA tensors, or, for CPU tensors, when
TRITON_INTERPRET=1 (the tests). Otherwise the reference in kernels/torch_refs.py runs: the same numbers within
each kernel's stated tolerance. Results have the input's dtype either way. The kernel modules import Triton,
so they are imported here only on the Triton path.

Under torch.compile the GEMMs and the paged decode attention are the custom ops `kiln::fp8_linear`,
`kiln::fp4_linear`, `kiln::fp6_linear`, `kiln::paged_decode_attention` and `kiln::mla_decode_attention` (torch.library): one opaque node each in the traced graph, so a compiled decode step traces whole (no graph break at a kernel's
Python launch code) and a CUDA graph captures the kernel launches.
"""

from __future__ import annotations

import importlib.util

import torch

from kiln.kernels import torch_refs
from kiln.kernels.formats import ActivationFormat
from kiln.kernels.mxfp4 import Mxfp4Weight
from kiln.kernels.mxfp6 import Mxfp6Weight
from kiln.kernels.nvfp4 import Nvfp4Weight
from kiln.kernels.torch_refs import KvPool, QuantizedActivation


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(x: torch.Tensor) -> bool:
    """Whether Triton serves `x`: Triton installed, and x on CUDA (or on CPU with TRITON_INTERPRET=1)."""
    if not triton_installed():
        return False
    # lazy: the Triton kernels import triton, which only this path needs
    from kiln.kernels.triton_codecs import interpreting

    return x.is_cuda != interpreting()


def unchecked_weight(cls: type[Nvfp4Weight | Mxfp4Weight | Mxfp6Weight],
                     **fields) -> Nvfp4Weight | Mxfp4Weight | Mxfp6Weight:
    """An NVFP4/MXFP4/MXFP6 weight from tensors already checked as one (moved to another device, or passed through a
    custom op), built without its constructor's value checks: those read every block scale back to the host."""
    weight = object.__new__(cls)
    for name, value in fields.items():
        object.__setattr__(weight, name, value)
    return weight


def fp8_linear(x: torch.Tensor, qw: torch.Tensor, w_scale: torch.Tensor,
               input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] times an FP8 weight [N, K] (per-channel or per-tensor scale) -> [..., N] in x's dtype."""
    if torch.compiler.is_compiling():
        return torch.ops.kiln.fp8_linear(x, qw, w_scale, input_scale)
    return _fp8_linear(x, qw, w_scale, input_scale)


def _fp8_linear(x: torch.Tensor, qw: torch.Tensor, w_scale: torch.Tensor,
                input_scale: torch.Tensor | None) -> torch.Tensor:
    if use_triton(x):
        # lazy: the Triton kernels import triton, which only this path needs
        from kiln.kernels.triton_fp8_gemm import fp8_linear as kernel

        return kernel(x, qw, w_scale, input_scale)
    return torch_refs.fp8_linear_ref(x, qw, w_scale, input_scale).to(x.dtype)


def fp4_linear(x: torch.Tensor, weight: Nvfp4Weight | Mxfp4Weight, activation: str = ActivationFormat.NONE,
               input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] times an NVFP4/MXFP4 weight -> [..., N] in x's dtype.

    activation: "none" keeps x as it is (W4A16, Hopper's FP4 path); "nvfp4"/"mxfp4" quantizes it to the
    weight's format first (W4A4, Blackwell's), NVFP4 with `input_scale` as its global scale when given."""
    if not isinstance(weight, (Nvfp4Weight, Mxfp4Weight)):
        raise TypeError(f"weight must be an Nvfp4Weight or an Mxfp4Weight, got {type(weight).__name__}")
    weight_format = ActivationFormat.NVFP4 if isinstance(weight, Nvfp4Weight) else ActivationFormat.MXFP4
    if activation not in (ActivationFormat.NONE, weight_format):
        raise ValueError(f"an {weight_format} weight takes activation 'none' or '{weight_format}', "
                         f"got {activation!r}")
    if activation == ActivationFormat.NONE and input_scale is not None:
        raise ValueError("input_scale is an activation quantization scale; activation 'none' takes none")
    if torch.compiler.is_compiling():
        nvfp4 = isinstance(weight, Nvfp4Weight)
        return torch.ops.kiln.fp4_linear(x, weight.packed, weight.block_scale if nvfp4 else weight.scale_e8m0,
                                         weight.global_scale if nvfp4 else None, weight.in_features, activation,
                                         input_scale)
    return _fp4_linear(x, weight, activation, input_scale)


def _fp4_linear(x: torch.Tensor, weight: Nvfp4Weight | Mxfp4Weight, activation: str,
                input_scale: torch.Tensor | None) -> torch.Tensor:
    if use_triton(x):
        # lazy: the Triton kernels import triton, which only this path needs
        from kiln.kernels.triton_fp4_gemm import fp4_w4a4_linear, fp4_w4a16_gemm

        if activation == ActivationFormat.NONE:
            return fp4_w4a16_gemm(x, weight)
        return fp4_w4a4_linear(x, weight, input_scale)
    if activation == ActivationFormat.NONE:
        return torch_refs.fp4_w4a16_ref(x, weight).to(x.dtype)
    return torch_refs.fp4_w4a4_ref(x, weight, input_scale).to(x.dtype)


def packed_linear(kernel: str, x: torch.Tensor, weight, activation: str,
                  input_scale: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] times a packed weight (WeightCodec.packed_weight) by the kernel family its format names
    (WeightCodec.gpu_kernel) -> [..., N]."""
    return PACKED_LINEARS[kernel](x, weight, activation, input_scale)


def _fp8_packed(x: torch.Tensor, weight, activation: str, input_scale: torch.Tensor | None) -> torch.Tensor:
    if activation == ActivationFormat.NONE:  # W8A16: the weight dequantized for each product
        return torch.nn.functional.linear(x, weight.dequantize().to(x.dtype))
    return fp8_linear(x, weight.qweight, weight.weight_scale, input_scale)


PACKED_LINEARS = {
    "fp8": _fp8_packed,
    "fp4": lambda x, weight, activation, input_scale: fp4_linear(x, weight, activation, input_scale),
    "fp6": lambda x, weight, activation, input_scale: fp6_linear(x, weight),
    "dequantize": lambda x, weight, activation, input_scale: torch.nn.functional.linear(
        x, weight.dequantize().to(x.dtype)),
}
"""The kernel families a format's `gpu_kernel` names (WeightCodec.gpu_kernel)."""


def fp6_linear(x: torch.Tensor, weight: Mxfp6Weight) -> torch.Tensor:
    """x [..., K] times an MXFP6 weight -> [..., N] in x's dtype (weight-only: x stays as it is)."""
    if not isinstance(weight, Mxfp6Weight):
        raise TypeError(f"weight must be an Mxfp6Weight, got {type(weight).__name__}")
    if torch.compiler.is_compiling():
        return torch.ops.kiln.fp6_linear(x, weight.packed, weight.scale_e8m0, weight.in_features)
    return _fp6_linear(x, weight)


def _fp6_linear(x: torch.Tensor, weight: Mxfp6Weight) -> torch.Tensor:
    if use_triton(x):
        # lazy: the Triton kernels import triton, which only this path needs
        from kiln.kernels.triton_fp6_gemm import fp6_w6a16_gemm

        return fp6_w6a16_gemm(x, weight)
    return torch_refs.fp6_w6a16_ref(x, weight).to(x.dtype)


@torch.library.custom_op("kiln::fp6_linear", mutates_args=())
def _fp6_linear_op(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, in_features: int) -> torch.Tensor:
    return _fp6_linear(x, unchecked_weight(Mxfp6Weight, packed=packed, scale_e8m0=scales, in_features=in_features))


@_fp6_linear_op.register_fake
def _(x, packed, scales, in_features):
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


@torch.library.custom_op("kiln::fp8_linear", mutates_args=())
def _fp8_linear_op(x: torch.Tensor, qw: torch.Tensor, w_scale: torch.Tensor,
                   input_scale: torch.Tensor | None) -> torch.Tensor:
    return _fp8_linear(x, qw, w_scale, input_scale)


@_fp8_linear_op.register_fake
def _(x, qw, w_scale, input_scale):
    return x.new_empty((*x.shape[:-1], qw.shape[0]))


@torch.library.custom_op("kiln::fp4_linear", mutates_args=())
def _fp4_linear_op(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor | None,
                   in_features: int, activation: str, input_scale: torch.Tensor | None) -> torch.Tensor:
    # an NVFP4 weight has a global scale, an MXFP4 one none
    if global_scale is not None:
        weight = unchecked_weight(Nvfp4Weight, packed=packed, block_scale=scales, global_scale=global_scale,
                                  in_features=in_features)
    else:
        weight = unchecked_weight(Mxfp4Weight, packed=packed, scale_e8m0=scales, in_features=in_features)
    return _fp4_linear(x, weight, activation, input_scale)


@_fp4_linear_op.register_fake
def _(x, packed, scales, global_scale, in_features, activation, input_scale):
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


def rmsnorm_quantize(x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, activation: str,
                     input_scale: torch.Tensor | None = None) -> QuantizedActivation:
    """RMSNorm (skipped when norm_weight is None) then quantize [M, K] to `activation`: fp8_dynamic_per_token,
    fp8_static_per_tensor (needs input_scale), nvfp4 (input_scale: the global scale, or None for dynamic) or
    mxfp4."""
    static = activation == ActivationFormat.FP8_STATIC_PER_TENSOR
    if static and input_scale is None:
        raise ValueError("fp8_static_per_tensor needs the calibrated input_scale")
    dynamic = activation in (ActivationFormat.FP8_DYNAMIC_PER_TOKEN, ActivationFormat.MXFP4)
    if dynamic and input_scale is not None:
        raise ValueError(f"{activation} computes its scales from the activation; input_scale must be None")
    if use_triton(x):
        # lazy: the Triton kernels import triton, which only this path needs
        from kiln.kernels import triton_quant

        if activation in (ActivationFormat.FP8_DYNAMIC_PER_TOKEN, ActivationFormat.FP8_STATIC_PER_TENSOR):
            return triton_quant.quantize_fp8(x, norm_weight, eps, input_scale)
        if activation == ActivationFormat.NVFP4:
            return triton_quant.quantize_nvfp4(x, norm_weight, eps, input_scale)
        if activation == ActivationFormat.MXFP4:
            return triton_quant.quantize_mxfp4(x, norm_weight, eps)
    else:
        y = x.float() if norm_weight is None else torch_refs.rmsnorm_ref(x, norm_weight, eps)
        if activation in (ActivationFormat.FP8_DYNAMIC_PER_TOKEN, ActivationFormat.FP8_STATIC_PER_TENSOR):
            return torch_refs.quantize_fp8_ref(y, input_scale)
        if activation == ActivationFormat.NVFP4:
            return torch_refs.quantize_nvfp4_ref(y, input_scale)
        if activation == ActivationFormat.MXFP4:
            return torch_refs.quantize_mxfp4_ref(y)
    allowed = [f.value for f in ActivationFormat if f != ActivationFormat.NONE]
    raise ValueError(f"unknown activation format {activation!r}; choose one of {', '.join(allowed)}")


def paged_decode_attention(q: torch.Tensor, k_pool: KvPool, v_pool: KvPool, block_table: torch.Tensor,
                           context_lens: torch.Tensor, block_size: int,
                           sm_scale: float | None = None) -> torch.Tensor:
    """One decode step of attention over a paged BF16/FP8/NVFP4 KV cache -> [B, H, D] in q's dtype."""
    if torch.compiler.is_compiling():
        scale = float(sm_scale) if sm_scale is not None else q.shape[-1] ** -0.5
        return torch.ops.kiln.paged_decode_attention(q.contiguous(), *_pool_fields(k_pool), *_pool_fields(v_pool), block_table,
                                                     context_lens, block_size, scale)
    return _paged_decode_attention(q, k_pool, v_pool, block_table, context_lens, block_size, sm_scale)


def _pool_fields(pool: KvPool) -> tuple:
    return pool.format, pool.data, pool.scale, pool.global_scale, pool.offset


def _paged_decode_attention(q: torch.Tensor, k_pool: KvPool, v_pool: KvPool, block_table: torch.Tensor,
                            context_lens: torch.Tensor, block_size: int, sm_scale: float | None) -> torch.Tensor:
    if use_triton(q):
        # lazy: the Triton kernels import triton, which only this path needs
        from kiln.kernels.triton_paged_attention import paged_decode_attention as kernel

        return kernel(q, k_pool, v_pool, block_table, context_lens, block_size, sm_scale)
    return torch_refs.paged_decode_attention_ref(q, k_pool, v_pool, block_table, context_lens, block_size,
                                                 sm_scale).to(q.dtype)


@torch.library.custom_op("kiln::paged_decode_attention", mutates_args=())
def _paged_decode_attention_op(q: torch.Tensor, k_format: str, k_data: torch.Tensor, k_scale: torch.Tensor | None,
                               k_global: torch.Tensor | None, k_offset: torch.Tensor | None, v_format: str,
                               v_data: torch.Tensor, v_scale: torch.Tensor | None, v_global: torch.Tensor | None,
                               v_offset: torch.Tensor | None, block_table: torch.Tensor, context_lens: torch.Tensor,
                               block_size: int, sm_scale: float) -> torch.Tensor:
    return _paged_decode_attention(q, KvPool(k_format, k_data, k_scale, k_global, k_offset),
                                   KvPool(v_format, v_data, v_scale, v_global, v_offset), block_table,
                                   context_lens, block_size, sm_scale)


@_paged_decode_attention_op.register_fake
def _(q, *args):
    # contiguous, as the kernel's and the reference's outputs are (whatever the query's strides)
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def mla_decode_attention(q_latent: torch.Tensor, q_rot: torch.Tensor, latent_pool: KvPool, rot_pool: KvPool,
                         block_table: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                         sm_scale: float) -> torch.Tensor:
    """One MLA decode step in latent space (W_uk folded into q_latent, W_uv still to apply) over a paged
    BF16/FP8/NVFP4 latent cache -> [B, H, r] in q_latent's dtype."""
    if torch.compiler.is_compiling():
        # contiguous queries: the layout inductor gives an einsum's output need not be the one eager tracing saw
        return torch.ops.kiln.mla_decode_attention(q_latent.contiguous(), q_rot.contiguous(),
                                                   *_pool_fields(latent_pool),
                                                   *_pool_fields(rot_pool), block_table, context_lens, block_size,
                                                   float(sm_scale))
    return _mla_decode_attention(q_latent, q_rot, latent_pool, rot_pool, block_table, context_lens, block_size,
                                 sm_scale)


def _mla_decode_attention(q_latent: torch.Tensor, q_rot: torch.Tensor, latent_pool: KvPool, rot_pool: KvPool,
                          block_table: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                          sm_scale: float) -> torch.Tensor:
    if use_triton(q_latent):
        # lazy: the Triton kernels import triton, which only this path needs
        from kiln.kernels.triton_mla_decode import mla_decode_attention as kernel

        return kernel(q_latent, q_rot, latent_pool, rot_pool, block_table, context_lens, block_size, sm_scale)
    return torch_refs.mla_decode_attention_ref(q_latent, q_rot, latent_pool, rot_pool, block_table,
                                               context_lens, block_size, sm_scale).to(q_latent.dtype)


@torch.library.custom_op("kiln::mla_decode_attention", mutates_args=())
def _mla_decode_attention_op(q_latent: torch.Tensor, q_rot: torch.Tensor, l_format: str, l_data: torch.Tensor,
                             l_scale: torch.Tensor | None, l_global: torch.Tensor | None,
                             l_offset: torch.Tensor | None, r_format: str, r_data: torch.Tensor,
                             r_scale: torch.Tensor | None, r_global: torch.Tensor | None,
                             r_offset: torch.Tensor | None, block_table: torch.Tensor, context_lens: torch.Tensor,
                             block_size: int, sm_scale: float) -> torch.Tensor:
    return _mla_decode_attention(q_latent, q_rot, KvPool(l_format, l_data, l_scale, l_global, l_offset),
                                 KvPool(r_format, r_data, r_scale, r_global, r_offset), block_table, context_lens,
                                 block_size, sm_scale)


@_mla_decode_attention_op.register_fake
def _(q_latent, *args):
    return torch.empty(q_latent.shape, dtype=q_latent.dtype, device=q_latent.device)
