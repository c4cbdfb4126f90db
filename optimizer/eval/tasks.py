"""lm-eval tasks through Kiln's runtime: `optimize gate --tasks FILE.yaml`.

    checks, raw = run_tasks(Path("examples/tasks/tinystories.yaml"), candidate, baseline)

`FILE.yaml` is an lm-eval task or group YAML. lm-eval indexes the YAMLs of FILE's directory only
(`TaskManager(include_path=FILE's dir, include_defaults=False)`: nothing from lm-eval's own task catalogue and
nothing fetched), builds the task(s) FILE names, and `EngineLM` answers their requests with an `Engine`: the
artifact's own numerics, as the rest of the gate measures them. A group YAML lists several tasks; its members'
YAMLs live beside it.

Floors. Each task states its own, in the free `metadata` dict lm-eval keeps per task (a group member may
override it: `- {task: NAME, metadata: {...}}` replaces the task's `metadata` whole):

    metadata:
      kiln_metric: acc            # the lm-eval metric held to the floor ("acc", or "exact_match,strict-match"
                                  # for a metric under a named filter; without a filter, "none" is implied)
      kiln_min_recovery: 0.95     # relative to the baseline: candidate >= 0.95 x baseline for a metric where
                                  # higher is better; candidate <= baseline / 0.95 where lower is (perplexities),
                                  # recovery = baseline / candidate as the perplexity gate defines it
      kiln_min: 0.4               # absolute floor (metrics where higher is better only)
      kiln_max: 30.0              # absolute ceiling (metrics where lower is better only)

`kiln_metric` and at least one of the three bounds are required for every task FILE runs: a task without a
floor is an error, as is an unknown `kiln_*` key, a bound on the wrong side of the metric, or a relative floor
with no baseline to be relative to. Each task gives one `Check` named `task:<task>:<metric>`: its value is
the candidate's metric, its floor the binding bound (the higher floor, or the lower ceiling, of those given).

Numerics. Full-vocabulary logits exist for at most gate.head_rows(V) scored positions at once (gate.head_log_probs),
and only for the positions a request scores (continuation tokens), never for a context; forward batches hold
at most BATCH_TOKENS tokens, padding included. Tokenization follows lm-eval's HFLM: a context's trailing
whitespace moves to the continuation, the continuation's tokens are those of encode(context + continuation)
past encode(context), and context + continuation is cut from the left to the model's context (+1: the last
token is only predicted). `loglikelihood_rolling` scores a text's own tokens (no BOS among them) after the
prefix token (BOS, else EOS), in disjoint windows of at most the model's context, each token exactly once;
HFLM does the same except that with a tokenizer that adds BOS it also scores that BOS after the prefix.
`generate_until` decodes greedily (`Engine.generate_ids`), stops at EOS or a stop string, and returns the
continuation decoded on its own and cut at the first stop string, as HFLM does; a task asking for sampling is
refused. Its prompts go to the engine in batches of at most BATCH_TOKENS prompt tokens (the engine's prefill
returns logits for every prompt position).

Determinism: the run seeds Python, NumPy and torch as lm-eval's `simple_evaluate` does (0, 1234, 1234; the
few-shot sampler 1234) and restores the caller's random states afterwards; the example tasks draw their items
with their own fixed seed.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from kiln.calibration.data import length_batches
from kiln.calibration.progress import stage
from kiln.kernels.errors import KilnError
from kiln.optimizer.measure.gate import BATCH_TOKENS, MAX_FLOOR, Check, head_log_probs
from kiln.runtime.engine import Engine

INSTALL_HINT = "pip install 'kiln[tasks]'"
FLOOR_KEYS = ("kiln_min_recovery", "kiln_min", "kiln_max")
METADATA_KEYS = ("kiln_metric", *FLOOR_KEYS)
DEFAULT_FILTER = "none"  # the filter lm-eval names a task's unfiltered responses by
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's (HFLM.max_gen_toks) when a task names none
RANDOM_SEED, OTHER_SEED = 0, 1234  # lm-eval's simple_evaluate defaults (python; numpy, torch, few-shot)


def _lm_eval():
    """lm-eval's modules, imported only when tasks run (it is the optional `tasks` extra)."""
    try:
        # lazy: lm-eval is the optional `tasks` extra
        import lm_eval.api.model
        import lm_eval.api.task
        import lm_eval.evaluator
        import lm_eval.tasks
        import lm_eval.utils
    except ImportError as exc:
        raise KilnError(f"running lm-eval tasks needs lm-eval ({exc.name or 'lm_eval'} is missing): "
                        f"{INSTALL_HINT}") from None
    return lm_eval


