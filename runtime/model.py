"""The model the runtime executes: plain torch, fp32 on CPU, one small module per block.

Shapes: B batch, T new tokens, S cached tokens, C hidden, H heads, Hkv KV heads, D head dim.
Every linear is a `QuantLinear` holding the dequantized fp32 weight and the activation fake-quantizer its
format asks for, so a Triton kernel reading packed bytes can replace it one module at a time.
A fused linear (`qkv`, `gate_up`: passes/fuse.py) is one F.linear whose output is split. The kernel fusions a
layer's spec lists (norm + activation quantization, SwiGLU + quantization, RoPE + KV-cache write) are for GPU
kernels; here they run one operation after another, which is what they compute.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from kiln.kernels import gpu
from kiln.kernels.errors import KilnError
from kiln.kernels.formats import ActivationFormat
from kiln.kernels.registry import WEIGHT_FORMATS
from kiln.kernels.registry import weight_format as weight_format_object
from kiln.runtime.artifact import clip
from kiln.runtime.spec import AttentionSpec, LayerSpec, LinearSpec, MlpSpec, ModelSpec, RotarySpec
from kiln.runtime.weights import (
    InputTransform,
    check_dtype,
    check_finite,
    check_format,
    check_shape,
    dequantize_weight,
    input_scale_tensor,
    input_transform,
    malformed,
    need_tensor,
    stored_weight,
)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + e^-x), the same bits however torch splits x among its CPU threads.

    torch's CPU sigmoid and silu run a vectorized loop and a scalar one for the elements left over at the end
    of each thread's chunk, and the two round differently in the last bit; so which elements get which
    depends on the thread count, and a calibration that observes these activations (its Hessians, AWQ's
    search) stored other weights on two threads than on one. exp, add and divide agree in both loops."""
    if x.device.type != "cpu":
        return torch.sigmoid(x)
    if x.dtype in (torch.bfloat16, torch.float16):
        return sigmoid(x.float()).to(x.dtype)  # one rounding to the narrow type, as torch.sigmoid does
    return 1 / (_exp_neg(x) + 1)  # out of place: the tuning differentiates through it


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) as x / (1 + e^-x): thread-count independent on the CPU (see `sigmoid`)."""
    if x.device.type != "cpu":
        return F.silu(x)
    if x.dtype in (torch.bfloat16, torch.float16):
        return silu(x.float()).to(x.dtype)
    return x / (_exp_neg(x) + 1)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (Gemma's GeGLU gate, transformers' gelu_pytorch_tanh), as
    x * sigmoid(2u) = x / (1 + e^-2u), u = sqrt(2/pi) (x + 0.044715 x^3), which is 0.5 x (1 + tanh u): thread-count
    independent on the CPU (see `sigmoid`); within fp32 rounding of F.gelu(x, approximate="tanh")."""
    if x.device.type != "cpu":
        return F.gelu(x, approximate="tanh")
    if x.dtype in (torch.bfloat16, torch.float16):
        return gelu_tanh(x.float()).to(x.dtype)
    u = (2 * _SQRT_2_OVER_PI) * (x + 0.044715 * x * x * x)
    return x / (_exp_neg(u) + 1)


_SQRT_2_OVER_PI = 0.7978845608028654
GATE_ACTIVATIONS = {"silu": silu, "gelu_tanh": gelu_tanh}
"""MlpSpec.activation -> the function (runtime.spec.ACTIVATIONS)."""


def _exp_neg(x: torch.Tensor) -> torch.Tensor:
    """e^-x with the exponent capped at 88 (e^88 = 1.7e38, under fp32's maximum): e^-x stays finite, so its
    gradient is never 0 * inf = NaN for x < -88.7. Below -88 sigmoid is then under 1e-38 and silu is x e^-88
    (-6e-9 at x = -1e30, where F.silu gives -0)."""
    return torch.exp(torch.clamp(-x, max=88.0))


