"""GPTQ: quantize a linear column by column, pushing each column's rounding error onto the columns not yet
quantized, so that the layer's output X W^T (not its weights) stays close (Frantar et al., 2022).

    H = X^T X + damping * mean(diag H) * I             # X: the layer's calibration inputs [tokens, K]
    order = argsort(diag H, descending) if act_order  # quantize the most active inputs first
    U = cholesky(H^-1)^T  (upper)                     # in the chosen order
    for each column j in order (lazily, in batches of `batch` columns):
        q_j = grid(w_j / m_j) * m_j                   # m_j: the scale of column j's block, per row
        e_j = (w_j - q_j) / U[j, j]
        w_k -= e_j * U[j, k]   for the columns k after j
    undo the order

Scales, on the FP8 / E2M1 grids of Kiln's formats (calibration.grids):
    static   chosen once from the original weight before any column moves (absmax or the MSE search of
             calibration.scale_search, weighted by diag H); needed with act_order, whose blocks are scattered
    dynamic  chosen when GPTQ reaches a block's first column, from the weights as GPTQ has updated them so far
             (natural order only; blocks of 16/32 columns for NVFP4/MXFP4, the whole row for FP8)
The returned values lie exactly on the grid of the returned scales (`WeightLayout.pack` stores them).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from kiln.calibration.grids import Scales, WeightLayout
from kiln.calibration.scale_search import mse_scales

SCALE_METHODS = ("absmax", "mse")
UPDATE_ROWS = 2048  # GPTQ's lazy-batch update runs over this many later columns at a time


@dataclass(frozen=True)
class GptqResult:
    values: Tensor  # fp32 [N, K], on the grid of `scales`
    scales: Scales
    source: Tensor  # the weight quantized
    hessian: Tensor | None

    @property
    def loss(self) -> float:
        """tr((W - Q) H (W - Q)^T) with the undamped H: the summed squared output error on X (NaN without H).
        Computed when asked: 2 N K^2 (3.4 TFLOP for an 8B model's down_proj), which builds do not need."""
        return output_error(self.source, self.values, self.hessian) if self.hessian is not None else float("nan")


def output_error(w: Tensor, q: Tensor, hessian: Tensor, rows: int = 1024) -> float:
    """||X W^T - X Q^T||_F^2 from H = X^T X: fp32 products over `rows` rows at a time, summed in float64
    (no [N, K] or [K, K] float64 copy: an 8B model's down_proj has K = 14336)."""
    h = hessian.float()
    total = 0.0
    for r in range(0, w.shape[0], rows):
        d = w[r:r + rows].float() - q[r:r + rows].float()
        total += float(((d @ h) * d).sum(dtype=torch.float64))
    return total


def choose_scales(layout: WeightLayout, w: Tensor, method: str, importance: Tensor | None,
                  global_scale: Tensor | None = None) -> Scales:
    if method == "absmax":
        return layout.absmax_scales(w, global_scale)
    if method == "mse":
        return mse_scales(layout, w, importance, global_scale)
    raise ValueError(f"scale method {method!r} is not one of {SCALE_METHODS}")


def gptq_quantize(w: Tensor, hessian: Tensor, layout: WeightLayout, *, damping: float = 0.01,
                  act_order: bool = True, scales: str = "mse", static_scales: bool | None = None,
                  batch: int = 128, global_scale: Tensor | None = None,
                  consume_hessian: bool = False) -> GptqResult:
    """GPTQ of w [N, K] on `layout`'s grid against the input Hessian [K, K] (X^T X, any normalization).

    Args:
        damping: added to the diagonal, as a fraction of its mean (Hessians of real inputs are singular).
        act_order: quantize columns in order of decreasing diag(H).
        scales: "absmax" or "mse" (calibration.scale_search, weighted by diag H).
        static_scales: choose all scales before GPTQ runs (default: only when act_order needs it).
        global_scale: NVFP4's per-tensor scale (default: from w's maximum); fused siblings share one.
        consume_hessian: factor in `hessian`'s own buffer (fp32, contiguous), which is overwritten, instead of
            in a [K, K] copy (0.8 GB at an 8B model's down_proj); the result then holds no Hessian.
    """
    static = _check_arguments(w, hessian, damping, act_order, scales, static_scales)
    w = w.float()
    k = w.shape[1]
    diag = torch.diagonal(hessian).float().clone()
    dead = diag <= 0
    diag[dead] = 1.0  # an input that is never active: nothing to compensate
    importance = diag
    global_scale = _global_scale(layout, w, scales, importance, global_scale)
    # fp8: one block spans the row, so dynamic == static
    dynamic = not static and layout.codec.blocked
    fixed = None if dynamic else choose_scales(layout, w, scales, importance, global_scale)
    perm = torch.argsort(diag, descending=True, stable=True) if act_order else torch.arange(k)
    columns = _GptqColumns(layout, scales, importance, global_scale, fixed)
    # the factor is handed over, not kept here: the loop frees it before gathering the values
    values = columns.run(w, _inverse_hessian_factor(hessian, perm, diag, damping, consume_hessian), perm, batch)
    result_scales = fixed if fixed is not None else _concat_block_scales(layout, columns.chosen_stored,
                                                                         global_scale)
    return GptqResult(values, result_scales, w, None if consume_hessian else hessian)


def _check_arguments(w: Tensor, hessian: Tensor, damping: float, act_order: bool, scales: str,
                     static_scales: bool | None) -> bool:
    """gptq_quantize's arguments checked; whether its scales are static."""
    if w.ndim != 2 or hessian.shape != (w.shape[1], w.shape[1]):
        raise ValueError(f"gptq_quantize: w [N, K] and hessian [K, K] needed, got {tuple(w.shape)} and "
                         f"{tuple(hessian.shape)}")
    if damping < 0:
        raise ValueError(f"damping must be >= 0, got {damping}")
    if scales not in SCALE_METHODS:
        raise ValueError(f"scales={scales!r} is not one of {SCALE_METHODS}")
    static = act_order if static_scales is None else static_scales
    if act_order and not static:
        raise ValueError("act_order needs static scales: its column order scatters every block")
    return static


def _global_scale(layout: WeightLayout, w: Tensor, scales: str, importance: Tensor,
                  given: Tensor | None) -> Tensor | None:
    """The per-tensor scale every block's scale multiplies (NVFP4's): `given`, or chosen from the source
    weight; None for formats without one."""
    if not layout.codec.takes_global_scale:
        return None
    if given is None:
        return choose_scales(layout, w, scales, importance).stored["weight_scale_2"]
    return given.float().reshape(())


def _inverse_hessian_factor(hessian: Tensor, perm: Tensor, diag: Tensor, damping: float,
                            consume_hessian: bool) -> Tensor:
    """U (H^-1 = U^T U, upper) of the damped Hessian in `perm`'s column order (_inverse_cholesky_upper);
    `consume_hessian`: computed in `hessian`'s own buffer."""
    damp = damping * float(diag.mean())
    # A = J P H P^T J (J the reversal, see _inverse_cholesky_upper): H in the chosen order, reversed
    reverse = perm.flip(0)
    if consume_hessian:
        if hessian.dtype != torch.float32 or not hessian.is_contiguous():
            raise ValueError("consume_hessian needs a contiguous float32 hessian")
        a = permute_symmetric_(hessian, reverse)
    else:
        a = hessian.float()[reverse.unsqueeze(1), reverse.unsqueeze(0)]  # one [K, K] copy
    return _inverse_cholesky_upper(a, diag[reverse] + damp, float(diag.mean()))  # dead inputs' diag is 1


class _GptqColumns:
    """GPTQ's column loop over one weight: static scales (`fixed`) or, when None, each block's scale chosen as
    the loop reaches its first column (then kept in `chosen_stored`, in block order)."""

    def __init__(self, layout: WeightLayout, scales: str, importance: Tensor, global_scale: Tensor | None,
                 fixed: Scales | None) -> None:
        self.layout, self.scales, self.importance, self.global_scale = layout, scales, importance, global_scale
        self.fixed = fixed
        self.chosen_stored: list[dict[str, Tensor]] = []

    def run(self, w: Tensor, upper: Tensor, perm: Tensor, batch: int) -> Tensor:
        """The quantized values [N, K] of w (fp32) in the original column order; `upper` is freed."""
        layout, dynamic = self.layout, self.fixed is None
        n_rows, k = w.shape
        bs = layout.block_size(k)
        multiplier = torch.zeros(n_rows, layout.num_blocks(k)) if dynamic else self.fixed.multiplier.clone()
        # one column-major [K, N] buffer: row `col` holds the column's working weights until it is quantized,
        # then its values; a lazy batch is [columns, N], so each column's rounding and rank-1 update read
        # contiguous rows (on an [N, K] layout every column is strided, several times slower for 4096+ rows)
        work = w.T[perm].contiguous()  # [K, N]
        block_of = perm // bs  # each permuted column's scale block
        multiplier_t = None if dynamic else multiplier.T.contiguous()  # [blocks, N]
        if dynamic:
            batch = max(bs, batch // bs * bs)  # a block never straddles two lazy batches
        for i1 in range(0, k, batch):
            i2 = min(i1 + batch, k)
            w1 = work[i1:i2].clone()
            err1 = torch.zeros_like(w1)
            u1 = upper[i1:i2, i1:i2]
            for i in range(i2 - i1):
                col = i1 + i
                if dynamic and col % bs == 0:  # first column of a block: choose its scale now
                    cols = slice(i, min(i + bs, i2 - i1))
                    part = choose_scales(layout, w1[cols].T, self.scales, self.importance[col: col + bs],
                                         self.global_scale)
                    multiplier[:, col // bs] = part.multiplier[:, 0]
                    self.chosen_stored.append(part.stored)
                m = multiplier[:, block_of[col]] if dynamic else multiplier_t[block_of[col]]
                q = layout.round_(w1[i] / m).mul_(m)
                work[col] = q
                e = (w1[i] - q) / u1[i, i]
                w1[i:] -= u1[i, i:].unsqueeze(1) * e.unsqueeze(0)
                err1[i] = e
            for r1 in range(i2, k, UPDATE_ROWS):  # the later columns, a slab at a time (no [K, N] temporary)
                r2 = min(r1 + UPDATE_ROWS, k)
                work[r1:r2] -= upper[i1:i2, r1:r2].T @ err1
        del upper
        values = work.T[:, torch.argsort(perm)]  # one [N, K] copy, unpermuted as it is gathered
        del work
        return values


def rtn_quantize(w: Tensor, layout: WeightLayout, hessian: Tensor | None = None, scales: str = "absmax") -> GptqResult:
    """Round to nearest with absmax or MSE scales (weighted by diag H when given): GPTQ's starting point."""
    importance = torch.diagonal(hessian).float() if hessian is not None else None
    chosen = choose_scales(layout, w.float(), scales, importance)
    values = layout.quantize(w.float(), chosen)
    return GptqResult(values, chosen, w, hessian)


def cholesky_in_place(a: Tensor) -> bool:
    """Factor a C-contiguous fp32 symmetric [K, K] `a` in place as a = U^T U, U upper triangular in `a`'s upper
    triangle (the strictly lower one keeps what it held); False when `a` is not positive definite.

    LAPACK's potrf through scipy: torch's Cholesky (even with out=) allocates a second [K, K], 0.8 GB at an 8B
    model's down_proj (K = 14336). The row-major buffer read column-major is its transpose, so LAPACK's lower
    factor L (a = L L^T) is torch's U = L^T."""
    from scipy.linalg import lapack  # lazy: about half a second to import, and only GPTQ factorizes

    with one_blas_thread():
        _, info = lapack.spotrf(a.numpy().T, lower=1, clean=0, overwrite_a=1)
    return info == 0


@contextmanager
def one_blas_thread() -> Iterator[None]:
    """scipy's LAPACK (OpenBLAS) on one thread for the block: a blocked factorization splits its updates among
    the BLAS threads, so U's last bits, and after them GPTQ's grid points, would depend on the thread count
    (tests/calibration/test_gptq.py). One thread costs the factorization its parallel speed-up: potrf and trtri
    take 0.68 s instead of 0.38 s at K = 4096 and 4.7 s instead of 2.4 s at K = 8192 on this project's 2 cores."""
    from threadpoolctl import threadpool_limits  # lazy: a tenth of a second to import, only for GPTQ

    with threadpool_limits(limits=1, user_api="blas"):
        yield


def _inverse_cholesky_upper(a: Tensor, diagonal: Tensor, diag_mean: float) -> Tensor:
    """Upper Cholesky factor U of H^-1 (H^-1 = U^T U) in fp32, computed in place in `a` = J H J (J the reversal
    of the order; a symmetric, C-contiguous fp32 [K, K] whose diagonal is ignored: `diagonal` [K] replaces it,
    plus `extra`, raised until H is positive definite); returns `a`, which then holds U (the strictly lower
    triangle zeroed).

    Reference GPTQ implementations factor H, invert it from the factor and factor the inverse (potrf, potri,
    potrf: 4/3 K^3). Here A = J H J is factored A = L L^T; then H^-1 = J L^-T L^-1 J = U^T U with
    U = J L^-1 J, which is upper triangular: potrf and trtri, 2/3 K^3 (K = 14336 at an 8B model's down_proj:
    10.6 s instead of 18 s on 2 cores, on two BLAS threads: `one_blas_thread` now runs it on one), and U
    never goes through the explicit inverse. LAPACK through scipy works in the buffer (torch's
    factorizations allocate a second [K, K]). The row-major buffer read
    column-major is its transpose, so LAPACK's upper (column-major) routines write L and then L^-1 in the
    buffer's lower triangle only: a failed try is undone from the untouched strict upper triangle
    (symmetric), so a retry needs no copy of H. Reversing the whole buffer (both axes at once) turns L^-1
    into U."""
    from scipy.linalg import lapack  # lazy: about half a second to import, and only GPTQ factorizes

    extra = 0.0
    for attempt in range(8):
        if attempt:
            _mirror_upper_(a)  # the failed factorization's lower triangle, restored
        torch.diagonal(a).copy_(diagonal + extra)
        with one_blas_thread():
            _, info = lapack.spotrf(a.numpy().T, lower=0, clean=0, overwrite_a=1)  # A = L L^T, L in the lower
            if info == 0:
                _, info = lapack.strtri(a.numpy().T, lower=0, overwrite_c=1)  # L^-1, in the same triangle
            if info == 0:
                _reverse_in_place(a)  # U = J L^-1 J, in the upper triangle
                return a.triu_()
        extra = max(extra * 10, 1e-6 * diag_mean)
    raise ValueError("gptq: the Hessian is not positive definite even with extra damping")


def _mirror_upper_(a: Tensor, rows: int = 256) -> None:
    """a's strictly lower triangle := its strictly upper one, transposed (a square, in place), a slab of `rows`
    rows at a time (no [K, K] temporary)."""
    for r1 in range(0, a.shape[0], rows):
        r2 = min(r1 + rows, a.shape[0])
        a[r1:r2, :r1] = a[:r1, r1:r2].T
        square = a[r1:r2, r1:r2]
        square.copy_(square.triu() + square.triu(1).T)


def permute_symmetric_(a: Tensor, perm: Tensor, rows: int = 256) -> Tensor:
    """a[perm][:, perm] in a's own buffer (a square and contiguous; returns a): the rows are moved along the
    permutation's cycles one row at a time, then each slab of `rows` rows is gathered along its columns. No
    [K, K] temporary (an 8B model's down_proj Hessian is 0.8 GB)."""
    k = a.shape[0]
    order = perm.tolist()
    if order == list(range(k)):
        return a
    if order == list(range(k - 1, -1, -1)):
        _reverse_in_place(a)
        return a
    seen = [False] * k
    for start in range(k):  # a[i] = old a[order[i]]: along each cycle i -> order[i] -> ...
        if seen[start] or order[start] == start:
            continue
        first = a[start].clone()
        i = start
        while True:
            seen[i] = True
            j = order[i]
            if j == start:
                a[i] = first
                break
            a[i] = a[j]
            i = j
    for r1 in range(0, k, rows):
        r2 = min(r1 + rows, k)
        a[r1:r2] = a[r1:r2][:, perm]
    return a


def _reverse_in_place(a: Tensor, chunk: int = 1 << 22) -> None:
    """Reverse a contiguous tensor's elements in place (for a row-major matrix: both axes flipped), a chunk at
    a time, so no second copy of it is made."""
    flat = a.numpy().reshape(-1)
    n = flat.shape[0]
    for start in range(0, n // 2, chunk):
        end = min(start + chunk, n // 2)
        head = flat[start:end].copy()
        flat[start:end] = flat[n - end:n - start][::-1]
        flat[n - end:n - start] = head[::-1]


def _concat_block_scales(layout: WeightLayout, parts: list[dict[str, Tensor]], global_scale: Tensor | None) -> Scales:
    stored = {"weight_scale": torch.cat([p["weight_scale"] for p in parts], dim=1)}
    if global_scale is not None:  # NVFP4's per-tensor scale
        stored["weight_scale_2"] = global_scale
    return Scales(*layout.codec.grid_scales(stored, layout.granularity, None))