# --- the model lm-eval talks to ------------------------------------------------------------------------------

def engine_lm(engine: Engine, max_length: int | None = None, batch_tokens: int = BATCH_TOKENS):
    """An lm-eval `LM` answering requests with `engine` (see `engine_lm_class`); `max_length` (default: the
    model's context) bounds every forward sequence."""
    return engine_lm_class()(engine, max_length, batch_tokens)


@functools.cache
def engine_lm_class():
    """`EngineLM`, lm-eval's `TemplateLM` over a Kiln `Engine`; defined on first use, as lm-eval is the optional
    `tasks` extra. lm-eval's model `kiln` (kiln.optimizer.eval.lm_eval_model.KilnLM) is this class over an artifact."""
    lm_eval = _lm_eval()

    class EngineLM(lm_eval.api.model.TemplateLM):
        """lm-eval's `TemplateLM` over a Kiln `Engine`: TemplateLM splits context and continuation as HFLM does;
        this class scores token lists with the engine (loglikelihood, rolling windows) and decodes greedily."""

        backend = "causal"

        def __init__(self, engine: Engine, max_length: int | None = None, batch_tokens: int = BATCH_TOKENS):
            super().__init__()
            self.engine = engine
            self.tokenizer = engine.require_tokenizer()
            context = engine.spec.max_position_embeddings
            if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int)
                                           or not 1 <= max_length <= context):
                raise KilnError(f"max_length must be in [1, {context}] (the model's context), got {max_length!r}")
            if isinstance(batch_tokens, bool) or not isinstance(batch_tokens, int) or batch_tokens < 1:
                raise KilnError(f"batch_tokens must be a positive number of tokens, got {batch_tokens!r}")
            self.max_length = max_length or context
            self.batch_tokens = batch_tokens

        # -- tokens
        @property
        def eot_token_id(self) -> int:
            eos = self.tokenizer.eos_token_id
            return eos if eos is not None else self.engine.spec.eos_token_ids[0]

        @property
        def prefix_token_id(self) -> int:
            bos = self.tokenizer.bos_token_id
            return bos if bos is not None else self.eot_token_id

        @property
        def tokenizer_name(self) -> str:
            return getattr(self.tokenizer, "name_or_path", "kiln").replace("/", "__")

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
            if add_special_tokens is None:  # the tokenizer's default, unless the text already opens with BOS
                bos = self.tokenizer.bos_token
                add_special_tokens = not (bos and string.startswith(bos))
            return self.tokenizer.encode(string, add_special_tokens=add_special_tokens)

        def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
            return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

        # -- requests
        def loglikelihood(self, requests, disable_tqdm: bool = True):
            return super().loglikelihood(requests, disable_tqdm=True)

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = True, **kwargs):
            pairs = [(context, continuation) for _, context, continuation in requests]
            return score_continuations(self.engine, pairs, self.max_length, self.batch_tokens)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = True) -> list[float]:
            return _loglikelihood_rolling(self, requests, lm_eval.utils)

        def generate_until(self, requests, disable_tqdm: bool = True) -> list[str]:
            return _generate_until(self, requests)

    return EngineLM


def _loglikelihood_rolling(lm, requests, lm_eval_utils) -> list[float]:
    """`EngineLM.loglikelihood_rolling`: each request's text cut into lm-eval's disjoint rolling windows, scored,
    and summed per request."""
    windows, owner = [], []
    for i, (string,) in enumerate(request.args for request in requests):
        tokens = lm.tok_encode(string, add_special_tokens=False)
        for window in lm_eval_utils.get_rolling_token_windows(
                token_list=tokens, prefix_token=lm.prefix_token_id, max_seq_len=lm.max_length, context_len=1):
            windows.append(lm_eval_utils.make_disjoint_window(window))
            owner.append(i)
    totals = [0.0] * len(requests)
    scores = score_continuations(lm.engine, windows, lm.max_length, lm.batch_tokens)
    for i, (logprob, _) in zip(owner, scores, strict=True):
        totals[i] += logprob
    return totals


