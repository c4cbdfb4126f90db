"""What a report prices: an artifact (its manifest) or a Hugging Face config under assumed formats, as a
waterfall Scenario; a measured speculation.

    scn = load_scenario(Path("ART"))                           # or a config.json: load_scenario(p, "fp8", "fp8")
    scn = load_scenario(p, speculation=load_speculation("speculative_serving.json"))
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from kiln.kernels.errors import KilnError, clip
from kiln.kernels.formats import ActivationFormat, KvFormat, WeightFormat
from kiln.optimizer.loader_config import build_spec, check_config
from kiln.optimizer.report.roofline import DEFAULT_DRAFT_TOKENS, Speculation
from kiln.optimizer.report.waterfall import Scenario, scenario
from kiln.runtime.artifact import MANIFEST, read_json, read_manifest
from kiln.runtime.manifest import known_source_spec
from kiln.runtime.spec import ModelSpec, spec_from_json

# --weights: every linear's but the LM head's and routers' (format, activations, what the note adds)
CONFIG_WEIGHTS = {
    "bf16": None,
    "fp8": (WeightFormat.FP8_E4M3, ActivationFormat.FP8_DYNAMIC_PER_TOKEN, ", W8A8"),
    "nvfp4": (WeightFormat.NVFP4, ActivationFormat.NVFP4, ", W4A4 where the GPU has FP4 tensor cores"),
}
CONFIG_KV = {"bf16": None, "fp8": {"format": KvFormat.FP8_E4M3, "scaling": "per_tensor"},
             "nvfp4": {"format": KvFormat.NVFP4, "scaling": "e4m3_block16"}}


def load_speculation(path: Path | str) -> Speculation:
    """A measured speculation (`benchmarks/speculative_serving.py --out FILE.json`): the tau measured at the
    largest concurrency below the break-even (the largest measured when it never broke even), the tokens a
    verification checks per sequence, the break-even concurrency, and where it was measured."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise KilnError(f"--speculation {path}: cannot read it ({exc.strerror or type(exc).__name__})") from None
    try:
        data = json.loads(text)
        rows = sorted(((int(r["concurrency"]), float(r["tau"])) for r in data["rows"]), key=lambda r: r[0])
        break_even = data["break_even"]
        nodes = data["verified_per_sequence"]
    except (ValueError, KeyError, TypeError) as exc:
        raise KilnError(f"--speculation {path}: not a speculative_serving.py measurement ({type(exc).__name__}: "
                        f"{exc})"[:300]) from None
    if break_even is not None and (isinstance(break_even, bool) or not isinstance(break_even, int) or break_even < 1):
        raise KilnError(f"--speculation {path}: break_even must be a positive integer or null, got {break_even!r}")
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise KilnError(f"--speculation {path}: verified_per_sequence must be a positive integer, got {nodes!r}")
    paid = [(c, tau) for c, tau in rows if break_even is None or c < break_even]
    if not paid:
        raise KilnError(f"--speculation {path}: speculation did not pay at any measured concurrency (break-even "
                        f"{break_even}); there is no tau to price")
    concurrency, tau = paid[-1]
    where = f"measured at concurrency {concurrency}" + (f", {data['machine']}" if data.get("machine") else "")
    return Speculation(tau, nodes, break_even, where)


# --- targets: an artifact, or a Hugging Face config ------------------------------------------------------------------
def _speculation_of(manifest: Mapping) -> Speculation | None:
    """A kept pass's gate metric named "tau", if the artifact records one, with the tokens a verification step
    checks per sequence: its config's draft_tokens, times its tree_width when it drafts a tree (every node of
    the tree is verified)."""
    for p in manifest.get("passes", ()):
        if p.get("decision") == "reverted" or not p.get("gate"):
            continue
        for metric in p["gate"].get("metrics", ()):
            if metric.get("name") == "tau":
                config = p.get("config") or {}
                nodes = int(config.get("draft_tokens", DEFAULT_DRAFT_TOKENS)) * int(config.get("tree_width", 1))
                return Speculation(float(metric["value"]), nodes)
    return None


def manifest_scenario(name: str, manifest: Mapping, spec: ModelSpec, source_spec: ModelSpec,
                      speculation: Speculation | None = None) -> Scenario:
    """An artifact's scenario from its manifest's formats and KV table (`speculation`: overrides its tau)."""
    formats = manifest["formats"]
    tied = bool((formats.get("lm_head") or {}).get("tied_to"))  # a dense LM head stored once, as the embedding
    return scenario(name, "artifact", spec, source_spec, formats, manifest.get("kv_cache"), tied,
                    speculation or _speculation_of(manifest))


