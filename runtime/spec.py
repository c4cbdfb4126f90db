"""ModelSpec: the one structural description of a model, which passes rewrite and the runtime executes.

Per layer: attention (MHA/GQA/MLA, with its own rotary embedding and softmax scale), MLP (dense or MoE),
norms; plus extra modules (DeepSeek MTP layers, draft heads). A model whose layers mix GQA and MLA is a
legal spec. The artifact's manifest carries it as JSON (`ModelSpec.to_json`, `spec_from_json`), so what
the runtime builds is what the passes left, not what the source checkpoint's config said.
`optimizer.loader_config` builds the spec of a Hugging Face checkpoint, once, when it is loaded.
A layer's parts (LinearSpec, AttentionSpec, MlpSpec, ...) are defined in runtime.layer_spec and exported here.
"""

from __future__ import annotations

import json
import math
import types
import typing
from dataclasses import MISSING, asdict, dataclass, fields, is_dataclass

from kiln.kernels.errors import KilnError
from kiln.runtime.layer_spec import (
    ACTIVATIONS,
    KERNEL_FUSIONS,
    AttentionSpec,
    ExtraModuleSpec,
    KernelFusion,
    LayerSpec,
    LinearSpec,
    MlpSpec,
    RotarySpec,
    norm_size,
)

# a spec's parts (runtime.layer_spec) belong to this module's API: importers take every spec class from here
__all__ = ["ACTIVATIONS", "KERNEL_FUSIONS", "AttentionSpec", "ExtraModuleSpec", "KernelFusion", "LayerSpec",
           "LinearSpec", "MlpSpec", "ModelSpec", "RotarySpec", "check_fields", "check_spec", "norm_size",
           "spec_from_json"]


@dataclass(frozen=True)
class ModelSpec:
    """The one structural description of a model: the loader builds it from the HF config once, passes rewrite
    it, the artifact's manifest carries it ("architecture"), and the runtime executes what it says."""

    model_type: str
    vocab_size: int
    hidden_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    embedding: str
    final_norm: str
    lm_head: LinearSpec
    layers: tuple[LayerSpec, ...]
    max_position_embeddings: int
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    extra_modules: tuple[ExtraModuleSpec, ...] = ()
    # Gemma: every RMSNorm scales by (norm_offset + w) with the stored w, and the embedding rows are multiplied
    # by embedding_scale (sqrt(hidden_size)) in the model's dtype before the first layer
    norm_offset: float = 0.0
    embedding_scale: float = 1.0

    def lm_head_tied(self, tensor_names) -> bool:
        """The lm_head reads the embedding: the config ties them and no separate lm_head weight is stored
        (`tensor_names`: the names of a checkpoint's or an artifact's tensors)."""
        return self.tie_word_embeddings and "lm_head.weight" not in tensor_names

    def linears(self) -> list[LinearSpec]:
        """The linears decoding runs, in model order: each layer's, then lm_head."""
        return [lin for layer in self.layers for lin in layer.linears()] + [self.lm_head]

    def extra_linears(self) -> list[LinearSpec]:
        """The extra modules' linears (MTP layers, draft heads)."""
        out: list[LinearSpec] = []
        for module in self.extra_modules:
            out.extend(module.layer.linears() if module.layer is not None else ())
            out.extend(module.linears.values())
        return out

    def norms(self) -> dict[str, int]:
        """Every RMSNorm weight the decoder stack uses -> its length (`norm_size`)."""
        sizes = {self.final_norm: self.hidden_size}
        for layer in self.layers:
            for name in (*layer.norms, *layer.output_norms):
                sizes[name] = norm_size(name, layer.attention, self.hidden_size)
        return sizes

    def tensor_names(self) -> set[str]:
        """Every tensor name the spec refers to, extra modules included."""
        names = {self.embedding, *self.norms()}
        for lin in (*self.linears(), *self.extra_linears()):
            names.add(f"{lin.name}.weight")
            if lin.bias:
                names.add(f"{lin.name}.bias")
        for layer in (*self.layers, *(m.layer for m in self.extra_modules if m.layer is not None)):
            names.update((*layer.norms, *layer.output_norms))
            if layer.mlp.score_correction_bias:
                names.add(layer.mlp.score_correction_bias)
        for module in self.extra_modules:
            names.update((*module.norms, *module.tensors))
            if module.draft_vocab:
                names.add(module.draft_vocab)
        return names

    def to_json(self) -> dict:
        """The spec as JSON data (the manifest's "architecture"); `spec_from_json` reads it back equal."""
        return asdict(self)


