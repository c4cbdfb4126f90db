"""Drafters for speculative decoding: what proposes the tokens a target forward then verifies.

    drafter = PromptLookupDrafter()                          # or NgramTableDrafter.from_corpus(token_lists)
    drafter.start(row, prompt_and_first_token, None)
    proposal = drafter.propose([row], [context], k, temperature=0.0, top_p=1.0, generator=None)
    drafter.accept(row, accepted, emitted, None); drafter.finish(row)

`DraftHeadDrafter` runs an MTP layer or a Kiln draft head of the artifact (runtime.draft) on the target's
features, with its own paged KV cache; `PromptLookupDrafter` copies what followed the latest earlier occurrence
of the context's last n-gram (as vLLM's ngram speculator); `NgramTableDrafter` chains a corpus n-gram table.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from kiln.runtime.paged_kv_cache import PagedKVCache
from kiln.runtime.sampling import probabilities


@dataclass
class Proposal:
    tokens: list[list[int]]  # per row, at most k: the chain
    probs: list[torch.Tensor | None]  # per row, [len(tokens), V] or None (one-hot proposals)
    # per row and depth, alternatives to the chain's token there (children of the chain's previous node):
    # greedy verification checks them in the same forward (a tree); None: a chain
    siblings: list[list[list[int]]] | None = None


class Drafter:
    """Proposes tokens. The engine calls `start` after a row's prefill, `propose` before each verification,
    `accept` after it, `finish` when the row leaves."""

    needs_features = False
    feature_layers: tuple[int, ...] = ()  # the target layers whose outputs it reads (else the last, pre-norm)

    def start(self, row: Hashable, tokens: Sequence[int], features: torch.Tensor | None) -> None:
        """`tokens`: the prompt plus the first token; `features` [len(prompt), C] (needs_features only)."""

    def propose(self, rows: Sequence[Hashable], contexts: Sequence[Sequence[int]], k: int, temperature: float,
                top_p: float, generator: torch.Generator | None) -> Proposal:
        raise NotImplementedError

    def accept(self, row: Hashable, accepted: int, emitted: Sequence[int], features: torch.Tensor | None) -> None:
        """`features` [accepted + 1, C]: the target's at the positions verified and kept."""

    def finish(self, row: Hashable) -> None:
        pass


