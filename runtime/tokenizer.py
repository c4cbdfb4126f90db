"""The runtime's tokenizer: `tokenizers` (tokenizer.json) and jinja2 (the chat template), without transformers.

Importing transformers' tokenizer stack costs about 8 s on a small CPU machine, longer than the whole of a
64-token generation on stories260K; `tokenizers` reads a tokenizer.json in milliseconds. `Tokenizer` gives the
ids and the text transformers' `TokenizersBackend` (v5; `PreTrainedTokenizerFast` before it) gives for the same
files, through the calls Kiln makes of a tokenizer:

    tok = load_tokenizer(path)                       # runtime.engine.load_tokenizer
    tok("Once upon a time")["input_ids"]             # special tokens as the files say (a BOS, usually)
    tok.encode(text, add_special_tokens=False)
    tok.decode(ids, skip_special_tokens=True)
    tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    tok.bos_token, tok.eos_token_id, tok.chat_template, len(tok)

What it reproduces of transformers (tests/runtime/test_tokenizer.py checks ids, text and chat prompts against
transformers on stories260K and SmolLM2):
- the named special tokens (bos, eos, unk, sep, pad, cls, mask) and extra/additional special tokens of
  tokenizer_config.json (or special_tokens_map.json) are added to the backend as special tokens, as
  `TokenizersBackend` does, so `skip_special_tokens` skips them;
- BOS/EOS: tokenizer.json's post-processor; tokenizer_config.json's `add_bos_token` and `add_eos_token` are
  ignored, as transformers v5 ignores them beside a tokenizer.json;
- decode: the backend's decoder; `clean_up_tokenization_spaces` as transformers applies it (never on BPE);
- the chat template (chat_template.jinja, else tokenizer_config.json's `chat_template`, a string or named
  templates with a `default`) rendered as transformers renders it: a sandboxed jinja2 environment with
  trim_blocks and lstrip_blocks, the loopcontrols extension, `raise_exception`, `strftime_now`, a `tojson` that
  does not escape HTML, and the special tokens (`bos_token`, `eos_token`, ...) and `add_generation_prompt` as
  variables.

Which files it takes: a tokenizer.json whose tokenizer_config.json names the generic class (`TokenizersBackend`
or `PreTrainedTokenizerFast`) and no custom code (`auto_map`). A model-specific class (LlamaTokenizer,
Qwen2Tokenizer, ...) rebuilds its normalizer and pre-tokenizer in transformers v5 rather than reading
tokenizer.json's, so `load_tokenizer` hands those (and a checkpoint with only a sentencepiece model) to
transformers, which stays correct at transformers' start-up cost.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as Backend

GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
"""tokenizer_config.json classes whose transformers tokenizer is tokenizer.json as written (plus special tokens)."""
SPECIAL_TOKENS_ATTRIBUTES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                             "mask_token")
"""transformers' named special tokens, in its order (`special_tokens_map`, the chat template's variables)."""


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise TypeError(f"{path.name} must hold a JSON object")
    return data


def _content(value) -> str | None:
    """A special token's text: a string, or a serialized AddedToken ({"content": ...})."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def readable(path: Path | str) -> bool:
    """Whether `Tokenizer` reads the tokenizer in directory `path` exactly as transformers would (see the module
    docstring); otherwise runtime.engine.load_tokenizer hands it to transformers."""
    root = Path(path)
    if not (root / "tokenizer.json").is_file():
        return False
    try:
        config = _read_json(root / "tokenizer_config.json")
    except (OSError, ValueError, TypeError):
        return False  # transformers reports a malformed file in its own words
    return config.get("tokenizer_class") in GENERIC_CLASSES and "auto_map" not in config


