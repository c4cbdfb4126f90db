"""`optimize gate` (the CI gate: an artifact against its baseline, exit 1 below a floor) and `optimize eval`
(an artifact's perplexity, and optionally its speculative decoding, on a text).

    optimize gate ART --baseline CHECKPOINT --data TEXT --min-recovery 0.98 [--tasks FILE.yaml] [--junit FILE]
    optimize eval ART --data TEXT [--speculative]
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer

from kiln.kernels.errors import KilnError
from kiln.optimizer.cli.console import log, out
from kiln.optimizer.cli.options import (
    DATA_FORMATS,
    DEVICE_HELP,
    DRAFT_TOKENS,
    GENERATE,
    GENERATE_TOKENS,
    PARAGRAPHS,
    RESAMPLES,
    SEED,
    TASK_LIMIT,
    TREE_WIDTH,
)
from kiln.optimizer.cli.tables import checks_table
from kiln.optimizer.errors import BelowFloor


def gate(
    artifact: Annotated[Path, typer.Argument(help="artifact directory")],
    baseline: Annotated[str, typer.Option(help="the checkpoint the artifact was built from")],
    data: Annotated[Path, typer.Option(help=f"held-out data: {DATA_FORMATS}")],
    min_recovery: Annotated[float, typer.Option(help="floor: ppl_baseline / ppl_artifact, in (0, 1.5]")],
    max_kl: Annotated[float | None, typer.Option(help="ceiling on the mean KL, nats/token (default: the sum of "
                                                 "the ceilings the artifact's passes were built to)")] = None,
    min_top1: Annotated[float | None, typer.Option(help="floor on top-1 agreement (default: 1 less the agreement "
                                                   "the artifact's passes were each allowed to lose)")] = None,
    paragraphs: Annotated[int, typer.Option(callback=PARAGRAPHS, help="first N paragraphs")] = 600,
    decision: Annotated[str, typer.Option(help="point: the recovery figure must clear --min-recovery; lower: "
                                          "the lower end of its 95% interval must")] = "point",
    resamples: Annotated[int, typer.Option(callback=RESAMPLES, help="bootstrap resamples for the recovery interval")] = 2000,
    seed: Annotated[int, typer.Option(callback=SEED, help="bootstrap seed (the interval is deterministic for a seed)")] = 0,
    generate: Annotated[int, typer.Option(callback=GENERATE, help="long-generation check: prompts (each paragraph's first 16 "
                                          "tokens) decoded greedily by both models; 0 skips it")] = 32,
    generate_tokens: Annotated[int, typer.Option(callback=GENERATE_TOKENS, help="tokens each long generation decodes")] = 256,
    min_gen_agreement: Annotated[float | None, typer.Option(help="floor, each quarter of the generation: fraction "
                                                            "of the artifact's tokens the baseline would pick "
                                                            "(default 0.8)")] = None,
    min_distinct_ratio: Annotated[float | None, typer.Option(help="floor: the artifact's distinct-4 over the "
                                                             "baseline's; a loop repeats its 4-grams (default "
                                                             "0.75)")] = None,
    min_first_divergence: Annotated[float | None, typer.Option(help="floor: median token where the generations "
                                                               "first differ (default 4)")] = None,
    tasks: Annotated[Path | None, typer.Option(help="lm-eval task YAML (local tasks, a floor per task in its "
                                               "metadata) run on both models through the runtime")] = None,
    task_limit: Annotated[int | None, typer.Option(callback=TASK_LIMIT, help="first N documents of each task")] = None,
    any_baseline: Annotated[bool, typer.Option(help="compare against BASELINE even when it is not the "
                                               "artifact's recorded source")] = False,
    force: Annotated[bool, typer.Option(help="score text the baseline cannot read (perplexity above 1/8 of "
                                        "the vocabulary), with a warning")] = False,
    fmt: Annotated[str, typer.Option("--format", help="text (tables), json, markdown or junit (XML, one test "
                                     "case per check), on stdout")] = "text",
    as_json: Annotated[bool, typer.Option("--json", help="same as --format json")] = False,
    junit: Annotated[Path | None, typer.Option(help="also write JUnit XML, one test case per check, to FILE")] = None,
    device: Annotated[str, typer.Option(help=DEVICE_HELP + "; the baseline runs there too")] = "cpu",
) -> None:
    """CI gate: exit 1 when a check fails (recovery, KL, top-1, long generation, tasks), 2 on bad input.

    Recovery comes with a 95% paired-bootstrap interval over the paragraphs; --decision lower holds its lower
    end to the floor."""
    # lazy: imports torch (through kiln.optimizer.measure.gate), which --help never needs
    from kiln.optimizer.output_dir import check_output_file
    from kiln.optimizer.report.gate_report import is_kiln_junit

    fmt = "json" if as_json else fmt
    gen_floors = _check_gate_request(min_recovery, max_kl, min_top1, fmt, decision, tasks,
                                     {"agreement": min_gen_agreement, "distinct4_ratio": min_distinct_ratio,
                                      "first_divergence": min_first_divergence})
    junit_inputs = [artifact, baseline, data, tasks]
    if junit is not None:  # before the gate runs, not after: never an input, a directory or the user's own file
        check_output_file(junit, junit_inputs, is_kiln_junit, "--junit")
    started = time.perf_counter()
    engine, reference, max_kl, min_top1 = _gate_models(artifact, baseline, device, any_baseline, max_kl, min_top1)
    tokens, result, checks, fields = _accuracy_checks(engine, reference, data, paragraphs, force, decision,
                                                      resamples, seed, (min_recovery, max_kl, min_top1))
    if generate:
        checks += _generation_checks(engine, reference, tokens, generate, generate_tokens, gen_floors, fields)
    if tasks is not None:
        checks += _task_checks(engine, reference, tasks, task_limit, fields)
    passed = all(c.passed for c in checks) and result.suspect is None
    fields.update(held={"recovery": checks[0].passed, "kl": checks[1].passed, "top1": checks[2].passed},
                  passed=passed, checks=[c.as_json() for c in checks])
    seconds = time.perf_counter() - started
    if junit is not None:
        _write_junit(junit, junit_inputs, checks, f"gate {artifact.name}", seconds, result.suspect)
    _print_gate(fmt, fields, checks, artifact, baseline, seconds, result)
    if result.suspect:
        raise BelowFloor(f"implausible result, not a pass: {result.suspect}")
    failed = [c.failure for c in checks if not c.passed]
    if failed:
        raise BelowFloor(f"{len(failed)} of {len(checks)} checks failed: " + "; ".join(failed))


def _check_gate_request(min_recovery: float, max_kl: float | None, min_top1: float | None, fmt: str, decision: str,
                        tasks: Path | None, generation_floors: dict):
    """Refuse, before any work, what the gate could not honour; the long generation's floors (defaults where
    `generation_floors` holds None)."""
    # lazy: each imports torch, which --help never needs
    from kiln.optimizer.measure.gate import check_floors
    from kiln.optimizer.measure.generation_check import GenerationFloors
    from kiln.optimizer.report.gate_report import FORMATS

    check_floors(min_recovery, max_kl, min_top1)
    if fmt not in FORMATS:
        raise KilnError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if decision not in ("point", "lower"):
        raise KilnError(f"--decision must be point or lower, got {decision!r}")
    gen_floors = GenerationFloors(**{name: value for name, value in generation_floors.items() if value is not None})
    if tasks is not None and not tasks.is_file():
        raise KilnError(f"--tasks {tasks}: no such file")
    return gen_floors


def _gate_models(artifact: Path, baseline: str, device: str, any_baseline: bool, max_kl: float | None,
                 min_top1: float | None):
    """The artifact's engine and the baseline's (checked to be its recorded source unless `any_baseline`), and the
    KL ceiling and top-1 floor: those given, else those the artifact's passes were built to."""
    # lazy: each imports torch, which --help never needs
    from kiln import runtime
    from kiln.optimizer.loader import load_checkpoint
    from kiln.optimizer.measure.gate import artifact_floors, check_baseline, engine_from_graph
    from kiln.runtime.engine import read_generation_defaults

    engine = runtime.load(artifact, device=device)
    source = load_checkpoint(baseline, log=log)
    if not any_baseline:
        check_baseline(engine.manifest, source, log=log)  # weights and config.json, each by sha256
    recorded_kl, recorded_top1 = artifact_floors(engine.manifest)
    max_kl = recorded_kl if max_kl is None else max_kl
    min_top1 = recorded_top1 if min_top1 is None else min_top1
    reference = engine_from_graph(source, engine.tokenizer, device=engine.device, dtype=engine.dtype)
    # the source decodes with its own generation defaults, as the artifact does with those it shipped
    reference.repetition_penalty = read_generation_defaults(source.source.path / "generation_config.json").get(
        "repetition_penalty", 1.0)
    if reference.spec.vocab_size != engine.spec.vocab_size:
        raise KilnError(f"baseline {baseline} has a vocabulary of {reference.spec.vocab_size} tokens, the artifact "
                        f"{engine.spec.vocab_size}: they are different models")
    return engine, reference, max_kl, min_top1


