"""Shared fixtures: single-threaded torch, paths to ../shared, tiny checkpoints of every architecture."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parent.parent
SHARED = (ROOT / ".." / "shared").resolve()
STORIES = SHARED / "models" / "stories260K"
EVAL_TEXT = SHARED / "data" / "tinystories" / "evaluation.txt"
CALIB_TEXT = SHARED / "data" / "tinystories" / "calibration.txt"

needs_stories = pytest.mark.skipif(not (STORIES / "config.json").is_file(), reason="../shared/models absent")


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """model_type -> directory of a saved tiny random model (built once per session)."""
    from tests.tiny_models import TINY_CONFIGS, make_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    return {mt: make_tiny_checkpoint(mt, root / mt) for mt in TINY_CONFIGS}


@pytest.fixture
def stories_graph():
    """A fresh graph of the real model (1 MB; tests may rewrite it)."""
    from optimizer.loader import load_checkpoint

    if not (STORIES / "config.json").is_file():
        pytest.skip("../shared/models absent")
    return load_checkpoint(STORIES)
