"""Checkpoint -> ModelGraph.

Accepts a local Hugging Face directory (config.json + model.safetensors, or a sharded
model.safetensors.index.json) or a hub id when the network allows. Safetensors only: pickle weights
(*.bin, *.pt, *.pth) are refused, never unpickled.

The graph holds no tensor data: its tensors (`CheckpointTensors`) are read from the safetensors files when a
pass or the lowering asks for them, one at a time, and what passes replace is spilled to a temporary file
(passes.tensor_store), so a checkpoint larger than RAM builds. The files must stay as they are while the graph
is in use (their sha256 is recorded at load).

Bad input is a one-line KilnError, found as early and as cheaply as possible: config.json's fields first
(types, ranges, consistency), then the shard index and the safetensors headers (layer count, every tensor
the model uses: present, shape, floating dtype), and only then the data, in one streaming pass that reads
one tensor at a time and keeps none: one reduction per tensor (NaN/Inf, overflow, absurd norm gains).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import platform
import re
import struct
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath
from typing import NamedTuple

import torch
from safetensors import SafetensorError, safe_open

from kiln.kernels.errors import KilnError
from kiln.optimizer import prequantized
from kiln.optimizer.loader_config import build_spec, check_config
from kiln.optimizer.prequantized_config import check_quantization_config
from kiln.passes import tensor_store
from kiln.passes.graph import ModelGraph, Source
from kiln.passes.tensor_store import (
    SAFETENSORS_DTYPES,
    IndexedTensors,
    SpillFile,
    TensorStore,
    read_tensor,
    releasing,
)
from kiln.runtime.artifact import MANIFEST, clip, read_json, sha256_file
from kiln.runtime.spec import ModelSpec, norm_size

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja")
FLOAT_DTYPES = ("BF16", "F16", "F32", "F64", "F8_E4M3", "F8_E5M2")  # safetensors header names
# 1-byte floats: (mask, smallest masked byte that is non-finite, what it is)
FP8_NONFINITE = {torch.float8_e4m3fn: (0x7F, 0x7F, "NaN"), torch.float8_e5m2: (0x7F, 0x7C, "NaN/Inf")}
FP32_MAX = torch.finfo(torch.float32).max
VALUE_LIMIT = 1e15  # no trained weight comes near; squared errors of larger ones overflow float32
NORM_LIMIT = 1e4  # real RMSNorm gains stay far below; beyond it the next matmul overflows to Inf/NaN
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # buffers older checkpoints saved; the runtime recomputes them
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class TensorInfo(NamedTuple):
    file: Path
    dtype: str  # safetensors header dtype, e.g. "BF16"
    shape: tuple[int, ...]


def resolve_checkpoint(ref: str | Path) -> Path:
    """A local directory for `ref`: the path itself, or a hub snapshot (safetensors and JSON files only)."""
    path = Path(ref).expanduser()
    if path.exists():
        if not path.is_dir():
            raise KilnError(f"checkpoint {path} is a file; pass the directory that holds config.json")
        return path
    text = str(ref)
    if text.count("/") == 1 and not text.startswith((".", "/", "~")):
        try:
            from huggingface_hub import snapshot_download  # lazy: only a hub id needs it (start-up time)

            return Path(snapshot_download(text, allow_patterns=["*.json", "*.safetensors", "tokenizer*",
                                                                "*.model", "*.txt", "*.jinja"]))
        except Exception as exc:  # noqa: BLE001 - any hub failure is one user-facing line
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise KilnError(f"cannot fetch {text!r} from the Hugging Face hub (offline or unknown id): {first}") from None
    raise KilnError(f"checkpoint {text} not found (neither a local directory nor a hub id like org/name)")


def _weight_files(root: Path) -> tuple[list[Path], dict[str, str]]:
    """The weight files and, for a sharded checkpoint, its index's weight_map (tensor name -> shard)."""
    single = root / "model.safetensors"
    index = root / "model.safetensors.index.json"
    if single.is_file():
        return [single], {}
    if index.is_file():
        weight_map = read_json(index)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict):
            raise KilnError(f"{index} is not a valid safetensors index: it must be a JSON object whose "
                            "'weight_map' maps tensor names to shard files")
        for key, shard in weight_map.items():
            if not isinstance(shard, str) or not shard:
                raise KilnError(f"{index}: weight_map entry {key!r:.80} must name a shard file, got {shard!r:.40}")
            # lexical check only: hub snapshots are symlinks into the cache, so resolving would always escape
            if PurePosixPath(shard).is_absolute() or ".." in PurePosixPath(shard).parts:
                raise KilnError(f"{index}: weight_map entry {key!r:.80} points outside the checkpoint directory "
                                f"({shard!r:.80})")
        files = sorted({root / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise KilnError(f"{index} lists missing shard(s): {', '.join(missing)}")
        return files, weight_map
    pickles = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise KilnError(f"{root} has only pickle weights ({', '.join(pickles[:3])}); Kiln never unpickles "
                        "checkpoints: convert them to safetensors first")
    raise KilnError(f"{root} has no model.safetensors or model.safetensors.index.json")


def _corrupt(file: Path, exc: Exception) -> KilnError:
    return KilnError(f"{file} is corrupt or truncated: {(str(exc).splitlines() or [type(exc).__name__])[0]}")


def _read_header(root: Path, files: list[Path], weight_map: dict[str, str]) -> dict[str, TensorInfo]:
    """Every tensor's file, dtype and shape, from the safetensors headers alone (no tensor data is read)."""
    header: dict[str, TensorInfo] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not iterable
                    if key in header:
                        raise KilnError(f"tensor {key} is stored twice, in {header[key].file.name} and {file.name}")
                    s = f.get_slice(key)
                    header[key] = TensorInfo(file, s.get_dtype(), tuple(s.get_shape()))
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise _corrupt(file, exc) from None
    for key, shard in weight_map.items():
        if key not in header or header[key].file != root / shard:
            raise KilnError(f"model.safetensors.index.json maps {key:.80} to {shard:.80}, which does not hold it")
    return header


def _check_layer_count(config: dict, header: dict[str, TensorInfo]) -> None:
    """The config's layer count must match the layers the tensors hold: more would build a model from
    missing weights (and a huge count would never finish), fewer would silently truncate the model."""
    declared = config.get("num_hidden_layers")
    if declared is None:
        return  # transformers' default; the tensor check below names what is missing
    held = 1 + max((int(m.group(1)) for k in header if (m := _LAYER.match(k))), default=-1)
    if declared > held:
        raise KilnError(f"config.json declares {declared} layers (num_hidden_layers) but the checkpoint holds "
                        f"tensors for {held}")
    # DeepSeek-V3 stores its multi-token-prediction layers after the decoder layers
    mtp = (config.get("num_nextn_predict_layers") or 0) if config.get("model_type") == "deepseek_v3" else 0
    if held > declared + mtp:
        layers = f"layer {declared}" if held == declared + 1 else f"layers {declared}-{held - 1}"
        raise KilnError(f"the checkpoint holds tensors for {layers}, which config.json does not declare "
                        f"(num_hidden_layers is {declared})")


class Expected(NamedTuple):
    what: str  # for messages: "a linear weight", "a norm weight", ...
    shape: tuple[int, ...]
    required: bool = True


NORM = "a norm weight"


def _expected_tensors(spec: ModelSpec) -> dict[str, Expected]:
    """Every tensor the spec uses (extra modules included), by name."""
    out = {spec.embedding: Expected("the embedding", (spec.vocab_size, spec.hidden_size))}
    for ls in (*spec.linears(), *spec.extra_linears()):
        tied = ls.role == "lm_head" and spec.tie_word_embeddings  # then a separate lm_head.weight is optional
        out[f"{ls.name}.weight"] = Expected("a linear weight", (ls.out_features, ls.in_features), not tied)
        if ls.bias:
            out[f"{ls.name}.bias"] = Expected("a bias", (ls.out_features,))
    out.update({name: Expected(NORM, (size,)) for name, size in spec.norms().items()})
    for layer in (*spec.layers, *(m.layer for m in spec.extra_modules if m.layer is not None)):
        if layer.mlp.score_correction_bias:  # the runtime routes without it when absent
            out[layer.mlp.score_correction_bias] = Expected("a router bias", (len(layer.mlp.experts),), False)
    for module in spec.extra_modules:
        a = module.layer.attention if module.layer is not None else None
        for name in (*module.norms, *(module.layer.norms if module.layer is not None else ())):
            out[name] = Expected(NORM, (norm_size(name, a, spec.hidden_size),))
        out.update({name: Expected("the embedding", (spec.vocab_size, spec.hidden_size)) for name in module.tensors})
    return out


def _check_tensors(model_type: str, expected: dict[str, Expected], header: dict[str, TensorInfo]) -> list[str]:
    """Check presence, shape and dtype of what the model uses against the header; return the unused names."""
    missing = [name for name, e in expected.items() if e.required and name not in header]
    if missing:
        raise KilnError(f"checkpoint lacks {len(missing)} tensor(s) its {model_type} config needs, e.g. "
                        f"{', '.join(missing[:3])}")
    for name, e in expected.items():
        info = header.get(name)
        if info is None:
            continue
        if info.shape != e.shape:
            raise KilnError(f"{name} has shape {info.shape}, config implies {e.shape}")
        if info.dtype not in FLOAT_DTYPES:
            raise KilnError(f"{name} has dtype {info.dtype}; {e.what} must be floating point "
                            f"({', '.join(FLOAT_DTYPES)})")
    return sorted(k for k in header if k not in expected and not k.endswith(IGNORED_SUFFIXES))


def _bad_values(t: torch.Tensor, limit: float | None = VALUE_LIMIT) -> str | None:
    """What is wrong with a floating tensor's values, or None. One reduction over the data (aminmax is far
    faster than isfinite on CPU); known 1-byte floats are checked on their bit patterns, not upcast."""
    bits = FP8_NONFINITE.get(t.dtype)
    if bits is not None:
        mask, lowest, what = bits
        return f"contains {what} values" if int((t.view(torch.uint8) & mask).max()) >= lowest else None
    lo, hi = (float(v) for v in torch.aminmax(t if t.dtype.itemsize > 1 else t.float()))  # NaN propagates
    if math.isnan(lo) or math.isnan(hi):
        return "contains NaN values"
    if math.isinf(lo) or math.isinf(hi):
        return "contains Inf values"
    if max(-lo, hi) > FP32_MAX:
        return "holds values beyond float32, the runtime's compute dtype"
    if limit is not None and max(-lo, hi) > limit:
        return (f"holds a value of magnitude {max(-lo, hi):.3g} (more than {limit:g}): calibration squares "
                "and sums weights, which overflows float32")
    return None


def _data_offsets(file: Path) -> tuple[int, dict[str, list[int]]]:
    """Where a safetensors file's data starts, and each tensor's [start, end) within it (its JSON header; the
    header was validated by safetensors when `_read_header` opened the file)."""
    try:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as exc:
        raise _corrupt(file, exc) from None
    return 8 + length, {k: v["data_offsets"] for k, v in header.items() if k != "__metadata__"}


class CheckpointTensors(IndexedTensors, Mapping[str, torch.Tensor]):
    """A checkpoint's tensors by name, each read from its safetensors file when asked: straight into memory of
    its own (the file is not mapped, so the process holds exactly what it reads), the same tensor again while
    anyone holds it, never all at once. Iterates in the headers' order."""

    def __init__(self, header: Mapping[str, TensorInfo]):
        self._where: dict[str, tuple[Path, int, tensor_store.TensorInfo]] = {}
        offsets = {file: _data_offsets(file) for file in dict.fromkeys(info.file for info in header.values())}
        for name, info in header.items():
            dtype = SAFETENSORS_DTYPES.get(info.dtype)
            if dtype is None:
                raise KilnError(f"tensor {name:.80} has dtype {info.dtype:.20}, which Kiln does not read "
                                f"(known: {', '.join(SAFETENSORS_DTYPES)})")
            start, data = offsets[info.file]
            self._where[name] = (info.file, start + data[name][0], tensor_store.TensorInfo(dtype, info.shape))
        self._held: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._held.get(name)
        if t is None:
            file, offset, info = self._where[name]
            try:
                with open(file, "rb") as f:
                    t = read_tensor(f.fileno(), offset, info)
            except OSError as exc:
                raise _corrupt(file, exc) from None
            self._held[name] = t
        return t

    def info(self, name: str) -> tensor_store.TensorInfo:
        return self._where[name][2]


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD = 32 << 20  # glibc's largest


def _return_freed_memory() -> None:
    """Fix glibc's mmap threshold at its largest, 32 MiB: buffers below it come from the heap and are reused
    (a fresh mapping is zero-filled page by page on every use: with a 1 MiB threshold a SmolLM2 build spent a
    third of its CPU time in page faults), larger ones from their own mapping, returned when freed. Freed heap
    memory is given back between blocks (tensor_store.release_freed_memory), which keeps a streaming build of
    an 8B model at about one block: the heap's kept holes once grew it from 1.5 to 4.6 GB. Elsewhere than
    glibc, nothing to do."""
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def _check_values(tensors: CheckpointTensors, norms: set[str]) -> None:
    """Every stored tensor's values, in one streaming pass: one tensor in memory at a time."""
    peaks = {}
    for key in releasing(list(tensors), lambda k: tensors.info(k).nbytes):
        t = tensors[key]
        # norms get their own, tighter bound below, with its own message
        problem = _bad_values(t, None if key in norms else VALUE_LIMIT) if t.is_floating_point() and t.numel() else None
        if problem:
            raise KilnError(f"tensor {key} {problem}; refusing to optimize a broken checkpoint")
        if key in norms:
            peaks[key] = float(t.float().abs().max())
        del t
    for key in norms:
        if peaks[key] > NORM_LIMIT:
            raise KilnError(f"norm weight {key} holds a value of magnitude {peaks[key]:.3g} (more than "
                            f"{NORM_LIMIT:g}); activations would overflow: refusing a broken checkpoint")


def _refuse_artifact(root: Path) -> None:
    """An engine artifact also holds config.json and model.safetensors, but its weights are packed."""
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        return
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return  # not ours
    if isinstance(manifest, dict) and "schema_version" in manifest:
        source = manifest.get("source")
        checkpoint = source.get("checkpoint") if isinstance(source, dict) else None
        raise KilnError(f"{root} is a Kiln engine artifact, not a checkpoint: give the source checkpoint it was "
                        f"built from (manifest source: {checkpoint or 'not recorded'!s:.120})")


def config_digest(config: dict) -> str:
    """sha256 of a config.json's content: its JSON with keys sorted and no whitespace, so that the same config
    written with another indentation or key order is the same config. Recorded beside the weight files' sha256
    (manifest source.config_sha256): the weights alone do not say which model runs them (rope_theta, eps, ...)."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def gguf_hint(root: Path) -> str | None:
    """How to turn a folder holding a GGUF file (llama.cpp's format, which Kiln does not read) into a Hugging Face
    checkpoint; None when it holds none."""
    try:
        ggufs = sorted(p.name for p in root.iterdir() if p.suffix.lower() == ".gguf")
    except OSError:
        return None
    if not ggufs:
        return None
    gguf = clip(ggufs[0], 60)
    if (root / "to_hf.py").is_file():
        how = f"convert it with its script: python {clip(root / 'to_hf.py', 90)} OUT, then build OUT"
    else:
        how = (f"convert it with transformers (pip install gguf): AutoModelForCausalLM and AutoTokenizer"
               f".from_pretrained(DIR, gguf_file={gguf!r}).save_pretrained(OUT)")
    return f"it holds {gguf} (GGUF, which Kiln does not read): {how}"


def read_config(root: Path) -> dict:
    config_path = root / "config.json"
    if not config_path.is_file():
        hint = gguf_hint(root)
        raise KilnError(f"{clip(root, 60) if hint else root} has no config.json; "
                        + (hint or "is it a Hugging Face checkpoint directory?"))
    config = read_json(config_path)
    if not isinstance(config, dict):
        raise KilnError(f"{config_path} must hold a JSON object")
    check_quantization_config(root, config)  # one line for a quantization Kiln cannot read
    return config


def graph_from_spec(spec: ModelSpec, config: dict, source: Source, tensors: Mapping[str, torch.Tensor]) -> ModelGraph:
    """The graph of a spec whose tensors `_check_tensors` has checked."""
    graph = ModelGraph(spec=spec, hf_config=config, source=source, tensors=tensors)
    if spec.lm_head_tied(tensors):
        graph.linears["lm_head"].tied_to = spec.embedding
    return graph


def load_checkpoint(ref: str | Path, trust_remote_code: bool = False, *,
                    log: Callable[[str], None] = lambda message: None) -> ModelGraph:
    """Read a checkpoint into a ModelGraph, refusing anything broken with a one-line KilnError.

    Everything that can be checked from config.json and the safetensors headers is checked before any
    tensor data is read. Tensors the model does not use are kept (and copied into the artifact) but reported
    through `log` and listed in `graph.metadata["loader"]["unused_tensors"]`."""
    root = resolve_checkpoint(ref)
    _refuse_artifact(root)
    config = read_config(root)
    config_sha256 = config_digest(config)  # as read: the dequantized view below rewrites the dict
    check_config(config)  # types and ranges first: the layer count below sizes everything after it
    files, weight_map = _weight_files(root)
    header = raw_header = _read_header(root, files, weight_map)
    _check_layer_count(config, header)
    spec = build_spec(config, trust_remote_code, tensor_names=header)
    expected = _expected_tensors(spec)
    config, header, quantized = prequantized.plan(root, config, header, expected, log)  # dequantized view
    unused = _check_tensors(spec.model_type, expected, header)
    if unused:
        log(f"{len(unused)} checkpoint tensor(s) are not used by the {spec.model_type} model and are copied to "
            f"the artifact unchanged: {', '.join(unused[:5])}{', ...' if len(unused) > 5 else ''}")
    stored = CheckpointTensors(raw_header)
    _return_freed_memory()
    _check_values(stored, {name for name, e in expected.items() if e.what == NORM})
    source = Source(
        path=root.resolve(),
        name=str(ref),
        weight_files={f.name: sha256_file(f) for f in files},
        weight_bytes=sum(stored.info(name).nbytes for name in stored),
        tokenizer_files=tuple(root / n for n in TOKENIZER_FILES if (root / n).is_file()),
        config_sha256=config_sha256,
        spec=spec,
    )
    tensors = TensorStore(stored, spill=SpillFile())
    tensors = prequantized.dequantize(quantized, tensors, _bad_values)  # float32; source keeps the stored bytes
    graph = graph_from_spec(spec, config, source, tensors)
    graph.metadata["loader"] = {"unused_tensors": unused}
    if quantized:
        graph.metadata["loader"]["prequantized"] = quantized.provenance
    return graph