def _accuracy_checks(engine, reference, data: Path, paragraphs: int, force: bool, decision: str, resamples: int,
                     seed: int, floors: tuple):
    """Score both models on `data`: the token lists, the gate's result, its recovery, KL and top-1 checks, and
    the figures the gate reports."""
    # lazy: each imports torch, which --help never needs
    from kiln.calibration.data import load_token_lists, token_cap
    from kiln.optimizer.measure.gate import AccuracyGate, Check, check_native_text

    min_recovery, max_kl, min_top1 = floors
    context = min(reference.spec.max_position_embeddings, engine.spec.max_position_embeddings)
    tokens = load_token_lists(engine.require_tokenizer(), data, paragraphs, token_cap(context), log=log)
    log(f"scoring {len(tokens)} paragraphs of {data}: baseline, then artifact")
    checker = AccuracyGate(reference, tokens, resamples=resamples, seed=seed)
    check_native_text(checker.baseline.perplexity, reference.spec.vocab_size, f"the text {data.name}", force, log)
    result = checker.compare(engine, min_recovery, max_kl, min_top1)
    low, high = result.recovery_interval
    checks = [Check("recovery" if decision == "point" else "recovery (95% lower bound)",
                    result.recovery if decision == "point" else low, min_recovery,
                    detail=f"point {result.recovery:.5f}, 95% interval [{low:.5f}, {high:.5f}]"),
              Check("KL (nats/token)", result.kl, max_kl, relation="<="),
              Check("top-1 agreement", result.top1, min_top1)]
    fields = {"recovery": result.recovery, "recovery_low": low, "recovery_high": high,
              "confidence": 0.95, "resamples": resamples, "seed": seed, "documents": len(tokens),
              "decision": decision, "perplexity": result.perplexity,
              "baseline_perplexity": result.baseline_perplexity, "kl": result.kl, "top1": result.top1,
              "tokens": result.tokens, "min_recovery": min_recovery, "max_kl": max_kl, "min_top1": min_top1,
              "suspect": result.suspect}
    return tokens, result, checks, fields