class RMSNorm(nn.Module):
    """x / rms(x) times the weight; with an `offset` (Gemma: 1.0) times (offset + weight), in fp32 and then cast,
    as transformers' Gemma3RMSNorm. The stored weight stays what the checkpoint holds: a pass that tunes or folds
    into it works on that."""

    def __init__(self, weight: torch.Tensor, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(weight.float(), requires_grad=False)
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (h * (self.offset + self.weight.float())).to(x.dtype)
        # scaled in the weight's dtype (the model's compute dtype), as transformers' LlamaRMSNorm
        return self.weight * h.to(self.weight.dtype)


class QuantLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 input_quantizer: Callable[[torch.Tensor], torch.Tensor] | None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out, in] fp32
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.input_quantizer = input_quantizer
        self.onednn: torch.Tensor | None = None  # prepack_onednn()
        self.onednn_handle = -1

    def prepack_onednn(self) -> int:
        """Keep a copy of the weight in oneDNN's blocked layout too, through which every product on the CPU is
        faster than MKL's from the dense weight (ONEDNN_BATCH_HINT); the bytes it adds (0: not this linear: one
        with an input quantizer, not fp32, or not on the CPU)."""
        w = self.weight
        if self.input_quantizer is not None or w.dtype != torch.float32 or w.device.type != "cpu":
            return 0
        self.onednn = torch.ops.mkldnn._reorder_linear_weight(w.detach(), ONEDNN_BATCH_HINT)
        self.onednn_handle = next(_ONEDNN_HANDLES)
        _ONEDNN_LINEARS[self.onednn_handle] = self
        return w.numel() * w.element_size()

    def drop_onednn(self) -> None:
        """Free the oneDNN copy, if any: products go through the dense weight again (equal within fp32
        rounding)."""
        _ONEDNN_LINEARS.pop(self.onednn_handle, None)
        self.onednn, self.onednn_handle = None, -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_quantizer is not None:
            x = self.input_quantizer(x).to(self.weight.dtype)
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if self.onednn is not None and x.device.type == "cpu" and x.dtype == torch.float32 and rows \
                and not (x.requires_grad and torch.is_grad_enabled()):  # (the op has no backward)
            # compiled: one opaque op around the same product, so a compiled step multiplies as an eager one
            product = torch.ops.kiln.onednn_linear if torch.compiler.is_compiling() else onednn_product
            out = product(x.reshape(rows, -1), self.onednn_handle).view(*x.shape[:-1], -1)
            return out if self.bias is None else out + self.bias
        if SKINNY_ROWS[0] <= rows <= SKINNY_ROWS[1] and x.device.type == "cpu":
            # a decode step's few rows without a oneDNN copy: W @ x^T streams the weight through MKL ~30% faster
            # on CPU than x @ W^T (benchmarks/decode.py; equal within fp32 rounding)
            out = torch.mm(self.weight, x.reshape(rows, -1).t()).t().contiguous().view(*x.shape[:-1], -1)
            return out if self.bias is None else out + self.bias
        return F.linear(x, self.weight, self.bias)


_ONEDNN_HANDLES = itertools.count()
_ONEDNN_LINEARS: weakref.WeakValueDictionary[int, QuantLinear] = weakref.WeakValueDictionary()
"""QuantLinears with a oneDNN copy, by handle (`kiln::onednn_linear` takes the handle: oneDNN tensors do not
trace)."""


