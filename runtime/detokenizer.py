"""Incremental detokenization: the text a sequence's new tokens add, without decoding its whole output again.

    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    for token in new_tokens:
        text_so_far += detok.add(token)

`add` decodes only a short window (the last few tokens already shown plus the new ones) twice and returns the
difference, as vLLM's detokenizer does; the window starts a few tokens back so that a word-boundary space and
a token that completes a multi-byte character come out as the whole output decoded with its prompt would
give them. While the window ends inside a multi-byte character (the decoded text ends in U+FFFD) nothing is
returned; the bytes come with the token that completes it.
"""

from __future__ import annotations

from collections.abc import Sequence

_CONTEXT = 5  # prompt tokens the first window reaches back over (a word boundary depends on the previous token)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids)
        self.prefix_offset = max(0, len(self.ids) - _CONTEXT)
        self.read_offset = len(self.ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token: int) -> str:
        """Append one token; the text it completes ("" while a character is still incomplete)."""
        self.ids.append(token)
        shown = self._decode(self.ids[self.prefix_offset: self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(shown) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(shown):]
        return ""