def _generate_until(lm, requests) -> list[str]:
    """`EngineLM.generate_until`: greedy decoding of each request, grouped by decoding setting as HFLM groups
    them, cut at the stop sequences."""
    from lm_eval.models import utils as model_utils  # lazy: lm-eval is the optional `tasks` extra

    results: list[str | None] = [None] * len(requests)
    groups: dict[str, list[int]] = {}
    for i, request in enumerate(requests):  # one decoding setting per group, as HFLM groups them
        groups.setdefault(repr(sorted(request.args[1].items())), []).append(i)
    eos = lm.tok_decode([lm.eot_token_id], skip_special_tokens=False)
    for rows in groups.values():
        kwargs = model_utils.normalize_gen_kwargs(requests[rows[0]].args[1], DEFAULT_MAX_GEN_TOKS)
        if kwargs.get("do_sample"):
            raise KilnError(f"task {requests[rows[0]].task_name} asks for sampling (do_sample: true); "
                            "Kiln's lm-eval model decodes greedily: set do_sample: false")
        until = model_utils.handle_stop_sequences(kwargs["until"], eos=eos)
        new_tokens = kwargs["max_gen_toks"]
        room = lm.max_length - new_tokens
        if room < 1:
            raise KilnError(f"max_gen_toks {new_tokens} leaves no room for a prompt in the model's context "
                            f"{lm.max_length}")
        # an empty context with a tokenizer that adds no BOS still needs a token to condition on
        prompts = [lm.tok_encode(requests[i].args[0])[-room:] or [lm.prefix_token_id] for i in rows]
        for texts, batch in generate(lm.engine, prompts, new_tokens, until, lm.batch_tokens):
            for j, text in zip(batch, texts, strict=True):
                results[rows[j]] = model_utils.postprocess_generated_text(text, until, None)
    return results


def score_continuations(engine: Engine, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], max_length: int,
                        batch_tokens: int = BATCH_TOKENS) -> list[tuple[float, bool]]:
    """(log-probability of `continuation` after `context`, whether greedy decoding gives it) per pair, as lm-eval's
    `_loglikelihood_tokens`: context + continuation is cut from the left to `max_length` + 1 tokens, whose last
    is only a target. Full-vocabulary log-probs exist only for continuation positions, head_rows(V) at a time."""
    inputs, widths = [], []
    for context, continuation in pairs:
        if not context or not continuation:
            raise ValueError("every request needs a non-empty context and continuation (lm-eval ensures both)")
        if len(continuation) > max_length:
            raise KilnError(f"a continuation of {len(continuation)} tokens exceeds the model's context {max_length}")
        inputs.append((list(context) + list(continuation))[-(max_length + 1):][:-1])
        widths.append(len(continuation))
    results: list[tuple[float, bool] | None] = [None] * len(pairs)
    with stage("tasks: loglikelihood", total=len(pairs), unit="requests") as task:
        for batch in length_batches(inputs, batch_tokens):
            hidden = engine.hidden_states([inputs[i] for i in batch])
            rows = torch.cat([h[-widths[i]:] for h, i in zip(hidden, batch, strict=True)])  # [sum widths, C]
            targets = torch.cat([torch.as_tensor(pairs[i][1], dtype=torch.long) for i in batch]).to(rows.device)
            logprob = torch.empty(len(targets), dtype=torch.float64)
            greedy = torch.empty(len(targets), dtype=torch.bool)
            for chunk, lp in head_log_probs(engine.head_logits, rows, engine.spec.vocab_size):
                logprob[chunk] = lp.gather(1, targets[chunk, None]).squeeze(1).double()
                greedy[chunk] = lp.argmax(-1) == targets[chunk]
            start = 0
            for i in batch:
                end = start + widths[i]
                results[i] = (float(logprob[start:end].sum()), bool(greedy[start:end].all()))
                start = end
            task.advance(len(batch))
    return results


