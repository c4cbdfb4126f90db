"""Shared fixtures: single-threaded torch, paths to ../shared, tiny checkpoints of every architecture."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from kiln.optimizer.numerics import pin_cpu_numerics

# the CLI's MKL and OpenBLAS modes, set before torch or scipy computes anything (the tests build as it does)
pin_cpu_numerics()

import torch

from kiln.optimizer.defaults import CALIBRATION_TEXT, EVALUATION_TEXT, PROJECT_ROOT, STORIES260K

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)

# the names tests import
ROOT, STORIES, CALIB_TEXT, EVAL_TEXT = PROJECT_ROOT, STORIES260K, CALIBRATION_TEXT, EVALUATION_TEXT

needs_stories = pytest.mark.skipif(not (STORIES / "config.json").is_file(), reason="../shared/models absent")
GEMMA3 = Path(os.environ.get("KILN_GEMMA3", Path.home() / ".cache" / "kiln" / "gemma-3-270m"))
needs_gemma3 = pytest.mark.skipif(not (GEMMA3 / "config.json").is_file(),
                                  reason="Gemma 3 270M not converted (../shared/models/gemma-3-270m/to_hf.py)")


def untuned(name: str):
    """Built-in recipe `name` (same name, passes and formats) without its end-to-end tuning: for tests that need
    the recipe's artifact layout, not its calibrated accuracy (200 tuning steps are about a minute of CPU)."""
    from kiln.optimizer.recipes import Recipe, resolve_recipe

    recipe = resolve_recipe(name)
    return Recipe(recipe.name, tuple(dataclasses.replace(p, tune_steps=0) for p in recipe.passes))


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """model_type -> directory of a saved tiny random model (built once per session)."""
    from tests.tiny_models import TINY_CONFIGS, make_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    return {mt: make_tiny_checkpoint(mt, root / mt) for mt in TINY_CONFIGS}


@pytest.fixture
def stories_graph():
    """A fresh graph of the real model (1 MB; tests may rewrite it)."""
    from kiln.optimizer.loader import load_checkpoint

    if not (STORIES / "config.json").is_file():
        pytest.skip("../shared/models absent")
    return load_checkpoint(STORIES)


@pytest.fixture(scope="session")
def generated_checkpoint(tmp_path_factory):
    """The embedded fallback checkpoint (random Llama with a real tokenizer): usable without ../shared."""
    from kiln.optimizer.defaults import generated_checkpoint as make

    return make(tmp_path_factory.mktemp("generated") / "ckpt")


MAX_MESSAGE = 300  # the CLI's bound on an error line


def benchmark(name: str):
    """A script of benchmarks/ as a module (they are scripts, not a package), to test its pure functions."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"kiln_benchmark_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def refused(call, *args, match: str) -> str:
    """Call `call(*args)`, expect a KilnError whose message holds `match` on one bounded line; return it."""
    from kiln.kernels.errors import KilnError

    with pytest.raises(KilnError) as info:
        call(*args)
    message = str(info.value)
    assert match in message, message
    assert "\n" not in message and len(message) <= MAX_MESSAGE, message
    return message


@pytest.fixture(scope="session")
def plain_artifact(generated_checkpoint, tmp_path_factory):
    """An artifact of the generated checkpoint with no passes (built once; tests tamper with copies)."""
    from kiln.optimizer.build import build

    return build(generated_checkpoint, "hopper", "none", tmp_path_factory.mktemp("plain") / "art", gate=False).path


@pytest.fixture
def art(plain_artifact, tmp_path):
    """A fresh copy of `plain_artifact` to tamper with."""
    import shutil

    return shutil.copytree(plain_artifact, tmp_path / "art")


@pytest.fixture
def cli(capsys, monkeypatch):
    """Run `optimize ARGS...` in-process; returns (exit code, stdout, stderr)."""
    import sys

    from kiln.optimizer.cli import main

    def run(*args: str) -> tuple[int, str, str]:
        monkeypatch.setattr(sys, "argv", ["optimize", *map(str, args)])
        code = 0
        try:
            main()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run