def _linear_from_json(d: dict) -> LinearSpec:
    return LinearSpec(**{**d, "parts": tuple(_linear_from_json(p) for p in d.get("parts", ()))})


def _fusion_from_json(d: dict) -> KernelFusion:
    if d["kind"] not in KERNEL_FUSIONS:
        raise KilnError(f"malformed architecture in the manifest: unknown kernel fusion {str(d['kind'])[:40]!r}; "
                        f"known: {', '.join(KERNEL_FUSIONS)}")
    return KernelFusion(d["kind"], tuple(d["ops"]))


def _linears_from_json(d: dict) -> dict[str, LinearSpec]:
    return {role: _linear_from_json(lin) for role, lin in d.items()}


def _layer_from_json(d: dict) -> LayerSpec:
    a, m = d["attention"], d["mlp"]
    rotary = RotarySpec(**{**a["rotary"], "inv_freq": tuple(a["rotary"]["inv_freq"])})
    attention = AttentionSpec(**{**a, "linears": _linears_from_json(a["linears"]), "rotary": rotary})
    mlp = MlpSpec(**{**m, "linears": _linears_from_json(m["linears"]),
                     "experts": tuple(_linears_from_json(e) for e in m["experts"])})
    return LayerSpec(d["index"], d["prefix"], attention, mlp, tuple(d["norms"]),
                     tuple(_fusion_from_json(f) for f in d.get("fusions", ())), tuple(d.get("output_norms", ())))


def spec_from_json(data: dict) -> ModelSpec:
    """A ModelSpec from `ModelSpec.to_json()` output; malformed data is a one-line KilnError.

    The data may come from hostile hands (an artifact's manifest, whose writer also writes its checksums), so
    every field is checked first for its type and range (`check_fields`), and the spec it builds for the
    consistency of its sizes (`check_spec`), as `optimizer.loader_config.check_config` checks a config.json."""
    check_fields(data)
    try:
        extras = tuple(ExtraModuleSpec(e["kind"], e["name"],
                                       _layer_from_json(e["layer"]) if e["layer"] is not None else None,
                                       _linears_from_json(e["linears"]), tuple(e["norms"]), tuple(e["tensors"]),
                                       tuple(e.get("aux_layers", ())), e.get("draft_vocab"), e.get("tree_width"))
                       for e in data["extra_modules"])
        spec = ModelSpec(**{**data, "lm_head": _linear_from_json(data["lm_head"]),
                            "layers": tuple(_layer_from_json(layer) for layer in data["layers"]),
                            "eos_token_ids": tuple(data["eos_token_ids"]), "extra_modules": extras})
    except (KeyError, TypeError, AttributeError) as exc:
        raise KilnError(f"malformed architecture in the manifest: {type(exc).__name__}: {exc}"[:300]) from None
    check_spec(spec)
    return spec


# --- checking an architecture from hostile hands ----------------------------------------------------------
# Ranges of the spec's numeric fields, by field name (a name means one thing wherever it appears).
POSITIVE_INTS = frozenset({
    "vocab_size", "hidden_size", "max_position_embeddings", "num_heads", "num_kv_heads", "head_dim", "v_head_dim",
    "in_features", "out_features", "intermediate_size", "n_group", "topk_group", "q_lora_rank", "sliding_window",
    "tree_width",
})
"""Integer fields that must be >= 1 (when not null); every other integer field must be >= 0."""
POSITIVE_FLOATS = frozenset({"rms_norm_eps", "softmax_scale", "attention_scaling", "routed_scaling_factor",
                             "inv_freq", "embedding_scale"})
"""Float fields that must be finite and > 0; every other float field must be finite."""
CHOICES: dict[tuple[type, str], tuple[str, ...]] = {}  # filled below, once the classes exist
OPTIONAL_STRINGS = frozenset({"routing"})
"""String fields that may be empty; every other string (a name) must not be."""


def _fail(path: str, problem: str) -> KilnError:
    return KilnError(f"malformed architecture in the manifest: {path[:100]} {problem}")


