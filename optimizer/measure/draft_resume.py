"""A draft head's resume source (the draft-head pass's `init_from`): another artifact's head, read and checked
here, where the optimizer may read artifacts, and handed to the pass through `RuntimeRunner.resumed_head`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from safetensors import safe_open

from kiln.kernels.errors import KilnError, clip
from kiln.passes.base import Pass
from kiln.passes.draft_head import DRAFT_KINDS, DraftHead, head_module
from kiln.passes.graph import ModelGraph
from kiln.runtime.artifact import WEIGHTS, artifact_file, read_manifest
from kiln.runtime.spec import ExtraModuleSpec, spec_from_json


def check_init_from(passes: Sequence[Pass], graph: ModelGraph) -> None:
    """Refuse, before the build runs, a draft-head `init_from` that cannot start this graph's head
    (`resume_source` without the checksums, which the pass verifies when it reads the head)."""
    if any(m.kind in DRAFT_KINDS for m in graph.spec.extra_modules):
        return  # the checkpoint's own module drafts; nothing trains
    for p in passes:
        if isinstance(p, DraftHead) and p.init_from:
            resume_source(p.init_from, graph, head_module(graph, p.resolved(graph), p.draft_vocab), verify=False)


def resume_source(path: str, graph: ModelGraph, module: ExtraModuleSpec, verify: bool = True) -> tuple[dict, str]:
    """(artifact `path`'s manifest, where-prefix for errors), refused in one line unless it reads (with every
    checksum when `verify`), came from `graph`'s source config, and carries a head of exactly `module`'s
    structure (its tree width aside: verification's, not the head's)."""
    where = f"draft-head: init_from {clip(path)}"
    manifest = read_manifest(path, verify=verify)
    source = (manifest.get("source") or {}).get("config_sha256")
    if source and graph.source.config_sha256 and source != graph.source.config_sha256:
        raise KilnError(f"{where} was built from another model (its source config differs); a head drafts "
                        "only for the model it was trained on")
    theirs = [m for m in spec_from_json(manifest["architecture"]).extra_modules if m.kind in DRAFT_KINDS]
    if not theirs:
        raise KilnError(f"{where} has no draft head to start from")
    head = dataclasses.replace(theirs[0], tree_width=module.tree_width)
    if head != module:
        raise KilnError(f"{where}: its head ({describe_head(head)}) is not this recipe's ({describe_head(module)}); "
                        "set architecture and draft_vocab as its build did")
    return manifest, where


def resumed_head(path: str, graph: ModelGraph, module: ExtraModuleSpec,
                 init: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], str]:
    """The draft head of artifact `path` (`resume_source`) in place of `init`: the same names, floating tensors
    as float32; and a note saying where it came from."""
    manifest, where = resume_source(path, graph, module)
    out = {}
    with safe_open(artifact_file(path, manifest, WEIGHTS), framework="pt") as f:
        stored = set(f.keys())
        for name, fresh in init.items():
            if name not in stored:  # the structure check read the header: a head listing a tensor it lacks
                raise KilnError(f"{where}: its weights have no {name}")
            value = f.get_tensor(name)
            if value.shape != fresh.shape:  # the equal specs make this a corrupt file's
                raise KilnError(f"{where}: {name} is {list(value.shape)}, this head's is {list(fresh.shape)}")
            out[name] = value.float() if value.is_floating_point() else value.to(fresh.dtype)
    steps = sum(int(r.get("config", {}).get("train_steps", 0)) for r in manifest.get("passes", [])
                if r.get("config", {}).get("pass") == "draft-head")
    return out, (f"started from {clip(path)}'s {module.kind} head ({steps} steps in its build), not a random "
                 "init" + (", with its draft vocabulary" if module.draft_vocab else ""))


def describe_head(module: ExtraModuleSpec) -> str:
    vocab = (f", drafting over {module.linears['lm_head'].out_features} tokens"
             if module.draft_vocab and "lm_head" in module.linears else "")
    kind = "mtp" if module.kind == "draft_head" else module.kind  # the recipe's architecture names
    return kind + (f" reading layers {list(module.aux_layers)}" if module.aux_layers else "") + vocab
