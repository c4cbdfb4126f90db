"""Artifacts from hostile hands: every refusal is one bounded line, and the runtime reads only checksummed files.

One tiny artifact (conftest `plain_artifact`: recipe none, no gate); each test tampers with its own copy.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from kiln import runtime
from kiln.optimizer.defaults import SAMPLE_TEXT
from kiln.runtime.artifact import MANIFEST, artifact_file, read_json, read_manifest
from tests.conftest import refused


def _manifest(art: Path) -> dict:
    return json.loads((art / MANIFEST).read_text())


def _write_manifest(art: Path, manifest) -> None:
    (art / MANIFEST).write_text(json.dumps(manifest))


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_the_intact_copy_loads(art):
    engine = runtime.load(art)
    assert engine.tokenizer is not None
    assert artifact_file(art, engine.manifest, "config.json") == art / "config.json"


# --- 1. only checksummed files are read ------------------------------------------------------------------
def test_config_dropped_from_the_table_and_edited_isrefused(art):
    manifest = _manifest(art)
    del manifest["files"]["config.json"]
    _write_manifest(art, manifest)
    config = json.loads((art / "config.json").read_text())
    (art / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    for call in (runtime.load, read_manifest):
        refused(call, art, match="'config.json' is in the artifact but not in its manifest's checksum table")


def test_weights_dropped_from_the_table_arerefused(art):
    manifest = _manifest(art)
    del manifest["files"]["model.safetensors"]
    _write_manifest(art, manifest)
    refused(runtime.load, art, match="manifest has no checksum for model.safetensors")


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "generation_config.json"])
def test_a_tokenizer_file_dropped_from_the_table_isrefused(art, name):
    manifest = _manifest(art)
    del manifest["files"][name]
    _write_manifest(art, manifest)
    (art / name).write_text("{}")
    refused(runtime.load, art, match=f"'{name}' is in the artifact but not in its manifest's checksum table")


@pytest.mark.parametrize("name", ["added_tokens.json", "special_tokens_map.json", "chat_template.jinja",
                                  "vocab.json", "merges.txt", "tokenizer.model", "additional_chat_templates"])
def test_an_unlisted_file_the_tokenizer_loader_would_read_isrefused(art, name):
    if name == "additional_chat_templates":
        (art / name).mkdir()
        (art / name / "evil.jinja").write_text("{{ 1 }}")
    else:
        (art / name).write_text('{"<evil>": 0}')
    refused(runtime.load, art, match=f"'{name}' is in the artifact but not in its manifest's checksum table")
    refused(read_manifest, art, match="the runtime reads only checksummed files")


def test_a_listed_file_edited_isrefused(art):
    (art / "config.json").write_text((art / "config.json").read_text().replace("1", "2", 1))
    refused(runtime.load, art, match="checksum mismatch for config.json")


def test_artifact_file_refuses_names_outside_the_table(art):
    manifest = read_manifest(art)
    for name in ("report2.md", "../manifest.json", MANIFEST):
        refused(artifact_file, art, manifest, name, match="not in the manifest's checksum table")


@pytest.mark.parametrize("architecture, match", [
    ([1, 2], "architecture must be an object"),
    ({"model_type": "llama"}, "malformed architecture in the manifest"),
])
def test_a_malformed_architecture_isrefused(art, architecture, match):
    manifest = _manifest(art)
    manifest["architecture"] = architecture
    _write_manifest(art, manifest)
    refused(runtime.load, art, match=match)


def test_the_runtime_builds_from_the_manifest_not_from_config_json(art):
    data = (art / "config.json").read_bytes().replace(b'"num_hidden_layers": 2', b'"num_hidden_layers": 1')
    assert data != (art / "config.json").read_bytes()
    (art / "config.json").write_bytes(data)
    manifest = _manifest(art)
    manifest["files"]["config.json"] = _sha(data)
    _write_manifest(art, manifest)
    assert len(runtime.load(art).model.blocks) == 2


def test_a_garbage_tokenizer_is_one_line(art):
    data = b'{"model": {"type": "nonsense"}, "version": 7}'
    (art / "tokenizer.json").write_bytes(data)
    manifest = _manifest(art)
    manifest["files"]["tokenizer.json"] = _sha(data)
    _write_manifest(art, manifest)
    refused(runtime.load, art, match="cannot load the tokenizer from")


# --- 2. plain names, no symlinks -------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["../outside.txt", "/etc/hostname", "sub/x.json", "a\\b.json", "..", ".", "",
                                  "nul\x00.json"])
def test_file_names_must_be_plain(art, name):
    manifest = _manifest(art)
    manifest["files"][name] = "0" * 64
    _write_manifest(art, manifest)
    for call in (runtime.load, read_manifest):
        refused(call, art, match="file names must be plain names inside the artifact")


def test_an_absolute_path_to_a_real_file_isrefused(art, tmp_path):
    outside = tmp_path / "secret.txt"
    outside.write_text("secret")
    manifest = _manifest(art)
    manifest["files"][str(outside)] = _sha(b"secret")
    _write_manifest(art, manifest)
    refused(runtime.load, art, match="file names must be plain names")


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "model.safetensors", "report.md"])
def test_a_listed_file_that_is_a_symlink_is_refused_even_with_the_right_checksum(art, tmp_path, name):
    outside = tmp_path / f"outside-{name}"
    shutil.move(art / name, outside)
    (art / name).symlink_to(outside)  # same bytes, so the checksum would match
    refused(runtime.load, art, match=f"{name} is a symlink")


def test_a_manifest_that_is_a_symlink_isrefused(art, tmp_path):
    outside = tmp_path / "manifest-elsewhere.json"
    shutil.move(art / MANIFEST, outside)
    (art / MANIFEST).symlink_to(outside)
    refused(read_manifest, art, match="manifest.json is a symlink")


def test_a_symlinked_artifact_root_is_fine(art, tmp_path):
    link = tmp_path / "link-to-art"
    link.symlink_to(art, target_is_directory=True)
    assert runtime.load(link).tokenizer is not None


def test_a_listed_directory_isrefused(art):
    (art / "report.md").unlink()
    (art / "report.md").mkdir()
    refused(read_manifest, art, match="report.md listed in the manifest is not a regular file")


# --- 3. manifest shape -----------------------------------------------------------------------------------
def _set(path: str, value):
    """A mutation of the manifest: set the value at dotted `path` (deleting it when value is DELETE)."""

    def mutate(manifest: dict) -> dict:
        *parents, last = path.split(".")
        node = manifest
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if value is DELETE:
            del node[last]
        elif isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
        return manifest

    return mutate


DELETE = object()

MALFORMED = {
    "array": (lambda m: [1, 2], "it must be a JSON object, got an array"),
    "string": (lambda m: "manifest", "it must be a JSON object, got \"manifest\""),
    "version true": (_set("schema_version", True), "schema_version must be an integer, got true"),
    "version string": (_set("schema_version", "2"), "schema_version must be an integer, got \"2\""),
    "version float": (_set("schema_version", 2.0), "schema_version must be an integer, got 2.0"),
    "version missing": (_set("schema_version", DELETE), "schema_version is missing"),
    "no formats": (_set("formats", DELETE), "formats is missing"),
    "formats list": (_set("formats", [1]), "formats must be an object, got an array"),
    "format entry": (lambda m: {**m, "formats": {**m["formats"], "lm_head": "dense"}},
                     'formats["lm_head"] must be an object, got "dense"'),
    "format name": (lambda m: {**m, "formats": {**m["formats"], "lm_head": {"format": 8}}},
                    'formats["lm_head"].format must be a string, got 8'),
    "files list": (_set("files", ["model.safetensors"]), "files must be an object, got an array"),
    "files digest": (lambda m: {**m, "files": {**m["files"], "report.md": 5}}, 'files["report.md"] must be a sha256'),
    "target": (_set("target", None), "target must be a string, got null"),
    "source": (_set("source", "hf"), "source must be an object"),
    "model type": (_set("source.model_type", DELETE), "source.model_type is missing"),
    "recipe": (_set("recipe", "none"), "recipe must be an object"),
    "recipe name": (_set("recipe.name", ["x"]), "recipe.name must be a string, got an array"),
    "recipe passes": (_set("recipe.passes", DELETE), "recipe.passes is missing"),
    "passes": (_set("passes", {}), "passes must be an array, got an object"),
    "pass record": (_set("passes", [7]), "passes[0] must be an object, got 7"),
    "pass gate": (_set("passes", [{"name": "x", "decision": "kept", "gate": "ok"}]),
                  "passes[0].gate must be an object or null"),
    "gate figure": (_set("passes", [{"name": "x", "decision": "kept", "gate": {
        "perplexity": 1, "baseline_perplexity": 1, "recovery": "1", "kl": 0, "top1": 1, "floor": 0.9}}]),
        "passes[0].gate.recovery must be a number"),
    "sizes": (_set("sizes", DELETE), "sizes is missing"),
    "weight bytes string": (_set("sizes.weight_bytes", "12"), "sizes.weight_bytes must be a non-negative integer"),
    "weight bytes bool": (_set("sizes.weight_bytes", True), "sizes.weight_bytes must be a non-negative integer"),
    "source bytes zero": (_set("sizes.source_weight_bytes", 0), "sizes.source_weight_bytes must be a positive"),
    "tensors": (_set("tensors", []), "tensors must be an object"),
    "tensor shape": (lambda m: {**m, "tensors": {"w": {"dtype": "float32", "shape": [-1]}}},
                     'tensors["w"].shape[0] must be a non-negative integer, got -1'),
    "tensor dtype": (lambda m: {**m, "tensors": {"w": {"dtype": None, "shape": [1]}}},
                     'tensors["w"].dtype must be a string'),
    "kv cache": (_set("kv_cache", [1]), "kv_cache must be an object"),
    "kv entry": (_set("kv_cache", {"0": {"format": ["fp8"]}}), 'kv_cache["0"].format must be a string'),
    "precision": (_set("precision", {"pass": "auto"}), "precision.effective_bits is missing"),
    "kv budget": (_set("kv_budget", {"kv_bytes_per_token": 1}), "kv_budget.source_kv_bytes_per_token is missing"),
    "kv budget zero": (_set("kv_budget.source_kv_bytes_per_token", 0),
                       "kv_budget.source_kv_bytes_per_token must be a positive integer"),
}


@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_a_malformed_manifest_is_one_line_naming_the_key(art, kind):
    mutate, expected = MALFORMED[kind]
    _write_manifest(art, mutate(_manifest(art)))
    for call in (read_manifest, runtime.load):
        refused(call, art, match=expected)


@pytest.mark.parametrize("kind", ["version true", "format entry", "passes", "kv budget"])
def test_inspect_and_generate_refuse_a_malformed_manifest_without_a_traceback(cli, art, kind):
    mutate, expected = MALFORMED[kind]
    _write_manifest(art, mutate(_manifest(art)))
    for args in (("inspect", art), ("inspect", art, "--json"), ("generate", art, "hi")):
        code, _, stderr = cli(*args)
        assert code == 2 and expected in stderr and "Traceback" not in stderr, stderr
        assert stderr.count("\n") == 1, stderr


def test_an_other_schema_version_is_named(art):
    _write_manifest(art, {**_manifest(art), "schema_version": 3})
    refused(read_manifest, art, match="artifact schema version 3, this runtime reads version 2")


@pytest.mark.parametrize("data, expected", [
    (b"{", "is not valid JSON"),
    (b"\xff\xfe{}", "is not valid JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"schema_version": ' + b"9" * 10_000 + b"}", "is not valid JSON"),
])
def test_unparsable_manifests_are_one_line(art, data, expected):
    (art / MANIFEST).write_bytes(data)
    refused(read_manifest, art, match=expected)


def test_json_files_are_bounded_before_reading(tmp_path):
    big = tmp_path / "big.json"
    big.write_text("[" + "0," * 1000 + "0]")
    refused(read_json, big, 100, match="is larger than 100 bytes")


def test_long_keys_and_values_keep_the_message_bounded(art):
    manifest = _manifest(art)
    manifest["formats"]["x" * 100_000] = "y" * 100_000
    _write_manifest(art, manifest)
    message = refused(read_manifest, art, match="must be an object")
    assert "…" in message
    manifest = _manifest(art)
    manifest["files"]["../" + "z" * 100_000] = "0" * 64
    _write_manifest(art, manifest)
    refused(read_manifest, art, match="file names must be plain names")


def test_a_long_or_odd_artifact_path_keeps_the_message_one_line(tmp_path):
    odd = tmp_path / ("line\nbreak" + "q" * 200)
    odd.mkdir()
    message = refused(read_manifest, odd, match="is not a Kiln artifact")
    assert "\\n" in message


# --- 4. the architecture against the tensors (checksums recomputed after every edit) ----------------------
# The writer of an artifact writes its checksums too: each edit below leaves a manifest whose checksums, tensor
# table and weight bytes agree with its files, so the refusal must come from checking what the manifest says
# about the artifact's structure (runtime.spec.check_fields / check_spec, runtime.structure).
Q = "model.layers.0.self_attn.q_proj"
LAYER0 = "architecture.layers[0]"


def _lie(art: Path, edit_manifest=None, edit_tensors=None) -> None:
    """Edit the manifest and/or the tensors, then recompute what a checksum check would catch (sha256 of
    model.safetensors, the tensors table, the weight bytes): a hostile writer's edit."""
    import torch  # noqa: F401 - the tensor edits use it
    from safetensors.torch import load_file, save_file

    manifest = _manifest(art)
    if edit_tensors is not None:
        tensors = load_file(str(art / "model.safetensors"))
        edit_tensors(tensors, manifest)
        save_file(tensors, str(art / "model.safetensors"))
        manifest["files"]["model.safetensors"] = _sha((art / "model.safetensors").read_bytes())
        manifest["tensors"] = {name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                               for name, t in tensors.items()}
        manifest["sizes"]["weight_bytes"] = sum(t.numel() * t.element_size() for t in tensors.values())
    if edit_manifest is not None:
        edit_manifest(manifest)  # in place
    _write_manifest(art, manifest)


