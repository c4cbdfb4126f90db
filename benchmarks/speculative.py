"""Speculative decoding on CPU: tau, lossless output, tokens/s with and without speculation, the break-even batch.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/speculative.py ARTIFACT [ARTIFACT ...] [-o DIR]
        [--prompts 200] [--new-tokens 64] [--draft-tokens 4] [--batches 1,8,32] [--sweep 1,2,4,8,16,32,64]
        [--sequences 32] [--repeats 3] [--drafters head,head-tree,trigram,prompt-lookup] [--tau-target 2.8]
        [--speedup-target 1.0]

Protocol (issue #12): greedy; the prompts are the first 16 tokens of the first --prompts paragraphs of
evaluation.txt that have 16; --new-tokens new tokens, stopping at EOS (as `optimize eval --speculative`).
Drafters: the artifact's draft head (or MTP layer) when it has one; a trigram table counted on all of
calibration.txt (never on evaluation text); prompt lookup (n-grams of 3 down to 1 in the sequence itself).

- tau (tokens per target forward per sequence, the target's own token included) and draft acceptance: all
  prompts in one batch; every output is compared with plain greedy decoding of the same batch, and the
  prompts whose outputs differ are listed.
- tokens/s: for each batch B of --sweep, the first max(B, --sequences) prompts in consecutive groups of B,
  decoded plainly (`Engine.generate_ids`) and with each drafter (`Engine.speculative_ids`); generated tokens
  over wall time, the best of --repeats (modes interleaved, so load drifts hit all alike), after one warm-up.
  The break-even batch is the smallest batch of the sweep where a drafter's tokens/s falls below plain's.
- where the time goes: at each table batch, instrumented runs (the fastest of --repeats) time the target's
  forwards and the drafter's proposals inside the loops.
- the head's parameters and training from the artifact's manifest (the draft-head pass's metrics).

Writes DIR/speculative.md (the tables printed) and DIR/speculative.png (tokens/s and speedup against batch).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch

from kiln import runtime
from kiln.calibration.data import load_token_lists
from kiln.optimizer.defaults import CALIBRATION_TEXT as CALIB
from kiln.optimizer.defaults import EVALUATION_TEXT as EVAL
from kiln.runtime.drafters import Drafter

PROMPT_TOKENS = 16
TAU_TARGET, TAU_OVER_TRIGRAM = 2.8, 1.25  # issue #12's targets at k=4, stories260K, greedy
LABELS = {"head": "draft head (chain)", "head-tree": "draft head (tree)", "trigram": "trigram (calibration.txt)",
          "prompt-lookup": "prompt lookup"}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def evaluation_prompts(tokenizer, count: int) -> list[list[int]]:
    """The first 16 tokens of the first `count` evaluation paragraphs that have 16."""
    paragraphs = load_token_lists(tokenizer, EVAL, None)
    prompts = [list(t[:PROMPT_TOKENS]) for t in paragraphs if len(t) >= PROMPT_TOKENS][:count]
    if len(prompts) < count:
        raise SystemExit(f"{EVAL} has only {len(prompts)} paragraphs of {PROMPT_TOKENS}+ tokens; asked for {count}")
    return prompts


def head_training(manifest: dict) -> dict | None:
    """The draft-head pass's metrics and gate tau, from the manifest (None when no such pass ran)."""
    for record in manifest.get("passes", []):
        if record.get("name") == "draft-head" and record.get("decision") == "kept":
            metrics = dict((record.get("result") or {}).get("metrics") or {})
            gate = [m for m in (record.get("gate") or {}).get("metrics", []) if m.get("name") == "tau"]
            metrics["gate_tau"] = gate[0]["value"] if gate else None
            return metrics
    return None


