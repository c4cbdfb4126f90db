"""Recipe files from hostile hands: bounded parsing, no code import without the opt-in, one-line refusals."""

from __future__ import annotations

import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from kiln.kernels.errors import KilnError
from kiln.optimizer.recipes import MAX_RECIPE_BYTES, Recipe, build_pass, load_recipe_file, resolve_recipe
from kiln.passes.weight_quant import WeightQuantization
from tests.conftest import ROOT

MAX_MESSAGE = 300

BILLION_LAUGHS = """\
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
passes: [*i]
"""


def _refused(call, *args, match: str, **kwargs) -> str:
    with pytest.raises(KilnError) as info:
        call(*args, **kwargs)
    message = str(info.value)
    assert match in message, message
    assert "\n" not in message and len(message) <= MAX_MESSAGE, message
    return message


def _recipe(tmp_path: Path, text: str | bytes, name: str = "r.yaml") -> Path:
    path = tmp_path / name
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


# --- 5. bounded parsing ----------------------------------------------------------------------------------
def test_a_yaml_bomb_is_refused_fast_in_little_memory(tmp_path):
    path = _recipe(tmp_path, BILLION_LAUGHS)
    tracemalloc.start()
    start = time.perf_counter()
    try:
        _refused(resolve_recipe, str(path), match="YAML aliases (*name) are not allowed in recipe files (line 2)")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - start < 2.0
    assert peak < 20 * 2**20


def test_even_a_single_alias_is_refused(tmp_path):
    path = _recipe(tmp_path, "passes:\n  - &q {pass: weight-quant, format: fp8}\n  - *q\n")
    _refused(load_recipe_file, path, match="YAML aliases (*name) are not allowed")
    path = _recipe(tmp_path, "base: &b {format: fp8}\npasses:\n  - {pass: weight-quant, <<: *b}\n")
    _refused(load_recipe_file, path, match="YAML aliases (*name) are not allowed")


def test_a_big_file_is_refused_before_parsing(tmp_path):
    path = _recipe(tmp_path, "passes: []\n" + "#" * MAX_RECIPE_BYTES)
    _refused(load_recipe_file, path, match=f"is larger than {MAX_RECIPE_BYTES} bytes")


@pytest.mark.parametrize("text, expected", [
    ("passes: " + "[" * 5000 + "]" * 5000, "nested deeper than"),
    ("passes: [" + "1," * 50_000 + "1]", "more than 20000 YAML nodes"),
    ("passes: [\n  - pass: weight-quant\n format: :\n", "is not valid YAML"),
    ("!!python/object/apply:os.system ['touch pwned']\n", "is not valid YAML"),
    ("passes: []\nname: !!python/name:os.system\n", "is not valid YAML"),
    (b"\xff\xfe passes: []", "is not UTF-8 text"),
    ("passes: []\n---\npasses: []\n", "is not valid YAML"),
])
def test_odd_documents_are_one_line(tmp_path, text, expected):
    _refused(load_recipe_file, _recipe(tmp_path, text), match=expected)
    assert not (tmp_path / "pwned").exists()


# --- 6. custom passes need the opt-in --------------------------------------------------------------------
MARKER_MODULE = """\
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from kiln.passes.base import Pass, PassResult

Path({marker!r}).write_text("imported")


@dataclass(frozen=True)
class Noop(Pass):
    name: ClassVar[str] = "noop"
    factor: float = 1.0

    def apply(self, graph, ctx):
        return PassResult(self.name)
"""


@pytest.fixture
def custom_module(tmp_path, monkeypatch):
    """A module in the cwd that writes a marker file when imported; (module name, marker path)."""
    name = f"hostile_pass_{tmp_path.name.replace('-', '_')}"
    marker = tmp_path / "marker"
    (tmp_path / f"{name}.py").write_text(MARKER_MODULE.format(marker=str(marker)))
    monkeypatch.chdir(tmp_path)
    yield name, marker
    sys.modules.pop(name, None)


def test_a_custom_pass_is_refused_without_the_opt_in_and_never_imported(tmp_path, custom_module):
    module, marker = custom_module
    path = _recipe(tmp_path, f"name: sneaky\npasses:\n  - pass: {module}:Noop\n")
    path_before = list(sys.path)
    for call in (lambda: resolve_recipe(str(path)), lambda: load_recipe_file(path),
                 lambda: build_pass({"pass": f"{module}:Noop"})):
        _refused(call, match=f"custom pass '{module}:Noop' names Python code from outside Kiln; importing it "
                             "needs --allow-custom-passes")
    assert not marker.exists() and module not in sys.modules and sys.path == path_before