def generate(engine: Engine, prompts: Sequence[Sequence[int]], max_new_tokens: int, until: Sequence[str],
             batch_tokens: int = BATCH_TOKENS) -> Iterator[tuple[list[str], list[int]]]:
    """Greedy continuations of `prompts` (token lists), as text, stopping at EOS or once a string of `until`
    appears; per batch of at most `batch_tokens` prompt tokens: (texts, indices into `prompts`). A text may run
    past its stop string (the caller cuts it, as lm-eval does)."""
    tok = engine.require_tokenizer()
    stops = [s for s in until if s]

    def stopped(out: list[int]) -> bool:
        text = tok.decode(out, skip_special_tokens=True)
        return any(s in text for s in stops)

    with stage("tasks: generate", total=len(prompts), unit="requests") as task:
        for batch in length_batches(prompts, batch_tokens):
            outputs = engine.generate_ids([prompts[i] for i in batch], max_new_tokens, temperature=0.0,
                                          stop_ids=engine.spec.eos_token_ids, stop_check=stopped if stops else None)
            # the continuation decoded on its own, as HFLM does: a SentencePiece tokenizer drops its leading space
            # (Engine.generate keeps it), and tasks' answer filters expect HFLM's text
            yield [tok.decode(out, skip_special_tokens=True) for out, _ in outputs], batch
            task.advance(len(batch))


# --- floors ---------------------------------------------------------------------------------------------------

def task_floor(name: str, metadata: dict | None, higher_is_better: dict[str, bool], has_baseline: bool) -> dict:
    """The floor a task's `metadata` declares, checked against the task's metrics: {metric, filter,
    higher_is_better, kiln_min_recovery?, kiln_min?, kiln_max?}."""
    metadata = metadata or {}
    unknown = sorted(k for k in metadata if str(k).startswith("kiln_") and k not in METADATA_KEYS)
    if unknown:
        raise KilnError(f"task {name}: unknown metadata key(s) {', '.join(unknown)}; Kiln reads "
                        f"{', '.join(METADATA_KEYS)}")
    bounds = {k: metadata[k] for k in FLOOR_KEYS if metadata.get(k) is not None}
    if not bounds:
        raise KilnError(f"task {name} has no floor: give its metadata kiln_metric and kiln_min_recovery, kiln_min "
                        "or kiln_max (see kiln.optimizer.eval.tasks)")
    metric = metadata.get("kiln_metric")
    if not isinstance(metric, str) or not metric:
        raise KilnError(f"task {name}: metadata kiln_metric must name one of its metrics "
                        f"({', '.join(sorted(higher_is_better))}), got {metric!r}")
    base, _, filter_name = metric.partition(",")
    if base not in higher_is_better:
        raise KilnError(f"task {name}: kiln_metric {base!r} is not one of its metrics "
                        f"({', '.join(sorted(higher_is_better))})")
    higher = bool(higher_is_better[base])
    for key, value in bounds.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise KilnError(f"task {name}: {key} must be a finite number, got {value!r}")
    recovery = bounds.get("kiln_min_recovery")
    if recovery is not None and not 0 < recovery <= MAX_FLOOR:
        raise KilnError(f"task {name}: kiln_min_recovery must be in (0, {MAX_FLOOR}], got {recovery}")
    wrong = "kiln_max" if higher else "kiln_min"
    if wrong in bounds:
        right = "kiln_min" if higher else "kiln_max"
        raise KilnError(f"task {name}: {base} is better {'higher' if higher else 'lower'}, so it takes {right}, "
                        f"not {wrong}")
    if recovery is not None and not has_baseline:
        raise KilnError(f"task {name}: kiln_min_recovery is relative to a baseline, and none was given")
    return {"metric": base, "filter": filter_name or DEFAULT_FILTER, "higher_is_better": higher,
            **{k: float(v) for k, v in bounds.items()}}