class TimedDrafter(Drafter):
    """A drafter that adds up the seconds its `propose` takes."""

    def __init__(self, inner: Drafter):
        self.inner, self.needs_features, self.seconds = inner, inner.needs_features, 0.0
        self.feature_layers = inner.feature_layers  # an EAGLE-3 head reads these target layers

    def start(self, row, tokens, features):
        self.inner.start(row, tokens, features)

    def propose(self, rows, contexts, k, temperature, top_p, generator):
        start = time.perf_counter()
        proposal = self.inner.propose(rows, contexts, k, temperature, top_p, generator)
        self.seconds += time.perf_counter() - start
        return proposal

    def accept(self, row, accepted, emitted, features):
        self.inner.accept(row, accepted, emitted, features)

    def finish(self, row):
        self.inner.finish(row)


def decode(engine, mode: str, drafters: dict, prompts, args):
    """([(tokens, reason)], stats or None) of one batch: plain greedy decoding, or speculative with a drafter."""
    eos = engine.spec.eos_token_ids
    if mode == "plain":
        return engine.generate_ids(prompts, args.new_tokens, stop_ids=eos), None
    return engine.speculative_ids(prompts, args.new_tokens, args.draft_tokens, drafters[mode], stop_ids=eos)


def quality(engine, drafters: dict, prompts, args) -> dict:
    """Per drafter: tau, acceptance and the prompts whose output differs from plain greedy's (all in one batch)."""
    log(f"  plain greedy decoding of {len(prompts)} prompts")
    plain, _ = decode(engine, "plain", drafters, prompts, args)
    out = {}
    for mode in drafters:
        log(f"  speculative decoding with {mode}")
        spec, stats = decode(engine, mode, drafters, prompts, args)
        out[mode] = {"tau": stats.tau, "acceptance": stats.acceptance, "steps": stats.steps,
                     "by_position": stats.accepted_by_position,
                     "differ": [i for i, (a, b) in enumerate(zip(plain, spec, strict=True)) if a != b]}
    return out


def throughput(engine, drafters: dict, prompts, args) -> tuple[dict, list[str]]:
    """{(mode, batch): best tokens/s} over the sweep, and the mismatches seen (speculative vs plain output of
    the same group)."""
    modes = ["plain", *drafters]
    decode(engine, "plain", drafters, prompts[:2], args)  # warm-up: first-call allocations, the KV pool
    for mode in drafters:
        decode(engine, mode, drafters, prompts[:2], args)
    best: dict[tuple[str, int], float] = {}
    mismatches: list[str] = []
    for repeat in range(args.repeats):
        for batch in args.sweep:
            n = max(batch, args.sequences)
            groups = [prompts[i:i + batch] for i in range(0, n, batch)]
            reference = []
            for mode in modes:
                start, tokens, outputs = time.perf_counter(), 0, []
                for group in groups:
                    results, _ = decode(engine, mode, drafters, group, args)
                    tokens += sum(len(o) for o, _ in results)
                    outputs += results
                rate = tokens / (time.perf_counter() - start)
                best[mode, batch] = max(best.get((mode, batch), 0.0), rate)
                if mode == "plain":
                    reference = outputs
                elif repeat == 0:
                    differ = [i for i, (a, b) in enumerate(zip(reference, outputs, strict=True)) if a != b]
                    if differ:
                        mismatches.append(f"{mode} at batch {batch}: prompts {differ}")
            log(f"  repeat {repeat + 1}/{args.repeats}, batch {batch}: "
                + ", ".join(f"{m} {best[m, batch]:.0f}" for m in modes) + " tokens/s")
    return best, mismatches