def test_the_refusal_comes_before_any_import_even_after_built_in_passes(tmp_path, custom_module):
    module, marker = custom_module
    path = _recipe(tmp_path, f"passes:\n  - pass: weight-quant\n    format: fp8\n  - pass: {module}:Noop\n")
    message = _refused(resolve_recipe, str(path), match="needs --allow-custom-passes")
    assert "pass 2" in message and not marker.exists()


def test_with_the_opt_in_a_custom_pass_is_imported_and_sys_path_is_left_alone(tmp_path, custom_module):
    module, marker = custom_module
    path = _recipe(tmp_path, f"name: mine\npasses:\n  - pass: {module}:Noop\n    factor: 2.0\n"
                             "  - pass: weight-quant\n    format: fp8\n")
    path_before = list(sys.path)
    recipe = resolve_recipe(str(path), allow_custom_passes=True)
    assert isinstance(recipe, Recipe) and recipe.name == "mine"
    assert type(recipe.passes[0]).__name__ == "Noop" and recipe.passes[0].factor == 2.0
    assert isinstance(recipe.passes[1], WeightQuantization)
    assert marker.read_text() == "imported" and sys.path == path_before


def test_the_example_recipe_needs_the_opt_in(monkeypatch):
    monkeypatch.chdir(ROOT)
    example = ROOT / "examples" / "custom_recipe.yaml"
    _refused(resolve_recipe, str(example), match="needs --allow-custom-passes")
    recipe = resolve_recipe(str(example), allow_custom_passes=True)
    assert recipe.name == "custom-example" and len(recipe.passes) == 2


@pytest.mark.parametrize("source, expected", [
    (None, "ModuleNotFoundError"),
    ("def broken(:\n", "SyntaxError"),
    ("raise RuntimeError('boom\\nsecond line')\n", "RuntimeError: boom"),
    ("import sys\nsys.exit(3)\n", "SystemExit: 3"),
    ("import no_such_dependency_of_kiln\n", "ModuleNotFoundError: No module named 'no_such_dependency_of_kiln'"),
    ("raise KeyError('x' * 10000)\n", "KeyError"),
])
def test_with_the_opt_in_an_import_failure_is_one_line(tmp_path, monkeypatch, source, expected):
    name = f"broken_pass_{tmp_path.name.replace('-', '_')}"
    if source is not None:
        (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    path = _recipe(tmp_path, f"passes:\n  - pass: {name}:Thing\n")
    path_before = list(sys.path)
    try:
        _refused(resolve_recipe, str(path), allow_custom_passes=True,
                 match=f"cannot import custom pass module '{name}': {expected}")
    finally:
        sys.modules.pop(name, None)
    assert sys.path == path_before


@pytest.mark.parametrize("ref", ["os.path/../x:C", "..relative:C", "mod:", ":Class", "mod:Class.attr", "a b:C"])
def test_malformed_custom_pass_names_are_refused(tmp_path, ref):
    path = _recipe(tmp_path, f"passes:\n  - pass: '{ref}'\n")
    _refused(resolve_recipe, str(path), allow_custom_passes=True, match="must be written module:Class")


def test_an_object_that_is_not_a_pass_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = _recipe(tmp_path, "passes:\n  - pass: os:getcwd\n")
    _refused(resolve_recipe, str(path), allow_custom_passes=True, match="'os:getcwd' is not a Pass dataclass")


# --- 7. only name and passes -----------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("target: blackwell\npasses: []\n", "recipe files do not set the target; pass --target"),
    ("passes: []\nfoo: 1\n", "unknown key 'foo'; a recipe file has only name and passes"),
    ("passes: []\n1: x\nbar: y\n", "unknown key 1 (+1 more)"),
    ("name: [a]\npasses: []\n", "'name' must be a non-empty string, got a list"),
    ("name: 12\npasses: []\n", "'name' must be a non-empty string, got 12"),
    ("name: x\n", "needs a 'passes' list, got None"),
    ("passes: {pass: weight-quant}\n", "needs a 'passes' list, got a dict"),
    ("- pass: weight-quant\n", "must be a mapping with a 'passes' list, got a list"),
    ("just text\n", "must be a mapping with a 'passes' list, got 'just text'"),
    ("", "must be a mapping with a 'passes' list, got None"),
    ("passes: [weight-quant]\n", "pass 1: each recipe entry must be a mapping with a 'pass' key, got 'weight-quant'"),
    ("passes: [{format: fp8}]\n", "each recipe entry must be a mapping with a 'pass' key"),
    ("passes: [{pass: [weight-quant]}]\n", "a recipe entry's 'pass' must be a pass name, got a list"),
    ("passes: [{pass: weight-quant, 3: fp8}]\n", "recipe entry keys must be field names, got 3"),
    ("passes: [{pass: weight-quant, formatt: fp8}]\n", "pass 'weight-quant' has no field(s) formatt"),
    ("passes: [{pass: weight-quant, format: {a: 1}}]\n", "pass 1: format={'a': 1} is not allowed"),
    (f"passes: [{{pass: weight-quant, format: {'f' * 100_000}}}]\n", "pass 1: format='fff"),
    ("passes: [{pass: warp-drive}]\n", "unknown pass 'warp-drive'"),
])
def test_recipe_file_shape_is_checked(tmp_path, text, expected):
    _refused(load_recipe_file, _recipe(tmp_path, text), match=expected)