def _arch(path: str, value):
    """Set `architecture.<path>` (dotted; list indices as numbers)."""
    return _set(f"architecture.{path}", value)


def _as_fp8(tensors: dict, module: str) -> None:
    from kiln.kernels import fp8

    q, scale = fp8.fp8_quantize_per_channel(tensors.pop(f"{module}.weight").float())
    tensors[f"{module}.weight"], tensors[f"{module}.weight_scale"] = q, scale


def _fp8_labelled(fmt: dict):
    """Q stored as FP8 (codes and per-channel scale), its format entry replaced by `fmt`."""
    def edit(tensors, manifest):
        _as_fp8(tensors, Q)
        manifest["formats"][Q] = fmt
    return edit


def _without(name: str):
    def edit(tensors, manifest):
        del tensors[name]
    return edit


def _kv_fp8(manifest: dict) -> None:
    manifest["kv_cache"] = {"0": {"format": "fp8_e4m3", "scaling": "per_tensor", "streams": ["k", "v"],
                                  "scale_tensors": {}}}


def _scale_tensors(tensors, manifest):
    import torch

    tensors["model.layers.0.self_attn.k_scale"] = torch.ones(3)  # per tensor: one value, not three
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor(1.0)
    manifest["kv_cache"] = {"0": {"format": "fp8_e4m3", "scaling": "per_tensor", "streams": ["k", "v"],
                                  "scale_tensors": {"k": "model.layers.0.self_attn.k_scale",
                                                    "v": "model.layers.0.self_attn.v_scale"}}}


