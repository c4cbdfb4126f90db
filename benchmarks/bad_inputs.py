"""Bad and hostile inputs through the installed `optimize` console script, as a user (or an attacker) gives them.

    python benchmarks/bad_inputs.py [--out FILE.md] [--only SUBSTRING]

Each case runs `optimize ...` in a subprocess (OMP_NUM_THREADS=1, cwd a temporary directory) and declares the
exit code it expects: 0 pass, 1 below a floor, 2 bad input or usage, 130 SIGINT, 143 SIGTERM. A case behaves
when its exit code is the expected one, stderr holds no traceback and (for a non-zero exit) exactly one error
line, the last one, and its own check (a user's file survived, nothing was left behind, ...) holds. The script
prints a Markdown table and a summary line, and exits 1 if any case misbehaves.

The model is the real stories260K (../shared/models) with its evaluation text when present, else the small
generated checkpoint with the bundled sample text. Broken checkpoints come from tests/breakage.py.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kiln.optimizer.defaults import EVALUATION_TEXT, SAMPLE_TEXT, STORIES260K, generated_checkpoint
from tests.breakage import KINDS, broken_copy

OPTIMIZE = shutil.which("optimize") or str(Path(sys.executable).parent / "optimize")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
ERROR_PREFIXES = ("error:", "gate failed:", "interrupted", "terminated")
MAX_LINE = 300  # the CLI's promise (optimizer.cli.app.MAX_MESSAGE)
SHOWN = 220  # longest stderr line printed in the table
TIMEOUT = 300  # seconds per case


# --- what a case is ---------------------------------------------------------------------------------------
@dataclass
class Result:
    code: int | None  # None: timed out
    stderr: str
    seconds: float
    note: str = ""  # from the runner (e.g. the interruption point was never reached)

    @property
    def lines(self) -> list[str]:
        return [line for line in self.stderr.strip().splitlines() if line.strip()]


Check = Callable[[Result], tuple[bool, str]]
"""A case's own check: (holds, a note shown next to the case name)."""


@dataclass
class Interrupt:
    signum: int
    ready: Callable[[list[str]], bool]  # given the stderr lines so far: time to send the signal?


@dataclass
class Case:
    name: str
    args: list[str]
    expect: int
    setup: Callable[[], None] | None = None
    check: Check | None = None
    show: str | None = None  # show the first stderr line containing this (a warning) instead of the last line
    cwd: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    interrupt: Interrupt | None = None


# --- the workspace: a checkpoint, eval text, two artifacts, and the places cases write ----------------------
class Workspace:
    def __init__(self, tmp: Path, generated: bool = False):
        self.tmp = tmp
        self.work = tmp / "work"  # the default cwd
        self.work.mkdir()
        if not generated and (STORIES260K / "config.json").is_file() and EVALUATION_TEXT.is_file():
            self.ckpt, self.text, self.model = STORIES260K, EVALUATION_TEXT, "stories260K"
        else:
            self.ckpt, self.text = generated_checkpoint(tmp / "gen"), SAMPLE_TEXT
            self.model = "generated checkpoint" + (" (--generated)" if generated else " (../shared absent)")
        self.ckpt_copy = tmp / "ckpt-copy"  # the cases that aim the output at the input get a copy, never ../shared
        self.a = tmp / "art-none"
        self.f = tmp / "art-fp8"
        self.other = tmp / "other-model"
        self.outs = tmp / "outs"  # build outputs that must not appear
        self.outs.mkdir()
        self.broken = tmp / "broken"
        self.hostile = tmp / "hostile"
        self.recipes = tmp / "recipes"
        for d in (self.broken, self.hostile, self.recipes):
            d.mkdir()

    def prepare(self) -> None:
        shutil.copytree(self.ckpt, self.ckpt_copy)
        for path, recipe in ((self.a, "none"), (self.f, "fp8-weights")):
            proc = subprocess.run([OPTIMIZE, "build", str(self.ckpt), "--recipe", recipe, "-o", str(path), "--no-gate"],
                                  capture_output=True, text=True, env=ENV, cwd=self.work, timeout=TIMEOUT,
                                  check=False)
            if proc.returncode != 0:
                sys.exit(f"could not build the {recipe} artifact the cases need:\n{proc.stderr}")
        scrambled_copy(self.ckpt, self.other)

    def shorten(self, text: str) -> str:
        """Long paths as $NAMES, longest first, so a command or message fits a table cell."""
        names = [(self.a, "$A"), (self.f, "$F"), (self.ckpt_copy, "$CKPT_COPY"), (self.other, "$OTHER"),
                 (self.ckpt, "$CKPT"), (self.text, "$TEXT"), (self.tmp, "$TMP"), (ROOT, "$REPO")]
        for path, name in sorted(names, key=lambda pair: -len(str(pair[0]))):
            text = text.replace(str(path), name)
        return text