def test_a_good_recipe_still_loads(tmp_path):
    recipe = load_recipe_file(_recipe(tmp_path, "name: ok\npasses:\n  - pass: weight-quant\n    format: fp8\n"))
    assert recipe.name == "ok" and isinstance(recipe.passes[0], WeightQuantization)
    assert load_recipe_file(_recipe(tmp_path, "passes: []\n", "stem.yml")).name == "stem"


def test_long_values_keep_messages_bounded(tmp_path):
    path = _recipe(tmp_path, f"passes:\n  - pass: {'w' * 100_000}\n")
    assert "…" in _refused(load_recipe_file, path, match="unknown pass")
    path = _recipe(tmp_path, f"passes: []\n? {'k' * 100_000}\n: 1\n")
    _refused(load_recipe_file, path, match="unknown key")
    _refused(resolve_recipe, "x" * 100_000, match="unknown recipe")
    _refused(resolve_recipe, "y" * 100_000 + ".yaml", match="not found")
    _refused(resolve_recipe, "line\nbreak.yaml", match="recipe file line\\nbreak.yaml not found")


# --- 6. every numeric field typed and bounded; conflicting passes refused before any work (issue #18, 3) -------
@pytest.mark.parametrize("entry, expected", [
    ("{pass: weight-quant, tune_lr: .inf}", "tune_lr must be a finite number in (0, 1], got inf"),
    ("{pass: weight-quant, tune_lr: .nan}", "tune_lr must be a finite number in (0, 1], got nan"),
    ("{pass: mla, kv_fraction: 0.5, heal_lr: .inf}", "heal_lr must be a finite number in (0, 1], got inf"),
    ("{pass: draft-head, tree_width: 2.5}", "tree_width must be an integer in [1, 8] (1: a chain), got 2.5"),
    ("{pass: draft-head, seed: 'x'}", "seed must be an integer in [0, 4294967295], got 'x'"),
    ("{pass: draft-head, seed: 1180591620717411303424}", "seed must be an integer in [0, 4294967295]"),
    ("{pass: draft-head, min_tau: .inf}", "min_tau must be >= 1"),
    ("{pass: weight-quant, tune_steps: 1000000000000}", "tune_steps must be an integer in [0, 100000]"),
    ("{pass: weight-quant, max_back_offs: true}", "max_back_offs must be an integer in [0, 64]"),
    ("{pass: weight-quant, damping: -.inf}", "damping must be a finite number in [0, 1], got -inf"),
    ("{pass: weight-quant, rotation_block: 1048576}", "rotation_block must be an integer in [0, 4096]"),
    ("{pass: auto-precision, weight_bits: .nan}", "weight_bits must be a finite number in (0, 16], got nan"),
    ("{pass: auto-precision, weight_bits: 5, tune_samples: 10000000}", "tune_samples must be an integer in [0, 100000]"),
    ("{pass: production-precision, keep_most_sensitive: 1.5}", "keep_most_sensitive must be an integer >= 0"),
    ("{pass: kv-cache, sensitivity_paragraphs: 1e9}", "sensitivity_paragraphs must be an integer in [1, 100000]"),
    ("{pass: kv-cache, keep: [0, 1.5]}", "keep entry (a layer index) must be an integer >= 0, got 1.5"),
    ("{pass: mla, kv_fraction: true}", "kv_fraction must be a finite number in (0, 1] or null, got true"),
    ("{pass: mla, kv_fraction: 0.5, heal_steps: 10000000}", "heal_steps must be an integer in [0, 100000]"),
    ("{pass: mla, kv_fraction: 0.5, layers: [0, x]}", "layers entry (a layer index) must be an integer >= 0"),
    ("{pass: draft-head, batch_tokens: 0}", "batch_tokens must be an integer in [1, 1048576], got 0"),
    ("{pass: fuse, max_logit_diff: .inf}", "max_logit_diff must be a finite number in (0, 1), got inf"),
])
def test_numeric_fields_out_of_range_are_refused_when_parsed(tmp_path, entry, expected):
    path = _recipe(tmp_path, f"passes:\n  - {entry}\n")
    message = _refused(load_recipe_file, path, match=expected)
    assert message.startswith("recipe file ") and ", pass 1: " in message, message