def available_memory() -> int:
    """Bytes of memory still available (Linux MemAvailable; elsewhere 0, so nothing optional is allocated)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def onednn_fits(linear_bytes: int) -> bool:
    """Whether oneDNN copies of `linear_bytes` of fp32 linears may be kept: oneDNN is built in, and they fit a
    quarter of the memory still available (they double the linears' bytes)."""
    return torch.backends.mkldnn.is_available() and 0 < linear_bytes <= available_memory() // 4


def prepack_onednn(module: nn.Module) -> int:
    """QuantLinear.prepack_onednn for every QuantLinear in `module` (itself included); the bytes added."""
    return sum(m.prepack_onednn() for m in module.modules() if isinstance(m, QuantLinear))


ONEDNN_BATCH_HINT = 8
"""The rows oneDNN lays a prepacked weight out for (torch.ops.mkldnn._reorder_linear_weight). One thread on this
project's AMD EPYC (AVX-512), SmolLM2's linears out of cache, ms for the 210 of one step: 1 row 15.0, 2-4 rows
17.2, 8 rows 21.1, 32 rows 43.7, 1024 rows 1039; MKL from the dense weight: 21 (two columns), 20-24, 46, 93, 2239
(hint 1 or 32: slower at every row count but 32 rows)."""

SKINNY_ROWS = (2, 32)
"""Row counts (batch x tokens) for which a QuantLinear without a oneDNN copy multiplies as W @ x^T on CPU;
F.linear outside them (one row: the two are equally fast; many rows: a regular GEMM)."""


def onednn_product(x: torch.Tensor, handle: int) -> torch.Tensor:
    """x [rows, K] @ weight^T in fp32 through the oneDNN copy of QuantLinear `handle` (prepack_onednn)."""
    return torch.ops.mkldnn._linear_pointwise(x, _ONEDNN_LINEARS[handle].onednn, None, "none", [], "")


@torch.library.custom_op("kiln::onednn_linear", mutates_args=())
def _onednn_linear(x: torch.Tensor, handle: int) -> torch.Tensor:
    return onednn_product(x, handle)


@_onednn_linear.register_fake
def _(x, handle):
    return x.new_empty(x.shape[0], _ONEDNN_LINEARS[handle].weight.shape[0])


class PackedLinear(nn.Module):
    """A linear that keeps its weight as the artifact stores it and multiplies through kiln.kernels.gpu: a
    Triton kernel on CUDA tensors (or on CPU under TRITON_INTERPRET=1), else that kernel's torch reference.

    FP8 weights (bytes and a per-tensor or per-channel scale) with FP8 activations run the W8A8 GEMM; without
    activation quantization (W8A16) the weight is dequantized for each product, in the activation's dtype.
    NVFP4/MXFP4 weights (nibbles and block scales) run the W4A16 GEMM, or W4A4 with activations in the weight's
    own format; MXFP6 weights (E2M3 codes, four in three bytes, and E8M0 block scales) the W6A16 GEMM. What it computes is QuantLinear's product on the dequantized weight, within fp32 rounding."""

    def __init__(self, weight_format: str, tensors: Mapping[str, torch.Tensor], in_features: int,
                 activation: str, input_scale: torch.Tensor | None, bias: torch.Tensor | None,
                 rotation: InputTransform | None):
        super().__init__()
        self.weight_format, self.activation, self.rotation = weight_format, activation, rotation
        self.codec = weight_format_object(weight_format)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.register_buffer("input_scale", None if input_scale is None else input_scale.float().reshape(()))
        # the weight as the format's kernel takes it (Fp8Weight, Nvfp4Weight, ...); its tensors are buffers
        self.packed_weight = self.codec.packed_weight(tensors, in_features)
        for name, value in vars(self.packed_weight).items():
            if isinstance(value, torch.Tensor):
                self.register_buffer(f"packed_{name}", value)

    def _apply(self, fn, recurse=True):  # .to(device) moves the packed weight's tensors with the buffers
        super()._apply(fn, recurse)
        if getattr(self, "packed_weight", None) is not None:
            # the same checked values, moved (re-checking them would read every block scale back to the host)
            fields = {f.name: getattr(self.packed_weight, f.name) for f in dataclasses.fields(self.packed_weight)}
            fields.update({name[len("packed_"):]: buffer for name, buffer in self.named_buffers(recurse=False)
                           if name.startswith("packed_")})
            self.packed_weight = gpu.unchecked_weight(type(self.packed_weight), **fields)
        return self

    @property
    def stored_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype  # the output's: the rotation computes in fp32
        if self.rotation is not None:
            x = self.rotation.rotate(x).to(dtype)
        out = gpu.packed_linear(self.codec.gpu_kernel, x, self.packed_weight, self.activation,
                                self.input_scale).to(dtype)
        return out if self.bias is None else out + self.bias.to(dtype)


PACKED_ACTIVATIONS = {name: codec.activations for name, codec in WEIGHT_FORMATS.items() if codec.activations}
"""The activation formats PackedLinear runs with each stored weight format (the kernels' combinations)."""


class Weights:
    """Resolves module names to runtime modules from the artifact's tensors and format table.

    Every tensor is checked against the spec as it is resolved (presence, shape, dtype, finite values), so an
    artifact whose tensors disagree with its architecture is refused at load with one line naming the tensor,
    rather than failing inside a matmul at the first forward."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], formats: Mapping[str, Mapping], spec: ModelSpec,
                 packed: bool = False):
        self.tensors = tensors
        self.formats = formats
        self.spec = spec
        self.norm_sizes = spec.norms()
        self.packed = packed  # PackedLinear where the stored format has a kernel (PACKED_ACTIVATIONS)
        self._embedding: torch.Tensor | None = None

    @property
    def embedding_entry(self) -> Mapping | None:
        """The embedding table's format entry when it is stored quantized (passes/embedding_quant.py), else None."""
        entry = self.formats.get(self.spec.embedding.removesuffix(".weight"))
        return None if entry is None or entry.get("format") == "dense" else entry

    def embedding(self) -> torch.Tensor:
        """The [vocab, hidden] embedding table in fp32, checked; a quantized one dequantized once (its exact stored
        values). Every caller gets this one tensor, so a tied lm_head and the lookup share its memory."""
        if self._embedding is None:
            shape = (self.spec.vocab_size, self.spec.hidden_size)
            entry = self.embedding_entry
            self._embedding = (self.tensor(self.spec.embedding, shape, "the embedding") if entry is None else
                               dequantize_weight(self.spec.embedding.removesuffix(".weight"), entry, self.tensors,
                                                 shape))
        return self._embedding

    def tensor(self, name: str, shape: tuple[int, ...] | None, what: str) -> torch.Tensor:
        """A plain floating tensor (embedding, norm, bias, router bias) as fp32, checked: present, floating
        point, of `shape` (None: any), finite."""
        t = need_tensor(self.tensors, name)
        check_dtype(name, t, what)
        if shape is not None:
            check_shape(name, t, shape)
        check_finite(name, t)
        return t.float()

    def linear(self, lin: LinearSpec, packable: bool = True) -> QuantLinear | PackedLinear:
        """The runtime module of linear `lin`: PackedLinear when this Weights packs, `packable` is True and the
        stored format has a kernel; else QuantLinear over the dequantized weight."""
        name = lin.name
        entry = self.formats.get(name, {"format": "dense"})
        fmt = check_format(name, entry)
        shape = (lin.out_features, lin.in_features)
        bias = self.tensor(f"{name}.bias", (lin.out_features,), "a bias") if lin.bias else None
        tied = name == "lm_head" and self.spec.lm_head_tied(self.tensors)
        activation = entry.get("activation", ActivationFormat.NONE)
        if self.packed and packable and not tied and activation in PACKED_ACTIVATIONS.get(fmt, ()):
            return self._packed(name, entry, shape, activation, bias)
        table = self.embedding_entry if tied else None
        if (self.packed and packable and table is not None
                and ActivationFormat.NONE in PACKED_ACTIVATIONS.get(table["format"], ())):
            # a quantized tied table: the head's GEMM reads its stored bytes, as any weight-only linear's
            return self._packed(self.spec.embedding.removesuffix(".weight"), table, shape, ActivationFormat.NONE, bias)
        if tied:
            weight = self.embedding()
        else:
            weight = dequantize_weight(name, entry, self.tensors, shape)
        return QuantLinear(weight, bias, input_transform(name, entry, self.tensors))

    def _packed(self, name: str, entry: Mapping, shape: tuple[int, int], activation: str,
                bias: torch.Tensor | None) -> PackedLinear:
        fmt, stored, in_features = stored_weight(name, entry, self.tensors, shape)
        for key, value in stored.items():  # the scales (the codes are finite by construction)
            if key != "weight":
                check_finite(f"{name}.{key}", value.float())
        transform = input_transform(name, entry, self.tensors)
        rotation = transform if transform is not None and transform.rotation_block else None
        takes_scale = activation in (ActivationFormat.FP8_STATIC_PER_TENSOR, ActivationFormat.NVFP4)
        input_scale = input_scale_tensor(name, self.tensors, activation) if takes_scale else None
        try:
            return PackedLinear(fmt, stored, in_features if in_features is not None else shape[1], activation,
                                input_scale, bias, rotation)
        except (ValueError, TypeError) as exc:  # the FP4 weight classes' own layout checks
            raise malformed(name, fmt, exc) from None

    def norm(self, name: str) -> RMSNorm:
        size = self.norm_sizes.get(name)
        return RMSNorm(self.tensor(name, None if size is None else (size,), "a norm weight"),
                       self.spec.rms_norm_eps, self.spec.norm_offset)


class Rotary(nn.Module):
    """cos/sin tables of one RotarySpec for given positions (fp32; apply_rope casts them to the activations')."""

    def __init__(self, spec: RotarySpec):
        super().__init__()
        self.register_buffer("inv_freq", torch.tensor(spec.inv_freq, dtype=torch.float32), persistent=False)
        self.attention_scaling = spec.attention_scaling

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


class LayerRotaries(nn.Module):
    """Each layer's rotary tables for one forward: layers with the same RotarySpec share one computation."""

    def __init__(self, layers):
        super().__init__()
        specs = [layer.attention.rotary for layer in layers]
        distinct = list(dict.fromkeys(specs))
        self.index = [distinct.index(spec) for spec in specs]
        self.rotaries = nn.ModuleList(Rotary(spec) for spec in distinct)

    def forward(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        tables = [rotary(positions) for rotary in self.rotaries]
        return [tables[i] for i in self.index]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    # x: [B, T, H, D]; cos/sin: [B, T, D] (fp32, applied in x's dtype)
    cos, sin = cos.unsqueeze(2).to(x.dtype), sin.unsqueeze(2).to(x.dtype)
    if interleaved:
        # DeepSeek: pairs (x0, x1), (x2, x3), ...; output de-interleaved as transformers does
        half = cos.shape[-1] // 2
        cos, sin = cos[..., :half], sin[..., :half]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return x * cos + _rotate_half(x) * sin


def step_mask(cache, positions: torch.Tensor, key_positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """The cache's explicit mask for this forward (tree verification: each node sees the cached prefix and its
    own ancestors; a window layer only those in its window), else causal by position."""
    explicit = getattr(cache, "explicit_mask", None) if cache is not None else None
    memo = getattr(cache, "step_masks", None)  # a paged cache keeps the masks of the prepared forward
    if explicit is not None:
        if window is None:
            return explicit
        # a window layer sees only its window, counted in model positions (a tree node's key is at its depth's)
        if ("explicit", window) not in memo:
            keys = cache.explicit_key_positions
            memo["explicit", window] = explicit & attention_mask(positions, keys, window)
        return memo["explicit", window]
    if memo is None:
        return attention_mask(positions, key_positions, window)
    if window not in memo:
        mask = attention_mask(positions, key_positions, window)
        # on CPU an all-true mask is dropped (e.g. one sequence decoding: SDPA runs faster without one); on a GPU
        # that test would cost a host sync every forward
        memo[window] = None if mask.device.type == "cpu" and bool(mask.all()) else mask
    return memo[window]


def attention_mask(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None) -> torch.Tensor:
    # [B, 1, T, S]: a query attends keys at positions <= its own (and within the sliding window)
    q = query_positions[:, None, :, None]
    k = key_positions[:, None, None, :]
    mask = k <= q
    if window is not None:
        mask &= k > q - window
    return mask


class GqaAttention(nn.Module):
    def __init__(self, spec: AttentionSpec, weights: Weights, layer_prefix: str):
        super().__init__()
        self.spec = spec
        self.o_proj = weights.linear(spec.linears["o"])
        if "qkv" in spec.linears:  # fused (passes/fuse.py): one GEMM, its output split into q, k, v
            sizes = (spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim,
                     spec.num_kv_heads * spec.v_head_dim)
            self.qkv_split = fused_split(spec.linears["qkv"], ("q", "k", "v"), sizes)
            self.qkv_proj = weights.linear(spec.linears["qkv"])
        else:
            self.qkv_proj = None
            self.q_proj = weights.linear(spec.linears["q"])
            self.k_proj, self.v_proj = _projection(spec, weights, "k"), _projection(spec, weights, "v")
        self.q_norm = weights.norm(f"{layer_prefix}.self_attn.q_norm.weight") if spec.qk_norm else None
        self.k_norm = weights.norm(f"{layer_prefix}.self_attn.k_norm.weight") if spec.qk_norm else None
        # what the paged decode kernel serves: head dims a power of two >= 32, K's and V's equal, no window
        d = spec.head_dim
        self.kernel_decodes = (d >= 32 and not d & (d - 1) and spec.v_head_dim == d and spec.sliding_window is None
                               and spec.num_heads % spec.num_kv_heads == 0)

    def stream_shapes(self) -> tuple[tuple[int, int], ...]:
        return ((self.spec.num_kv_heads, self.spec.head_dim), (self.spec.num_kv_heads, self.spec.v_head_dim))

    def forward(self, x, rope, positions, cache, layer):
        B, T, _ = x.shape
        s = self.spec
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split(self.qkv_split, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(B, T, s.num_heads, s.head_dim)
        k = k.view(B, T, s.num_kv_heads, s.head_dim)
        v = v.view(B, T, s.num_kv_heads, s.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.kernel_decodes and cache is not None and getattr(cache, "decode_kernel", False):
            out = cache.decode_attention(layer, q, (k, v), s.softmax_scale)  # reads the pools as stored
            return self.o_proj(out.reshape(B, T, s.num_heads * s.v_head_dim))
        key_positions = positions
        if cache is not None:
            k, v = cache.update(layer, (k, v), positions)
            key_positions = torch.arange(k.shape[1], device=k.device).expand(B, -1)
        out = _attend(q, k, v, step_mask(cache, positions, key_positions, s.sliding_window), s.softmax_scale)
        return self.o_proj(out.reshape(B, T, s.num_heads * s.v_head_dim))


def fused_split(lin: LinearSpec, roles: tuple[str, ...], sizes: tuple[int, ...]) -> tuple[int, ...]:
    """The output widths a fused linear's output splits into, checked against what the layer needs: its parts
    must have `roles` and `sizes` in that order and add up to its output (a one-line KilnError otherwise)."""
    got = tuple((p.role, p.out_features) for p in lin.parts)
    if got != tuple(zip(roles, sizes, strict=True)) or sum(sizes) != lin.out_features:
        raise KilnError(f"artifact's fused linear {clip(lin.name)} has parts {clip(got, 120)} and "
                        f"{lin.out_features} outputs; the layer needs {tuple(zip(roles, sizes, strict=True))}")
    return sizes


def _projection(spec: AttentionSpec, weights: Weights, role: str) -> nn.Module:
    """K or V: one linear, or a low-rank pair `{role}_down` [r, hidden] then `{role}_up` [kv dim, r] that a
    structural pass put in its place (the cache still holds the full K/V)."""
    if role in spec.linears:
        return weights.linear(spec.linears[role])
    return nn.Sequential(weights.linear(spec.linears[f"{role}_down"]), weights.linear(spec.linears[f"{role}_up"]))


class MlaAttention(nn.Module):
    """DeepSeek-V3 multi-head latent attention; the cache holds the normed latent and the roped key part.

    Two equal ways to attend (tests hold them within 1e-5 of each other and of transformers'):
      expanded  kv_b_proj turns every key's latent into per-head K_nope and V, then plain attention: for
                prefill and scoring, where the new tokens are all the keys;
      absorbed  W_uk (kv_b's K rows) folds into the query and W_uv (its V rows) applies after the weighted sum
                of latents, so a step never expands the cache: per head, S x (rank + rope) multiply-adds for
                the scores and S x rank for the output, whatever the heads' dims. Used when the cache already
                holds tokens before the new ones (decode, chunked prefill, draft verification).
    `absorb` None chooses as above; True / False forces one (tests)."""

    def __init__(self, spec: AttentionSpec, weights: Weights, layer_prefix: str):
        super().__init__()
        self.spec = spec
        lin = spec.linears
        p = f"{layer_prefix}.self_attn"
        if spec.q_lora_rank is None:
            self.q_proj = weights.linear(lin["q"])
        else:
            self.q_a_proj = weights.linear(lin["q_a"])
            self.q_a_layernorm = weights.norm(f"{p}.q_a_layernorm.weight")
            self.q_b_proj = weights.linear(lin["q_b"])
        self.kv_a_proj = weights.linear(lin["kv_a"])
        self.kv_a_layernorm = weights.norm(f"{p}.kv_a_layernorm.weight")
        # never packed: absorbed decode reads kv_b's weight per head (W_uk into the query, W_uv after the mix)
        self.kv_b_proj = weights.linear(lin["kv_b"], packable=False)
        self.o_proj = weights.linear(lin["o"])
        self.absorb: bool | None = None
        # the absorbed decode kernel reads raw latents: no activation quantizer or bias on kv_b to apply first
        self.kernel_decodes = (getattr(self.kv_b_proj, "input_quantizer", None) is None
                               and self.kv_b_proj.bias is None)

    def stream_shapes(self) -> tuple[tuple[int, int], ...]:
        return ((1, self.spec.kv_lora_rank), (1, self.spec.qk_rope_head_dim))

    def forward(self, x, rope, positions, cache, layer):
        B, T, _ = x.shape
        s = self.spec
        H, nope, rope_dim = s.num_heads, s.qk_nope_head_dim, s.qk_rope_head_dim
        if s.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, T, H, nope + rope_dim)
        q_pass, q_rot = q.split([nope, rope_dim], dim=-1)
        latent, k_rot = self.kv_a_proj(x).split([s.kv_lora_rank, rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent).view(B, T, 1, s.kv_lora_rank)
        cos, sin = rope
        q_rot = apply_rope(q_rot, cos, sin, s.rotary.interleaved)
        k_rot = apply_rope(k_rot.view(B, T, 1, rope_dim), cos, sin, s.rotary.interleaved)
        if self.kernel_decodes and cache is not None and getattr(cache, "decode_kernel", False):
            w = self.kv_b_proj.weight.view(H, nope + s.v_head_dim, s.kv_lora_rank)
            q_latent = torch.einsum("bthn,hnr->bthr", q_pass, w[:, :nope])
            mixed = cache.decode_attention(layer, (q_latent, q_rot), (latent, k_rot), s.softmax_scale)
            out = torch.einsum("bthr,hvr->bthv", mixed, w[:, nope:])
            return self.o_proj(out.reshape(B, T, H * s.v_head_dim))
        key_positions = positions
        if cache is not None:
            latent, k_rot = cache.update(layer, (latent, k_rot), positions)
            key_positions = torch.arange(latent.shape[1], device=latent.device).expand(B, -1)
        S = latent.shape[1]
        mask = step_mask(cache, positions, key_positions, None)
        absorb = self.absorb if self.absorb is not None else (cache is not None and S > T)
        if absorb and self.kv_b_proj.bias is None:
            out = self._absorbed(q_pass, q_rot, latent.view(B, S, s.kv_lora_rank), k_rot.view(B, S, rope_dim), mask)
        else:
            kv = self.kv_b_proj(latent.view(B, S, s.kv_lora_rank)).view(B, S, H, nope + s.v_head_dim)
            k_pass, v = kv.split([nope, s.v_head_dim], dim=-1)
            k = torch.cat([k_pass, k_rot.expand(B, S, H, rope_dim)], dim=-1)
            q = torch.cat([q_pass, q_rot], dim=-1)
            out = _attend(q, k, v, mask, s.softmax_scale)
        return self.o_proj(out.reshape(B, T, H * s.v_head_dim))

    def _absorbed(self, q_pass, q_rot, latent, k_rot, mask):
        # q_pass [B, T, H, nope], q_rot [B, T, H, rope], latent [B, S, r], k_rot [B, S, rope] -> [B, T, H, v]
        # One-KV-head attention in latent space: queries [W_uk q_nope, q_rot], the key [latent, k_rot], the
        # value the latent itself; W_uv then maps each head's mix of latents to its values.
        s = self.spec
        w = self.kv_b_proj.weight.view(s.num_heads, s.qk_nope_head_dim + s.v_head_dim, s.kv_lora_rank)
        if self.kv_b_proj.input_quantizer is not None:  # kv_b's activation format acts on each latent row
            latent = self.kv_b_proj.input_quantizer(latent)
        B, T, H = q_pass.shape[:3]
        q_latent = torch.einsum("bthn,hnr->bthr", q_pass, w[:, : s.qk_nope_head_dim])
        # every head reads the same key and value: the T x H queries attend as the rows of one head
        rows_mask = None if mask is None else mask.repeat_interleave(H, dim=2)  # [B, 1, T * H, S]
        if T == 1:
            mixed = _latent_decode(q_latent.view(B, H, -1), q_rot.reshape(B, H, -1), latent, k_rot,
                                   None if rows_mask is None else rows_mask[:, 0], s.softmax_scale)
        else:  # SDPA: a chunk of queries never materialises its [T x H, S] scores on the fused backends
            q = torch.cat([q_latent, q_rot], dim=-1).reshape(B, 1, T * H, -1)
            k = torch.cat([latent, k_rot], dim=-1).unsqueeze(1)  # [B, 1, S, r + rope]
            mixed = F.scaled_dot_product_attention(q, k, latent.unsqueeze(1), attn_mask=rows_mask,
                                                   scale=s.softmax_scale)
        return torch.einsum("bthr,hvr->bthv", mixed.view(B, T, H, -1), w[:, s.qk_nope_head_dim:])


def _latent_decode(q_latent, q_rot, latent, k_rot, mask, scale):
    """One decode step of absorbed MLA: q_latent [B, H, r], q_rot [B, H, rope], latent [B, S, r], k_rot
    [B, S, rope], mask [B, H, S] (True: attend) or None -> [B, H, r]. The latent and rotary scores are two
    batched matmuls into one buffer: no [S, r + rope] key is concatenated per step, which costs SDPA 2-3x on a
    CPU at decode shapes. A row with nothing to attend gives zeros, as SDPA does."""
    scores = torch.baddbmm(torch.bmm(q_rot, k_rot.transpose(1, 2)), q_latent, latent.transpose(1, 2))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores * scale, dim=-1)
    if mask is not None:
        probs = probs.nan_to_num(0.0)
    return torch.bmm(probs, latent)


def _attend(q, k, v, mask, scale):
    # q: [B, T, H, D]; k: [B, S, Hkv, D]; v: [B, S, Hkv, Dv]; mask: [B, 1, T, S] -> [B, T, H, Dv]
    # GQA: each KV head serves H / Hkv query heads without being copied (SDPA's enable_gqa)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)


class DenseMlp(nn.Module):
    """A gated MLP: down(act(gate(x)) * up(x)), act SiLU (SwiGLU) or tanh GELU (GeGLU)."""

    def __init__(self, linears: Mapping[str, LinearSpec], weights: Weights, prefix: str = "",
                 activation: str = "silu"):
        super().__init__()
        self.act = GATE_ACTIVATIONS[activation]
        down = linears[f"{prefix}down"]
        fused = linears.get(f"{prefix}gate_up")
        if fused is not None:  # passes/fuse.py: one GEMM, its output split into gate and up
            self.gate_up_split = fused_split(fused, ("gate", "up"), (down.in_features, down.in_features))
            self.gate_up_proj = weights.linear(fused)
        else:
            self.gate_up_proj = None
            self.gate_proj = weights.linear(linears[f"{prefix}gate"])
            self.up_proj = weights.linear(linears[f"{prefix}up"])
        self.down_proj = weights.linear(down)

    def forward(self, x):
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).split(self.gate_up_split, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act(gate) * up)


class MoeMlp(nn.Module):
    def __init__(self, spec: MlpSpec, weights: Weights):
        super().__init__()
        self.spec = spec
        self.router = weights.linear(spec.linears["router"])
        self.experts = nn.ModuleList(DenseMlp(e, weights, activation=spec.activation) for e in spec.experts)
        self.shared = (DenseMlp(spec.linears, weights, "shared_", spec.activation) if "shared_down" in spec.linears
                       else None)
        self.shared_gate = weights.linear(spec.linears["shared_gate_router"]) if spec.shared_expert_gate else None
        bias = spec.score_correction_bias
        self.register_buffer("score_bias", weights.tensor(bias, (len(spec.experts),), "a router bias")
                             if bias and bias in weights.tensors else None)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [N, C] -> (weights [N, k], expert indices [N, k])
        s = self.spec
        logits = self.router(x).float()
        if s.routing == "softmax_topk":
            probs = logits.softmax(dim=-1)
            top_w, top_i = probs.topk(s.top_k, dim=-1)
            if s.norm_topk_prob:
                top_w = top_w / top_w.sum(dim=-1, keepdim=True)
            return top_w, top_i
        scores = sigmoid(logits)
        choice = scores + self.score_bias if self.score_bias is not None else scores
        n, E = choice.shape
        group_scores = choice.view(n, s.n_group, E // s.n_group).topk(min(2, E // s.n_group), dim=-1)[0].sum(-1)
        group_idx = group_scores.topk(s.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(n, s.n_group, E // s.n_group).reshape(n, E)
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        top_i = choice.topk(s.top_k, dim=-1, sorted=False)[1]
        top_w = scores.gather(1, top_i)
        if s.norm_topk_prob:
            top_w = top_w / (top_w.sum(dim=-1, keepdim=True) + 1e-20)
        return top_w * s.routed_scaling_factor, top_i

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        top_w, top_i = self.route(x)
        out = torch.zeros_like(x)
        for e in top_i.unique().tolist():
            token, slot = (top_i == e).nonzero(as_tuple=True)
            out.index_add_(0, token, self.experts[e](x[token]) * top_w[token, slot, None])
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                shared = shared * sigmoid(self.shared_gate(x))
            out = out + shared
        return out.view(shape)


class Block(nn.Module):
    """Pre-norm residual block; with output norms (Gemma's sandwich), each sublayer's output is normed before
    its residual add."""

    def __init__(self, attention: nn.Module, mlp: nn.Module, input_norm: RMSNorm, post_norm: RMSNorm,
                 output_norms: tuple[RMSNorm, RMSNorm] | None = None):
        super().__init__()
        self.attention, self.mlp = attention, mlp
        self.input_norm, self.post_norm = input_norm, post_norm
        self.attention_out_norm, self.mlp_out_norm = output_norms if output_norms is not None else (None, None)

    def forward(self, x, rope, positions, cache, layer):
        if self.attention_out_norm is None:
            x = x + self.attention(self.input_norm(x), rope, positions, cache, layer)
            return x + self.mlp(self.post_norm(x))
        x = x + self.attention_out_norm(self.attention(self.input_norm(x), rope, positions, cache, layer))
        return x + self.mlp_out_norm(self.mlp(self.post_norm(x)))


def build_block(layer: LayerSpec, weights: Weights) -> Block:
    """One decoder layer as its spec says (a model may mix GQA and MLA layers, dense and MoE MLPs)."""
    a = layer.attention
    attention = MlaAttention(a, weights, layer.prefix) if a.kind == "mla" else GqaAttention(a, weights, layer.prefix)
    if layer.mlp.kind == "dense":
        mlp = DenseMlp(layer.mlp.linears, weights, activation=layer.mlp.activation)
    else:
        mlp = MoeMlp(layer.mlp, weights)
    output_norms = tuple(weights.norm(name) for name in layer.output_norms) or None
    return Block(attention, mlp, weights.norm(layer.norms[0]), weights.norm(layer.norms[1]), output_norms)


def place(module: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Move `module` to `device`, its floating parameters (embedding, norms, dequantized weights, biases) to the
    compute `dtype`; buffers (packed weight bytes and their scales, rotary frequencies) keep their dtypes.
    Parameters that share storage (an lm_head tied to the embedding) still share one copy after."""
    moved: dict[tuple, torch.Tensor] = {}  # by storage: one copy of what several parameters view
    replaced: dict[int, nn.Parameter] = {}  # by parameter: a module shared by two owners is replaced once
    for owner in module.modules():
        for name, param in owner.named_parameters(recurse=False):
            if id(param) not in replaced:
                replaced[id(param)] = param
                if param.is_floating_point() and (param.device != device or param.dtype != dtype):
                    key = (param.data_ptr(), param.device, tuple(param.shape), param.stride(), param.dtype)
                    if key not in moved:
                        moved[key] = param.detach().to(device, dtype)
                    replaced[id(param)] = nn.Parameter(moved[key], requires_grad=False)
            setattr(owner, name, replaced[id(param)])
    return module.to(device)  # the buffers


def scale_embedding(rows: torch.Tensor, scale: float) -> torch.Tensor:
    """Embedding rows times `scale` (ModelSpec.embedding_scale) as an fp32 scalar cast to the rows' dtype, as
    transformers' Gemma3TextScaledWordEmbedding."""
    return rows if scale == 1.0 else rows * torch.tensor(scale, dtype=torch.float32).to(rows.dtype)


class Transformer(nn.Module):
    """The whole model. Built from the artifact's tensors and format table, or from a `Weights` the caller
    made (the calibrator passes one that records which module each linear became). `packed`: linears keep
    their stored bytes and run kiln.kernels.gpu (PackedLinear) where their format has a kernel."""

    def __init__(self, spec: ModelSpec, tensors: Mapping[str, torch.Tensor] | None = None,
                 formats: Mapping[str, Mapping] | None = None, *, weights: Weights | None = None,
                 packed: bool = False):
        super().__init__()
        self.spec = spec
        weights = weights if weights is not None else Weights(tensors, formats, spec, packed)
        self.embed = nn.Parameter(weights.embedding(), requires_grad=False)
        self.rotary = LayerRotaries(spec.layers)
        self.blocks = nn.ModuleList(build_block(layer, weights) for layer in spec.layers)
        self.norm = weights.norm(spec.final_norm)
        self.lm_head = weights.linear(spec.lm_head)

    def stream_shapes(self) -> list[tuple[tuple[int, int], ...]]:
        return [b.attention.stream_shapes() for b in self.blocks]

    def place(self, device: torch.device, dtype: torch.dtype) -> Transformer:
        """On `device`, computing in `dtype` (see `place`): fp32 on CPU is the reference."""
        return place(self, device, dtype)

    def features(self, tokens: torch.Tensor, positions: torch.Tensor, cache=None,
                 collect: tuple[int, ...] = ()):
        """tokens, positions: [B, T] -> the last layer's output before the final norm [B, T, C] (what an MTP
        layer or a draft head reads: transformers' hidden_states[-1] is after the norm). With `collect`, also
        the outputs of those layers concatenated ([B, T, len(collect) * C], an EAGLE-3 head's input)."""
        x = self.embed_tokens(tokens)
        ropes = self.rotary(positions)
        kept = {}
        for i, block in enumerate(self.blocks):
            x = block(x, ropes[i], positions, cache, i)
            if i in collect:
                kept[i] = x
        return (x, torch.cat([kept[i] for i in collect], dim=-1)) if collect else x

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] -> the first layer's input [B, T, C]: the embedding rows (times the spec's
        embedding_scale, in the embedding's dtype, as transformers' Gemma3TextScaledWordEmbedding)."""
        return scale_embedding(F.embedding(tokens, self.embed), self.spec.embedding_scale)

    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor, cache=None) -> torch.Tensor:
        # tokens, positions: [B, T] -> the final norm's output [B, T, C]
        return self.norm(self.features(tokens, positions, cache))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache=None) -> torch.Tensor:
        # tokens, positions: [B, T] -> logits [B, T, V]
        return self.lm_head(self.hidden(tokens, positions, cache))