def scrambled_copy(src: Path, dst: Path) -> None:
    """`src` with every matrix replaced by seeded noise ten times its scale: another model that shares the
    tokenizer, config and shapes (so it passes every check but the source hash) and predicts confidently
    wrong tokens, so that it is far from the source even when the source is the random generated model."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    gen = torch.Generator().manual_seed(0)
    tensors = load_file(dst / "model.safetensors")
    for name, t in tensors.items():
        if t.is_floating_point() and t.dim() >= 2:
            noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
            tensors[name] = (noise * 10 * t.float().std()).to(t.dtype)
    save_file(tensors, dst / "model.safetensors")


def digest_tree(root: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        h.update(str(path.relative_to(root)).encode())
        if path.is_file():
            h.update(path.read_bytes())
    return h.hexdigest()


# --- checks -----------------------------------------------------------------------------------------------
def nothing_left(out: Path) -> Check:
    """No output directory and no `.NAME.tmp-*` / `.NAME.old-*` beside it."""
    def check(_: Result) -> tuple[bool, str]:
        debris = [p.name for p in out.parent.glob(f".{out.name}.*")]
        if out.exists() or debris:
            return False, f"LEFT BEHIND: {', '.join(([out.name] if out.exists() else []) + debris)}"
        return True, "nothing left"
    return check


def file_kept(path: Path, content: str) -> Check:
    def check(_: Result) -> tuple[bool, str]:
        ok = path.is_file() and path.read_text() == content
        return ok, "file kept" if ok else f"FILE LOST: {path.name}"
    return check


def unchanged(root: Path, before: dict) -> Check:
    def check(_: Result) -> tuple[bool, str]:
        ok = root.is_dir() and digest_tree(root) == before.get("digest")
        return ok, "input unchanged" if ok else "INPUT CHANGED"
    return check


# --- the cases --------------------------------------------------------------------------------------------
def make_cases(w: Workspace) -> list[Case]:
    ckpt, text, a, f = str(w.ckpt), str(w.text), str(w.a), str(w.f)
    quick = ["--recipe", "none", "--no-gate"]
    prompt = ["Once upon a time", "--max-new-tokens", "4"]
    cases: list[Case] = []

    def out(name: str) -> Path:
        return w.outs / name

    # usage
    cases += [
        Case("usage: unknown flag", ["build", "--no-such-flag"], 2),
        Case("usage: missing argument", ["eval"], 2),
        Case("usage: --paragraphs abc", ["eval", a, "--data", text, "--paragraphs", "abc"], 2),
        Case("usage: unknown command", ["frobnicate"], 2),
        Case("usage: no command", [], 2),
    ]

    # signals: a custom pass that touches a marker and stalls, imported from the repo (PYTHONPATH)
    def stall_case(name: str, signum: int, expect: int) -> Case:
        marker, recipe, target = w.tmp / f"{name}.marker", w.recipes / f"{name}.yaml", out(name)
        recipe.write_text(f"passes:\n  - pass: tests.passes.destructive:Stall\n    marker: {marker}\n")
        return Case(f"{signal.Signals(signum).name} during build (stalled pass)",
                    ["build", ckpt, "--recipe", str(recipe), "--allow-custom-passes", "-o", str(target),
                     "--eval-data", text], expect, check=nothing_left(target), env={"PYTHONPATH": str(ROOT)},
                    interrupt=Interrupt(signum, lambda lines: marker.exists()))

    long_text = w.tmp / "long-eval.txt"  # enough paragraphs that the gate is still scoring when the signal comes

    def write_long_text() -> None:
        paragraphs = [p for p in w.text.read_text().split("\n\n") if p.strip()]
        long_text.write_text("\n\n".join((paragraphs * (2000 // len(paragraphs) + 1))[:2000]))

    cases += [
        stall_case("sigint-build", signal.SIGINT, 130),
        Case("SIGINT during gate (after 'scoring')",
             ["gate", a, "--baseline", ckpt, "--data", str(long_text), "--min-recovery", "0.9", "--paragraphs", "2000"],
             130, setup=write_long_text,
             interrupt=Interrupt(signal.SIGINT, lambda lines: any("scoring" in line for line in lines))),
        stall_case("sigterm-build", signal.SIGTERM, 143),
    ]

    # where the output goes
    user_dir, user_file, cwd_with_file = w.tmp / "userdir", w.tmp / "afile.txt", w.tmp / "cwd-with-file"
    replaced, before_copy = w.tmp / "replaced", {}

    def make_user_dir() -> None:
        user_dir.mkdir(exist_ok=True)
        (user_dir / "notes.txt").write_text("my notes")

    def make_user_file() -> None:
        user_file.write_text("my file")

    def make_cwd() -> None:
        cwd_with_file.mkdir(exist_ok=True)
        (cwd_with_file / "keep.txt").write_text("keep me")

    def snapshot_copy() -> None:
        before_copy["digest"] = digest_tree(w.ckpt_copy)

    def copy_artifact() -> None:
        shutil.rmtree(replaced, ignore_errors=True)
        shutil.copytree(w.a, replaced)

    def replaced_whole(_: Result) -> tuple[bool, str]:
        debris = [p.name for p in replaced.parent.glob(".replaced.*")]
        ok = (replaced / "manifest.json").is_file() and not debris
        return ok, "replaced, no debris" if ok else f"BROKEN REPLACE: debris {debris}"

    before_a = {}

    def snapshot_a() -> None:
        before_a["digest"] = digest_tree(w.a)

    cases += [
        Case("-o DIR --overwrite, DIR holds a user's file", ["build", ckpt, *quick, "-o", str(user_dir), "--overwrite"],
             2, setup=make_user_dir, check=file_kept(user_dir / "notes.txt", "my notes")),
        Case("-o FILE --overwrite", ["build", ckpt, *quick, "-o", str(user_file), "--overwrite"], 2,
             setup=make_user_file, check=file_kept(user_file, "my file")),
        Case("output is the input (-o CKPT --overwrite)",
             ["build", str(w.ckpt_copy), *quick, "-o", str(w.ckpt_copy), "--overwrite"], 2,
             setup=snapshot_copy, check=unchanged(w.ckpt_copy, before_copy)),
        Case("output inside the input (-o CKPT/sub)",
             ["build", str(w.ckpt_copy), *quick, "-o", str(w.ckpt_copy / "sub")], 2,
             setup=snapshot_copy, check=unchanged(w.ckpt_copy, before_copy)),
        Case("-o . --overwrite (cwd holds a file)", ["build", ckpt, *quick, "-o", ".", "--overwrite"], 2,
             setup=make_cwd, cwd=cwd_with_file, check=file_kept(cwd_with_file / "keep.txt", "keep me")),
        Case("-o /proc/x (unwritable)", ["build", ckpt, *quick, "-o", "/proc/x"], 2),
        Case("-o a_file/out (parent is a file)", ["build", ckpt, *quick, "-o", str(user_file / "out")], 2,
             setup=make_user_file, check=file_kept(user_file, "my file")),
        Case("existing artifact, no --overwrite", ["build", ckpt, *quick, "-o", a], 2, setup=snapshot_a,
             check=unchanged(w.a, before_a)),
        Case("existing artifact, --overwrite", ["build", ckpt, *quick, "-o", str(replaced), "--overwrite"], 0,
             setup=copy_artifact, check=replaced_whole),
        Case("export A -o A --overwrite", ["export", f, "-o", f, "--overwrite"], 2),
    ]

    # trusting the wrong inputs
    gate = ["--data", text, "--paragraphs", "50"]
    cases += [
        Case("gate: baseline is another model",
             ["gate", a, "--baseline", str(w.other), *gate, "--min-recovery", "0.9"], 2),
        Case("gate: baseline is the artifact itself", ["gate", a, "--baseline", a, *gate, "--min-recovery", "0.9"], 2),
        Case("build: an artifact given as the checkpoint", ["build", a, *quick, "-o", str(out("from-artifact"))], 2,
             check=nothing_left(out("from-artifact"))),
        # --any-baseline waives the source check, not the text check: the other model cannot read the text
        # (perplexity ~1e62), so no verdict would mean anything (2); with --force too it is compared, and fails (1)
        Case("gate: another model with --any-baseline, on text it cannot read",
             ["gate", a, "--baseline", str(w.other), *gate, "--min-recovery", "0.9", "--any-baseline"], 2),
        Case("gate: another model with --any-baseline --force",
             ["gate", a, "--baseline", str(w.other), *gate, "--min-recovery", "0.9", "--any-baseline", "--force"],
             1),
        Case("gate: the real baseline, floor 0.5", ["gate", f, "--baseline", ckpt, *gate, "--min-recovery", "0.5"], 0),
    ]

    # broken checkpoints (tests/breakage.py), each through a plain build
    for kind in KINDS:
        broken, target = w.broken / kind, out(f"broken-{kind}")
        cases.append(Case(f"broken checkpoint: {kind}", ["build", str(broken), "-o", str(target)], 2,
                          setup=lambda broken=broken, kind=kind: broken_copy(w.ckpt, broken, kind),
                          check=nothing_left(target)))

    extra = w.broken / "extra_tensors"

    def add_extra_tensors() -> None:
        import torch
        from safetensors.torch import load_file, save_file

        shutil.copytree(w.ckpt, extra)
        tensors = load_file(extra / "model.safetensors")
        tensors.update({f"extra.probe.{i}": torch.zeros(4) for i in range(3)})
        save_file(tensors, extra / "model.safetensors")

    cases.append(Case("checkpoint with unused extra tensors", ["build", str(extra), *quick, "-o", str(out("extra"))],
                      0, setup=add_extra_tensors, show="not used"))

    # hostile artifacts (copies of the fp8 artifact), each through inspect and generate
    def hostile(name: str, edit: Callable[[Path, dict], object]) -> Callable[[], None]:
        def setup() -> None:
            root = w.hostile / name
            if root.exists():
                return  # inspect made it, generate reuses it
            shutil.copytree(w.f, root)
            manifest = json.loads((root / "manifest.json").read_text())
            result = edit(root, manifest)
            (root / "manifest.json").write_text(json.dumps(manifest if result is None else result))
        return setup

    def unlisted_config(root: Path, m: dict) -> None:
        del m["files"]["config.json"]
        config = json.loads((root / "config.json").read_text())
        config["num_hidden_layers"] = 1
        (root / "config.json").write_text(json.dumps(config))

    def absolute_name(root: Path, m: dict) -> None:
        m["files"]["/etc/passwd"] = hashlib.sha256(Path("/etc/passwd").read_bytes()).hexdigest()

    def symlinked_config(root: Path, m: dict) -> None:
        outside = w.hostile / f"{root.name}-config.json"  # the same bytes: only the link itself is wrong
        shutil.move(root / "config.json", outside)
        (root / "config.json").symlink_to(outside)

    def extra_file(root: Path, m: dict) -> None:
        (root / "added_tokens.json").write_text('{"<evil>": 0}')  # a tokenizer file the loader would pick up

    hostiles = [
        ("config.json dropped from the files table and edited", "unlisted-config", unlisted_config),
        ("'/etc/passwd' in the files table", "absolute-name", absolute_name),
        ("config.json is a symlink", "symlinked-config", symlinked_config),
        ("manifest is [1,2]", "manifest-array", lambda root, m: [1, 2]),
        ("manifest lacks 'formats'", "no-formats", lambda root, m: m.pop("formats") and None),
        ("schema_version: true", "schema-true", lambda root, m: m.update(schema_version=True)),
        ("an unlisted extra file (added_tokens.json)", "unlisted-file", extra_file),
    ]
    for label, name, edit in hostiles:
        art = str(w.hostile / name)
        cases.append(Case(f"hostile artifact, inspect: {label}", ["inspect", art], 2, setup=hostile(name, edit)))
        cases.append(Case(f"hostile artifact, generate: {label}", ["generate", art, *prompt], 2,
                          setup=hostile(name, edit)))

    # recipe files
    bomb, no_flag, raises, target_key = (w.recipes / n for n in ("bomb.yaml", "custom.yaml", "raises.yaml",
                                                                  "target.yaml"))
    imported = w.tmp / "custom-module-imported"

    def write_recipes() -> None:
        levels = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
        levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
        bomb.write_text("name: laughs\n" + "\n".join(levels) + "\npasses: *a9\n")
        (w.recipes / "kiln_probe_module.py").write_text(
            f"import pathlib\npathlib.Path({str(imported)!r}).touch()\n"
            "from dataclasses import dataclass\nfrom passes.base import Pass\n\n"
            "@dataclass(frozen=True)\nclass Probe(Pass):\n    name = 'probe'\n")
        no_flag.write_text("passes:\n  - pass: kiln_probe_module:Probe\n")
        (w.recipes / "kiln_raising_module.py").write_text("raise RuntimeError('boom at import\\nsecond line')\n")
        raises.write_text("passes:\n  - pass: kiln_raising_module:Probe\n")
        target_key.write_text("target: blackwell\npasses:\n  - pass: weight-quantization\n")

    def not_imported(result: Result) -> tuple[bool, str]:
        return (False, "MODULE WAS IMPORTED") if imported.exists() else (True, "module not imported")

    def short_line(result: Result) -> tuple[bool, str]:
        n = len(result.lines[-1]) if result.lines else 0
        return n <= 200 and result.seconds < 30, f"{n} chars, {result.seconds:.1f} s"

    cases += [
        Case("recipe: YAML bomb (billion laughs)", ["build", ckpt, "--recipe", str(bomb), "-o", str(out("bomb"))], 2,
             setup=write_recipes, check=short_line),
        Case("recipe: module:Class without --allow-custom-passes",
             ["build", ckpt, "--recipe", str(no_flag), "-o", str(out("custom"))], 2, setup=write_recipes,
             check=not_imported),
        Case("recipe: custom module raising at import",
             ["build", ckpt, "--recipe", str(raises), "--allow-custom-passes", "-o", str(out("raises"))], 2,
             setup=write_recipes, check=nothing_left(out("raises"))),
        Case("recipe: top-level target:", ["build", ckpt, "--recipe", str(target_key), "-o", str(out("target"))], 2,
             setup=write_recipes),
        Case("recipe: unknown name", ["build", ckpt, "--recipe", "fp9-magic", "-o", str(out("fp9"))], 2),
    ]

    # other numbers and texts
    big = w.tmp / "one-paragraph.txt"

    def write_big() -> None:
        sentence = "Once upon a time there was a little cat who liked to play in the sun. "
        big.write_text(sentence * (500_000 // len(sentence)))

    cases += [
        Case("gate --min-recovery -1", ["gate", a, "--baseline", ckpt, "--data", text, "--min-recovery", "-1"], 2),
        Case("generate --temperature -1", ["generate", a, *prompt, "--temperature", "-1"], 2),
        Case("generate --top-p 0", ["generate", a, *prompt, "--top-p", "0"], 2),
        Case("eval: one 500 KB paragraph", ["eval", a, "--data", str(big)], 0, setup=write_big, show="warning"),
        Case("build --recipe fp8 --weight-bits 5", ["build", ckpt, "--recipe", "fp8", "--weight-bits", "5",
                                                   "-o", str(out("bits"))], 2),
    ]
    for group in (artifact_structure_cases, output_policy_cases, bounds_cases, baseline_identity_cases,
                  killed_build_cases, first_contact_cases, export_layout_cases):
        cases += group(w, out)
    return cases


def export_layout_cases(w: Workspace, out: Callable[[str], Path]) -> list[Case]:
    """Artifacts whose stored layout no export format has: refused before anything is written."""
    built = {"emb": w.tmp / "art-embedding-fp8", "kv": w.tmp / "kv-centered-art"}
    recipes = {"emb": "embedding-fp8", "kv": "fp8-kv"}

    def build(key: str) -> Callable[[], None]:
        def setup() -> None:
            if not built[key].exists():
                subprocess.run([OPTIMIZE, "build", str(w.ckpt), "--recipe", recipes[key], "--no-gate",
                                "--calib-tokens", "2048", "-o", str(built[key])], capture_output=True, env=ENV,
                               cwd=w.work, timeout=TIMEOUT, check=True)
        return setup

    cases = []
    for fmt in ("compressed-tensors", "hf-modelopt"):
        target = out(f"export-emb-{fmt}")
        cases.append(Case(f"export: a quantized embedding table as {fmt}",
                          ["export", str(built["emb"]), "--format", fmt, "-o", str(target)], 2, setup=build("emb"),
                          check=nothing_left(target)))
    target = out("export-kv-centered")
    cases.append(Case("export: an FP8 KV cache with calibrated offsets (fp8-kv) as compressed-tensors",
                      ["export", str(built["kv"]), "--format", "compressed-tensors", "-o", str(target)], 2,
                      setup=build("kv"), check=nothing_left(target)))
    return cases


# --- the classes of issue #18 (a second hostile run), at least three cases each ----------------------------
def artifact_structure_cases(w: Workspace, out: Callable[[str], Path]) -> list[Case]:
    """An artifact whose manifest lies about its own structure (checksums recomputed): exit 2, one line.

    Copies of the fp8-weights artifact, each edited as a hostile writer would: the manifest and/or the tensors,
    then model.safetensors' sha256, the manifest's tensors table and weight bytes recomputed, so that every
    checksum matches and only the check of the architecture against the tensors can refuse it."""
    prompt = ["Once upon a time", "--max-new-tokens", "4"]

    def lie(name: str, edit_manifest: Callable[[dict], object] | None = None,
            edit_tensors: Callable[[dict, dict], object] | None = None) -> tuple[str, Callable[[], None]]:
        root = w.hostile / f"structure-{name}"

        def setup() -> None:
            if root.exists():
                return
            shutil.copytree(w.f, root)
            manifest = json.loads((root / "manifest.json").read_text())
            if edit_tensors is not None:
                from safetensors.torch import load_file, save_file

                tensors = load_file(root / "model.safetensors")
                edit_tensors(tensors, manifest)
                save_file(tensors, root / "model.safetensors")
                manifest["files"]["model.safetensors"] = hashlib.sha256(
                    (root / "model.safetensors").read_bytes()).hexdigest()
                manifest["tensors"] = {k: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                                       for k, t in tensors.items()}
                manifest["sizes"]["weight_bytes"] = sum(t.numel() * t.element_size() for t in tensors.values())
            if edit_manifest is not None:
                edit_manifest(manifest)
            (root / "manifest.json").write_text(json.dumps(manifest))
        return str(root), setup

    def layer0(m: dict) -> dict:
        return m["architecture"]["layers"][0]["attention"]

    q = "model.layers.0.self_attn.q_proj"

    def dense_label_on_fp8(tensors: dict, m: dict) -> None:
        # the fp8-weights artifact stores q_proj as FP8 codes + scale; the entry now says they are plain weights
        m["formats"][q] = {"format": "dense", "activation": "none", "role": "q"}

    def sliced_q(tensors: dict, m: dict) -> None:
        tensors[f"{q}.weight"] = tensors[f"{q}.weight"][:, :32].contiguous()

    def rotary_strings(m: dict) -> None:
        layer0(m)["rotary"]["inv_freq"] = [str(f) for f in layer0(m)["rotary"]["inv_freq"]]

    cases = []
    for label, command, (art, setup) in [
        ("num_heads 0 in a layer", "generate", lie("heads0", lambda m: layer0(m).update(num_heads=0))),
        ("no layers", "generate", lie("nolayers", lambda m: m["architecture"].update(layers=[]))),
        ("rotary inv_freq as strings", "generate", lie("rotary-strings", rotary_strings)),
        ("head_dim 16 where the tensors hold 8", "eval", lie("headdim16", lambda m: layer0(m).update(head_dim=16))),
        ("formats says dense for an FP8 linear", "generate", lie("dense-fp8", None, dense_label_on_fp8)),
        ("a weight sliced to (64, 32)", "inspect", lie("sliced", None, sliced_q)),
        ("a weight sliced to (64, 32)", "generate", lie("sliced", None, sliced_q)),
        ("num_kv_heads 3 (does not divide 8 heads)", "inspect",
         lie("kvheads3", lambda m: layer0(m).update(num_kv_heads=3))),
        ("tensors table says (64, 32) for a (64, 64) weight", "inspect",
         lie("table", lambda m: m["tensors"][f"{q}.weight"].update(shape=[64, 32]))),
        ("intermediate_size 100 where down_proj takes 172", "generate",
         lie("inter100", lambda m: m["architecture"]["layers"][1]["mlp"].update(intermediate_size=100))),
        ("rms_norm_eps -1", "eval", lie("eps", lambda m: m["architecture"].update(rms_norm_eps=-1))),
    ]:
        args = {"generate": ["generate", art, *prompt], "inspect": ["inspect", art],
                "eval": ["eval", art, "--data", str(w.text)]}[command]
        cases.append(Case(f"structure: {command}: {label}", args, 2, setup=setup))
    return cases


def output_policy_cases(w: Workspace, out: Callable[[str], Path]) -> list[Case]:
    """Outputs other than build's and export's -o (gate --junit, report -o) and --overwrite onto a Kiln
    directory the user added to: refused before any work, never an input, nothing of the user's lost."""
    ckpt, a, f = str(w.ckpt), str(w.a), str(w.f)
    root = w.tmp / "output-policy"
    text_copy = root / "eval.txt"  # the cases aim at a copy of the evaluation text, never at ../shared
    user_xml, user_report = root / "mine.xml", root / "user-report"
    kiln_art, kiln_export = root / "kiln-art", root / "kiln-export"
    text = w.text.read_text()

    def prepare() -> None:
        root.mkdir(exist_ok=True)
        text_copy.write_text(text)
        user_xml.write_text("<mine/>\n")
        user_report.mkdir(exist_ok=True)
        (user_report / "report.md").write_text("my own report")

    def art_with_user_file() -> None:
        prepare()
        shutil.rmtree(kiln_art, ignore_errors=True)
        shutil.copytree(w.a, kiln_art)
        (kiln_art / "notes.md").write_text("my notes")

    def export_with_user_file() -> None:
        prepare()
        if not (kiln_export / "kiln_export.json").is_file():
            subprocess.run([OPTIMIZE, "export", f, "-o", str(kiln_export)], capture_output=True, env=ENV, cwd=w.work,
                           timeout=TIMEOUT, check=True)
        (kiln_export / "notes.md").write_text("my notes")

    gate = ["gate", a, "--baseline", ckpt, "--data", str(text_copy), "--min-recovery", "0.5", "--paragraphs", "20",
            "--generate", "0"]

    def made_nothing(path: Path) -> Check:
        def check(_: Result) -> tuple[bool, str]:
            return (False, f"CREATED {path.name}") if path.exists() else (True, "nothing created")
        return check

    return [
        Case("output: gate --junit into a missing directory", [*gate, "--junit", str(root / "nodir" / "g.xml")], 2,
             setup=prepare, check=made_nothing(root / "nodir")),
        Case("output: gate --junit onto a directory", [*gate, "--junit", str(user_report)], 2, setup=prepare,
             check=file_kept(user_report / "report.md", "my own report")),
        Case("output: gate --junit /proc/x", [*gate, "--junit", "/proc/x"], 2, setup=prepare),
        Case("output: gate --junit FILE, FILE is the --data text", [*gate, "--junit", str(text_copy)], 2,
             setup=prepare, check=file_kept(text_copy, text)),
        Case("output: gate --junit onto the user's own XML", [*gate, "--junit", str(user_xml)], 2, setup=prepare,
             check=file_kept(user_xml, "<mine/>\n")),
        Case("output: report -o DIR, DIR holds the user's report.md", ["report", a, "-o", str(user_report)], 2,
             setup=prepare, check=file_kept(user_report / "report.md", "my own report")),
        Case("output: report -o /proc/x", ["report", a, "-o", "/proc/x"], 2, setup=prepare),
        Case("output: build --overwrite onto a Kiln artifact the user added a file to",
             ["build", ckpt, "--recipe", "none", "--no-gate", "-o", str(kiln_art), "--overwrite"], 2,
             setup=art_with_user_file, check=file_kept(kiln_art / "notes.md", "my notes")),
        Case("output: export --overwrite onto a Kiln export the user added a file to",
             ["export", f, "-o", str(kiln_export), "--overwrite"], 2, setup=export_with_user_file,
             check=file_kept(kiln_export / "notes.md", "my notes")),
    ]