def _show(value: object) -> str:
    """A JSON value, briefly: `true`, `"abc"`, `3`, `an array`, `an object`."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:39] + "…"


def _hints(cls: type) -> dict[str, object]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


_HINTS: dict[type, dict[str, object]] = {}


def check_fields(data: object, path: str = "architecture") -> None:
    """Refuse architecture JSON whose fields are missing, unknown, of the wrong type or out of range, with one
    line naming the field (a dotted path: `architecture.layers[0].attention.num_heads must be a positive
    integer, got 0`). Walks the ModelSpec dataclasses' own type hints, so a field added to the spec is checked
    without being listed here; ranges come from POSITIVE_INTS, POSITIVE_FLOATS and CHOICES."""
    try:
        _check_value(data, ModelSpec, path, "")
    except RecursionError:
        raise _fail(path, "is nested too deeply") from None


def _check_value(value: object, hint: object, path: str, name: str, owner: type | None = None) -> None:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return
        (inner,) = [a for a in args if a is not type(None)]
        _check_value(value, inner, path, name, owner)
        return
    if is_dataclass(hint):
        if not isinstance(value, dict):
            raise _fail(path, f"must be an object, got {_show(value)}")
        known = {f.name: f for f in fields(hint)}
        unknown = [k for k in value if k not in known]
        if unknown:
            raise _fail(path, f"has unknown field {_show(unknown[0])}; known: {', '.join(known)}")
        hints = _hints(hint)
        for field in known.values():
            if field.name not in value:
                if field.default is MISSING and field.default_factory is MISSING:
                    raise _fail(f"{path}.{field.name}", "is missing")
                continue
            _check_value(value[field.name], hints[field.name], f"{path}.{field.name}", field.name, hint)
        return
    if origin is tuple:
        if not isinstance(value, list | tuple):  # JSON arrays; tuples where the writer checks to_json()'s data
            raise _fail(path, f"must be an array, got {_show(value)}")
        (item, _) = typing.get_args(hint)
        for i, v in enumerate(value):
            _check_value(v, item, f"{path}[{i}]", name, owner)
        return
    if origin is dict:
        if not isinstance(value, dict):
            raise _fail(path, f"must be an object, got {_show(value)}")
        _, item = typing.get_args(hint)
        for k, v in value.items():
            _check_value(v, item, f"{path}[{_show(k)}]", name, owner)
        return
    if hint is bool:
        if not isinstance(value, bool):
            raise _fail(path, f"must be true or false, got {_show(value)}")
    elif hint is int:
        low = 1 if name in POSITIVE_INTS else 0
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise _fail(path, f"must be a {'positive' if low else 'non-negative'} integer, got {_show(value)}")
    elif hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise _fail(path, f"must be a finite number, got {_show(value)}")
        if name in POSITIVE_FLOATS and not value > 0:
            raise _fail(path, f"must be a positive number, got {_show(value)}")
    elif hint is str:
        choices = CHOICES.get((owner, name))
        if not isinstance(value, str):
            raise _fail(path, f"must be a string, got {_show(value)}")
        if choices is not None and value not in choices:
            raise _fail(path, f"must be one of {', '.join(repr(c) for c in choices)}, got {_show(value)}")
        if not value and name not in OPTIONAL_STRINGS:
            raise _fail(path, "must be a non-empty string")
    else:  # a hint this walker does not know: a spec field was added with a new kind of type
        raise TypeError(f"check_fields: no rule for {hint!r} ({path})")


CHOICES.update({
    (AttentionSpec, "kind"): ("mha", "gqa", "mla"),
    (MlpSpec, "kind"): ("dense", "moe"),
    (MlpSpec, "routing"): ("", "softmax_topk", "sigmoid_group_topk"),
    (MlpSpec, "activation"): ACTIVATIONS,
    (ExtraModuleSpec, "kind"): ("mtp", "draft_head", "eagle3"),
})  # a KernelFusion's kind: `_fusion_from_json` names the known ones


def _inconsistent(path: str, problem: str) -> KilnError:
    return KilnError(f"inconsistent architecture in the manifest: {path[:100]}: {problem}")


def _linear_shape(lin: LinearSpec, path: str, in_features: int | None, out_features: int | None) -> None:
    """`lin` must map in_features -> out_features (None: either side is free); a fused linear's parts must be
    plain linears on its input whose outputs add up to its own."""
    for what, got, need in (("in_features", lin.in_features, in_features), ("out_features", lin.out_features,
                                                                           out_features)):
        if need is not None and got != need:
            raise _inconsistent(f"{path} ({lin.name})",
                                f"{what} is {got}, the architecture's other sizes need {need}")
    for i, part in enumerate(lin.parts):
        if part.parts or part.in_features != lin.in_features:
            raise _inconsistent(f"{path}.parts[{i}]", f"a fused linear's part must be a plain linear on its input "
                                f"({lin.in_features} features)")
    if lin.parts and sum(p.out_features for p in lin.parts) != lin.out_features:
        raise _inconsistent(path, f"its parts' outputs add up to {sum(p.out_features for p in lin.parts)}, "
                            f"not its {lin.out_features}")


def _roles(linears: dict[str, LinearSpec], path: str, allowed: tuple[str, ...]) -> None:
    unknown = [role for role in linears if role not in allowed]
    if unknown:
        raise _inconsistent(f"{path}.linears", f"role {_show(unknown[0])} is not one the runtime runs here "
                            f"({', '.join(allowed)})")


def _need(linears: dict[str, LinearSpec], path: str, *roles: str) -> None:
    missing = [role for role in roles if role not in linears]
    if missing:
        raise _inconsistent(f"{path}.linears", f"has no {_show(missing[0])} linear")


def _check_dense(linears: dict[str, LinearSpec], path: str, hidden: int, inter: int | None, prefix: str = "") -> int:
    """A SwiGLU MLP's linears (`prefix` gate/up/down, or gate_up fused): hidden -> inter -> hidden."""
    _need(linears, path, f"{prefix}down")
    down = linears[f"{prefix}down"]
    inter = down.in_features if inter is None else inter
    _linear_shape(down, f"{path}.linears.{prefix}down", inter, hidden)
    if f"{prefix}gate_up" in linears:
        fused = linears[f"{prefix}gate_up"]
        _linear_shape(fused, f"{path}.linears.{prefix}gate_up", hidden, 2 * inter)
        if tuple((p.role, p.out_features) for p in fused.parts) != (("gate", inter), ("up", inter)):
            raise _inconsistent(f"{path}.linears.{prefix}gate_up", f"its parts must be gate and up of {inter} "
                                "outputs each")
    else:
        _need(linears, path, f"{prefix}gate", f"{prefix}up")
        for role in ("gate", "up"):
            _linear_shape(linears[f"{prefix}{role}"], f"{path}.linears.{prefix}{role}", hidden, inter)
    return inter