class PromptLookupDrafter(Drafter):
    """Copy the k tokens that followed the latest earlier occurrence of the context's last n tokens, for n from
    `max_ngram` down to `min_ngram` (no proposal when none recurs)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, rows, contexts, k, temperature, top_p, generator) -> Proposal:
        out = []
        for context in contexts:
            found: list[int] = []
            for n in range(self.max_ngram, self.min_ngram - 1, -1):
                if len(context) <= n:
                    continue
                tail = list(context[-n:])
                for start in range(len(context) - n - 1, -1, -1):
                    if list(context[start:start + n]) == tail:
                        found = list(context[start + n:start + n + k])
                        break
                if found:
                    break
            out.append(found)
        return Proposal(out, [None] * len(out))


class NgramTableDrafter(Drafter):
    """Chain the most frequent next token of the last n-1 tokens in a corpus (a trigram table by default)."""

    def __init__(self, table: Mapping[tuple[int, ...], int], n: int = 3):
        self.table, self.n = table, n

    @classmethod
    def from_corpus(cls, token_lists: Sequence[Sequence[int]], n: int = 3) -> NgramTableDrafter:
        counts: dict[tuple[int, ...], dict[int, int]] = {}
        for tokens in token_lists:
            for i in range(len(tokens) - n + 1):
                key, nxt = tuple(tokens[i:i + n - 1]), tokens[i + n - 1]
                row = counts.setdefault(key, {})
                row[nxt] = row.get(nxt, 0) + 1
        return cls({key: max(row, key=row.get) for key, row in counts.items()}, n)

    def propose(self, rows, contexts, k, temperature, top_p, generator) -> Proposal:
        out = []
        for context in contexts:
            seq, drafts = list(context), []
            for _ in range(k):
                nxt = self.table.get(tuple(seq[len(seq) - self.n + 1:]))
                if nxt is None:
                    break
                drafts.append(nxt)
                seq.append(nxt)
            out.append(drafts)
        return Proposal(out, [None] * len(out))


@dataclass
class _HeadRow:
    pending: torch.Tensor  # [P, C] target features of positions start..start+P-1 not yet run by the draft
    start: int  # position of pending[0]; the draft cache holds positions < start
    tokens: list[int] = field(default_factory=list)  # every token of the row, prompt first


class DraftHeadDrafter(Drafter):
    """An MTP layer or a Kiln draft head (runtime.draft.DraftModule) with its own paged KV cache."""

    needs_features = True

    def __init__(self, module, num_blocks: int, block_size: int, kv_streams, tree_width: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.module = module
        self.feature_layers = tuple(module.aux_layers)
        self.tree_width = tree_width  # greedy: the top-`tree_width` tokens at each depth go to verification
        self.cache = PagedKVCache([kv_streams], num_blocks, block_size, dtype, device=device)
        self.rows: dict[Hashable, _HeadRow] = {}

    def start(self, row, tokens, features):
        self.cache.add_sequence(row)
        self.rows[row] = _HeadRow(features, 0, list(tokens))

    def finish(self, row):
        if row in self.rows:
            self.cache.free_sequence(row)
            del self.rows[row]

    @torch.inference_mode()
    def propose(self, rows, contexts, k, temperature, top_p, generator) -> Proposal:
        states = [self.rows[r] for r in rows]
        # 1. the pending positions, with the target's true features: their last output drafts token 1
        width = max(len(s.pending) for s in states)
        C = states[0].pending.shape[-1]
        features = states[0].pending.new_zeros(len(rows), width, C)
        tokens = torch.zeros(len(rows), width, dtype=torch.long)
        positions = torch.zeros(len(rows), width, dtype=torch.long)
        valid = torch.zeros(len(rows), width, dtype=torch.bool)
        for i, s in enumerate(states):
            n = len(s.pending)
            features[i, :n] = s.pending
            tokens[i, :n] = torch.as_tensor(s.tokens[s.start + 1:s.start + 1 + n])
            positions[i, :n] = torch.arange(s.start, s.start + n)
            positions[i, n:] = s.start + n - 1  # padding: masked, never written
            valid[i, :n] = True
        positions = self.cache.prepare(list(rows), positions, valid)
        out = self.module(self.module.project(features), tokens.to(features.device), positions, self.cache)
        last = torch.stack([out[i, len(s.pending) - 1] for i, s in enumerate(states)])  # [B, C]
        ends = [s.start + len(s.pending) for s in states]  # the next position to run
        for s, end in zip(states, ends, strict=True):
            s.start, s.pending = end, s.pending[:0]
        drafts: list[list[int]] = [[] for _ in rows]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        siblings: list[list[list[int]]] = [[] for _ in rows]
        for step in range(k):
            logits = self.module.logits(last)
            if temperature <= 0:
                top = logits.topk(self.tree_width, dim=-1).indices  # [B, w], best first
                picked = top[:, 0]
                for i, alternatives in enumerate(top[:, 1:].tolist()):
                    siblings[i].append(alternatives)
            else:
                q = probabilities(logits, temperature, top_p)
                picked = torch.multinomial(q, 1, generator=generator)[:, 0]
                for i in range(len(rows)):
                    probs[i].append(q[i])
            for i, t in enumerate(picked.tolist()):
                drafts[i].append(t)
            if step == k - 1:
                break
            positions = self.cache.prepare(list(rows), torch.tensor([[end + step] for end in ends]))
            last = self.module(last[:, None], picked[:, None], positions, self.cache)[:, 0]
        return Proposal(drafts, [torch.stack(p) if p else None for p in probs],
                        siblings if temperature <= 0 and self.tree_width > 1 else None)

    def accept(self, row, accepted, emitted, features):
        s = self.rows[row]
        # drop what the draft wrote from its own guesses (positions >= s.start); rerun them with true features
        self.cache.truncate(row, min(s.start, self.cache.lengths[row]))
        s.tokens.extend(emitted)
        s.pending = features