def config_scenario(name: str, spec: ModelSpec, weights: str = "bf16", kv: str = "bf16",
                    speculation: Speculation | None = None) -> Scenario:
    """A config's scenario under assumed formats: `weights` for every linear but the LM head and routers
    (fp8: W8A8; nvfp4: W4A4, weight-only where there are no FP4 tensor cores), `kv` for every layer's cache."""
    if weights not in CONFIG_WEIGHTS:
        raise KilnError(f"--weights must be one of {', '.join(CONFIG_WEIGHTS)}, got {weights!r}")
    if kv not in CONFIG_KV:
        raise KilnError(f"--kv must be one of {', '.join(CONFIG_KV)}, got {kv!r}")
    formats, assumed = {}, CONFIG_WEIGHTS[weights]
    if assumed:
        fmt, act, _ = assumed
        for lin in spec.linears():
            if lin.role not in ("lm_head", "router"):
                formats[lin.name] = {"format": fmt, "activation": act}
    table = {str(layer.index): CONFIG_KV[kv] for layer in spec.layers} if CONFIG_KV[kv] else None
    notes = (f"assumed formats: weights {weights} (all linears but the LM head and routers"
             + (assumed[2] if assumed else "") + f"), KV cache {kv}; no weights read (meta figures)",)
    return scenario(name, "config", spec, spec, formats, table, spec.tie_word_embeddings, speculation, notes)


CONFIG_SIZE_LIMITS = {"num_hidden_layers": 1024, "num_nextn_predict_layers": 16, "head_dim": 4096,
                      "qk_rope_head_dim": 4096, "qk_nope_head_dim": 4096, "v_head_dim": 4096,
                      "num_local_experts": 1024, "num_experts": 1024, "n_routed_experts": 1024}
"""Most of each config.json field that sizes what a report builds (a spec per layer, per expert, rotary tables per
head dim): far above any released model (DeepSeek-V3: 61 layers, 256 experts; head dims up to 256), far below a
config whose spec would not fit in memory. A report reads no weights, so nothing else bounds them."""
MAX_LAYER_EXPERTS = 1 << 17
"""Most expert specs in all (layers x experts; Kimi K2: 61 x 384)."""


def check_config_sizes(config: Mapping, where: str) -> None:
    """Refuse, before a spec is built, a config (already type-checked by loader_config.check_config) whose sizes
    would make the spec itself huge: CONFIG_SIZE_LIMITS, the head dim hidden_size / num_attention_heads when
    head_dim is not given, and layers x experts. One line naming the field, its value and the bound."""
    def refuse(name: str, value: object, limit: int) -> None:
        raise KilnError(f"{where}: {name} = {value} is above {limit}, the most a report models (the spec it builds "
                        "grows with it)")

    for name, limit in CONFIG_SIZE_LIMITS.items():
        value = config.get(name)
        if isinstance(value, int) and value > limit:
            refuse(name, value, limit)
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    if config.get("head_dim") is None and isinstance(hidden, int) and isinstance(heads, int) and heads > 0 \
            and hidden // heads > CONFIG_SIZE_LIMITS["head_dim"]:
        refuse("hidden_size / num_attention_heads", hidden // heads, CONFIG_SIZE_LIMITS["head_dim"])
    experts = max((config.get(k) or 0 for k in ("num_local_experts", "num_experts", "n_routed_experts")
                   if isinstance(config.get(k), int)), default=0)
    layers = config.get("num_hidden_layers") or 0
    if experts * layers > MAX_LAYER_EXPERTS:
        refuse("num_hidden_layers x experts", experts * layers, MAX_LAYER_EXPERTS)


def _config_spec(config_path: Path) -> ModelSpec:
    """The spec of a Hugging Face config.json, refused in one line when it is malformed or too big to model."""
    data = read_json(config_path)
    if not isinstance(data, dict):
        raise KilnError(f"{clip(config_path)} must hold a JSON object")
    check_config(data)  # types and ranges, as the loader checks them
    check_config_sizes(data, clip(config_path))
    return build_spec(data)


def load_scenario(target: Path, weights: str | None = None, kv: str | None = None,
                  speculation: Speculation | None = None) -> Scenario:
    """An artifact directory (its manifest; weights are not read, so not checksummed), or a Hugging Face config:
    a config.json file or a directory holding one and no manifest."""
    target = Path(target)
    if not target.exists():
        raise KilnError(f"{clip(target)} does not exist (give an artifact directory or a config.json)")
    if target.is_dir() and (target / MANIFEST).exists():
        if weights is not None or kv is not None:
            raise KilnError("--weights and --kv describe a config; an artifact's manifest records its own formats")
        manifest = read_manifest(target, verify=False)
        spec = spec_from_json(manifest["architecture"])
        source = known_source_spec(manifest, spec, "pricing the MLA conversion")
        return manifest_scenario(str(target), manifest, spec, source, speculation)
    config = target / "config.json" if target.is_dir() else target
    if not config.is_file():
        raise KilnError(f"{clip(target)} is neither a Kiln artifact nor a Hugging Face config (no manifest.json "
                        "or config.json)")
    return config_scenario(str(target), _config_spec(config), weights or "bf16", kv or "bf16", speculation)