def check_task(name: str, floor: dict, candidate: float, baseline: float | None, samples: int | None) -> Check:
    """One Check: the candidate's metric against the binding bound of `floor` (see the module docstring)."""
    metric, higher = floor["metric"], floor["higher_is_better"]
    label = metric if floor["filter"] == DEFAULT_FILTER else f"{metric},{floor['filter']}"
    bounds, notes = [], []
    recovery = floor.get("kiln_min_recovery")
    if recovery is not None:
        bounds.append(recovery * baseline if higher else baseline / recovery)
        numerator, denominator = (candidate, baseline) if higher else (baseline, candidate)
        achieved = numerator / denominator if denominator else math.nan
        notes.append(f"baseline {baseline:.4g}, recovery {achieved:.4f} (floor {recovery:g})")
    if "kiln_min" in floor:
        bounds.append(floor["kiln_min"])
        notes.append(f"absolute floor {floor['kiln_min']:g}")
    if "kiln_max" in floor:
        bounds.append(floor["kiln_max"])
        notes.append(f"absolute ceiling {floor['kiln_max']:g}")
    bound = max(bounds) if higher else min(bounds)
    notes.append(f"{samples} samples" if samples is not None else "")
    return Check(f"task:{name}:{label}", candidate, bound, ">=" if higher else "<=",
                 f"{label} {candidate:.4g}; " + "; ".join(n for n in notes if n))


# --- running --------------------------------------------------------------------------------------------------

def run_tasks(tasks_file: Path, candidate: Engine, baseline: Engine | None = None, limit: int | None = None,
              log: Callable[[str], None] = lambda message: None) -> tuple[list[Check], dict]:
    """Evaluate the lm-eval task(s) `tasks_file` defines on `candidate` (and `baseline` when given), and hold each
    task to the floor its metadata declares. Returns (one Check per task, raw results: per task its floor, every
    metric of the candidate and of the baseline, and the sample count; the seconds each model took).
    `limit` caps the documents per task (lm-eval's --limit), for quick runs."""
    lm_eval = _lm_eval()
    tasks_file = Path(tasks_file)
    if not tasks_file.is_file():
        raise KilnError(f"task file {tasks_file} not found")
    if tasks_file.suffix not in (".yaml", ".yml"):
        raise KilnError(f"task file {tasks_file} is not a YAML file (.yaml or .yml)")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise KilnError(f"limit must be a positive number of documents per task, got {limit!r}")

    with _quiet_lm_eval(lm_eval):
        first = _load_tasks(lm_eval, tasks_file)
        floors = {name: task_floor(name, task.config.metadata, task.higher_is_better(), baseline is not None)
                  for name, task in first["tasks"].items()}
        log(f"tasks: {', '.join(floors)} from {tasks_file}")
        models = {role: engine_lm(engine) for role, engine in (("candidate", candidate), ("baseline", baseline))
                  if engine is not None}  # both before either runs: a missing tokenizer fails fast
        measured, seconds = {}, {}
        for role, lm in models.items():
            loaded = first if role == "candidate" else _load_tasks(lm_eval, tasks_file)  # fresh task state
            start = time.perf_counter()
            with stage(f"tasks: {role}"):
                measured[role] = _evaluate(lm_eval, lm, loaded, limit)
            seconds[role] = round(time.perf_counter() - start, 3)
            log(f"tasks: {role} evaluated in {seconds[role]:.1f} s")

    checks, raw = [], {"tasks_file": str(tasks_file), "limit": limit, "tasks": {}, "seconds": seconds}
    for name, floor in floors.items():
        results = {role: measured[role]["results"][name] for role in measured}
        key = _metric_key(name, floor, results["candidate"])
        value = float(results["candidate"][key])
        base = float(results["baseline"][key]) if "baseline" in results else None
        samples = (measured["candidate"].get("n-samples") or {}).get(name, {}).get("effective")
        checks.append(check_task(name, floor, value, base, samples))
        raw["tasks"][name] = {"floor": floor, "samples": samples,
                              **{role: _plain(results[role]) for role in ("candidate", "baseline")
                                 if role in results}}
    return checks, raw