def _sliced_q(tensors, manifest):
    tensors[f"{Q}.weight"] = tensors[f"{Q}.weight"][:, :32].contiguous()


# edit name -> (manifest edit, tensor edit, the field or tensor the one-line refusal must name)
STRUCTURE = {
    # the table
    "num_heads 0": (_arch("layers.0.attention.num_heads", 0), None,
                    f"{LAYER0}.attention.num_heads must be a positive integer, got 0"),
    "no layers": (_arch("layers", []), None, "architecture.layers: is empty"),
    "inv_freq strings": (lambda m: m["architecture"]["layers"][0]["attention"]["rotary"].update(
        inv_freq=[str(f) for f in m["architecture"]["layers"][0]["attention"]["rotary"]["inv_freq"]]), None,
        f'{LAYER0}.attention.rotary.inv_freq[0] must be a finite number, got "1.0"'),
    "head_dim 16": (_arch("layers.0.attention.head_dim", 16), None,
                    f"{LAYER0}.attention: v_head_dim 8 differs from head_dim 16"),
    "dense label on fp8 bytes": (None, _fp8_labelled({"format": "dense", "activation": "none"}),
                                 (f"artifact tensor {Q}.weight has dtype float8_e4m3fn; a dense weight must be "
                                 "float32")),
    "sliced weight": (None, _sliced_q, f"artifact tensor {Q}.weight has shape (64, 32), the architecture needs"),
    "tensors table": (lambda m: m["tensors"][f"{Q}.weight"].update(shape=[64, 32]), None,
                      (f'manifest tensors["{Q}.weight"] says float32 (64, 32), model.safetensors holds float32 '
                      "(64, 64)")),
    # more of the same class: every int/float/list field type- and range-checked, cross-checked with the rest
    "num_kv_heads 3": (_arch("layers.0.attention.num_kv_heads", 3), None,
                       f"{LAYER0}.attention: num_heads 8 is not a multiple of num_kv_heads 3"),
    "num_kv_heads 2": (_arch("layers.0.attention.num_kv_heads", 2), None,
                       (f"{LAYER0}.attention.linears.k (model.layers.0.self_attn.k_proj): out_features is 32, the "
                       "architecture's other sizes need 16")),
    "intermediate_size": (_arch("layers.1.mlp.intermediate_size", 100), None,
                          ("architecture.layers[1].mlp.linears.down (model.layers.1.mlp.down_proj): in_features "
                          "is 172, the architecture's other sizes need 100")),
    "vocab_size true": (_arch("vocab_size", True), None, ("architecture.vocab_size must be a positive integer, "
                                                         "got true")),
    "hidden_size float": (_arch("hidden_size", 64.0), None, ("architecture.hidden_size must be a positive integer, "
                                                            "got 64.0")),
    "rms_norm_eps 0": (_arch("rms_norm_eps", 0), None, "architecture.rms_norm_eps must be a positive number, got 0"),
    "rms_norm_eps string": (_arch("rms_norm_eps", "1e-5"), None, "architecture.rms_norm_eps must be a finite number"),
    "softmax_scale inf": (_arch("layers.0.attention.softmax_scale", 1e999), None,
                          f"{LAYER0}.attention.softmax_scale must be a finite number, got Infinity"),
    "inv_freq short": (lambda m: m["architecture"]["layers"][0]["attention"]["rotary"]["inv_freq"].pop(), None,
                       f"{LAYER0}.attention.rotary: 3 inverse frequencies for 8 rotated dimensions"),
    "rotary dim": (_arch("layers.0.attention.rotary.dim", -8), None,
                   f"{LAYER0}.attention.rotary.dim must be a non-negative integer, got -8"),
    "rotary table": (_arch("layers.0.attention.rotary", [1.0, 0.1]), None,
                     f"{LAYER0}.attention.rotary must be an object, got an array"),
    "max_position_embeddings 0": (_arch("max_position_embeddings", 0), None,
                                  "architecture.max_position_embeddings must be a positive integer, got 0"),
    "sliding_window 0": (_arch("layers.0.attention.sliding_window", 0), None,
                         f"{LAYER0}.attention.sliding_window must be a positive integer, got 0"),
    "eos outside vocab": (_arch("eos_token_ids", [2, 100_000]), None,
                          "architecture.eos_token_ids: token 100000 is outside the vocabulary of 384"),
    "layer index": (_arch("layers.1.index", 0), None, "architecture.layers[1].index: is 0, not its position 1"),
    "attention kind": (_arch("layers.0.attention.kind", "flash"), None,
                       f"{LAYER0}.attention.kind must be one of 'mha', 'gqa', 'mla', got \"flash\""),
    "unknown field": (lambda m: m["architecture"]["layers"][0]["mlp"].update(num_experts=8), None,
                      f"{LAYER0}.mlp has unknown field \"num_experts\""),
    "missing field": (_arch("layers.0.attention.v_head_dim", DELETE), None,
                      f"{LAYER0}.attention.v_head_dim is missing"),
    "norms": (_arch("layers.0.norms", ["model.layers.0.input_layernorm.weight"]), None,
              f"{LAYER0}.norms: needs the input and post-attention norms, got 1"),
    "q out_features": (_arch("layers.0.attention.linears.q.out_features", 32), None,
                       (f"{LAYER0}.attention.linears.q ({Q}): out_features is 32, the architecture's other sizes "
                       "need 64")),
    "qk_norm without tensors": (_arch("layers.0.attention.qk_norm", True), None,
                                "artifact is missing tensor 'model.layers.0.self_attn.q_norm.weight'"),
    "extra module": (_arch("extra_modules", [{"kind": "eagle3", "name": "x", "layer": None, "linears": {},
                                               "norms": [], "tensors": []}]), None,
                     "architecture.extra_modules[0]: a eagle3 module needs a decoder layer"),
    "fusion ops": (_arch("layers.0.fusions", [{"kind": "rmsnorm_quant", "ops": ["elsewhere.weight"]}]), None,
                   f"{LAYER0}.fusions[0].ops: names \"elsewhere.weight\", which is not one of the layer's"),
    # the formats table and the scales it says are stored
    "activation unknown": (lambda m: m["formats"][Q].update(activation="fp16_magic"), None,
                           f"manifest formats[\"{Q}\"].activation is 'fp16_magic'"),
    "format of no module": (lambda m: m["formats"].update({"model.layers.9.mlp.up_proj": {"format": "dense"}}),
                            None, ('manifest formats["model.layers.9.mlp.up_proj"] names a module the '
                                  "architecture does not have")),
    "format entry missing": (lambda m: m["formats"].pop(Q), None, f"manifest formats has no entry for {Q}"),
    "fp8 static without input scale": (None, _fp8_labelled({"format": "fp8_e4m3",
                                                            "activation": "fp8_static_per_tensor"}),
                                       f"artifact is missing tensor '{Q}.input_scale'"),
    "fp8 without its scale": (None, lambda t, m: (_fp8_labelled({"format": "fp8_e4m3", "activation": "none"})(t, m),
                                                  t.pop(f"{Q}.weight_scale")),
                              f"artifact is missing tensor '{Q}.weight_scale'"),
    "nvfp4 label on fp8 bytes": (None, _fp8_labelled({"format": "nvfp4", "activation": "none"}),
                                 f"artifact tensor {Q}.weight has shape (64, 64), the architecture needs (64, 32)"),
    "rotation block": (lambda m: m["formats"][Q].update(input_rotation={"kind": "block_hadamard",
                                                                        "block_size": 48}), None,
                       f'manifest formats["{Q}"].input_rotation.block_size must be a power of two, got 48'),
    "tied lm_head quantized": (lambda m: m["formats"]["lm_head"].update(format="fp8_e4m3"), None,
                               "manifest formats[lm_head] says fp8_e4m3, but lm_head is tied to the embedding"),
    "missing norm": (None, _without("model.norm.weight"), "artifact is missing tensor 'model.norm.weight'"),
    "kv scale named nowhere": (_kv_fp8, None, ("kv_cache layer 0: fp8_e4m3 (per_tensor) needs a scale tensor for "
                                              "stream 'k'")),
    "kv scale shape": (None, _scale_tensors, ("artifact tensor model.layers.0.self_attn.k_scale has shape (3,), the "
                                             "architecture needs () or (1,)")),
    "weight bytes": (_set("sizes.weight_bytes", 1), None, ("manifest sizes.weight_bytes is 1, model.safetensors "
                                                          "holds")),
}