class Tokenizer:
    """A tokenizer.json (the `tokenizers` library) with tokenizer_config.json's special tokens and chat template."""

    def __init__(self, path: Path | str):
        root = Path(path)
        self.name_or_path = str(root)
        config = _read_json(root / "tokenizer_config.json")
        special_map = _read_json(root / "special_tokens_map.json")
        self.backend = Backend.from_file(str(root / "tokenizer.json"))
        self.init_kwargs = config
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self._clean_up_bpe_anyway = bool(
            config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))

        # added tokens tokenizer_config.json lists that tokenizer.json lacks, then the special tokens
        present = {t.content for t in self.backend.get_added_tokens_decoder().values()}
        extra = []
        for _, entry in sorted(((int(k), v) for k, v in (config.get("added_tokens_decoder") or {}).items()),
                               key=lambda kv: kv[0]):
            if isinstance(entry, dict) and entry.get("content") not in present:
                extra.append(AddedToken(entry["content"], single_word=entry.get("single_word", False),
                                        lstrip=entry.get("lstrip", False), rstrip=entry.get("rstrip", False),
                                        normalized=entry.get("normalized", True), special=entry.get("special", False)))
        if extra:
            self.backend.add_tokens(extra)
        self._special: dict[str, str] = {}
        to_add = []
        for attr in SPECIAL_TOKENS_ATTRIBUTES:
            value = config.get(attr, special_map.get(attr))
            text = _content(value)
            if text is None:
                continue
            self._special[attr] = text
            to_add.append(self._added_token(value, AddedToken))
        listed = config.get("extra_special_tokens", config.get("additional_special_tokens",
                                                                  special_map.get("additional_special_tokens")))
        # transformers v5's named form ({"image_token": "<img>"}): the names are attributes and template variables
        self._named_extra: dict[str, str] = {}
        if isinstance(listed, dict):
            self._named_extra = {name: text for name, v in listed.items() if (text := _content(v)) is not None}
            listed = list(listed.values())
        self.extra_special_tokens = [t for t in (_content(v) for v in listed or ()) if t is not None]
        to_add += [self._added_token(v, AddedToken) for v in listed or () if _content(v) is not None]
        if to_add:
            self.backend.add_special_tokens(to_add)

        # BOS/EOS: tokenizer.json's post-processor. transformers v5 drops tokenizer_config.json's add_bos_token and
        # add_eos_token when a tokenizer.json is there (tokenization_utils_base: from_pretrained), so they are
        # ignored here too; a tokenizer.json without a post-processor gets transformers' template without either.
        self.add_bos_token = self.add_eos_token = False
        if self.backend.post_processor is None:
            self.backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1",
                                                                        special_tokens=[])

        self.chat_template = self._read_chat_template(root, config)
        self._compiled: dict[str, object] = {}

    @staticmethod
    def _added_token(value, added_token):
        if isinstance(value, dict):
            return added_token(value["content"], single_word=value.get("single_word", False),
                               lstrip=value.get("lstrip", False), rstrip=value.get("rstrip", False),
                               normalized=value.get("normalized", False), special=True)
        return added_token(value, special=True, normalized=False)

    @staticmethod
    def _read_chat_template(root: Path, config: dict):
        file = root / "chat_template.jinja"
        if file.is_file():
            return file.read_text(encoding="utf-8")
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            return {t["name"]: t["template"] for t in template if isinstance(t, dict) and "name" in t}
        return template if isinstance(template, str) else None

    # -- special tokens --
    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {**self._named_extra, **self._special}

    def _token(self, attr: str) -> str | None:
        return self._special.get(attr)

    def _token_id(self, attr: str) -> int | None:
        token = self._special.get(attr)
        return None if token is None else self.backend.token_to_id(token)

    bos_token = property(lambda self: self._token("bos_token"))
    eos_token = property(lambda self: self._token("eos_token"))
    unk_token = property(lambda self: self._token("unk_token"))
    pad_token = property(lambda self: self._token("pad_token"))
    bos_token_id = property(lambda self: self._token_id("bos_token"))
    eos_token_id = property(lambda self: self._token_id("eos_token"))
    unk_token_id = property(lambda self: self._token_id("unk_token"))
    pad_token_id = property(lambda self: self._token_id("pad_token"))

    @property
    def all_special_ids(self) -> list[int]:
        """The named and extra special tokens' ids (transformers' list; `skip_special_tokens` skips every added
        token marked special, these and others)."""
        tokens = [*self._special.values(), *self.extra_special_tokens]
        return sorted({i for i in (self.backend.token_to_id(t) for t in tokens) if i is not None})

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            return self.backend.token_to_id(tokens)
        return [self.backend.token_to_id(t) for t in tokens]

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        return [self.backend.id_to_token(i) for i in ids]

    # -- encoding and decoding --
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True) -> dict:
        """{"input_ids": ids, "attention_mask": ones}, for one text or a list of them (as transformers)."""
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens)
            return {"input_ids": ids, "attention_mask": [1] * len(ids)}
        ids = [e.ids for e in self.backend.encode_batch(list(text), add_special_tokens=add_special_tokens)]
        return {"input_ids": ids, "attention_mask": [[1] * len(i) for i in ids]}

    def decode(self, ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None) -> str:
        if isinstance(ids, int):
            ids = [ids]
        elif isinstance(ids, dict):
            ids = ids["input_ids"]
        text = self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        clean = self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None else clean_up_tokenization_spaces
        if clean and (type(self.backend.model).__name__ != "BPE" or self._clean_up_bpe_anyway):
            for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                         (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(a, b)
        return text

    def batch_decode(self, sequences, skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(s, skip_special_tokens) for s in sequences]

    # -- chat --
    def get_chat_template(self, chat_template: str | None = None, tools=None) -> str:
        template = self.chat_template
        if isinstance(template, dict):
            if chat_template is not None and chat_template in template:
                return template[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in template:
                    return template["tool_use"]
                if "default" in template:
                    return template["default"]
                raise ValueError("this tokenizer has several chat templates and none is named 'default'")
        if chat_template is not None:
            return chat_template
        if template is None:
            raise ValueError("this tokenizer has no chat template")
        return template

    def apply_chat_template(self, conversation, tools=None, documents=None, chat_template: str | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = True, **kwargs):
        """The conversation rendered by the chat template (transformers' semantics); its ids (no special tokens
        added: the template writes them) when `tokenize`."""
        source = self.get_chat_template(chat_template, tools)
        compiled = self._compiled.get(source)
        if compiled is None:
            compiled = self._compiled[source] = _compile(source)
        variables = {**self.special_tokens_map, **kwargs}
        text = compiled.render(messages=list(conversation), tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt, **variables)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _compile(source: str):
    """A chat template compiled as transformers compiles one (utils/chat_template_utils.py)."""
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class _Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask tag) renders its body."""
        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