def _check_attention(a: AttentionSpec, path: str, hidden: int, width: int) -> None:
    """Attention reading `width` features (the hidden size; twice it for an EAGLE-3 layer), writing `hidden`."""
    H, D, Dv, lin = a.num_heads, a.head_dim, a.v_head_dim, a.linears
    r = a.rotary
    if len(r.inv_freq) * 2 != r.dim:
        raise _inconsistent(f"{path}.rotary", f"{len(r.inv_freq)} inverse frequencies for {r.dim} rotated "
                            "dimensions (it needs dim / 2)")
    if a.kind == "mla":
        _roles(lin, path, ("q", "q_a", "q_b", "kv_a", "kv_b", "o"))
        nope, rope, rank = a.qk_nope_head_dim, a.qk_rope_head_dim, a.kv_lora_rank
        if D != nope + rope:
            raise _inconsistent(path, f"head_dim {D} is not qk_nope_head_dim {nope} + qk_rope_head_dim {rope}")
        if rank < 1:
            raise _inconsistent(path, f"kv_lora_rank must be a positive integer for MLA, got {rank}")
        if r.dim != rope:
            raise _inconsistent(f"{path}.rotary", f"dim {r.dim} is not qk_rope_head_dim {rope}")
        if a.q_lora_rank is None:
            _need(lin, path, "q")
            _linear_shape(lin["q"], f"{path}.linears.q", width, H * D)
        else:
            _need(lin, path, "q_a", "q_b")
            _linear_shape(lin["q_a"], f"{path}.linears.q_a", width, a.q_lora_rank)
            _linear_shape(lin["q_b"], f"{path}.linears.q_b", a.q_lora_rank, H * D)
        _need(lin, path, "kv_a", "kv_b", "o")
        _linear_shape(lin["kv_a"], f"{path}.linears.kv_a", width, rank + rope)
        _linear_shape(lin["kv_b"], f"{path}.linears.kv_b", rank, H * (nope + Dv))
        _linear_shape(lin["o"], f"{path}.linears.o", H * Dv, hidden)
        return
    Hkv = a.num_kv_heads
    _roles(lin, path, ("q", "k", "v", "o", "qkv", "k_down", "k_up", "v_down", "v_up"))
    if H % Hkv:
        raise _inconsistent(path, f"num_heads {H} is not a multiple of num_kv_heads {Hkv}")
    if Dv != D:  # the runtime views V per head with head_dim
        raise _inconsistent(path, f"v_head_dim {Dv} differs from head_dim {D}; {a.kind} attention needs them equal")
    if r.dim != D:
        raise _inconsistent(f"{path}.rotary", f"dim {r.dim} is not head_dim {D}")
    if a.kind == "mha" and Hkv != H:
        raise _inconsistent(path, f"mha attention needs num_kv_heads equal to num_heads {H}, got {Hkv}")
    _need(lin, path, "o")
    _linear_shape(lin["o"], f"{path}.linears.o", H * Dv, hidden)
    if "qkv" in lin:
        fused = lin["qkv"]
        _linear_shape(fused, f"{path}.linears.qkv", width, H * D + Hkv * D + Hkv * Dv)
        want = (("q", H * D), ("k", Hkv * D), ("v", Hkv * Dv))
        if tuple((p.role, p.out_features) for p in fused.parts) != want:
            raise _inconsistent(f"{path}.linears.qkv", f"its parts must be q, k, v of {want[0][1]}, {want[1][1]}, "
                                f"{want[2][1]} outputs")
        return
    _need(lin, path, "q")
    _linear_shape(lin["q"], f"{path}.linears.q", width, H * D)
    for role, out in (("k", Hkv * D), ("v", Hkv * Dv)):
        if role in lin:
            _linear_shape(lin[role], f"{path}.linears.{role}", width, out)
            continue
        _need(lin, path, f"{role}_down", f"{role}_up")  # a low-rank pair in its place
        down = lin[f"{role}_down"]
        _linear_shape(down, f"{path}.linears.{role}_down", width, None)
        _linear_shape(lin[f"{role}_up"], f"{path}.linears.{role}_up", down.out_features, out)