@pytest.mark.parametrize("kind", sorted(STRUCTURE))
def test_a_manifest_lying_about_its_structure_is_one_line_naming_the_field(art, kind):
    edit_manifest, edit_tensors, expected = STRUCTURE[kind]
    _lie(art, edit_manifest, edit_tensors)
    for call in (read_manifest, runtime.load):
        refused(call, art, match=expected)


@pytest.mark.parametrize("kind, command", [
    ("num_heads 0", "generate"), ("no layers", "generate"), ("inv_freq strings", "generate"),
    ("head_dim 16", "eval"), ("dense label on fp8 bytes", "generate"), ("sliced weight", "inspect"),
    ("tensors table", "inspect"), ("num_kv_heads 3", "inspect"), ("kv scale shape", "generate"),
])
def test_the_console_refuses_a_lying_structure_with_exit_2(cli, art, kind, command):
    edit_manifest, edit_tensors, expected = STRUCTURE[kind]
    _lie(art, edit_manifest, edit_tensors)
    args = {"generate": ("generate", art, "hi", "--max-new-tokens", "2"), "inspect": ("inspect", art),
            "eval": ("eval", art, "--data", SAMPLE_TEXT)}[command]
    code, out, stderr = cli(*args)
    assert code == 2 and expected in stderr and "Traceback" not in stderr + out, stderr
    assert stderr.count("\n") == 1, stderr


