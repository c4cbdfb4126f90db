"""What the Triton kernel tests share: skip without Triton, and run in its CPU interpreter without a GPU.

Import this before any kiln.kernels.triton_* module. Triton decides at definition time whether a @triton.jit
function is compiled or interpreted, including its own standard library (tl.max, tl.sum, tl.cdiv) when
`triton` is first imported; so on a machine with no CUDA device this sets TRITON_INTERPRET=1 (unless the
caller chose otherwise) before anything imports Triton. The kernels then run on CPU tensors: DEVICE is "cpu"
there and "cuda" on a GPU.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed (pip install -e '.[triton]')", allow_module_level=True)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("no CUDA device and TRITON_INTERPRET is off", allow_module_level=True)
if INTERPRET and "triton" in sys.modules:
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.max, InterpretedFunction):
        pytest.skip("Triton was imported in compiled mode before TRITON_INTERPRET=1 was set (by another "
                    "module in this session); run with TRITON_INTERPRET=1 in the environment",
                    allow_module_level=True)

DEVICE = "cpu" if INTERPRET else "cuda"


def relative_max_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|, in fp32."""
    ref = ref.float()
    return float((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def output_rounding(dtype: torch.dtype) -> float:
    """Relative error a kernel's final store into `dtype` may add: half an ulp (round to nearest), except a
    whole ulp for bf16 under the interpreter, which truncates fp32 -> bf16 (checked in Triton 3.9)."""
    half_ulp = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    return 2 * half_ulp if INTERPRET and dtype == torch.bfloat16 else half_ulp


def make_pool(kind: str, x: torch.Tensor, offset: torch.Tensor | None = None):
    """x [slots, KV heads, D] stored as the runtime's KV pool of that kind would store it: `offset` comes off
    before storing and back on reading. kind: fp32 (the CPU runtime's BF16 layers), bf16, fp8_per_tensor,
    fp8_per_head, fp8_dynamic (per token) or nvfp4."""
    from kiln.kernels.kv_fp8 import fp8_kv_quantize, fp8_kv_quantize_per_token
    from kiln.kernels.kv_nvfp4 import nvfp4_kv_global_scale, nvfp4_kv_quantize
    from kiln.kernels.torch_refs import KvPool

    centered = x if offset is None else x - offset
    if kind == "fp32":
        return KvPool("bf16", centered, offset=offset)
    if kind == "bf16":
        return KvPool("bf16", centered.bfloat16(), offset=offset)
    if kind in ("fp8_per_tensor", "fp8_per_head"):
        heads = x.shape[1]
        scale = torch.tensor(0.011) if kind == "fp8_per_tensor" else torch.linspace(0.008, 0.02, heads).reshape(heads, 1)
        return KvPool("fp8_e4m3", fp8_kv_quantize(centered, scale), scale, offset=offset)
    if kind == "fp8_dynamic":
        return KvPool("fp8_e4m3", *fp8_kv_quantize_per_token(centered), offset=offset)
    if kind != "nvfp4":
        raise ValueError(f"unknown pool kind {kind!r}")
    g = nvfp4_kv_global_scale(centered.abs().amax())
    return KvPool("nvfp4", *nvfp4_kv_quantize(centered, g), g, offset=offset)


def pool_to(pool, device: str = DEVICE):
    """The pool with every tensor on `device` (the kernels' device by default)."""
    from kiln.kernels.torch_refs import KvPool

    def move(t):
        return None if t is None else t.to(device)

    return KvPool(pool.format, move(pool.data), move(pool.scale), move(pool.global_scale), move(pool.offset))
