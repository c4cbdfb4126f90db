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