def _generation_checks(engine, reference, tokens, generate: int, generate_tokens: int, gen_floors,
                       fields: dict) -> list:
    """The long-generation checks (`fields["generation"]` gets their figures)."""
    # lazy: imports torch, which --help never needs
    from kiln.optimizer.measure.generation_check import generation_prompts, long_generation

    log(f"long generation: {generate} prompts x {generate_tokens} tokens, baseline and artifact")
    long = long_generation(engine, reference, generation_prompts(tokens, generate), generate_tokens)
    checks = long.checks(gen_floors)
    fields["generation"] = long.to_json()
    return checks


def _task_checks(engine, reference, tasks: Path, task_limit: int | None, fields: dict) -> list:
    """The lm-eval tasks' checks (`fields["tasks"]` gets their results)."""
    from kiln.optimizer.eval.tasks import run_tasks  # lazy: imports torch (and lm-eval when run)

    task_checks, task_results = run_tasks(tasks, engine, reference, limit=task_limit, log=log)
    fields["tasks"] = task_results
    return task_checks


def _write_junit(junit: Path, junit_inputs: list, checks, name: str, seconds: float, suspect) -> None:
    # lazy: imports torch (through kiln.optimizer.measure.gate), which --help never needs
    from kiln.optimizer.output_dir import atomic_file
    from kiln.optimizer.report.gate_report import is_kiln_junit, junit_xml

    atomic_file(junit, junit_xml(checks, name, seconds, suspect), junit_inputs, is_kiln_junit, "--junit")


def _print_gate(fmt: str, fields: dict, checks, artifact: Path, baseline: str, seconds: float, result) -> None:
    """The gate's result on stdout, as --format asks."""
    # lazy: imports torch (through kiln.optimizer.measure.gate), which --help never needs
    from kiln.optimizer.report.gate_report import junit_xml, markdown

    if fmt == "json":
        print(json.dumps(fields, indent=2))
    elif fmt == "junit":
        print(junit_xml(checks, f"gate {artifact.name}", seconds, result.suspect), end="")
    elif fmt == "markdown":
        print(markdown(fields, checks, f"Kiln gate: {artifact.name} against {baseline}"), end="")
    else:
        low, high = result.recovery_interval
        out.print(checks_table(checks, f"gate: {artifact} against {baseline}", fields["passed"]))
        out.print(f"recovery {result.recovery:.5f}, 95% interval [{low:.5f}, {high:.5f}] ({fields['resamples']} "
                  f"paired bootstrap resamples over {fields['documents']} paragraphs, seed {fields['seed']}); "
                  f"perplexity {result.perplexity:.5f} vs baseline {result.baseline_perplexity:.5f} over "
                  f"{result.tokens} tokens")