def _check_mlp(m: MlpSpec, path: str, hidden: int) -> None:
    if m.kind == "dense":
        _roles(m.linears, path, ("gate", "up", "down", "gate_up"))
        if m.experts:
            raise _inconsistent(path, f"a dense MLP has no experts, got {len(m.experts)}")
        _check_dense(m.linears, path, hidden, m.intermediate_size)
        return
    _roles(m.linears, path, ("router", "shared_gate", "shared_up", "shared_down", "shared_gate_up",
                             "shared_gate_router"))
    E = len(m.experts)
    if E < 1:
        raise _inconsistent(path, "an MoE MLP needs at least one expert")
    _need(m.linears, path, "router")
    _linear_shape(m.linears["router"], f"{path}.linears.router", hidden, E)
    if not 1 <= m.top_k <= E:
        raise _inconsistent(path, f"top_k {m.top_k} must be between 1 and the {E} experts")
    if m.routing not in ("softmax_topk", "sigmoid_group_topk"):
        raise _inconsistent(path, f"an MoE MLP needs routing softmax_topk or sigmoid_group_topk, got {_show(m.routing)}")
    if m.routing == "sigmoid_group_topk":
        if E % m.n_group or m.topk_group > m.n_group:
            raise _inconsistent(path, f"{E} experts do not split into n_group {m.n_group} groups of which "
                                f"topk_group {m.topk_group} are chosen")
        if m.top_k > m.topk_group * (E // m.n_group):
            raise _inconsistent(path, f"top_k {m.top_k} exceeds the {m.topk_group * (E // m.n_group)} experts of "
                                f"the topk_group {m.topk_group} chosen groups")
    for e, expert in enumerate(m.experts):
        _roles(expert, f"{path}.experts[{e}]", ("gate", "up", "down", "gate_up"))
        _check_dense(expert, f"{path}.experts[{e}]", hidden, m.intermediate_size)
    if any(role.startswith("shared_") and role != "shared_gate_router" for role in m.linears):
        _check_dense(m.linears, path, hidden, None, "shared_")
    if m.shared_expert_gate is not None:
        _need(m.linears, path, "shared_gate_router", "shared_down")
        gate = m.linears["shared_gate_router"]
        if gate.name != m.shared_expert_gate:
            raise _inconsistent(path, f"shared_expert_gate {_show(m.shared_expert_gate)} is not the "
                                f"shared_gate_router linear {_show(gate.name)}")
        _linear_shape(gate, f"{path}.linears.shared_gate_router", hidden, 1)


def _check_layer(layer: LayerSpec, path: str, hidden: int, width: int) -> None:
    if len(layer.norms) < 2:
        raise _inconsistent(f"{path}.norms", f"needs the input and post-attention norms, got {len(layer.norms)}")
    if len(layer.output_norms) not in (0, 2):
        raise _inconsistent(f"{path}.output_norms", "needs none or two (the attention's and the MLP's output), "
                            f"got {len(layer.output_norms)}")
    _check_attention(layer.attention, f"{path}.attention", hidden, width)
    _check_mlp(layer.mlp, f"{path}.mlp", hidden)
    names = {lin.name for lin in layer.linears()} | set(layer.norms)
    for i, fusion in enumerate(layer.fusions):
        unknown = [op for op in fusion.ops if op not in names]
        if not fusion.ops or unknown:
            raise _inconsistent(f"{path}.fusions[{i}].ops", f"names {_show(unknown[0]) if unknown else 'nothing'}, "
                                "which is not one of the layer's linears or norms")


def check_spec(spec: ModelSpec) -> None:
    """Refuse a spec whose sizes disagree with each other (one line naming the field), before any tensor is
    read: the runtime sizes every view, split and table from these numbers, so an inconsistent one would fail
    inside a forward (or, worse, compute garbage). What `check_fields` cannot see from one field alone."""
    C, V = spec.hidden_size, spec.vocab_size
    if not spec.layers:
        raise _inconsistent("architecture.layers", "is empty; a model needs at least one decoder layer")
    for token, what in ((spec.bos_token_id, "bos_token_id"), *((t, "eos_token_ids") for t in spec.eos_token_ids)):
        if token is not None and token >= V:
            raise _inconsistent(f"architecture.{what}", f"token {token} is outside the vocabulary of {V}")
    _linear_shape(spec.lm_head, "architecture.lm_head", C, V)
    for i, layer in enumerate(spec.layers):
        if layer.index != i:
            raise _inconsistent(f"architecture.layers[{i}].index", f"is {layer.index}, not its position {i}")
        _check_layer(layer, f"architecture.layers[{i}]", C, C)
    for j, module in enumerate(spec.extra_modules):
        path = f"architecture.extra_modules[{j}]"
        lin = module.linears
        if module.layer is None:
            raise _inconsistent(path, f"a {module.kind} module needs a decoder layer")
        eagle = module.kind == "eagle3"
        _check_layer(module.layer, f"{path}.layer", C, 2 * C if eagle else C)
        if len(module.norms) < 2:
            raise _inconsistent(f"{path}.norms", f"a {module.kind} module needs two norms, got {len(module.norms)}")
        if eagle:
            _roles(lin, path, ("fc", "lm_head"))
            _need(lin, path, "fc")
            bad = [a for a in module.aux_layers if a >= len(spec.layers)]
            if not module.aux_layers or bad:
                raise _inconsistent(f"{path}.aux_layers", f"must name layers of the {len(spec.layers)}, got "
                                    f"{_show(list(module.aux_layers))}")
            _linear_shape(lin["fc"], f"{path}.linears.fc", len(module.aux_layers) * C, C)
            if module.draft_vocab is not None:
                _need(lin, path, "lm_head")  # what scores the draft vocabulary
                if not 1 <= lin["lm_head"].out_features <= V:
                    raise _inconsistent(f"{path}.linears.lm_head", f"scores {lin['lm_head'].out_features} draft "
                                        f"tokens; a draft vocabulary holds 1 to the vocabulary's {V}")
                _linear_shape(lin["lm_head"], f"{path}.linears.lm_head", C, None)
            elif "lm_head" in lin:
                _linear_shape(lin["lm_head"], f"{path}.linears.lm_head", C, V)
        else:
            if module.draft_vocab is not None:
                raise _inconsistent(f"{path}.draft_vocab", f"only an EAGLE-3 module drafts over a draft "
                                    f"vocabulary, not a {module.kind} module")
            _roles(lin, path, ("eh_proj", "head"))
            _need(lin, path, "eh_proj")
            _linear_shape(lin["eh_proj"], f"{path}.linears.eh_proj", 2 * C, C)
            if "head" in lin:
                _linear_shape(lin["head"], f"{path}.linears.head", C, V)

