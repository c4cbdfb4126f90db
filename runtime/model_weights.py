"""From an artifact's tensors and format table to runtime modules: `Weights`, and the `RMSNorm` it builds.

    weights = Weights(tensors, manifest["formats"], spec, packed=False)
    head = weights.linear(spec.lm_head)                       # QuantLinear, or PackedLinear when packed
    norm = weights.norm(spec.final_norm)                      # RMSNorm
    sizes = fused_split(spec_of_qkv, ("q", "k", "v"), (q_dim, k_dim, v_dim))
    qkv = Weights(tensors, formats, spec, fuse=True).siblings([q, k, v])   # one QuantLinear, or None
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from kiln.kernels.errors import KilnError
from kiln.kernels.formats import ActivationFormat
from kiln.kernels.registry import WEIGHT_FORMATS, weight_format
from kiln.runtime.artifact import clip
from kiln.runtime.linear import PACKED_ACTIVATIONS, PackedLinear, QuantLinear
from kiln.runtime.spec import LinearSpec, ModelSpec
from kiln.runtime.weights import (
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


class Weights:
    """Resolves module names to runtime modules from the artifact's tensors and format table.

    Every tensor is checked against the spec as it is resolved (presence, shape, dtype, finite values), so an
    artifact whose tensors disagree with its architecture is refused at load with one line naming the tensor,
    rather than failing inside a matmul at the first forward.

    `fuse`: sibling linears that read one input (q/k/v, gate/up) become one QuantLinear at load (`siblings`),
    as vLLM fuses them, so an artifact built without the `fuse` pass runs one GEMM where it would run three."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], formats: Mapping[str, Mapping], spec: ModelSpec,
                 packed: bool = False, fuse: bool = False):
        self.tensors = tensors
        self.formats = formats
        self.spec = spec
        self.norm_sizes = spec.norms()
        self.packed = packed  # PackedLinear where the stored format has a kernel (PACKED_ACTIVATIONS)
        self.fuse = fuse
        self.fused_groups = 0  # sibling groups fused at load (`siblings`)
        self._embedding: torch.Tensor | None = None

    @property
    def embedding_entry(self) -> Mapping | None:
        """The embedding table's format entry when it is stored quantized (passes/embedding_quant.py), else None."""
        entry = self.formats.get(self.spec.embedding.removesuffix(".weight"))
        if entry is None:
            return None
        fmt = entry.get("format")
        codec = WEIGHT_FORMATS.get(fmt) if isinstance(fmt, str) else None
        # a table stored as its values is the plain path; an unknown format is refused where it is dequantized
        return None if codec is not None and not codec.dequantizes else entry

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

    def siblings(self, lins: Sequence[LinearSpec]) -> QuantLinear | None:
        """One QuantLinear computing `lins` side by side (output columns in their order), or None where they
        cannot be one product: this Weights does not fuse, keeps weights packed (a fused packed weight needs
        the stored tensors concatenated: the `fuse` pass), or their inputs differ in width, rotation,
        activation format or input scale, or some have a bias and some not. The weights are each dequantized
        (their exact stored values) and concatenated, so the product equals the separate ones up to the order
        of fp32 sums."""
        if not self.fuse or self.packed or len(lins) < 2:
            return None
        entries = [self.formats.get(lin.name, {}) for lin in lins]
        inputs = {(e.get("activation", ActivationFormat.NONE), json.dumps(e.get("input_rotation"), sort_keys=True))
                  for e in entries}
        if len({lin.in_features for lin in lins}) > 1 or len({lin.bias for lin in lins}) > 1 or len(inputs) > 1:
            return None
        scales = [self.tensors.get(f"{lin.name}.input_scale") for lin in lins]
        if any((s is None) != (scales[0] is None) or (s is not None and not torch.equal(s, scales[0]))
               for s in scales):
            return None
        parts = [self.linear(lin, packable=False) for lin in lins]
        bias = torch.cat([p.bias.detach() for p in parts]) if lins[0].bias else None
        fused = QuantLinear(torch.cat([p.weight.detach() for p in parts]), bias, parts[0].input_quantizer)
        self.fused_groups += 1
        return fused

    def _packed(self, name: str, entry: Mapping, shape: tuple[int, int], activation: str,
                bias: torch.Tensor | None) -> PackedLinear:
        fmt, stored, in_features = stored_weight(name, entry, self.tensors, shape)
        for key, value in stored.items():  # the scales (the codes are finite by construction)
            if key != "weight":
                check_finite(f"{name}.{key}", value.float())
        transform = input_transform(name, entry, self.tensors)
        rotation = transform if transform is not None and transform.rotation_block else None
        takes_scale = activation in weight_format(fmt).scaled_activations
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


def fused_split(lin: LinearSpec, roles: tuple[str, ...], sizes: tuple[int, ...]) -> tuple[int, ...]:
    """The output widths a fused linear's output splits into, checked against what the layer needs: its parts
    must have `roles` and `sizes` in that order and add up to its output (a one-line KilnError otherwise)."""
    got = tuple((p.role, p.out_features) for p in lin.parts)
    if got != tuple(zip(roles, sizes, strict=True)) or sum(sizes) != lin.out_features:
        raise KilnError(f"artifact's fused linear {clip(lin.name)} has parts {clip(got, 120)} and "
                        f"{lin.out_features} outputs; the layer needs {tuple(zip(roles, sizes, strict=True))}")
    return sizes