def _score_artifact(artifact: Path, data: Path, paragraphs: int, force: bool = False, device: str = "cpu"):
    """Score the artifact on `data`, paragraphs cut at its context; refuse text it cannot read unless `force`."""
    # lazy: each imports torch, which --help never needs
    from kiln import runtime
    from kiln.calibration.data import load_token_lists, token_cap
    from kiln.optimizer.measure.gate import check_native_text, score

    engine = runtime.load(artifact, device=device)
    tokens = load_token_lists(engine.require_tokenizer(), data, paragraphs, token_cap(engine.spec.max_position_embeddings),
                              log=log)
    result = score(engine, tokens)
    check_native_text(result.perplexity, engine.spec.vocab_size, f"the text {data.name}", force, log)
    return engine, tokens, result


def eval_(
    artifact: Annotated[Path, typer.Argument(help="artifact directory")],
    data: Annotated[Path, typer.Option(help=DATA_FORMATS)],
    paragraphs: Annotated[int, typer.Option(callback=PARAGRAPHS, help="first N paragraphs")] = 600,
    force: Annotated[bool, typer.Option(help="score text the model cannot read (perplexity above 1/8 of the "
                                        "vocabulary), with a warning")] = False,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    speculative: Annotated[bool, typer.Option(help="also decode each paragraph's first 16 tokens greedily for 64 "
                                              "tokens, with and without speculative decoding: tau, identical "
                                              "outputs, tokens/s")] = False,
    draft_tokens: Annotated[int, typer.Option(callback=DRAFT_TOKENS, help="speculative: tokens drafted per target forward")] = 4,
    draft: Annotated[str, typer.Option(help="speculative drafter: auto, head, prompt-lookup")] = "auto",
    tree_width: Annotated[int | None, typer.Option(callback=TREE_WIDTH, help="speculative, head: candidates per depth verified as a "
                                                   "tree (default: the artifact's; 1: a chain)")] = None,
    device: Annotated[str, typer.Option(help=DEVICE_HELP)] = "cpu",
) -> None:
    """Perplexity of an artifact on a text file, through the runtime, within the model's context."""
    engine, tokens, s = _score_artifact(artifact, data, paragraphs, force, device)
    result = {"perplexity": s.perplexity, "nll_per_token": s.nll / s.tokens, "tokens": s.tokens,
              "paragraphs": len(tokens)}
    if speculative:
        result.update(_speculative_eval(engine, tokens, draft, draft_tokens, tree_width))
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        out.print(f"perplexity {s.perplexity:.4f} over {s.tokens} tokens ({len(tokens)} paragraphs)")
        if speculative:
            out.print(f"speculative ({result['drafter']}, k={draft_tokens}): tau {result['tau']:.3f}, "
                      f"{result['identical']}/{result['prompts']} outputs identical to plain greedy decoding, "
                      f"{result['tokens_per_s']:.1f} vs {result['plain_tokens_per_s']:.1f} tokens/s")


SPECULATIVE_PROMPT_TOKENS, SPECULATIVE_NEW_TOKENS = 16, 64


def _speculative_eval(engine, tokens, draft: str, draft_tokens: int, tree_width: int | None = None) -> dict:
    """Greedy decoding of each paragraph's first 16 tokens, 64 new, plain and speculative, all prompts in one
    batch: tau, how many outputs are identical, and tokens/s of each."""
    prompts = [t[:SPECULATIVE_PROMPT_TOKENS] for t in tokens if len(t) >= SPECULATIVE_PROMPT_TOKENS]
    if not prompts:
        raise KilnError(f"--speculative needs paragraphs of at least {SPECULATIVE_PROMPT_TOKENS} tokens")
    drafter = engine.drafter(draft, tree_width=tree_width)
    start = time.perf_counter()
    plain = engine.generate_ids(prompts, SPECULATIVE_NEW_TOKENS, stop_ids=engine.spec.eos_token_ids)
    plain_seconds = time.perf_counter() - start
    start = time.perf_counter()
    spec, stats = engine.speculative_ids(prompts, SPECULATIVE_NEW_TOKENS, draft_tokens, drafter,
                                         stop_ids=engine.spec.eos_token_ids)
    spec_seconds = time.perf_counter() - start
    count = sum(len(o) for o, _ in plain)
    return {"drafter": type(drafter).__name__, "draft_tokens": draft_tokens,
            "tree_width": getattr(drafter, "tree_width", 1), "prompts": len(prompts),
            "identical": sum(a == b for a, b in zip(plain, spec, strict=True)), "tau": stats.tau,
            "acceptance": stats.acceptance, "tokens_per_s": sum(len(o) for o, _ in spec) / spec_seconds,
            "plain_tokens_per_s": count / plain_seconds}