def _load_tasks(lm_eval, tasks_file: Path) -> dict:
    """lm-eval's TaskDict of `tasks_file`, indexed among the YAMLs of its directory only.

    Loaded by its registered name: lm-eval 0.4.13 takes a group YAML's `task` list for its name when given the
    file's path."""
    name = _defined_name(tasks_file)
    manager = lm_eval.tasks.TaskManager(include_path=str(tasks_file.parent.resolve()), include_defaults=False)
    entry = manager.task_index.get(name)
    if entry is None or entry.yaml_path is None or Path(entry.yaml_path).resolve() != tasks_file.resolve():
        where = f" (lm-eval took {entry.yaml_path}'s)" if entry is not None and entry.yaml_path else ""
        raise KilnError(f"lm-eval cannot index {tasks_file}: another YAML in {tasks_file.parent} defines "
                        f"{name!r} too, or this one is malformed{where}")
    members = entry.cfg.get("task") if entry.cfg and "group" in entry.cfg else None
    if isinstance(members, list):  # an unknown member becomes a broken inline task deep inside lm-eval
        names = [m if isinstance(m, str) else m.get("task") for m in members if isinstance(m, str | dict)]
        missing = [n for n in names if isinstance(n, str) and n not in manager.task_index]
        if missing:
            raise KilnError(f"{tasks_file} names task(s) {', '.join(missing)} that no YAML in {tasks_file.parent} "
                            "defines")
    try:
        loaded = manager.load([name])
    except KilnError:
        raise
    except Exception as exc:  # noqa: BLE001 -- a task YAML is input; whatever lm-eval makes of it is its fault
        lines = str(exc).strip().splitlines()
        detail = lines[0] if lines else type(exc).__name__
        raise KilnError(f"lm-eval cannot load the tasks of {tasks_file}: {detail[:200]}") from None
    if not loaded["tasks"]:
        raise KilnError(f"{tasks_file} defines no task")
    return loaded


def _defined_name(tasks_file: Path) -> str:
    """The group or task name `tasks_file` defines."""
    # lazy: lm-eval is the optional `tasks` extra; its own YAML reader knows `!function`
    from lm_eval.tasks._yaml_loader import load_yaml

    try:
        config = load_yaml(tasks_file.resolve(), resolve_func=False)
    except Exception as exc:  # noqa: BLE001 -- the user's YAML
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise KilnError(f"{tasks_file} is not a readable task YAML: {detail[:200]}") from None
    name = config.get("group") or config.get("task") if isinstance(config, dict) else None
    if not isinstance(name, str) or not name:
        raise KilnError(f"{tasks_file} is not an lm-eval task or group YAML (it needs a `task` or `group` name)")
    return name


def _evaluate(lm_eval, lm, loaded: dict, limit: int | None) -> dict:
    """lm-eval's `evaluate` with `simple_evaluate`'s seeds and zero-shot default, leaving the caller's RNGs as
    they were."""
    for task in loaded["tasks"].values():
        if task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=OTHER_SEED)
    with _seeded():
        return lm_eval.evaluator.evaluate(lm=lm, task_dict=loaded, limit=limit, bootstrap_iters=0,
                                          log_samples=False)


def _metric_key(name: str, floor: dict, results: dict) -> str:
    key = f"{floor['metric']},{floor['filter']}"
    if key not in results:
        have = sorted(k for k in results if "," in k and "_stderr" not in k)
        raise KilnError(f"task {name}: no result {key!r} (it reports {', '.join(have)}); name the filter in "
                        "kiln_metric as METRIC,FILTER")
    return key


def _plain(results: dict) -> dict:
    """A task's results as JSON: numbers, and lm-eval's "N/A" for skipped standard errors."""
    return {k: (float(v) if isinstance(v, int | float) and not isinstance(v, bool) else str(v))
            for k, v in results.items()}


@contextlib.contextmanager
def _seeded():
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    random.seed(RANDOM_SEED)
    torch.manual_seed(OTHER_SEED)
    np.random.seed(OTHER_SEED)
    try:
        yield
    finally:
        random.setstate(states[0])
        torch.set_rng_state(states[2])
        np.random.set_state(states[1])


@contextlib.contextmanager
def _quiet_lm_eval(lm_eval):
    """lm-eval logs each task's setup at INFO/WARNING and draws a tqdm bar per task while building requests;
    the gate reports through kiln.calibration.progress instead, so both are silenced for the run (errors still
    raise)."""
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.ERROR)
    task_module = lm_eval.api.task
    bar = task_module.tqdm
    task_module.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        task_module.tqdm = bar
        logger.setLevel(level)
