"""The GPU path compiles without a GPU: each kernel is lowered ahead of time, with Triton's bundled ptxas, to
Hopper (sm_90) and Blackwell (sm_100) machine code, and the instructions its design relies on are there.

The interpreter tests check the numbers; this checks what the interpreter cannot: that the compiled path
builds (hardware E4M3 cast, IEEE division, FP8 tensor cores, Blackwell's block-scaled FP4 MMA for
tl.dot_scaled)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


def _nvidia_backend() -> bool:
    """Triton with its NVIDIA backend (ptxas bundled), found without importing Triton: importing it here,
    before the interpreter tests set TRITON_INTERPRET, would put them in compiled mode."""
    spec = importlib.util.find_spec("triton")
    return spec is not None and any((Path(p) / "backends" / "nvidia").is_dir()
                                    for p in spec.submodule_search_locations or ())


pytestmark = pytest.mark.skipif(not _nvidia_backend(), reason="Triton's NVIDIA backend is not installed")

ROOT = Path(__file__).resolve().parents[2]


def _types(pointers: str, ints: str, floats: str = "") -> dict:
    """'name:type ...' pointers, then int32 and fp32 scalar names, as Triton signature types."""
    out = {name: f"*{kind}" for name, kind in (p.split(":") for p in pointers.split())}
    return out | {name: "i32" for name in ints.split()} | {name: "fp32" for name in floats.split()}


QUANT = _types("x_ptr:bf16 w_ptr:fp32 q_ptr:u8 scale_ptr:u8 g_ptr:fp32 y_ptr:fp32 amax_ptr:fp32",
               "K stride_x stride_q stride_s stride_y", "K_FLOAT eps")
FP8_GEMM = _types("a_ptr:u8 b_ptr:u8 a_scale_ptr:fp32 b_scale_ptr:fp32 c_ptr:bf16",
                  "M N K stride_am stride_bn stride_cm")
W4A16 = _types("x_ptr:bf16 w_ptr:u8 ws_ptr:u8 g_ptr:fp32 c_ptr:fp32",
               "M N K KP stride_xm stride_wn stride_wsn stride_cm")
W4A4 = _types("a_ptr:u8 as_ptr:u8 w_ptr:u8 ws_ptr:u8 alpha_ptr:fp32 c_ptr:bf16",
              "M N KP stride_am stride_asm stride_wn stride_wsn stride_cm")
PAGED = _types("q_ptr:bf16 k_ptr:u8 k_scale_ptr:u8 k_g_ptr:fp32 v_ptr:u8 v_scale_ptr:u8 v_g_ptr:fp32 "
               "v_offset_ptr:fp32 table_ptr:i32 lens_ptr:i32 out_ptr:bf16",
               "stride_qb stride_qh stride_tb stride_ob stride_oh KV_HEADS GROUP PAGE", "sm_scale")
W4A4_TILES = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 256, "DOT_DTYPE": "bfloat16", "DOT_SCALED": True}

# (label, module, kernel, argument types, constexprs, options, arch, PTX that must appear, PTX that must not)
CASES = [
    ("hardware e4m3 cast", "triton_codecs", "_e4m3_encode_kernel", _types("x_ptr:fp32 out_ptr:u8", "count"),
     {"HW_CAST": True, "BLOCK": 1024}, {}, 90, ["cvt.rn.satfinite.e4m3x2.f32"], []),
    ("rmsnorm + nvfp4 quantize", "triton_quant", "rmsnorm_quantize_kernel", QUANT,
     {"FORMAT": 2, "NORM": True, "WRITE_Y": False, "AMAX_ONLY": False, "GROUP": 16, "BLOCKS": 256,
      "HW_CAST": True}, {}, 90, ["div.rn.f32", "sqrt.rn.f32", "cvt.rn.satfinite.e4m3x2.f32"],
     ["div.full.f32", "div.approx.f32"]),
    ("fp8 gemm on fp8 tensor cores", "triton_fp8_gemm", "fp8_gemm_kernel", FP8_GEMM,
     {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 1, "UPCAST": False}, {"num_stages": 3}, 90,
     ["wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3"], []),
    ("nvfp4 w4a16, bf16 activations, split K", "triton_fp4_gemm", "fp4_w4a16_kernel", W4A16,
     {"GROUP": 16, "SCALE_E4M3": True, "HAS_GLOBAL": True, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128,
      "SPLIT_K": 4, "DOT_DTYPE": "bfloat16"}, {"num_stages": 4}, 90, [".bf16.bf16.f32", "add.f32"], []),
    ("nvfp4 w4a4 tl.dot_scaled", "triton_fp4_gemm", "fp4_w4a4_kernel", W4A4,
     {"GROUP": 16, "SCALE_E4M3": True, "HAS_GLOBAL": True, **W4A4_TILES}, {"num_warps": 8}, 100,
     ["tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.block16"], []),
    ("mxfp4 w4a4 tl.dot_scaled", "triton_fp4_gemm", "fp4_w4a4_kernel", W4A4,
     {"GROUP": 32, "SCALE_E4M3": False, "HAS_GLOBAL": False, **W4A4_TILES}, {"num_warps": 8}, 100,
     ["tcgen05.mma.cta_group::1.kind::mxf4.block_scale.block32"], []),
    ("paged decode attention, nvfp4 kv", "triton_paged_attention", "paged_decode_kernel", PAGED,
     {"HEAD_DIM": 128, "G_PAD": 16, "BLOCK_N": 64, "K_FORMAT": 2, "K_SCALE_MODE": 0, "V_FORMAT": 2,
      "V_SCALE_MODE": 0, "HAS_V_OFFSET": True}, {}, 90, ["cvt.rn.f16x2.e4m3x2"], []),
]

_COMPILE = textwrap.dedent("""
    import importlib, inspect, json, sys
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, name, types, constexprs, options, arch = json.loads(sys.argv[1])
    kernel = getattr(importlib.import_module("kiln.kernels." + module), name)
    dtypes = ("bfloat16", "float16", "float32")
    constexprs = {k: getattr(tl, v) if v in dtypes else v for k, v in constexprs.items()}
    names = list(inspect.signature(kernel.fn).parameters)
    signature = {n: "constexpr" if n in constexprs else types[n] for n in names}
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(names.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    print(json.dumps({"ptx": compiled.asm["ptx"], "cubin_bytes": len(compiled.asm["cubin"])}))
""")


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_compiles_to_the_expected_instructions(case):
    label, module, kernel, types, constexprs, options, arch, present, absent = case
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    args = json.dumps([module, kernel, types, constexprs, options, arch])
    done = subprocess.run([sys.executable, "-c", _COMPILE, args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, f"{label} failed to compile for sm_{arch}:\n{done.stderr[-3000:]}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["cubin_bytes"] > 0
    for instruction in present:
        assert instruction in result["ptx"], f"{label}: no {instruction} in the sm_{arch} PTX"
    for instruction in absent:
        assert instruction not in result["ptx"], f"{label}: {instruction} in the sm_{arch} PTX"