def breakdown(engine, drafters: dict, prompts, batch: int, args) -> dict:
    """Per mode at `batch` (the first `batch` prompts as one group; the fastest of --repeats runs): ms per
    decoding step (wall, prefill excluded), of which the target's layers and the drafter's proposal; tokens a
    sequence emits per step; ms per token a sequence."""
    model = engine.model
    forwards: list[float] = []  # seconds of each target forward through the layers (the first: the prefill)
    features = model.features

    def timed_features(tokens, positions, cache=None, **kwargs):
        start = time.perf_counter()
        out = features(tokens, positions, cache, **kwargs)
        forwards.append(time.perf_counter() - start)
        return out

    group = prompts[:batch]
    model.features = timed_features  # an instance attribute: Transformer.forward reaches it through self
    try:
        out = {}
        for mode in ["plain", *drafters]:
            for _ in range(args.repeats):
                forwards.clear()
                timed = TimedDrafter(drafters[mode]) if mode != "plain" else None
                start = time.perf_counter()
                results, stats = decode(engine, mode, {mode: timed}, group, args)
                decoding = time.perf_counter() - start - forwards[0]
                steps = len(forwards) - 1
                run = {"step_ms": decoding / steps * 1e3, "forward_ms": sum(forwards[1:]) / steps * 1e3,
                       "propose_ms": timed.seconds / steps * 1e3 if timed else 0.0,
                       "tokens_per_seq_step": stats.tau if stats else 1.0,
                       "token_ms": decoding / (sum(len(o) for o, _ in results) / len(group)) * 1e3}
                if mode not in out or run["step_ms"] < out[mode]["step_ms"]:
                    out[mode] = run
    finally:
        del model.features
    return out


def break_even(best: dict, mode: str, sweep: list[int]) -> str:
    """The smallest batch of the sweep where `mode` decodes fewer tokens/s than plain decoding."""
    even = next((b for b in sweep if best[mode, b] < best["plain", b]), None)
    if even is None:
        return f"none up to {max(sweep)}"
    return f"{even} (slower at every batch)" if even == sweep[0] else str(even)


def speedup_cell(best: dict, mode: str, batch: int) -> str:
    return f"{best[mode, batch]:.0f} ({best[mode, batch] / best['plain', batch]:.2f}x)"


