"""One command for a CUDA machine: every Triton kernel against its reference, HBM bandwidth, and GEMM timings.

    .venv/bin/python benchmarks/gpu_check.py               # on a GPU (one H200: about 2-4 minutes)
    .venv/bin/python benchmarks/gpu_check.py --interpret   # the correctness table on CPU, TRITON_INTERPRET=1

1. Correctness (Markdown table): each kernel of kernels/triton_*.py against its kernels/torch_refs.py
   reference, as the max error over the output's largest magnitude, or as mismatched bytes where the kernel
   must be bit-exact; on a GPU the FP8 GEMM is also compared with torch._scaled_mm (cuBLASLt, row-wise
   scales), and the hardware fp32 -> E4M3 cast with the integer one the interpreter tests check. A failed
   row exits 1.
2. HBM bandwidth (GPU only): a 4 GiB device-to-device copy, read + write bytes over the median time.
3. Decode (GPU only; benchmarks/gpu_decode.py): batch-1 and batch-8 decode steps of stories260K, SmolLM2-135M
   and Llama-3.1-8B shapes in FP8 and NVFP4 W4A16 through `runtime.Engine(device="cuda")`, eager and (8B)
   compiled with CUDA graphs, against the HBM roofline and transformers bf16.
4. GEMM timings (GPU only) for Llama-3.1-8B's linear shapes [N, K] at batch 1 and 8: torch bf16 matmul,
   torch._scaled_mm FP8, the Triton FP8 GEMM (activation already quantized) and the Triton NVFP4 W4A16 GEMM,
   each beside its bound weight_bytes / measured bandwidth (decode reads every weight once per step), timed
   as CUDA graphs over weight copies that do not fit in L2 (see `gemm_timings`).

Without a GPU (and without --interpret) it prints one line and exits 0. The GPU path was written without a
GPU to run it on: every row is guarded, so a kernel that fails to compile shows as an error row, not a crash.
The tile heuristics (kernels/triton_fp8_gemm.py `gemm_config`) are untuned.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LLAMA_8B_SHAPES = [  # [N, K] of the linears: q/o, k/v, gate/up, down, lm_head
    ("q_proj/o_proj", 4096, 4096),
    ("k_proj/v_proj", 1024, 4096),
    ("gate/up_proj", 14336, 4096),
    ("down_proj", 4096, 14336),
    ("lm_head", 128256, 4096),
]
TIME_BUDGET_S = 7 * 60  # stop starting new timing rows past this, so the whole run stays under 8 minutes
DECODE_BUDGET_S = 5 * 60  # the decode table starts no new model past this; the GEMM rows get the rest


class Check:
    """One row of the correctness table."""

    def __init__(self, kernel: str, case: str, metric: str, value: float, tolerance: float):
        self.kernel, self.case, self.metric = kernel, case, metric
        self.value, self.tolerance = value, tolerance

    @property
    def ok(self) -> bool:
        return self.value <= self.tolerance

    def row(self) -> str:
        if self.metric == "skipped":
            return f"| {self.kernel} | {self.case} | - | - | - | skipped |"
        value = f"{int(self.value)}" if self.metric == "mismatched bytes" else f"{self.value:.2e}"
        tol = f"{int(self.tolerance)}" if self.metric == "mismatched bytes" else f"{self.tolerance:.0e}"
        result = "ok" if self.ok else "FAIL"
        return f"| {self.kernel} | {self.case} | {self.metric} | {value} | {tol} | {result} |"


def _rel(out, ref) -> float:
    ref = ref.float()
    return float((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _mismatches(a, b) -> int:
    import torch

    a = a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a
    b = b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b
    return int((a.cpu() != b.cpu()).sum()) + (0 if a.shape == b.shape else 10**9)


def shuffled_block_table(lengths: list[int], page: int, gen):
    """A block table for sequences of `lengths` tokens over pages of `page` in shuffled order, unused entries
    pointing at the null block (the last): (table [B, width] int32, blocks used + 1)."""
    import torch

    blocks = sum(-(-t // page) for t in lengths) + 1
    order = torch.randperm(blocks, generator=gen).tolist()
    table = torch.full((len(lengths), max(-(-t // page) for t in lengths)), blocks, dtype=torch.int32)
    for b, t in enumerate(lengths):
        table[b, :-(-t // page)] = torch.tensor(order[:-(-t // page)], dtype=torch.int32)
        order = order[-(-t // page):]
    return table, blocks


def correctness(device: str, interpret: bool) -> list:
    """Run every kernel on small (interpreter) or medium (GPU) inputs against its reference."""
    import torch

    from kiln.kernels import torch_refs as refs
    from kiln.kernels.fp8 import fp8_quantize_per_channel
    from kiln.kernels.kv_fp8 import fp8_kv_quantize_per_token
    from kiln.kernels.kv_nvfp4 import nvfp4_kv_global_scale, nvfp4_kv_quantize
    from kiln.kernels.mxfp4 import Mxfp4Weight, mxfp4_quantize
    from kiln.kernels.nvfp4 import Nvfp4Weight, nvfp4_quantize
    from kiln.kernels.triton_codecs import e4m3_encode_tensor
    from kiln.kernels.triton_fp4_gemm import fp4_w4a4_linear, fp4_w4a16_gemm
    from kiln.kernels.triton_fp8_gemm import fp8_gemm
    from kiln.kernels.triton_mla_decode import mla_decode_attention
    from kiln.kernels.triton_paged_attention import paged_decode_attention
    from kiln.kernels.triton_quant import quantize_fp8, quantize_mxfp4, quantize_nvfp4

    gen = torch.Generator().manual_seed(0)
    m, n, k = (12, 64, 160) if interpret else (64, 1024, 4096)
    act_dtype = torch.float32 if interpret else torch.bfloat16
    checks: list[Check] = []

    def guarded(kernel: str, case: str, fn) -> None:
        try:
            checks.extend(fn())
        except Exception as exc:  # noqa: BLE001  (a row that fails to compile or run is reported, not fatal)
            message = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:120]}"
            checks.append(Check(kernel, f"{case}: ERROR {message}", "error", 1.0, 0.0))

    # --- codecs: E4M3 encode, integer path and (GPU) hardware cast, against torch's cast -----------------
    def codecs():
        values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        values = values[torch.isfinite(values)].unique()
        count = 1 << (14 if interpret else 22)
        exponents = torch.randint(-14, 10, (count,), generator=gen).float()
        x = torch.cat([values, (values[1:] + values[:-1]) / 2,
                       torch.randn(count, generator=gen) * torch.exp2(exponents)])
        x = torch.cat([x, -x]).to(device)
        ref = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        out = []
        for hw in ([False] if interpret else [False, True]):
            got = e4m3_encode_tensor(x, hw_cast=hw)
            path = "hardware cast" if hw else "integer path"
            out.append(Check("e4m3_encode", f"{path}, {x.numel()} values", "mismatched bytes",
                             _mismatches(got, ref), 0))
        return out

    guarded("e4m3_encode", "codecs", codecs)

    # --- fused RMSNorm + quantization: bit-exact with the reference quantizers applied to the kernel's y ----
    x = (torch.randn(m, k, generator=gen) * torch.logspace(-2, 1, k)).to(act_dtype).to(device)
    norm_weight = (torch.rand(k, generator=gen) + 0.5).to(device)

    static_scale = torch.tensor(0.01, device=device)

    def quant():
        out = []
        for label, run, ref in [
            ("fp8 per token", lambda w: quantize_fp8(x, w, 1e-5, return_normed=True), refs.quantize_fp8_ref),
            ("fp8 static", lambda w: quantize_fp8(x, w, 1e-5, static_scale, return_normed=True),
             lambda y: refs.quantize_fp8_ref(y, static_scale)),
            ("nvfp4 dynamic global", lambda w: quantize_nvfp4(x, w, 1e-5, return_normed=True),
             refs.quantize_nvfp4_ref),
            ("mxfp4", lambda w: quantize_mxfp4(x, w, 1e-5, return_normed=True), refs.quantize_mxfp4_ref),
        ]:
            for w in (None, norm_weight):
                got = run(w)
                want = ref(got.normed)
                bad = _mismatches(got.data, want.data) + _mismatches(got.scale, want.scale)
                out.append(Check("rmsnorm_quantize" if w is not None else "quantize", f"{label}, [{m}, {k}]",
                                 "mismatched bytes", bad, 0))
        y = quantize_mxfp4(x, norm_weight, 1e-5, return_normed=True).normed
        out.append(Check("rmsnorm_quantize", "its y vs torch RMSNorm", "max rel err",
                         _rel(y, refs.rmsnorm_ref(x, norm_weight, 1e-5)), 1e-6))
        return out

    guarded("rmsnorm_quantize", "quantizers", quant)

    # --- FP8 W8A8 GEMM ------------------------------------------------------------------------------------
    w = torch.randn(n, k, generator=gen) * 0.05
    qw, w_scale = (t.to(device) for t in fp8_quantize_per_channel(w))

    def fp8():
        act = quantize_fp8(x)
        got = fp8_gemm(act.data, act.scale, qw, w_scale, out_dtype=torch.float32)
        ref = refs.fp8_gemm_ref(act.data, act.scale, qw, w_scale)
        out = [Check("fp8_gemm", f"per-token x per-channel, [{m}, {k}] x [{n}, {k}]", "max rel err",
                     _rel(got, ref), 1e-4)]
        if not interpret:
            lib = torch._scaled_mm(act.data, qw.t(), scale_a=act.scale.reshape(m, 1),
                                   scale_b=w_scale.reshape(1, n), out_dtype=torch.bfloat16)
            out.append(Check("fp8_gemm", "vs torch._scaled_mm (bf16 out)", "max rel err", _rel(got, lib),
                             2**-8 + 1e-4))
        return out

    guarded("fp8_gemm", "fp8", fp8)

    # --- FP4 W4A16 and W4A4 ---------------------------------------------------------------------------------
    def to_device(q):
        if isinstance(q, Nvfp4Weight):
            return Nvfp4Weight(q.packed.to(device), q.block_scale.to(device), q.global_scale.to(device),
                               q.in_features)
        return Mxfp4Weight(q.packed.to(device), q.scale_e8m0.to(device), q.in_features)

    weights = {"nvfp4": to_device(nvfp4_quantize(w)), "mxfp4": to_device(mxfp4_quantize(w))}
    out_rounding = 0.0 if act_dtype == torch.float32 else 2**-8

    def w4a16():
        out = []
        for name, q in weights.items():
            got = fp4_w4a16_gemm(x, q)
            out.append(Check("fp4_w4a16_gemm", f"{name}, {str(act_dtype)[6:]} x", "max rel err",
                             _rel(got, refs.fp4_w4a16_ref(x, q)), 1e-4 + out_rounding))
        return out

    guarded("fp4_w4a16_gemm", "w4a16", w4a16)

    def w6a16():
        from kiln.kernels.mxfp6 import Mxfp6Weight, mxfp6_quantize
        from kiln.kernels.triton_fp6_gemm import fp6_w6a16_gemm

        q = mxfp6_quantize(w)
        q = Mxfp6Weight(q.packed.to(device), q.scale_e8m0.to(device), q.in_features)
        return [Check("fp6_w6a16_gemm", f"mxfp6, {str(act_dtype)[6:]} x", "max rel err",
                      _rel(fp6_w6a16_gemm(x, q), refs.fp6_w6a16_ref(x, q)), 1e-4 + out_rounding)]

    guarded("fp6_w6a16_gemm", "w6a16", w6a16)
    for name, q in weights.items():
        for dot_scaled in (False, True):
            if interpret and dot_scaled and name == "nvfp4":
                checks.append(Check("fp4_w4a4", "nvfp4, tl.dot_scaled: GPU only (the interpreter reads E4M3 "
                                    "scales as E8M0)", "skipped", 0.0, 0.0))
                continue
            if not interpret and dot_scaled and name == "nvfp4" and torch.cuda.get_device_capability()[0] < 10:
                # the runtime takes dot_scaled for NVFP4 only from sm_100 (triton_fp4_gemm.fp4_w4a4_gemm)
                checks.append(Check("fp4_w4a4", "nvfp4, tl.dot_scaled: Blackwell's block-scaled MMA (Triton does "
                                    "not compile E4M3-scaled dots before sm_100)", "skipped", 0.0, 0.0))
                continue

            def w4a4(name=name, q=q, dot_scaled=dot_scaled):
                got = fp4_w4a4_linear(x, q, dot_scaled=dot_scaled)
                return [Check("fp4_w4a4", f"{name}, {'tl.dot_scaled' if dot_scaled else 'dequantize + dot'}",
                              "max rel err", _rel(got, refs.fp4_w4a4_ref(x, q)), 1e-4 + out_rounding)]

            guarded("fp4_w4a4", f"{name} dot_scaled={dot_scaled}", w4a4)

    # --- paged decode attention -------------------------------------------------------------------------
    def attention():
        batch, heads, kv_heads, dim, page = (3, 8, 2, 64, 4) if interpret else (8, 32, 8, 128, 16)
        lengths = [5, 0, 23] if interpret else [1, 17, 200, 1000, 513, 64, 999, 4]
        table, blocks = shuffled_block_table(lengths, page, gen)
        kv = torch.randn(2, (blocks + 1) * page, kv_heads, dim, generator=gen)
        q = torch.randn(batch, heads, dim, generator=gen).to(device)
        table, lens = table.to(device), torch.tensor(lengths, dtype=torch.int32, device=device)
        g = nvfp4_kv_global_scale(kv.abs().amax())
        pools = {
            "fp8 per token": [refs.KvPool("fp8_e4m3", *(t.to(device) for t in fp8_kv_quantize_per_token(s)))
                              for s in kv],
            "nvfp4": [refs.KvPool("nvfp4", *(t.to(device) for t in nvfp4_kv_quantize(s, g)), g.to(device))
                      for s in kv],
        }
        out = []
        for label, (k_pool, v_pool) in pools.items():
            got = paged_decode_attention(q, k_pool, v_pool, table, lens, page)
            ref = refs.paged_decode_attention_ref(q, k_pool, v_pool, table, lens, page)
            err = float((got.float() - ref).abs().max())
            out.append(Check("paged_decode_attention", f"{label}, B={batch} H={heads} KVH={kv_heads} D={dim}",
                             "max abs err", err, 2e-5))
        return out

    guarded("paged_decode_attention", "attention", attention)

    # --- MLA absorbed decode attention ------------------------------------------------------------------
    def mla():
        batch, heads, rank, rope, page = (3, 4, 32, 16, 4) if interpret else (8, 128, 512, 64, 64)
        lengths = [5, 0, 23] if interpret else [1, 17, 200, 1000, 513, 64, 999, 4]
        table, blocks = shuffled_block_table(lengths, page, gen)
        latent = torch.randn((blocks + 1) * page, 1, rank, generator=gen)
        k_rot = torch.randn((blocks + 1) * page, 1, rope, generator=gen)
        q_latent = torch.randn(batch, heads, rank, generator=gen).to(device)
        q_rot = torch.randn(batch, heads, rope, generator=gen).to(device)
        table, lens = table.to(device), torch.tensor(lengths, dtype=torch.int32, device=device)
        sm_scale = 1 / (192 ** 0.5)  # DeepSeek-V3: qk_nope 128 + rope 64

        def fp8(s):
            return refs.KvPool("fp8_e4m3", *(t.to(device) for t in fp8_kv_quantize_per_token(s)))

        def nvfp4(s):
            g = nvfp4_kv_global_scale(s.abs().amax())
            return refs.KvPool("nvfp4", *(t.to(device) for t in nvfp4_kv_quantize(s, g)), g.to(device))

        dense = torch.float32 if interpret else torch.bfloat16
        pools = {
            f"{str(dense)[6:]} dense": [refs.KvPool("bf16", s.to(dense).to(device)) for s in (latent, k_rot)],
            "fp8 per token": [fp8(s) for s in (latent, k_rot)],
            "nvfp4": [nvfp4(s) for s in (latent, k_rot)],
        }
        shape = f"B={batch} H={heads} r={rank} rope={rope}"
        out = []
        for label, (latent_pool, rot_pool) in pools.items():
            ref = refs.mla_decode_attention_ref(q_latent, q_rot, latent_pool, rot_pool, table, lens, page,
                                                sm_scale)
            got = mla_decode_attention(q_latent, q_rot, latent_pool, rot_pool, table, lens, page, sm_scale)
            out.append(Check("mla_decode_attention", f"{label}, fp32 q, {shape}", "max abs err",
                             float((got.float() - ref).abs().max()), 2e-5))
            if not interpret:  # the tensor-core path: q, p and the dequantized latents rounded to bf16
                q16, r16 = q_latent.bfloat16(), q_rot.bfloat16()
                ref = refs.mla_decode_attention_ref(q16, r16, latent_pool, rot_pool, table, lens, page,
                                                    sm_scale)
                got = mla_decode_attention(q16, r16, latent_pool, rot_pool, table, lens, page, sm_scale)
                out.append(Check("mla_decode_attention", f"{label}, bf16 q (tensor cores), {shape}",
                                 "max rel err", _rel(got, ref), 2**-7))
        return out

    guarded("mla_decode_attention", "mla", mla)
    return checks


def bandwidth_gbps() -> float:
    """Device-to-device copy of 4 GiB: (read + write bytes) / median time."""
    import torch
    from triton.testing import do_bench

    src = torch.empty(1 << 30, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=5, rep=200, return_mode="median")
    return 2 * (4 << 30) / (ms * 1e-3) / 1e9


def gemm_timings(bandwidth: float, start: float) -> None:
    """Print Markdown rows as they finish: per shape and batch, microseconds of each GEMM and its bound.

    Each time is one CUDA graph replaying the GEMM over enough distinct copies of the weight to fill 256 MiB
    (at most 64 copies), divided by the number of copies: no Python launch overhead (a decode step runs as a
    graph in production engines), and weights that stream from HBM rather than sit in the 50 MB L2, as a
    model's layers do. Weights are random bytes without NaN patterns: the values do not change the time.
    The Triton FP8 time includes its split-K output's zero fill and bf16 cast."""
    import torch
    from triton.testing import do_bench_cudagraph

    from kiln.kernels.nvfp4 import Nvfp4Weight
    from kiln.kernels.triton_fp4_gemm import fp4_w4a16_gemm
    from kiln.kernels.triton_fp8_gemm import fp8_gemm
    from kiln.kernels.triton_quant import quantize_fp8

    def copies(weight_bytes: int) -> int:
        return max(1, min(64, -(-(256 << 20) // weight_bytes)))

    def per_call_us(calls) -> float:
        try:
            for call in calls:  # compiles on the first call; a graph cannot capture a compilation
                call()
            torch.cuda.synchronize()
            ms = do_bench_cudagraph(lambda: [call() for call in calls], rep=50, return_mode="median")
            return ms * 1e3 / len(calls)
        except Exception as exc:  # noqa: BLE001  (as in correctness: report the failure, time the rest)
            print(f"    ({type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:150]})", flush=True)
            return float("nan")

    def fp8_weight(n: int, k: int):
        codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, device="cuda")
        return torch.where((codes & 0x7F) == 0x7F, 0x38, codes).view(torch.float8_e4m3fn)

    def nvfp4_weight(n: int, k: int) -> Nvfp4Weight:
        return Nvfp4Weight(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda"),
                           (torch.rand(n, k // 16, device="cuda") * 100 + 1).to(torch.float8_e4m3fn),
                           torch.tensor(1e-4, device="cuda"), k)

    def time_batch(batch: int, k: int, bf16_weights, fp8_weights, w_scale, nv_weights) -> list[float]:
        x = torch.randn(batch, k, device="cuda", dtype=torch.bfloat16)
        act = quantize_fp8(x)
        scale_b = w_scale.reshape(1, -1)
        return [
            per_call_us([lambda w=w: x @ w.t() for w in bf16_weights]),
            per_call_us([lambda w=w: torch._scaled_mm(act.data, w.t(), scale_a=act.scale, scale_b=scale_b,
                                                      out_dtype=torch.bfloat16) for w in fp8_weights]),
            per_call_us([lambda w=w: fp8_gemm(act.data, act.scale, w, w_scale) for w in fp8_weights]),
            per_call_us([lambda w=w: fp4_w4a16_gemm(x, w) for w in nv_weights]),
        ]

    print("| linear | N x K | batch | bf16 torch us | fp8 _scaled_mm us | fp8 triton us "
          "| nvfp4 w4a16 triton us | fp8 bound us | nvfp4 bound us | fp8 triton % of bound "
          "| nvfp4 triton % of bound |")
    print("|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for name, n, k in LLAMA_8B_SHAPES:
        fp8_bytes = n * k + 4 * n  # E4M3 weights + per-channel fp32 scales
        nv_bytes = n * k // 2 + n * k // 16 + 4  # E2M1 pairs + E4M3 block scales + the global scale
        bf16_weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                        for _ in range(copies(2 * n * k))]
        fp8_weights = [fp8_weight(n, k) for _ in range(copies(fp8_bytes))]
        nv_weights = [nvfp4_weight(n, k) for _ in range(copies(nv_bytes))]
        w_scale = torch.rand(n, 1, device="cuda") * 1e-3 + 1e-4
        for batch in (1, 8):
            if time.perf_counter() - start > TIME_BUDGET_S:
                print(f"| {name} | {n} x {k} | {batch} | (skipped: past the {TIME_BUDGET_S} s budget) |")
                continue
            times = time_batch(batch, k, bf16_weights, fp8_weights, w_scale, nv_weights)
            bounds = [b / (bandwidth * 1e9) * 1e6 for b in (fp8_bytes, nv_bytes)]
            cells = [name, f"{n} x {k}", batch, *(f"{t:.1f}" for t in times + bounds),
                     f"{100 * bounds[0] / times[2]:.0f}%", f"{100 * bounds[1] / times[3]:.0f}%"]
            print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)
        del bf16_weights, fp8_weights, nv_weights
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interpret", action="store_true",
                        help="run the correctness table on CPU under TRITON_INTERPRET=1 with small sizes")
    parser.add_argument("--no-timing", action="store_true", help="on a GPU: the correctness table only")
    args = parser.parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: it is read at kernel definition

    import torch

    if not args.interpret and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU on this machine; nothing to check "
              "(--interpret runs the correctness part on CPU)")
        return 0
    if importlib.util.find_spec("triton") is None:
        print("gpu_check: Triton is not installed (pip install -e '.[triton]')")
        return 2
    torch.manual_seed(0)
    start = time.perf_counter()
    device = "cpu" if args.interpret else "cuda"
    where = "Triton interpreter on CPU" if args.interpret else torch.cuda.get_device_name()
    import triton

    print(f"## Kernel correctness ({where}, triton {triton.__version__}, torch {torch.__version__})\n")
    print("| kernel | case | metric | value | tolerance | result |")
    print("|---|---|---|---|---|---|")
    checks = correctness(device, args.interpret)
    for check in checks:
        print(check.row())
    failed = [c for c in checks if not c.ok]
    seconds = time.perf_counter() - start
    print(f"\n{len(checks) - len(failed)} of {len(checks)} checks passed ({seconds:.0f} s)")
    if not args.interpret and not args.no_timing:
        bandwidth = bandwidth_gbps()
        print(f"\n## HBM bandwidth\n\ndevice copy: {bandwidth:.0f} GB/s (read + write)\n")
        print("## Decode: runtime.Engine(device='cuda') vs the HBM roofline and transformers bf16 "
              "(benchmarks/gpu_decode.py)\n", flush=True)
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from gpu_decode import decode_table

        decode_table("cuda", bandwidth, deadline=start + DECODE_BUDGET_S)
        print("\n## GEMM time vs weight bytes / bandwidth (Llama-3.1-8B linears)\n", flush=True)
        gemm_timings(bandwidth, start)
        print(f"\ntotal {time.perf_counter() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
