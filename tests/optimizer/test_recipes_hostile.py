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