def report(name: str, spec, manifest: dict, training: dict | None, quality_rows: dict, best: dict,
           mismatches: list[str], costs: dict, trigram_contexts: int, args) -> list[str]:
    """The markdown lines for one artifact."""
    n, batches, drafters = args.prompts, args.batches, list(quality_rows)
    recipe = " + ".join(p["pass"] for p in (manifest.get("recipe") or {}).get("passes", [])) or "-"
    if training:
        head = (f"Draft head: {int(training['parameters']):,} parameters, {int(training['train_steps'])} training "
                f"steps, {int(training['train_tokens']):,} tokens, {training['train_seconds']:.0f} s of training "
                f"(final loss {training.get('final_loss', float('nan')):.3f}; the build's gate measured tau "
                f"{training['gate_tau']:.3f} on 64 prompts without EOS stops).")
    else:
        head = "No draft head in this artifact: the baselines only."
    protocol = (f"Greedy, k={args.draft_tokens}, {n} prompts of {PROMPT_TOKENS} tokens, {args.new_tokens} new. "
                f"tokens/s: best of {args.repeats}, 1 thread, at least {args.sequences} sequences per batch size; "
                "in brackets, against plain decoding.")
    lines = [f"### {name} ({recipe})", "", head, "", protocol, "",
             ("| drafter | tau | acceptance | identical to greedy | "
              + " | ".join(f"tokens/s @ batch {b}" for b in batches) + " | break-even batch |"),
             "|---|---:|---:|---:|" + "---:|" * len(batches) + "---:|",
             "| none (plain greedy) | 1 | - | - | " + " | ".join(f"{best['plain', b]:.0f}" for b in batches) + " | - |"]
    for mode, q in quality_rows.items():
        label = LABELS[mode] + (f" ({trigram_contexts:,} contexts)" if mode == "trigram" else "")
        lines.append(f"| {label} | {q['tau']:.3f} | {q['acceptance']:.3f} | {n - len(q['differ'])}/{n} | "
                     + " | ".join(speedup_cell(best, mode, b) for b in batches)
                     + f" | {break_even(best, mode, args.sweep)} |")
    lines += ["", "Verification steps whose j-th draft was accepted, j = 1, 2, ... (a tree: its chosen path):", ""]
    lines += [f"- {LABELS[mode]}: {', '.join(map(str, q['by_position'])) or 'none'} of {q['steps']} steps"
              for mode, q in quality_rows.items()]
    for mode, q in quality_rows.items():
        if q["differ"]:
            lines += ["", f"**{mode}: {len(q['differ'])} outputs differ from plain greedy decoding: {q['differ']}**"]
    lines += ["", "Sweep (tokens/s; speedup against plain):", "",
              "| batch | plain | " + " | ".join(LABELS[m] for m in drafters) + " |",
              "|---:|---:|" + "---:|" * len(drafters)]
    for b in args.sweep:
        lines.append(f"| {b} | {best['plain', b]:.0f} | " + " | ".join(speedup_cell(best, m, b) for m in drafters)
                     + " |")
    timed = len(drafters) * sum(max(b, args.sequences) for b in args.sweep)
    agreement = ("all identical to plain greedy decoding of the same group." if not mismatches else
                 "**outputs that differ from plain decoding of the same group: " + "; ".join(mismatches) + "**")
    lines += ["", f"Throughput runs: {timed} speculative outputs, {agreement}", "",
              ("Where a step's time goes (ms per step; the first B prompts as one batch, the fastest of "
               f"{args.repeats} instrumented runs; a plain step emits one token a sequence, a speculative step tau):"), "",
              ("| batch | decoding | ms per step | target's layers | drafter proposes | rest (Python, cache, "
               "accept) | tokens a sequence per step | ms per token a sequence |"),
              "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for b, c in costs.items():
        for mode, r in c.items():
            rest = r["step_ms"] - r["forward_ms"] - r["propose_ms"]
            lines.append(f"| {b} | {'plain' if mode == 'plain' else LABELS[mode]} | {r['step_ms']:.2f} | "
                         f"{r['forward_ms']:.2f} | {r['propose_ms']:.2f} | {rest:.2f} | "
                         f"{r['tokens_per_seq_step']:.2f} | {r['token_ms']:.2f} |")
    lines += ["", *note(spec, costs, args)]
    if "head" in quality_rows:
        lines += ["", "Targets:", ""]
        lines += [f"- {what}: {value} -> {'met' if ok else 'NOT MET'}"
                  for what, (value, ok) in targets(quality_rows, best, args).items()]
    return lines


def targets(quality_rows: dict, best: dict, args) -> dict[str, tuple[str, bool]]:
    """Issue #12's targets for the head: {what: (measured, met)}."""
    n, goal = args.prompts, args.tau_target
    tau, differ = quality_rows["head"]["tau"], quality_rows["head"]["differ"]
    tri = quality_rows["trigram"]["tau"] if "trigram" in quality_rows else None
    checks = {f"tau (head) >= {goal}": (f"{tau:.3f}", tau >= goal)}
    if tri is not None:
        checks[f"tau (head) >= {TAU_OVER_TRIGRAM} x trigram's"] = (f"{tau:.3f} vs {tri:.3f} ({tau / tri - 1:+.0%})",
                                                                  tau >= TAU_OVER_TRIGRAM * tri)
    checks["lossless (head)"] = (f"{n - len(differ)}/{n} identical", not differ)
    if "head-tree" in quality_rows:
        t = quality_rows["head-tree"]
        over = f" ({t['tau'] / tri - 1:+.0%} over the trigram)" if tri is not None else ""
        checks[f"tau (head, tree of {args.tree_width}) >= {goal}"] = (
            f"{t['tau']:.3f}{over}, {n - len(t['differ'])}/{n} identical", t["tau"] >= goal and not t["differ"])
    for mode in [m for m in ("head", "head-tree") if (m, args.sweep[0]) in best]:
        for b in (1, 8):
            if b in args.sweep:
                speedup = best[mode, b] / best["plain", b]
                floor = args.speedup_target if b == 1 else 1.0
                checks[f"speedup at batch {b} ({LABELS[mode]}) > {floor}"] = (f"{speedup:.2f}x", speedup > floor)
        checks[f"break-even batch ({LABELS[mode]})"] = (break_even(best, mode, args.sweep), True)
    return checks


def note(spec, costs: dict, args) -> list[str]:
    """What the numbers mean, in the measured figures."""
    out = []
    for b, c in costs.items():
        plain = c["plain"]
        for mode in [m for m in c if m != "plain"][:1]:  # the first drafter: the head when there is one
            r = c[mode]
            out.append(f"- batch {b}, {LABELS[mode]}: a verification forward ({args.draft_tokens + 1} tokens a "
                       f"sequence) costs {r['forward_ms'] / plain['forward_ms']:.2f}x a decode forward (1 token) "
                       f"in the target's layers; proposing costs {r['propose_ms'] / plain['step_ms']:.2f} plain "
                       f"steps; a speculative step costs {r['step_ms'] / plain['step_ms']:.2f} plain steps and emits "
                       f"{r['tokens_per_seq_step']:.2f} tokens a sequence.")
    out.append(f"- This model has {len(spec.layers)} layers of width {spec.hidden_size}. On the CPU a batch-1 forward "
               "costs about as much for k+1 tokens as for one (the verification/decode ratios above): it is bound by "
               "reading the weights (fp32 here) or, for a tiny model, by per-call overhead. Speculation pays while tau "
               "exceeds a speculative step's cost in plain steps (one verification, the drafter's forwards, the "
               "per-row acceptance loop in Python). As the batch grows a plain step becomes compute-bound and spreads "
               "its fixed costs over more rows, while verification multiplies the tokens by k+1 (a tree's by more) "
               "and acceptance runs row by row, so that ratio grows until speculation costs. These figures measure "
               "this runtime on one CPU thread, not a GPU serving a large model.")
    return out


def plot(series: dict, sweep: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rate_ax, speed_ax) = plt.subplots(1, 2, figsize=(11, 4.5))
    styles = ["-", "--", ":", "-."]
    colors = {"plain": "black", "head": "tab:blue", "head-tree": "tab:purple", "trigram": "tab:orange",
              "prompt-lookup": "tab:green"}
    for index, (name, best) in enumerate(series.items()):
        modes = sorted({m for m, _ in best}, key=list(colors).index)
        style = styles[index % len(styles)]
        for mode in modes:
            label = f"{name}: {'plain' if mode == 'plain' else LABELS[mode]}"
            rate_ax.plot(sweep, [best[mode, b] for b in sweep], style, marker="o", color=colors[mode], label=label)
            if mode != "plain":
                speed_ax.plot(sweep, [best[mode, b] / best["plain", b] for b in sweep], style, marker="o",
                              color=colors[mode], label=label)
    speed_ax.axhline(1.0, color="grey", linewidth=1)
    for ax in (rate_ax, speed_ax):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sweep, [str(b) for b in sweep])
        ax.set_xlabel("batch (sequences decoded together)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    rate_ax.set_yscale("log")
    rate_ax.set_ylabel("generated tokens/s (1 CPU thread)")
    rate_ax.set_title("greedy decoding, with and without speculation")
    speed_ax.set_ylabel("speedup over plain decoding")
    speed_ax.set_title("speculation's speedup (below 1: it costs)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def drafter_list(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [n for n in names if n not in LABELS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"drafters from {', '.join(LABELS)}, comma-separated; got {text!r}")
    return names


def batch_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"a comma-separated list of batch sizes >= 1, got {text!r}")
    return sorted(set(values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifacts", type=Path, nargs="+", help="artifact directories (built with draft-head or not)")
    parser.add_argument("-o", "--out", type=Path, default=ROOT / "artifacts" / "speculative")
    parser.add_argument("--prompts", type=int, default=200, help="evaluation prompts for tau and the lossless check")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--draft-tokens", type=int, default=4, help="k: drafts per verification")
    parser.add_argument("--tree-width", type=int, default=3, help="the head's tree rows: candidates per depth")
    parser.add_argument("--batches", type=batch_list, default=[1, 8, 32], help="batches in the main table")
    parser.add_argument("--sweep", type=batch_list, default=[1, 2, 4, 8, 16, 32, 64],
                        help="batches timed for the break-even (the table's are added)")
    parser.add_argument("--sequences", type=int, default=32, help="sequences timed per batch size (at least)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (the best counts)")
    parser.add_argument("--drafters", type=drafter_list, default=list(LABELS),
                        help=f"drafters to measure, comma-separated: {', '.join(LABELS)} (default: all)")
    parser.add_argument("--tau-target", type=float, default=TAU_TARGET,
                        help="the head's tau target (issue #12: 2.8 on stories260K; issue #19: 2.5 on SmolLM2)")
    parser.add_argument("--speedup-target", type=float, default=1.0,
                        help="the head's wall-clock target at batch 1 (issue #19: 1.5)")
    args = parser.parse_args()
    args.sweep = sorted(set(args.sweep) | set(args.batches))
    torch.set_num_threads(1)
    started = time.perf_counter()
    lines: list[str] = []
    series: dict[str, dict] = {}
    failed = False
    for path in args.artifacts:
        log(f"{path}: loading")
        engine = runtime.load(path)
        manifest = engine.manifest
        prompts = evaluation_prompts(engine.tokenizer, max(args.prompts, max(args.sweep), args.sequences))
        calibration = load_token_lists(engine.tokenizer, CALIB, None)  # the trigram's corpus: never evaluation
        drafters = {}
        if engine.draft_module() is not None:
            drafters["head"] = engine.drafter("head", tree_width=1)
            if args.tree_width > 1:
                drafters["head-tree"] = engine.drafter("head", tree_width=args.tree_width)
        drafters["trigram"] = engine.drafter("trigram", calibration)
        drafters["prompt-lookup"] = engine.drafter("prompt-lookup")
        trigram_contexts = len(drafters["trigram"].table)
        drafters = {m: d for m, d in drafters.items() if m in args.drafters}
        if not drafters:
            raise SystemExit(f"{path}: none of --drafters {','.join(args.drafters)} applies (no draft head?)")
        log(f"{path}: tau and outputs ({args.prompts} prompts, one batch)")
        quality_rows = quality(engine, drafters, prompts[:args.prompts], args)
        log(f"{path}: throughput over batches {args.sweep}")
        best, mismatches = throughput(engine, drafters, prompts, args)
        log(f"{path}: where the time goes at batches {args.batches}")
        costs = {b: breakdown(engine, drafters, prompts, b, args) for b in args.batches}
        section = report(path.name, engine.spec, manifest, head_training(manifest), quality_rows, best, mismatches,
                         costs, trigram_contexts, args)
        failed |= any(q["differ"] for q in quality_rows.values()) or bool(mismatches)
        lines += [*section, ""]
        series[path.name] = best
    lines.append(f"({time.perf_counter() - started:.0f} s in all; trigram counted on {CALIB.name}, prompts from "
                 f"{EVAL.name})")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "speculative.md").write_text("\n".join(lines) + "\n")
    plot(series, args.sweep, args.out / "speculative.png")
    print("\n".join(lines))
    print(f"wrote {args.out / 'speculative.md'} and {args.out / 'speculative.png'}")
    if failed:
        sys.exit("speculative outputs differ from plain greedy decoding (listed above)")


if __name__ == "__main__":
    main()
