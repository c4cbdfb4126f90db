"""Speculative decoding: a drafter proposes k tokens per sequence, one target forward verifies them all.

    tokens, stats = speculative_generate(runner, prompts, max_new_tokens, drafter, k=4)

`runner` is anything with runtime.runner_protocol.Runner's members (a ModelRunner, an Engine).

Each step feeds the target [last token, d1..dk] at the sequence's next k+1 positions (one forward, through
the paged KV cache in the artifact's KV format) and accepts, per sequence:

- greedy (temperature 0): the longest prefix of drafts equal to the target's argmax after each, plus the
  target's own next token: the output is plain greedy decoding's, token for token.
- sampling: draft d_i with probability min(1, p(d_i) / q(d_i)); at the first rejection a token from
  norm(max(0, p - q)); after k acceptances one more from p (Leviathan et al. 2023, Chen et al. 2023). p and q
  are the target's and the drafter's distributions after temperature and top-p; a drafter that proposes
  tokens without a distribution (n-gram lookup) has q = one-hot. Each emitted token is then distributed
  exactly as the target's own sample would be.

Rejected drafts are rolled back in the paged cache (`PagedKVCache.truncate`: lengths shrink, blocks past
them are freed) and in the drafter's own cache. Rows accept independently; a finished row leaves the batch.

tau = tokens emitted by verification steps / verification steps (the first token comes from the prefill).

The drafters (runtime.drafters): `DraftHeadDrafter` (an MTP layer or a Kiln draft head in the artifact:
runtime.draft), `PromptLookupDrafter` (copy what followed the latest earlier occurrence of the context's last
n-gram, as vLLM's ngram speculator) and `NgramTableDrafter` (a corpus n-gram table).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from kiln.kernels.errors import KilnError
from kiln.runtime.drafters import Drafter
from kiln.runtime.paged_kv_cache import PagedKVCache
from kiln.runtime.runner_protocol import Runner
from kiln.runtime.sampling import penalize_repeats, probabilities, sample

# --- distributions ------------------------------------------------------------------------------------------


def accept_greedy(drafts: Sequence[int], target_logits: torch.Tensor) -> tuple[int, list[int]]:
    """(drafts accepted, tokens emitted) for target logits [k+1, V] after [last, d1..dk]."""
    choice = target_logits.argmax(-1).tolist()
    n = 0
    while n < len(drafts) and drafts[n] == choice[n]:
        n += 1
    return n, [*drafts[:n], choice[n]]


def draft_tree(chain: Sequence[int], siblings: Sequence[Sequence[int]] | None) -> tuple[list[int], list[int]]:
    """The verified nodes as (tokens, parents), node 0 the last accepted token: the chain's node at depth d is
    the child of its node at depth d-1, and that depth's alternatives are its siblings (leaves). Nodes are in
    depth order, each after its parent."""
    tokens, parents, previous = [-1], [-1], 0
    for depth, token in enumerate(chain):
        here = len(tokens)
        tokens.append(token)
        parents.append(previous)
        for alternative in (siblings[depth] if siblings is not None and depth < len(siblings) else ()):
            if alternative != token:
                tokens.append(alternative)
                parents.append(previous)
        previous = here
    return tokens, parents


def accept_tree(tokens: Sequence[int], parents: Sequence[int], target_logits: torch.Tensor) -> tuple[list[int], int]:
    """Greedy acceptance on a tree: from node 0, follow the child holding the target's argmax while there is
    one. (accepted node indices, the target's next token after the last of them)."""
    choice = target_logits.argmax(-1).tolist()
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        if node:
            children.setdefault(parent, []).append(node)
    path, current = [], 0
    while True:
        nxt = next((j for j in children.get(current, ()) if tokens[j] == choice[current]), None)
        if nxt is None:
            return path, choice[current]
        path.append(nxt)
        current = nxt


def accept_sampled(drafts: Sequence[int], draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                   generator: torch.Generator | None) -> tuple[int, list[int]]:
    """The rejection rule: (drafts accepted, tokens emitted). target_probs [k+1, V]; draft_probs [k, V] or None
    (one-hot proposals)."""
    out = []
    for i, d in enumerate(drafts):
        p = target_probs[i]
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        if q_d > 0 and float(torch.rand((), generator=generator, device=p.device)) * q_d < float(p[d]):
            out.append(d)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[d] = 0.0
        else:
            residual = (p - draft_probs[i]).clamp_min(0.0)
        total = float(residual.sum())
        residual = residual / total if total > 0 else p
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return i, out
    out.append(int(torch.multinomial(target_probs[len(drafts)], 1, generator=generator)))
    return len(drafts), out


# --- the loop ----------------------------------------------------------------------------------------------


@dataclass
class SpeculativeStats:
    steps: int = 0  # verification forwards
    emitted: int = 0  # tokens emitted by verification steps
    drafted: int = 0
    accepted: int = 0
    accepted_lengths: list[int] = field(default_factory=list)  # [n]: verification steps that accepted n drafts

    def record(self, drafted: int, accepted: int) -> None:
        """One verification step that checked `drafted` draft nodes and accepted `accepted` of them."""
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.accepted_lengths += [0] * (accepted + 1 - len(self.accepted_lengths))
        self.accepted_lengths[accepted] += 1

    @property
    def accepted_by_position(self) -> list[int]:
        """Steps whose j-th draft (j = 1, 2, ...) was accepted, as vLLM counts acceptance per position."""
        return [sum(self.accepted_lengths[j:]) for j in range(1, len(self.accepted_lengths))]

    @property
    def tau(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def penalized_nodes(logits: torch.Tensor, seen: list[int], tokens: Sequence[int], parents: Sequence[int],
               penalty: float) -> torch.Tensor:
    """Per verified node, the repetition penalty over what plain decoding would have seen there: the context
    plus the node's ancestors' tokens (and its own)."""
    if penalty == 1.0:
        return logits
    rows = []
    for node in range(logits.shape[0]):
        path, j = [], node
        while j > 0:
            path.append(tokens[j])
            j = parents[j]
        rows.append(penalize_repeats(logits[node:node + 1], [seen + path[::-1]], penalty))
    return torch.cat(rows)


@torch.inference_mode()
def speculative_generate(runner: Runner, prompts: Sequence[Sequence[int]], max_new_tokens: int, drafter: Drafter,
                         k: int = 4, temperature: float = 0.0, top_p: float = 1.0, stop_ids: Sequence[int] = (),
                         seed: int | None = None, repetition_penalty: float = 1.0
                         ) -> tuple[list[tuple[list[int], str]], SpeculativeStats]:
    """Decode `prompts` (token ids) with `drafter` proposing up to `k` tokens a step; ([(tokens, reason)], stats).
    Rows run together while the runner's KV pool holds them (each reserves prompt + max_new_tokens + k x tree
    width positions), in waves otherwise."""
    k = check_draft_tokens(k)
    cache = runner.kv_pool
    context = runner.spec.max_position_embeddings
    for row, p in enumerate(prompts):
        if not p:
            raise KilnError("every prompt needs at least one token")
        if len(p) + max_new_tokens + k > context:
            raise KilnError(f"prompt {row}: {len(p)} tokens + {max_new_tokens} new + {k} drafts exceed the model's "
                            f"context {context}")
    # a verification writes up to k x tree width nodes past the accepted tokens before the rollback
    spare = k * (getattr(drafter, "tree_width", 1) if temperature <= 0 else 1)
    # each row's prompt is prefilled in one forward, then verifications write 1 + spare positions at a time
    need = [cache.sequence_blocks(len(p) + max_new_tokens + spare, max(len(p), 1 + spare)) for p in prompts]
    if any(n > cache.num_blocks for n in need):
        raise KilnError(f"a request needs more KV-cache blocks than the cache's {cache.num_blocks}")
    generator = torch.Generator(runner.device).manual_seed(seed) if seed is not None else None
    stop_ids = set(stop_ids)
    results: list[tuple[list[int], str]] = [([], "length") for _ in prompts]
    stats = SpeculativeStats()
    pending = list(range(len(prompts)))
    while pending:
        wave, used = [], 0
        while pending and used + need[pending[0]] <= cache.num_blocks:
            used += need[pending[0]]
            wave.append(pending.pop(0))
        _run_wave(runner, cache, prompts, wave, max_new_tokens, drafter, k, temperature, top_p, stop_ids,
                  generator, repetition_penalty, results, stats)
    return results, stats


def verification_batch(cache: PagedKVCache, rows: Sequence[Hashable], nodes: Mapping, position: Mapping,
                       last: Mapping) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's verification forward for `rows`: (tokens [B, W], positions prepared in `cache`).

    Row r feeds [last[r], its draft nodes] (`nodes[r]`: (tokens, parents) from `draft_tree`, node 0 standing
    for last[r]) from position[r], the position of last[r]. A chain runs at consecutive positions; when any row
    has a tree, each node is written at its own slot, rotated at its depth's position and attending to its
    ancestors only."""
    width = max(len(t) for t, _ in nodes.values())
    tree = any(p != j - 1 for t, parents in nodes.values() for j, p in enumerate(parents) if j)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    positions = torch.zeros(len(rows), width, dtype=torch.long)
    depth = torch.zeros(len(rows), width, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        node_tokens, parents = nodes[r]
        n = len(node_tokens)
        tokens[i, :n] = torch.tensor([last[r], *node_tokens[1:]])
        positions[i] = position[r] + torch.arange(width).clamp(max=n - 1)
        for j in range(1, n):
            depth[i, j] = depth[i, parents[j]] + 1
        depth[i, n:] = depth[i, n - 1]
        valid[i, :n] = True
    if not tree:
        prepared = cache.prepare(list(rows), positions, valid)
        return tokens.to(prepared.device), prepared
    rope = torch.stack([position[r] + depth[i] for i, r in enumerate(rows)])
    ends = [position[r] + len(nodes[r][0]) for r in rows]
    S = max(max(cache.lengths[r] for r in rows), *ends)
    attend = torch.zeros(len(rows), 1, width, S, dtype=torch.bool)
    for i, r in enumerate(rows):
        L, (node_tokens, parents) = position[r], nodes[r]
        attend[i, 0, :, :L] = True
        for j in range(len(node_tokens)):
            a = j
            while a >= 0:
                attend[i, 0, j, L + a] = True
                a = parents[a]
        attend[i, 0, len(node_tokens):, :L + 1] = True  # padding rows: anything valid
    prepared = cache.prepare(list(rows), positions, valid, rope_positions=rope, attend=attend)
    return tokens.to(prepared.device), prepared


def accept_row(logits: torch.Tensor, drafts: Sequence[int], draft_probs: torch.Tensor | None, nodes,
               temperature: float, top_p: float, generator: torch.Generator | None) -> tuple[list[int], list[int]]:
    """One row's verification: (the accepted nodes' indices in `nodes` = (tokens, parents), the tokens it
    emits: the accepted drafts, then the target's own). Greedy follows the tree; sampling the rejection rule
    along the chain."""
    node_tokens, parents = nodes
    if temperature <= 0:
        path, bonus = accept_tree(node_tokens, parents, logits)
        return path, [*(node_tokens[j] for j in path), bonus]
    n, emitted = accept_sampled(drafts, draft_probs, probabilities(logits, temperature, top_p), generator)
    return list(range(1, n + 1)), emitted


def keep_path(cache: PagedKVCache, row: Hashable, position: int, path: Sequence[int]) -> None:
    """Keep [last, accepted nodes] in `cache` at position..position + len(path) (a tree's path moves to
    consecutive positions); the rejected drafts roll back."""
    n = len(path)
    if list(path) != list(range(1, n + 1)):
        cache.move(row, [position + j for j in path], [position + 1 + j for j in range(n)])
    cache.truncate(row, position + n + 1)


def target_features(runner: Runner, tokens, positions, cache, drafter) -> tuple[torch.Tensor, torch.Tensor]:
    """(the target's last features, what the drafter reads: the same, or its layers' outputs concatenated)."""
    if drafter.feature_layers:
        return runner.features(tokens, positions, cache, collect=drafter.feature_layers)
    features = runner.features(tokens, positions, cache)
    return features, features


def _emit(emitted: list[int], out: list[int], stop_ids: set[int], max_new_tokens: int) -> tuple[int, str | None]:
    """Append `emitted` to `out` up to a stop token or the length limit: (tokens appended, finish reason)."""
    for i, token in enumerate(emitted):
        if token in stop_ids:
            return i, "eos"
        out.append(token)
        if len(out) >= max_new_tokens:
            return i + 1, "length"
    return len(emitted), None


def _run_wave(runner: Runner, cache, prompts, rows, max_new_tokens, drafter, k, temperature, top_p, stop_ids,
              generator, penalty, results, stats) -> None:
    live: set[int] = set()
    try:
        # prefill, as plain decoding's (ModelRunner.prefill_rows); the first token from the last position
        for r in rows:
            cache.add_sequence(r)
            live.add(r)
        last_logits, _, drafted_from = runner.prefill_rows(cache, rows, prompts, drafter.feature_layers)
        last_logits = penalize_repeats(last_logits, [list(prompts[r]) for r in rows], penalty)
        first = sample(last_logits, temperature, top_p, generator).tolist()
        position, last, active = {}, {}, []
        for i, r in enumerate(rows):
            out = results[r][0]
            if max_new_tokens == 0:
                continue
            _, reason = _emit([first[i]], out, stop_ids, max_new_tokens)
            if reason is not None:
                results[r] = (out, reason)
                continue
            position[r], last[r] = len(prompts[r]), first[i]
            drafter.start(r, [*prompts[r], first[i]], drafted_from[i, :len(prompts[r])] if drafter.needs_features
                          else None)
            active.append(r)
        for r in rows:
            if r not in active:
                cache.free_sequence(r)
                live.discard(r)
        while active:
            budget = {r: min(k, max_new_tokens - len(results[r][0]) - 1) for r in active}
            proposal = drafter.propose(active, [[*prompts[r], *results[r][0]] for r in active], k, temperature,
                                       top_p, generator)
            drafts = {r: list(t[:budget[r]]) for r, t in zip(active, proposal.tokens, strict=True)}
            draft_probs = {r: (q[:budget[r]] if q is not None else None)
                           for r, q in zip(active, proposal.probs, strict=True)}
            tree = temperature <= 0 and proposal.siblings is not None
            nodes = {r: draft_tree(drafts[r], proposal.siblings[i][:budget[r]] if tree else None)
                     for i, r in enumerate(active)}
            tokens, prepared = verification_batch(cache, active, nodes, position, last)
            features, drafted_from = target_features(runner, tokens, prepared, cache, drafter)
            logits = runner.logits_from_features(features)
            still = []
            for i, r in enumerate(active):
                d = drafts[r]
                node_tokens, parents = nodes[r]
                row_logits = penalized_nodes(logits[i, :len(node_tokens)], [*prompts[r], *results[r][0]],
                                        node_tokens, parents, penalty)
                path, emitted = accept_row(row_logits, d, draft_probs[r], nodes[r], temperature, top_p, generator)
                n = len(path)
                stats.record(len(node_tokens) - 1, n)
                out = results[r][0]
                appended, reason = _emit(emitted, out, stop_ids, max_new_tokens)
                stats.emitted += appended
                if reason is not None:
                    results[r] = (out, reason)
                    drafter.finish(r)
                    cache.free_sequence(r)
                    live.discard(r)
                    continue
                keep_path(cache, r, position[r], path)
                position[r] += n + 1
                last[r] = emitted[-1]
                kept = drafted_from[i, [0, *path]] if drafter.needs_features else None
                drafter.accept(r, n, emitted, kept)
                still.append(r)
            active = still
    finally:
        for r in live:
            drafter.finish(r)
            cache.free_sequence(r)


def check_tree_width(width: int) -> int:
    if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= 8:
        raise KilnError(f"--tree-width must be an integer in [1, 8] (1: a chain), got {width!r}")
    return width


def check_draft_tokens(k: int) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 16:
        raise KilnError(f"--draft-tokens must be an integer in [1, 16], got {k!r}")
    return k