def test_check_range_names_the_value_and_the_range():
    from kiln.passes.base import check_range

    check_range("n", 3, 1, 8, integer=True)
    check_range("x", None, 0, 1, optional=True)
    check_range("big", 10**400, 0, integer=True)  # compared as an int, never converted to a float
    _refused(check_range, "n", True, 1, 8, integer=True, match="n must be an integer in [1, 8], got true")
    _refused(check_range, "x", 10**400, 0, 1, match="x must be a finite number in [0, 1], got 1000")
    _refused(check_range, "x", 0.0, 0, low_open=True, why="why", match="x must be a finite number > 0 (why), got 0.0")


@pytest.mark.parametrize("spec, expected", [
    ("fp8-kv,nvfp4-kv", "two 'kv-cache' passes both set the KV cache's format"),
    ("fp8-weights,nvfp4-w4a16", "two 'weight-quant' passes both quantize the same linears"),
    ("production,fp8-weights", "'production-precision' and 'weight-quant' both set the weights' format"),
    ("production,production", "two 'production-precision' passes both set the weights' format"),
    ("draft-head,draft-head", "two 'draft-head' passes both set the draft module"),
    ("fuse,fp8-weights", "'fuse' must be the last pass"),
])
def test_conflicting_built_in_recipes_are_refused_at_once(spec, expected):
    start = time.perf_counter()
    _refused(resolve_recipe, spec, match=expected)
    assert time.perf_counter() - start < 1.0


def test_mla_twice_is_refused_before_any_pass_runs():
    _refused(resolve_recipe, "mla,mla", kv_fraction=0.5, match="two 'mla' passes both set the attention's structure")


def test_a_recipe_file_with_two_kv_passes_is_refused(tmp_path):
    path = _recipe(tmp_path, "passes:\n  - {pass: kv-cache, format: fp8}\n  - {pass: kv-cache, format: nvfp4}\n")
    message = _refused(load_recipe_file, path, match="two 'kv-cache' passes both set the KV cache's format")
    assert message.startswith("recipe file ") and ": recipe conflict: " in message, message


def test_passes_that_split_the_model_still_combine(tmp_path):
    """What is not a conflict: weight passes on disjoint roles, a precision pass after a weight pass (it takes
    what the weight pass left), and one pass of each kind in their order."""
    split = _recipe(tmp_path, "passes:\n  - {pass: weight-quant, roles: [q, k, v, o]}\n"
                              "  - {pass: weight-quant, format: nvfp4, roles: [gate, up, down]}\n"
                              "  - {pass: production-precision}\n")
    assert [p.name for p in load_recipe_file(split).passes] == ["weight-quant", "weight-quant", "production-precision"]
    assert len(resolve_recipe("fp8-weights,fp8-kv,draft-head,fuse").passes) == 4


def test_build_refuses_a_conflicting_recipe_before_loading_anything(tmp_path):
    from kiln.optimizer.build import build

    start = time.perf_counter()
    _refused(build, tmp_path / "no-such-checkpoint", "hopper", "fp8-weights,nvfp4-w4a16", tmp_path / "out",
             match="two 'weight-quant' passes")
    assert time.perf_counter() - start < 2.0 and not (tmp_path / "out").exists()
