"""Rebuild built-in recipes on stories260K and hash what each artifact holds.

    python benchmarks/byte_identity.py --save before.json        # record
    python benchmarks/byte_identity.py --against before.json     # rebuild and compare (exit 1 on a difference)

Each recipe is built with `--reproducible --no-gate` (timings left out), so two builds of one tree give the
same bytes and a refactor that changes no figure gives the same bytes as the tree before it. The table lists
the sha256 of model.safetensors, and of every other file the artifact holds.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
MLA_NO_HEAL = "name: mla-no-heal\npasses:\n  - pass: mla\n    kv_fraction: 0.5\n    heal_steps: 0\n"
RECIPES = ("fp8-weights", "fp8", "nvfp4-w4a16", "fp8-kv", "fp8-weights,fuse", "mla-no-heal")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build(recipe: str, work: Path, checkpoint: Path, calib: Path) -> dict[str, str]:
    """Build `recipe` into `work` and return {file: sha256} of the artifact."""
    spec = recipe
    if recipe == "mla-no-heal":
        spec = str(work / "mla-no-heal.yaml")
        Path(spec).write_text(MLA_NO_HEAL)
    out = work / recipe.replace(",", "+")
    cmd = [sys.executable, "-m", "kiln.optimizer.cli", "build", str(checkpoint), "--recipe", spec, "-o", str(out),
           "--calib-data", str(calib), "--reproducible", "--no-gate"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{recipe}: build failed (exit {done.returncode}): {done.stderr.strip()[-400:]}")
    return {p.relative_to(out).as_posix(): _sha(p) for p in sorted(out.rglob("*")) if p.is_file()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save", type=Path, help="write the hashes to this JSON file")
    parser.add_argument("--against", type=Path, help="compare with hashes saved by --save (exit 1 if any differ)")
    parser.add_argument("--keep", type=Path, help="build into this directory and keep the artifacts there")
    parser.add_argument("--recipes", default=",".join(RECIPES).replace(",fuse", "+fuse"),
                        help="recipes to build, comma-separated ('+' joins a compound recipe)")
    args = parser.parse_args()
    checkpoint, calib = SHARED / "models" / "stories260K", SHARED / "data" / "tinystories" / "calibration.txt"
    if not (checkpoint / "config.json").is_file():
        raise SystemExit(f"no {checkpoint}: this check needs the shared stories260K")
    recipes = [r.replace("+", ",") for r in args.recipes.split(",")]
    saved = json.loads(args.against.read_text()) if args.against else {}
    hashes, differ = {}, 0
    print("| recipe | model.safetensors sha256 | files | against saved |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            work = args.keep
        for recipe in recipes:
            hashes[recipe] = files = build(recipe, work, checkpoint, calib)
            verdict = ""
            if args.against:
                old = saved.get(recipe)
                if old is None:
                    verdict = "not saved"
                else:
                    changed = sorted(k for k in set(old) | set(files) if old.get(k) != files.get(k))
                    verdict = "identical" if not changed else "DIFFERS: " + ", ".join(changed)
                    differ += bool(changed)
            print(f"| `{recipe}` | `{files['model.safetensors'][:16]}` | {len(files)} | {verdict} |", flush=True)
    if args.save:
        args.save.write_text(json.dumps(hashes, indent=1, sort_keys=True) + "\n")
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