def test_edits_that_keep_the_structure_true_still_load(art):
    """The check refuses lies, not edits: FP8 bytes labelled fp8 (with their scale) load and generate."""
    _lie(art, None, _fp8_labelled({"format": "fp8_e4m3", "activation": "fp8_dynamic_per_token"}))
    assert runtime.load(art).generate("hi", max_new_tokens=2)[0].token_ids


@pytest.mark.parametrize("model_type, path, value, expected", [
    ("mixtral", "layers.0.mlp.top_k", 5, "top_k 5 must be between 1 and the 4 experts"),
    ("mixtral", "layers.0.mlp.top_k", 0, "top_k 0 must be between 1 and the 4 experts"),
    ("mixtral", "layers.0.mlp.routing", "", "an MoE MLP needs routing softmax_topk or sigmoid_group_topk"),
    ("mixtral", "layers.0.mlp.experts", [], "an MoE MLP needs at least one expert"),
    ("mixtral", "layers.0.mlp.intermediate_size", 48, ("experts[0].linears.down (model.layers.0.block_sparse_moe"
                                                      ".experts.0.w2): in_features is 96")),
    ("qwen2_moe", "layers.0.mlp.shared_expert_gate", "model.layers.0.mlp.other_gate", ("shared_expert_gate "
                                                                                     "\"model.layers.0.mlp.other_gate\"")),
    ("deepseek_v3", "layers.1.mlp.n_group", 3, "4 experts do not split into n_group 3 groups"),
    ("deepseek_v3", "layers.1.mlp.topk_group", 0, "layers[1].mlp.topk_group must be a positive integer, got 0"),
    ("deepseek_v3", "layers.1.mlp.routed_scaling_factor", -1.0, "routed_scaling_factor must be a positive number"),
    ("deepseek_v3", "layers.1.mlp.num_shared_experts", -1, "num_shared_experts must be a non-negative integer"),
    ("deepseek_v3", "layers.0.attention.kv_lora_rank", 8, ("linears.kv_a (model.layers.0.self_attn.kv_a_proj_with_mqa)"
                                                          ": out_features is 24, the architecture's other sizes need 16")),
    ("deepseek_v3", "layers.0.attention.q_lora_rank", 0, "q_lora_rank must be a positive integer, got 0"),
    ("deepseek_v3", "layers.0.attention.qk_rope_head_dim", 4, ("head_dim 24 is not qk_nope_head_dim 16 + "
                                                              "qk_rope_head_dim 4")),
    ("deepseek_v3", "layers.0.attention.rotary.interleaved", 1, "rotary.interleaved must be true or false, got 1"),
])
def test_moe_and_mla_fields_are_checked(model_type, path, value, expected):
    """The MoE and MLA fields, on the specs the loader builds for the tiny models of those architectures."""
    from kiln.optimizer.loader_config import build_spec
    from kiln.runtime.spec import spec_from_json
    from tests.tiny_models import TINY_CONFIGS

    data = json.loads(json.dumps(build_spec({"model_type": model_type, **TINY_CONFIGS[model_type]}).to_json()))
    assert json.loads(json.dumps(spec_from_json(data).to_json())) == data  # the intact spec passes
    refused(spec_from_json, _arch(path, value)({"architecture": data})["architecture"], match=expected)
