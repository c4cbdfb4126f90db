"""Iteration-level scheduling over the paged KV cache: continuous batching, chunked prefill, preemption.

    scheduler = Scheduler(engine, max_num_seqs=32, max_num_batched_tokens=512, prefix_caching=True)
    request = scheduler.add_request(prompt_ids, SamplingParams(max_tokens=64))
    while scheduler.has_work():
        for event in scheduler.step():   # each running request's new tokens (and text) this step
            ...

Every `step` is one iteration (vLLM's and Orca's iteration-level scheduling): requests join and leave between
any two steps.

- **Budget.** A step runs at most `max_num_batched_tokens` tokens over at most `max_num_seqs` requests.
  Decoding requests come first, one token each, in arrival order; the remaining budget goes to prompt chunks,
  in arrival order (chunked prefill), so a long prompt never stalls the decoders for more than a chunk.
- **Admission.** Requests wait in a bounded first-come-first-served queue (`max_queue`; `add_request` raises
  `QueueFull` when it is full). The head of the queue is admitted when a sequence slot is free and the free
  blocks hold its prompt; nothing behind it overtakes it.
- **Prefix caching** (the cache's `prefix_caching`): an admitted request starts on the cached blocks of its
  longest cached prefix and computes only the rest; its full blocks are registered as they fill.
- **Preemption by recompute.** When a step's tokens need more blocks than are free, the most recently
  admitted running request gives its blocks back and returns to the head of the queue, keeping its output.
  Readmitted, it recomputes prompt + output so far (its full blocks may still be cached) and continues with
  the tokens it would have produced: greedy decoding is deterministic, and a seeded request keeps its own
  random generator.
- **Stops.** A request ends at `max_tokens`, at a stop token (not emitted), at a stop string (the text is cut
  before it; needs a tokenizer), or when aborted; its blocks are freed at once.

Each step runs at most two forwards: the one-token rows ([B, 1], the decode step) and the chunk rows
(right-padded, padding never cached); the lm_head runs only on the rows that sample.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence

import torch

from kiln.kernels.errors import KilnError
from kiln.runtime.detokenizer import IncrementalDetokenizer
from kiln.runtime.paged_kv_cache import PagedKVCache
from kiln.runtime.request import QueueFull, Request, SamplingParams, StepEvent
from kiln.runtime.runner_protocol import ServingRunner
from kiln.runtime.sampling import penalize_repeats, probabilities
from kiln.runtime.speculative import (
    SpeculativeStats,
    accept_row,
    check_draft_tokens,
    draft_tree,
    keep_path,
    penalized_nodes,
    target_features,
    verification_batch,
)


def draft_pool_blocks(num_blocks: int, max_num_seqs: int, draft_tokens: int, block_size: int) -> int:
    """Blocks a draft head's own KV pool needs beside a scheduler's pool of `num_blocks`: what that pool holds,
    and each running sequence's chain of `draft_tokens` drafts past its end."""
    return num_blocks + max_num_seqs * -(-draft_tokens // block_size)


class Scheduler:
    """Steps requests on `engine`'s model (anything with runtime.runner_protocol.ServingRunner's members: an
    Engine) over `cache`, or over a pool of its own of `num_blocks` blocks (default: the engine's block count)."""

    def __init__(self, engine: ServingRunner, cache: PagedKVCache | None = None, *, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512, max_queue: int | None = 1024, prefix_caching: bool = True,
                 num_blocks: int | None = None, tokenizer=None, drafter=None, draft_tokens: int = 4):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise KilnError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.engine = engine
        # a drafter that reads the target's features needs them at every position, which a prefix-cache hit
        # skips computing: prefix caching is off with one
        self.drafter = drafter
        self.draft_tokens = check_draft_tokens(draft_tokens) if drafter is not None else 0
        needs_features = drafter is not None and drafter.needs_features
        if needs_features and cache is not None and cache.prefix_caching:
            raise KilnError("a draft head reads the target's features at every prompt position; give a cache "
                            "without prefix caching")
        self.cache = cache if cache is not None else engine.new_kv_cache(
            num_blocks or engine.kv_cache_blocks, prefix_caching=prefix_caching and not needs_features)
        own = getattr(getattr(drafter, "cache", None), "num_blocks", None)  # a draft head's own KV pool
        need = draft_pool_blocks(self.cache.num_blocks, max_num_seqs, self.draft_tokens, self.cache.block_size)
        if own is not None and own < need:
            raise KilnError(f"the draft head's KV pool has {own} blocks; {max_num_seqs} sequences on {self.cache.num_blocks} "
                            f"blocks drafting {self.draft_tokens} tokens past their ends need {need}: "
                            f"engine.drafter(\"head\", num_blocks={need})")
        self.speculative = SpeculativeStats()
        self._drafting: set[Hashable] = set()  # requests the drafter has started on
        self._prompt_features: dict[Hashable, list[torch.Tensor]] = {}  # what it reads, gathered over chunks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_queue = max_queue
        self.tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self._inbox: deque[Request] = deque()  # added since the last step (any thread)
        self._aborts: set[Hashable] = set()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.num_preemptions = 0
        self.num_steps = 0
        self.prompt_tokens_computed = 0
        self.generated_tokens = 0
        self.last_step_tokens = 0  # tokens the last step ran (prompt chunks and decoding rows)

    # --- requests (safe to call from another thread than the one stepping) ---------------------------------
    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams | None = None,
                    request_id: Hashable | None = None, stop_check: Callable[[list[int]], bool] | None = None,
                    bounded: bool = True) -> Request:
        """Queue a request; it joins the running batch at a coming step. Raises QueueFull when `max_queue`
        requests already wait (unless `bounded` is False), and KilnError for a request that could never run."""
        params = (params or SamplingParams()).checked()
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise KilnError("a prompt needs at least one token")
        vocab = self.engine.spec.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise KilnError(f"prompt token ids must be in [0, {vocab})")
        total = len(prompt) + params.max_tokens
        if total > self.engine.spec.max_position_embeddings:
            raise KilnError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                            f"the model's context {self.engine.spec.max_position_embeddings}")
        # the last token is sampled, never written; with sliding windows, a prompt chunk is cut to what the pool
        # holds, so the request's smallest step (one token and its drafts) is what must fit
        blocks = self.cache.sequence_blocks(total - 1, 1 + self._width_of(self.draft_tokens))
        if blocks > self.cache.num_blocks:
            raise KilnError(f"a request of {len(prompt)} tokens + {params.max_tokens} new needs {blocks} KV-cache "
                            f"blocks of {self.cache.block_size} tokens; the cache has {self.cache.num_blocks}")
        if params.stop and self.tokenizer is None:
            raise KilnError("stop strings need a tokenizer; this engine has none")
        stop_ids = self.engine.spec.eos_token_ids if params.stop_ids is None else params.stop_ids
        penalty = self.engine.repetition_penalty if params.repetition_penalty is None else params.repetition_penalty
        request = Request(next(self._ids) if request_id is None else request_id, prompt, params,
                          frozenset(stop_ids), float(penalty), stop_check)
        if params.seed is not None:
            request.generator = torch.Generator(self.engine.device).manual_seed(params.seed)
        if self.tokenizer is not None:
            request.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt)
        with self._lock:
            if bounded and self.max_queue is not None and len(self.waiting) + len(self._inbox) >= self.max_queue:
                raise QueueFull(f"the wait queue is full ({self.max_queue} requests)")
            self._inbox.append(request)
        return request

    def abort(self, request_id: Hashable) -> None:
        """End a request (a client went away): its blocks are freed at the next step."""
        with self._lock:
            self._aborts.add(request_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._inbox or self._aborts)

    @property
    def queue_depth(self) -> int:
        return len(self.waiting) + len(self._inbox)

    def stats(self) -> dict:
        cache = self.cache
        return {"waiting": self.queue_depth, "running": len(self.running),
                "kv_blocks_used": cache.num_used_blocks, "kv_blocks": cache.num_blocks,
                "kv_utilization": cache.num_used_blocks / cache.num_blocks,
                "prefix_hit_rate": cache.prefix_hit_rate, "prefix_queried_tokens": cache.prefix_queried,
                "prefix_hit_tokens": cache.prefix_hits, "preemptions": self.num_preemptions,
                "steps": self.num_steps, "prompt_tokens_computed": self.prompt_tokens_computed,
                "generated_tokens": self.generated_tokens,
                **({"spec_verifications": self.speculative.steps, "spec_draft_tokens": self.speculative.drafted,
                    "spec_accepted_tokens": self.speculative.accepted, "spec_emitted_tokens": self.speculative.emitted,
                    "spec_accepted_by_position": self.speculative.accepted_by_position}
                   if self.drafter is not None else {})}

    # --- one iteration -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[StepEvent]:
        events: list[StepEvent] = []
        with self._lock:
            self.waiting.extend(self._inbox)
            self._inbox.clear()
            aborts, self._aborts = self._aborts, set()
        for request in [r for r in (*self.running, *self.waiting) if r.id in aborts]:
            events.append(self._finish(request, "abort"))
        self._admit()
        plan = self._plan()
        if not plan:
            return events
        self.num_steps += 1
        self.last_step_tokens = sum(n + self._width(r, drafts) for r, n, drafts in plan)
        try:
            verify = [(r, drafts) for r, n, drafts in plan if r.id in self._drafting]
            rest = [(r, n) for r, n, _ in plan if r.id not in self._drafting]
            if verify:
                events += self._verify(verify)
            sampled = self._forward(rest)
        except BaseException:
            for request in list(self.running):  # a failed step leaves no request holding blocks
                self._finish(request, "abort")
            raise
        if sampled:
            requests = [r for r, _ in sampled]
            tokens = self._sample(requests, torch.stack([logits for _, logits in sampled]))
            now = time.perf_counter()
            for request, token in zip(requests, tokens, strict=True):
                events.append(self._append(request, token, now))
                if self.drafter is not None and not request.finished:
                    self._start_drafting(request)
        return events

    def _admit(self) -> None:
        cache = self.cache
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            # with sliding windows a sequence holds fewer blocks in shorter prompt chunks: beside others, room for
            # chunks of the whole budget; alone, for the one-token chunks it may be cut to (what add_request checks)
            step = self.max_num_batched_tokens if self.running else 1
            reserve = sum(cache.blocks_needed(r.id, len(r.tokens), step) for r in self.running)
            if cache.num_free_blocks - max(reserve, 0) < cache.sequence_blocks(len(request.tokens), step):
                break
            self.waiting.popleft()
            request.cached_tokens = cache.add_sequence(request.id, request.tokens)
            request.num_computed = request.cached_tokens
            self.running.append(request)

    def _plan(self) -> list[tuple[Request, int, int]]:
        """(request, tokens to run, drafts to verify after them) for this step: decoders first, then prompt
        chunks, within the budget (a decoder the drafter has started on drafts up to `draft_tokens`, each
        costing the drafter's tree width in tokens); preempts from the back of the running list while the
        step's blocks do not fit."""
        while True:
            budget, plan = self.max_num_batched_tokens, []
            decoding = [r for r in self.running if len(r.tokens) - r.num_computed == 1]
            prefilling = [r for r in self.running if len(r.tokens) - r.num_computed > 1]
            for request in decoding + prefilling:
                n = min(len(request.tokens) - request.num_computed, budget)
                if n <= 0:
                    break
                drafts = 0
                if request.id in self._drafting:
                    width = self._width(request, 1)
                    left = request.params.max_tokens - len(request.output_ids) - 1  # the target adds one
                    drafts = max(0, min(self.draft_tokens, left, (budget - n) // width))
                plan.append((request, n, drafts))
                budget -= n + self._width(request, drafts)
            needed = self._blocks_needed(plan)
            if needed > self.cache.num_free_blocks and self.cache.windowed:
                plan = self._cut_chunks(plan, needed - self.cache.num_free_blocks)
                needed = self._blocks_needed(plan)
            if needed <= self.cache.num_free_blocks or not self.running:
                return plan
            self._preempt(self.running[-1])

    def _blocks_needed(self, plan: list[tuple[Request, int, int]]) -> int:
        """Blocks the planned step takes from the pool. With sliding windows, what a row's window layers release
        counts too (the cache releases it before it allocates)."""
        needs = [self.cache.blocks_needed(r.id, r.num_computed + n + self._width(r, d)) for r, n, d in plan]
        return sum(needs) if self.cache.windowed else sum(max(0, n) for n in needs)

    def _cut_chunks(self, plan: list[tuple[Request, int, int]], excess: int) -> list[tuple[Request, int, int]]:
        """Prompt chunks cut, from the last planned, until the step needs `excess` fewer blocks (or each is down
        to one token): with sliding windows a shorter chunk holds fewer blocks of its window layers at once."""
        plan = list(plan)
        for i in range(len(plan) - 1, -1, -1):
            if excess <= 0:
                break
            r, n, d = plan[i]
            if n <= 1 or d:
                continue
            need = self.cache.blocks_needed(r.id, r.num_computed + n)
            low, high = 1, n  # the longest chunk that gives back `excess`, else one token
            while low < high:
                mid = (low + high + 1) // 2
                if need - self.cache.blocks_needed(r.id, r.num_computed + mid) >= excess:
                    low = mid
                else:
                    high = mid - 1
            excess -= need - self.cache.blocks_needed(r.id, r.num_computed + low)
            plan[i] = (r, low, d)
        return plan

    def _width(self, request: Request, drafts: int) -> int:
        """Tokens a verification of `drafts` drafts adds for `request`: a greedy tree's alternatives too."""
        greedy = request.params.temperature <= 0
        return drafts * (getattr(self.drafter, "tree_width", 1) if greedy else 1)

    def _width_of(self, drafts: int) -> int:
        """The most tokens a verification of `drafts` drafts adds for any request."""
        return drafts * getattr(self.drafter, "tree_width", 1)

    def _preempt(self, request: Request) -> None:
        self._stop_drafting(request)
        self.cache.commit(request.id, request.tokens)
        self.cache.free_sequence(request.id)
        self.running.remove(request)
        request.num_computed = 0
        request.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _forward(self, plan: list[tuple[Request, int]]) -> list[tuple[Request, torch.Tensor]]:
        """Run the planned tokens; the logits after each request whose tokens are now all computed."""
        runner, cache = self.engine, self.cache
        sampled = []
        # the one-token rows are decoders: a prompt chunk cut to one token by the budget is a chunk (its logits
        # are not sampled unless it ends the prompt); with a drafter every row here is a prompt on its way to
        # the drafter, and the chunk path gathers what it reads
        ones = [(r, n) for r, n in plan if n == 1 and len(r.tokens) - r.num_computed == 1 and self.drafter is None]
        chunks = [(r, n) for r, n in plan if (r, n) not in ones]
        device = cache.device
        if ones:
            ids = [r.id for r, _ in ones]
            tokens = torch.tensor([[r.tokens[r.num_computed]] for r, _ in ones]).to(device, non_blocking=True)
            positions = cache.prepare(ids, torch.tensor([[r.num_computed] for r, _ in ones]))
            logits = runner.decode_logits(tokens, positions, cache)
            sampled += self._advance(ones, logits)
        if chunks:
            lengths = torch.tensor([n for _, n in chunks])
            T = int(lengths.max())
            tokens = torch.zeros(len(chunks), T, dtype=torch.long)
            starts = torch.tensor([r.num_computed for r, _ in chunks])
            for i, (r, n) in enumerate(chunks):
                tokens[i, :n] = torch.tensor(r.tokens[r.num_computed: r.num_computed + n])
            positions = starts.unsqueeze(1) + torch.arange(T)
            positions = cache.prepare([r.id for r, _ in chunks], positions, torch.arange(T) < lengths.unsqueeze(1))
            if self.drafter is not None and self.drafter.needs_features:
                features, read = target_features(runner, tokens.to(device), positions, cache, self.drafter)
                for i, (r, n) in enumerate(chunks):  # the drafter reads every prompt position's
                    self._prompt_features.setdefault(r.id, []).append(read[i, :n])
            else:
                features = runner.features(tokens.to(device), positions, cache)
            done = [i for i, (r, n) in enumerate(chunks) if r.num_computed + n == len(r.tokens)]
            logits = None
            if done:
                rows = torch.tensor(done)
                last = (rows.to(device), (lengths[rows] - 1).to(device))
                logits = runner.logits_from_features(features[last])
            sampled += self._advance(chunks, logits, done)
            self.prompt_tokens_computed += int(lengths.sum())
        return sampled

    def _advance(self, rows, logits, done: Sequence[int] | None = None):
        out = []
        done_set = range(len(rows)) if done is None else done
        position = {i: j for j, i in enumerate(done_set)}
        for i, (request, n) in enumerate(rows):
            request.num_computed += n
            if request.num_computed // self.cache.block_size > (request.num_computed - n) // self.cache.block_size:
                self.cache.commit(request.id, request.tokens)  # a block filled up
            if i in position:
                out.append((request, logits[position[i]]))
        return out

    def _sample(self, requests: Sequence[Request], logits: torch.Tensor) -> list[int]:
        """Each row's next token, computed where the logits are (the GPU: penalties, argmax and multinomial run
        there, with each seeded request's generator on that device); the one host sync is the final list."""
        penalized = [i for i, r in enumerate(requests) if r.penalty != 1.0]
        for i in penalized:
            logits[i: i + 1] = penalize_repeats(logits[i: i + 1], [requests[i].tokens], requests[i].penalty)
        tokens = logits.argmax(dim=-1)
        for i, r in enumerate(requests):
            if r.params.temperature > 0:
                probs = probabilities(logits[i], r.params.temperature, r.params.top_p, normalize=False)
                tokens[i] = torch.multinomial(probs, 1, generator=r.generator)[0]
        return tokens.tolist()

    def _append(self, request: Request, token: int, now: float) -> StepEvent:
        if request.first_token_at is None:
            request.first_token_at = now
        if token in request.stop_ids:
            return self._finish(request, "eos", [])
        request.output_ids.append(token)
        request.tokens.append(token)
        self.generated_tokens += 1
        reason = None
        if request.detokenizer is not None:
            shown = len(request.text)
            request.text += request.detokenizer.add(token)
            stops = request.params.stop
            if stops and len(request.text) > shown:  # a stop string may begin in text already decoded
                since = max(0, shown - max(map(len, stops)) + 1)
                cuts = [i for i in (request.text.find(s, since) for s in stops) if i >= 0]
                if cuts:
                    request.text = request.text[: min(cuts)]
                    reason = "stop"
        if reason is None and request.stop_check is not None and request.stop_check(request.output_ids):
            reason = "stop"
        if reason is None and len(request.output_ids) >= request.params.max_tokens:
            reason = "length"
        if reason is not None:
            return self._finish(request, reason, [token])
        return StepEvent(request, [token], self._emit(request), False)

    @staticmethod
    def _emit(request: Request) -> str:
        """The text not yet given out. While the request runs, the last (longest stop string - 1) characters
        are held back: they may be the start of a stop string, which must never reach a client."""
        end = len(request.text)
        if not request.finished and request.params.stop:
            end -= max(map(len, request.params.stop)) - 1
        if end <= request.emitted:
            return ""
        text, request.emitted = request.text[request.emitted: end], end
        return text

    def _finish(self, request: Request, reason: str, tokens: list[int] | None = None) -> StepEvent:
        request.finish_reason = reason
        request.finished_at = time.perf_counter()
        self._stop_drafting(request)
        if request in self.running:
            self.running.remove(request)
            self.cache.free_sequence(request.id)
        elif request in self.waiting:
            self.waiting.remove(request)
        return StepEvent(request, tokens or [], self._emit(request), True)

    # --- speculative decoding ------------------------------------------------------------------------------
    def _start_drafting(self, request: Request) -> None:
        """The request's prompt (or, readmitted, prompt and output so far) is computed and its next token
        sampled: the drafter starts on it, from the features gathered over its chunks."""
        read = self._prompt_features.pop(request.id, None)
        features = torch.cat(read) if read else None
        self.drafter.start(request.id, list(request.tokens), features)
        self._drafting.add(request.id)

    def _stop_drafting(self, request: Request) -> None:
        self._prompt_features.pop(request.id, None)
        if request.id in self._drafting:
            self._drafting.discard(request.id)
            self.drafter.finish(request.id)

    def _verify(self, rows: list[tuple[Request, int]]) -> list[StepEvent]:
        """One speculative step for decoding requests: the drafter proposes up to their draft counts (requests
        grouped by sampling settings; a seeded request alone, with its own generator), one target forward
        verifies [last token, drafts] for all, and each request emits its accepted drafts and the target's next
        token (greedy: exactly plain decoding's tokens; sampling: the target's distribution)."""
        runner, cache, drafter = self.engine, self.cache, self.drafter
        groups: dict[tuple, list[tuple[Request, int]]] = {}
        for request, count in rows:
            p = request.params
            key = (p.temperature if p.temperature > 0 else 0.0, p.top_p if p.temperature > 0 else 1.0,
                   request.id if request.generator is not None else None)
            groups.setdefault(key, []).append((request, count))
        drafts, probs, nodes = {}, {}, {}
        for (temperature, top_p, _), members in groups.items():
            ids = [r.id for r, _ in members]
            generator = members[0][0].generator
            k = max(count for _, count in members)
            proposal = drafter.propose(ids, [r.tokens for r, _ in members], max(k, 1), temperature, top_p,
                                       generator)
            tree = temperature <= 0 and proposal.siblings is not None
            for i, (r, count) in enumerate(members):
                drafts[r.id] = list(proposal.tokens[i][:count])
                probs[r.id] = proposal.probs[i][:count] if proposal.probs[i] is not None else None
                nodes[r.id] = draft_tree(drafts[r.id], proposal.siblings[i][:count] if tree else None)
        ids = [r.id for r, _ in rows]
        position = {r.id: r.num_computed for r, _ in rows}  # where the last token goes
        last = {r.id: r.tokens[-1] for r, _ in rows}
        tokens, prepared = verification_batch(cache, ids, nodes, position, last)
        features, read = target_features(runner, tokens, prepared, cache, drafter)
        logits = runner.logits_from_features(features)
        events, now = [], time.perf_counter()
        stats = self.speculative
        for i, (request, _) in enumerate(rows):
            node_tokens, parents = nodes[request.id]
            row_logits = penalized_nodes(logits[i, :len(node_tokens)], request.tokens, node_tokens, parents,
                                         request.penalty)
            path, emitted = accept_row(row_logits, drafts[request.id], probs[request.id], nodes[request.id],
                                       request.params.temperature, request.params.top_p, request.generator)
            stats.record(len(node_tokens) - 1, len(path))
            before = len(request.output_ids)
            for token in emitted:
                events.append(self._append(request, token, now))
                if request.finished:
                    break
            stats.emitted += len(request.output_ids) - before
            if request.finished:
                continue
            keep_path(cache, request.id, position[request.id], path)
            request.num_computed = position[request.id] + len(path) + 1
            cache.commit(request.id, request.tokens)
            drafter.accept(request.id, len(path), emitted, read[i, [0, *path]] if drafter.needs_features else None)
        return events

    def run(self) -> None:
        """Step until every request has finished."""
        while self.has_work():
            self.step()