def bounds_cases(w: Workspace, out: Callable[[str], Path]) -> list[Case]:
    """Numeric options and recipe fields out of range, conflicting recipes, unbounded input text."""
    import resource

    ckpt, a, text = str(w.ckpt), str(w.a), str(w.text)
    gate = ["gate", a, "--baseline", ckpt, "--data", text, "--min-recovery", "0.9", "--generate", "0"]
    huge_config, one_line = w.tmp / "billion-layers" / "config.json", w.tmp / "no-newline-200MB.txt"
    not_measured, root = w.tmp / "not-a-measurement.json", w.tmp
    fields = {"tune-lr-inf": "{pass: weight-quant, tune_lr: .inf}",
              "draft-vocab-negative": "{pass: draft-head, draft_vocab: -5}",
              "heal-lr-inf": "{pass: mla, kv_fraction: 0.5, heal_lr: .inf}",
              "tree-width-2.5": "{pass: draft-head, tree_width: 2.5}",
              "seed-x": "{pass: draft-head, seed: 'x'}",
              "back-off-keep-unknown": "{pass: weight-quant, back_off_keep: [model.layers.99.mlp.up_proj]}",
              "back-off-keep-string": "{pass: weight-quant, back_off_keep: model.layers.0.mlp.up_proj}"}

    def write_recipes() -> None:
        for name, entry in fields.items():
            (w.recipes / f"{name}.yaml").write_text(f"passes:\n  - {entry}\n")

    def write_not_measured() -> None:
        not_measured.write_text(json.dumps({"rows": "many"}))

    def write_huge_config() -> None:
        huge_config.parent.mkdir(exist_ok=True)
        config = json.loads((w.ckpt / "config.json").read_text())
        huge_config.write_text(json.dumps({**config, "num_hidden_layers": 10**9}))

    def write_one_line() -> None:  # 200 MB, one paragraph, no newline: it grew to 8.2 GB before scoring a token
        sentence = "Once upon a time there was a little cat who liked to play in the sun. "
        block = sentence * ((1 << 20) // len(sentence))
        with open(one_line, "w", encoding="utf-8") as f:
            f.writelines(block for _ in range(200_000_000 // len(block) + 1))

    def fast(limit: float) -> Check:
        def check(result: Result) -> tuple[bool, str]:
            return result.seconds < limit, f"{result.seconds:.1f} s (refused before any work: under {limit:g} s)"
        return check

    def bounded_rss(_: Result) -> tuple[bool, str]:
        # the largest child so far (the two prepared builds included): well under the 8.2 GB it took
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB -> GiB
        one_line.unlink(missing_ok=True)
        return peak < 2.0, f"largest child RSS {peak:.2f} GiB"

    cases = [
        Case("bounds: generate --seed 2^70", ["generate", a, "Once upon a time", "--seed", str(2**70)], 2),
        Case("bounds: gate --resamples 10^9", [*gate, "--resamples", str(10**9)], 2, check=fast(60)),
        Case("bounds: gate --resamples 10^11", [*gate, "--resamples", str(10**11)], 2, check=fast(60)),
        Case("bounds: generate --temperature nan", ["generate", a, "Once upon a time", "--temperature", "nan"], 2),
        Case("bounds: serve --port 70000", ["serve", a, "--port", "70000"], 2),
        Case("bounds: serve --compile maybe", ["serve", a, "--compile", "maybe"], 2, check=fast(60)),
        Case("bounds: serve --compile background --device cuda", ["serve", a, "--compile", "background", "--device",
                                                                  "cuda"], 2, check=fast(60)),
        Case("bounds: report on a config.json declaring 10^9 layers", ["report", str(huge_config)], 2,
             setup=write_huge_config, check=fast(60)),
        Case("bounds: report --workload nope (unknown preset)", ["report", a, "--workload", "nope"], 2, check=fast(60)),
        Case("bounds: report --workload with a negative rate",
             ["report", a, "--workload", "rate=-1,prompt=2048,output=256,ttft=1,tpot=0.05"], 2, check=fast(60)),
        Case("bounds: report --workload rate=1,prompt (malformed)", ["report", a, "--workload", "rate=1,prompt"], 2,
             check=fast(60)),
        Case("bounds: report --workload chat --link-gbps nan",
             ["report", a, "--workload", "chat", "--link-gbps", "nan"], 2, check=fast(60)),
        Case("bounds: report --speculation on a file that is no measurement",
             ["report", a, "--speculation", str(not_measured)], 2, setup=write_not_measured, check=fast(60)),
        Case("bounds: report --speculation on a missing file", ["report", a, "--speculation", str(root / "nope.json")],
             2, check=fast(60)),
        Case("bounds: serve --speculative --draft head without a draft head", ["serve", a, "--speculative", "--draft",
                                                                               "head"], 2, check=fast(60)),
        Case("bounds: serve --speculative --draft-tokens 99", ["serve", a, "--speculative", "--draft-tokens", "99"], 2,
             check=fast(60)),
    ]
    cases += [Case(f"bounds: recipe YAML {entry}", ["build", ckpt, "--recipe", str(w.recipes / f"{name}.yaml"),
                                                      "-o", str(out(f"bounds-{name}"))], 2, setup=write_recipes,
                   check=nothing_left(out(f"bounds-{name}"))) for name, entry in fields.items()]
    cases += [
        Case("bounds: --recipe fp8-kv,nvfp4-kv (two KV passes)",
             ["build", ckpt, "--recipe", "fp8-kv,nvfp4-kv", "-o", str(out("bounds-kv"))], 2, check=fast(60)),
        Case("bounds: --recipe fp8-weights,nvfp4-w4a16 (refused before calibration)",
             ["build", ckpt, "--recipe", "fp8-weights,nvfp4-w4a16", "-o", str(out("bounds-w"))], 2, check=fast(60)),
        Case("bounds: --recipe mla,mla (refused before the MLA pass)",
             ["build", ckpt, "--recipe", "mla,mla", "--kv-fraction", "0.5", "-o", str(out("bounds-mla"))], 2,
             check=fast(60)),
        Case("bounds: eval --data, 200 MB with no newline", ["eval", a, "--data", str(one_line)], 0,
             setup=write_one_line, check=bounded_rss, show="warning"),
    ]
    return cases


def baseline_identity_cases(w: Workspace, out: Callable[[str], Path]) -> list[Case]:
    """A baseline that is not the artifact's recorded source (weights or config.json differ)."""
    ckpt, text = str(w.ckpt), str(w.text)
    rope, reformatted, old_art = w.tmp / "baseline-rope", w.tmp / "baseline-reformatted", w.tmp / "art-no-config-hash"
    # another rotary base (transformers 5 reads rope_parameters, older versions the top-level key): another model
    rope_500k = {"rope_theta": 500000.0, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}}

    def config_copy(dst: Path, **changes) -> Callable[[], None]:
        def setup() -> None:  # the source's weights, its config.json edited (or only rewritten)
            if dst.exists():
                return
            shutil.copytree(w.ckpt, dst)
            config = json.loads((dst / "config.json").read_text())
            (dst / "config.json").write_text(json.dumps({**config, **changes}, indent=4, sort_keys=not changes))
        return setup

    def old_artifact() -> None:  # an artifact built before the manifest recorded the config's hash
        if old_art.exists():
            return
        shutil.copytree(w.a, old_art)
        manifest = json.loads((old_art / "manifest.json").read_text())
        manifest["source"].pop("config_sha256", None)
        (old_art / "manifest.json").write_text(json.dumps(manifest))

    def gate(artifact: Path, baseline: Path | str, *extra: str) -> list[str]:
        return ["gate", str(artifact), "--baseline", str(baseline), "--data", text, "--paragraphs", "50",
                "--min-recovery", "0.9", "--generate", "0", *extra]

    return [
        Case("baseline: the source's weights, rope_theta changed in config.json", gate(w.a, rope), 2,
             setup=config_copy(rope, **rope_500k)),
        Case("baseline: rope_theta changed, --any-baseline compares anyway", gate(w.a, rope, "--any-baseline"), 1,
             setup=config_copy(rope, **rope_500k)),
        Case("baseline: config.json rewritten (indent, key order), same content", gate(w.a, reformatted), 0,
             setup=config_copy(reformatted)),
        Case("baseline: artifact without a config hash (built before), real source", gate(old_art, ckpt), 0,
             setup=old_artifact, show="checked on its weights only"),
        Case("baseline: artifact without a config hash, another model's weights", gate(old_art, w.other), 2,
             setup=old_artifact),
    ]


def killed_build_cases(w: Workspace, out: Callable[[str], Path]) -> list[Case]:
    """A build killed with SIGKILL, then run again: nothing at -o looks finished, the rerun works."""
    ckpt = str(w.ckpt)
    root = w.tmp / "killed"
    calibrated = ["--recipe", "fp8-weights", "--no-gate"]  # calibration runs; the gate is not the point here
    sleepers: list[subprocess.Popen] = []

    def kill_at(cmd: list[str], ready: Callable[[subprocess.Popen], bool], env: dict | None = None) -> None:
        """Run `cmd`, SIGKILL it once `ready`, wait: what a crash or the OOM killer leaves."""
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=w.work,
                                env={**ENV, **(env or {})})
        start = time.perf_counter()
        while not ready(proc) and proc.poll() is None and time.perf_counter() - start < TIMEOUT:
            time.sleep(0.02)
        proc.kill()
        proc.wait()

    def killed_in_calibration(target: Path) -> Callable[[], None]:
        """The issue's reproduction: the same build, SIGKILLed once its log shows calibration started."""
        def setup() -> None:
            root.mkdir(exist_ok=True)
            log = root / f"{target.name}.log"
            with open(log, "w") as err:
                proc = subprocess.Popen([OPTIMIZE, "build", ckpt, *calibrated, "-o", str(target)],
                                        stdout=subprocess.DEVNULL, stderr=err, cwd=w.work, env=ENV)
                start = time.perf_counter()
                while "calibration data" not in log.read_text() and proc.poll() is None \
                        and time.perf_counter() - start < TIMEOUT:
                    time.sleep(0.02)
                proc.kill()
                proc.wait()
        return setup

    def killed_while_writing(target: Path) -> Callable[[], None]:
        """A process of Kiln's own writer (atomic_directory) killed with the output half written: its
        `.NAME.tmp-*` stays behind, with Kiln's owner marker naming a process that is gone."""
        def setup() -> None:
            root.mkdir(exist_ok=True)
            script = ("import time\nfrom kiln.optimizer.output_dir import atomic_directory\n"
                      f"with atomic_directory({str(target)!r}) as d:\n"
                      "    (d / 'manifest.json').write_text('{}')\n    print('ready', flush=True)\n    time.sleep(60)\n")
            kill_at([sys.executable, "-c", script], lambda proc: proc.stdout.readline().strip() == "ready")
            if not list(target.parent.glob(f".{target.name}.tmp-*")):
                raise SystemExit(f"setup: no temporary left beside {target}")
        return setup

    def temporary(target: Path, kind: str, pid: int | None) -> Path:
        """A `.NAME.KIND-*` sibling of `target` with a half output in it and, when `pid`, Kiln's owner marker
        naming that process (on this machine, in this pid namespace)."""
        from kiln.optimizer.output_dir import OWNER_MARKER, _owner

        path = target.parent / f".{target.name}.{kind}-bench"
        shutil.rmtree(path, ignore_errors=True)
        (path / target.name).mkdir(parents=True)
        (path / target.name / "model.safetensors").write_bytes(b"half")
        if pid is not None:
            (path / OWNER_MARKER).write_text(json.dumps({**_owner(), "pid": pid, "start_time": None}))
        return path

    def killed_mid_replace(target: Path) -> Callable[[], None]:
        """An --overwrite killed between its two renames: the previous artifact only in `.NAME.old-*`."""
        def setup() -> None:
            path = temporary(target, "old", dead_pid())
            shutil.rmtree(path / target.name)
            shutil.copytree(w.a, path / target.name)
        return setup

    def dead_pid() -> int:
        proc = subprocess.Popen([sys.executable, "-c", "pass"])
        proc.wait()
        return proc.pid

    def finished(target: Path, kept: Path | None = None) -> Check:
        """The rerun wrote a whole artifact, and of the temporaries beside it only `kept` remains."""
        def check(_: Result) -> tuple[bool, str]:
            for proc in sleepers:
                proc.kill()
                proc.wait()
            debris = sorted(p.name for p in target.parent.glob(f".{target.name}.*") if p != kept)
            whole = (target / "manifest.json").is_file()
            if kept is not None and not kept.is_dir():
                return False, f"REMOVED {kept.name}, which was not a stale Kiln temporary"
            if not whole or debris:
                return False, f"{'' if whole else 'NO ARTIFACT; '}LEFT BEHIND: {', '.join(debris) or '-'}"
            return True, "artifact written, stale temporaries gone" + (f", {kept.name} kept" if kept else "")
        return check

    def live_temporary(target: Path) -> Callable[[], None]:
        def setup() -> None:
            sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            sleepers.append(sleeper)
            temporary(target, "tmp", sleeper.pid)
        return setup

    quick = ["--recipe", "none", "--no-gate"]
    a, b, c, d, e = (out(f"killed-{n}") for n in ("calibration", "write", "replace", "live", "user"))
    return [
        Case("killed: the same build again after SIGKILL during calibration",
             ["build", ckpt, *calibrated, "-o", str(a)], 0, setup=killed_in_calibration(a), check=finished(a)),
        Case("killed: rerun after SIGKILL mid-write (.NAME.tmp-* left, no --overwrite)",
             ["build", ckpt, *quick, "-o", str(b)], 0, setup=killed_while_writing(b), check=finished(b)),
        Case("killed: rerun --overwrite after SIGKILL mid-replace (the previous artifact only in .NAME.old-*: put "
             "back, then replaced)",
             ["build", ckpt, *quick, "-o", str(c), "--overwrite"], 0, setup=killed_mid_replace(c), check=finished(c)),
        Case("killed: a temporary whose build is still running is left alone",
             ["build", ckpt, *quick, "-o", str(d)], 0, setup=live_temporary(d),
             check=finished(d, kept=d.parent / f".{d.name}.tmp-bench")),
        Case("killed: a .NAME.tmp-* folder without Kiln's marker is left alone",
             ["build", ckpt, *quick, "-o", str(e)], 0, setup=lambda: temporary(e, "tmp", None),
             check=finished(e, kept=e.parent / f".{e.name}.tmp-bench")),
    ]


def first_contact_cases(w: Workspace, out: Callable[[str], Path]) -> list[Case]:
    """A newcomer's first hour: a GGUF folder, help at 80 columns, the runtime's start-up (no transformers), the
    thread count a build says it uses, what loads an hf-modelopt export."""
    a = str(w.a)
    gguf, export = w.tmp / "gguf-folder", w.tmp / "export-modelopt"

    def gguf_folder() -> None:  # the shared GGUF folder's shape: a .gguf and its to_hf.py, no config.json
        gguf.mkdir(exist_ok=True)
        (gguf / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF")
        (gguf / "to_hf.py").write_text("# converts the GGUF beside it\n")

    def says(*words: str) -> Check:
        def check(r: Result) -> tuple[bool, str]:
            last = r.lines[-1] if r.lines else ""
            missing = [word for word in words if word not in last]
            return not missing, f"missing {missing}" if missing else ""
        return check

    def rerun(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=w.work,
                              env={**ENV, **(env or {})}, timeout=TIMEOUT, check=False)

    def whole_at_80(command: str) -> Check:
        def check(r: Result) -> tuple[bool, str]:
            import re

            import typer

            from kiln.optimizer.cli import app

            params = typer.main.get_command(app).commands[command].params
            names = [n for p in params if p.param_type_name == "option" for n in (*p.opts, *p.secondary_opts)]
            text = rerun(["-m", "kiln.optimizer.cli", command, "--help"], {"COLUMNS": "80"}).stdout
            cut = [n for n in names if not re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", text)]
            wide = [line for line in text.splitlines() if len(line) > 80]
            return not cut and not wide, (f"{len(names)} option names whole, no line over 80 columns"
                                          if not cut and not wide else f"cut: {cut}, {len(wide)} wide lines")
        return check

    def no_transformers(r: Result) -> tuple[bool, str]:
        proc = rerun(["-X", "importtime", "-m", "kiln.optimizer.cli", "generate", a, "Once upon a time",
                      "--max-new-tokens", "8"])
        heavy = sorted({line.rsplit("|", 1)[-1].strip().split(".")[0] for line in proc.stderr.splitlines()
                        if line.startswith("import time:")} & {"transformers", "sklearn", "pandas"})
        return proc.returncode == 0 and not heavy, (f"{r.seconds:.1f} s wall, imports none of transformers, "
                                                    "sklearn, pandas" if not heavy else f"imports {heavy}")

    def export_modelopt() -> None:
        if not export.exists():
            # the unquantized artifact: ModelOpt's layout has no FP8 weight-only algorithm (export refuses $F)
            subprocess.run([OPTIMIZE, "export", a, "--format", "hf-modelopt", "-o", str(export)], env=ENV,
                           cwd=w.work, capture_output=True, timeout=TIMEOUT, check=True)

    def names_loaders(r: Result) -> tuple[bool, str]:
        text = " ".join(rerun(["-m", "kiln.optimizer.cli", "inspect", str(export)]).stdout.split())
        missing = [n for n in ("vLLM", "SGLang", "TensorRT-LLM", "ModelOpt", "does NOT read it") if n not in text]
        readme = (export / "README.md").read_text() if (export / "README.md").is_file() else ""
        missing += [f"README: {n}" for n in ("TensorRT-LLM", "does NOT read it") if n not in readme]
        return not missing, f"missing {missing}" if missing else "inspect and README.md name vLLM, SGLang, TRT-LLM, ModelOpt"

    return [
        Case("first contact: build a folder holding a .gguf and to_hf.py", ["build", str(gguf), "-o",
             str(out("fc-gguf"))], 2, setup=gguf_folder, check=says("GGUF", "to_hf.py OUT")),
        Case("first contact: build --help at 80 columns", ["build", "--help"], 0, env={"COLUMNS": "80"},
             check=whole_at_80("build")),
        Case("first contact: serve --help at 80 columns", ["serve", "--help"], 0, env={"COLUMNS": "80"},
             check=whole_at_80("serve")),
        Case("first contact: generate imports no transformers", ["generate", a, "Once upon a time",
             "--max-new-tokens", "64"], 0, check=no_transformers),
        Case("first contact: a build says its thread count", ["build", str(w.ckpt), "--recipe", "fp8-kv",
             "--no-gate", "--calib-tokens", "500", "-o", str(out("fc-threads"))], 0,
             show="threads: 1 (OMP_NUM_THREADS)"),
        Case("first contact: inspect an hf-modelopt export names its loaders", ["inspect", str(export)], 0,
             setup=export_modelopt, check=names_loaders),
    ]


# --- running ----------------------------------------------------------------------------------------------
def run_plain(cmd: list[str], cwd: Path, env: dict) -> Result:
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=TIMEOUT, check=False)
        return Result(proc.returncode, proc.stderr, time.perf_counter() - start)
    except subprocess.TimeoutExpired as exc:
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        return Result(None, stderr, time.perf_counter() - start, f"TIMED OUT after {TIMEOUT} s")


def run_interrupted(cmd: list[str], cwd: Path, env: dict, interrupt: Interrupt) -> Result:
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=cwd, env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
    reader.start()
    note = ""
    while not interrupt.ready(list(lines)):
        if proc.poll() is not None:
            note = "NEVER REACHED the interruption point"
            break
        if time.perf_counter() - start > TIMEOUT:
            proc.kill()
            note = f"NEVER REACHED the interruption point in {TIMEOUT} s"
            break
        time.sleep(0.05)
    else:
        proc.send_signal(interrupt.signum)
        note = f"signal after {time.perf_counter() - start:.1f} s"
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        note += "; DID NOT EXIT within 60 s of the signal"
    reader.join(5)
    return Result(proc.returncode, "".join(lines), time.perf_counter() - start, note)


def judge(case: Case, result: Result) -> tuple[bool, str]:
    """(behaved, note): expected exit, no traceback, one error line (last) for a failure, none for a pass."""
    problems, notes = [], [result.note] if result.note else []
    lines = result.lines
    errors = [line for line in lines if line.startswith(ERROR_PREFIXES)]
    if result.code != case.expect:
        problems.append(f"EXIT {result.code}, EXPECTED {case.expect}")
    if "Traceback" in result.stderr:
        problems.append("TRACEBACK")
    if case.expect != 0:
        if len(errors) != 1 or lines[-1] != errors[0]:
            problems.append(f"{len(errors)} ERROR LINES" if len(errors) != 1 else "ERROR LINE NOT LAST")
        elif len(errors[0]) > MAX_LINE:
            problems.append(f"ERROR LINE OF {len(errors[0])} CHARS")
        if len(lines) > 1:
            notes.append(f"+{len(lines) - 1} log line{'s' if len(lines) > 2 else ''} before it")
    elif errors:
        problems.append("ERROR LINE ON A PASS")
    if case.show is not None and not any(case.show in line for line in lines):
        problems.append(f"NO LINE WITH {case.show!r}")
    if case.check is not None:
        try:
            ok, note = case.check(result)
        except Exception as exc:  # noqa: BLE001 -- a broken check is a misbehaving case, not a crash
            ok, note = False, f"CHECK FAILED: {type(exc).__name__}: {exc}"
        notes.append(note)
        if not ok:
            problems.append("CHECK")
    return not problems, "; ".join([*problems, *(n for n in notes if n)])


def shown_line(case: Case, result: Result) -> str:
    """The last stderr line, or the first holding `case.show`. Kiln's log lines go through rich, which wraps
    them at 120 columns when stderr is not a terminal: such a line is marked, not rejoined."""
    lines = result.stderr.rstrip("\n").splitlines()
    if case.show is not None:
        at = next((i for i, line in enumerate(lines) if case.show in line), len(lines) - 1)
    else:
        at = len(lines) - 1
    if at < 0:
        return "(no stderr)"
    line = lines[at]
    wrapped = line.endswith(" ") and at + 1 < len(lines) and not lines[at + 1].startswith(("warning:", *ERROR_PREFIXES))
    line = line.rstrip()
    line = line if len(line) <= SHOWN else line[: SHOWN - 1] + "…"
    return line + (" ⏎ [wrapped by rich at 120 columns; continues on the next stderr line]" if wrapped else "")


def quoted(arg: str) -> str:
    return arg if arg and not any(c.isspace() or c in "'\"" for c in arg) else json.dumps(arg)


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("`", "'")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="also write the Markdown table to this file")
    parser.add_argument("--only", help="run only the cases whose name contains this")
    parser.add_argument("--generated", action="store_true",
                        help="use the generated checkpoint even when ../shared/models/stories260K is present")
    opts = parser.parse_args()
    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="kiln-bad-inputs-"))
    try:
        w = Workspace(tmp, opts.generated)
        print(f"preparing: {w.model}, two artifacts in {tmp} ...", file=sys.stderr, flush=True)
        w.prepare()
        cases = [c for c in make_cases(w) if opts.only is None or opts.only.lower() in c.name.lower()]
        rows, failed = [], []
        for i, case in enumerate(cases, 1):
            if case.setup is not None:
                case.setup()
            cmd = [OPTIMIZE, *case.args]
            env = {**ENV, **case.env}
            cwd = case.cwd or w.work
            result = (run_interrupted(cmd, cwd, env, case.interrupt) if case.interrupt
                      else run_plain(cmd, cwd, env))
            ok, note = judge(case, result)
            if not ok:
                failed.append(case.name)
            shown_cmd = " ".join(["optimize", *(quoted(w.shorten(a)) for a in case.args)])
            name = ("❌ MISBEHAVED: " if not ok else "") + case.name + (f" ({note})" if note else "")
            code = str(result.code) if result.code == case.expect else f"**{result.code}** (expected {case.expect})"
            line = w.shorten(shown_line(case, result))
            rows.append(f"| {i} | {cell(name)} | `{cell(shown_cmd)}` | {code} | {cell(line)} |")
            print(f"[{i}/{len(cases)}] {'ok ' if ok else 'BAD'} {case.name}: exit {result.code} "
                  f"({result.seconds:.1f} s){'' if ok else ' -- ' + note}", file=sys.stderr, flush=True)
        elapsed = time.perf_counter() - started
        behaved = len(cases) - len(failed)
        summary = (f"{behaved}/{len(cases)} cases got the expected exit code with exactly one stderr line of "
                   f"error (none on a pass) and no traceback, and passed their own checks. Model: {w.model}; "
                   f"total {elapsed:.0f} s.")
        table = ["| # | case | command | exit | stderr's last line |", "|---|---|---|---|---|", *rows, "", summary]
        if failed:
            table.append(f"**{len(failed)} MISBEHAVED:** " + "; ".join(failed))
        text = "\n".join(table) + "\n"
        print(text, end="")
        if opts.out:
            opts.out.write_text(text)
        return 1 if failed else 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
