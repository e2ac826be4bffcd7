"""Tokenizers of pretrained checkpoints: a Hugging Face folder or the metadata of a GGUF file.

`TextTokenizer` wraps a `tokenizers.Tokenizer` and adds what generation needs around it: the BOS id and
whether to prepend it, the set of ids that end a reply (`eos_ids`), and the checkpoint's chat template,
rendered with Jinja2 in a sandbox the way Hugging Face renders it (trim_blocks and lstrip_blocks on, the
loop-controls extension, a `raise_exception` helper, a `tojson` filter that keeps non-ASCII text).

Two sources:

* `from_hf_dir(path)`: `tokenizer.json` plus `tokenizer_config.json` (bos/eos tokens, add_bos_token,
  chat_template), `chat_template.jinja` when the template was saved on its own (transformers >= 4.5x),
  and `generation_config.json` / `config.json` for further end-of-sequence ids.
* `from_gguf_metadata(reader)`: llama.cpp writes no tokenizer.json into a GGUF; it stores the vocabulary
  (`tokenizer.ggml.tokens`, spelled in GPT-2's byte-to-unicode alphabet for byte-level BPE), the merges,
  per-token types (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte), the special ids, the
  chat template and a *name* for the pre-tokenizer (`tokenizer.ggml.pre`). We rebuild a byte-level BPE from
  those. The pre-tokenizer name maps to the split regexes llama.cpp uses for it (src/llama-vocab.cpp,
  `llama_vocab::impl::load`; the same regexes appear in the models' own tokenizer.json files).

Note on "smollm" (SmolLM/SmolLM2): llama.cpp splits on every digit first (`\\p{N}`), then applies GPT-2's
regex; SmolLM2's own tokenizer.json does the same with `Digits(individual_digits=True)` before
`ByteLevel`. transformers' GGUF loader (5.x) has no entry for "smollm" and falls back to GPT-2's regex
alone. The two agree on nearly all text (the vocabulary has no multi-digit or space+digit tokens) but not
on a run of two or more spaces right before a digit: "a  1" is [a, ĠĠ, 1] here and in llama.cpp and
[a, Ġ, Ġ, 1] in transformers' GGUF tokenizer; nor on a space before a non-ASCII numeric (" ½" is [Ġ, Â½]
here, [ĠÂ, ½] there). We follow llama.cpp and the model's own tokenizer.
"""

from __future__ import annotations

import json
import numbers
import threading
import uuid
import warnings
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

# Gemma 3's chat format, for its GGUF files, which carry no template (its instruction-tuned models'
# tokenizer_config.json): turns <start_of_turn>{user|model}\n...<end_of_turn>\n after BOS. A system message may
# only come first, and its text, as given, then a blank line, opens the first turn; then user and model turns
# alternate, starting with the user's, each text trimmed. Other orders are refused, as Google's template refuses.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(prefix='', first=0) %}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set ns.prefix = messages[0]['content'] + '\n\n' %}{% set ns.first = 1 %}{% endif %}"
    "{% for m in messages[ns.first:] %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Gemma 3 chats alternate user and assistant turns, the user first; a system message may "
    "only come first') }}{% endif %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ ns.prefix if loop.first else '' }}{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
# Markers that end an assistant turn in common chat templates; added to `eos_ids` when the template uses
# them, so that generation stops at the end of a reply even if the checkpoint's eos is another token.
END_OF_TURN_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")

# GGUF token types (llama.cpp `llama_token_type` / gguf-py `TokenType`).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# Split regexes by `tokenizer.ggml.pre` name (facts from llama.cpp src/llama-vocab.cpp and the models'
# tokenizer.json files). GPT-2's own regex is what `ByteLevel(use_regex=True)` applies.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2_PRE = ("default", "gpt2", "gpt-2", "mpt", "olmo", "jais")  # GPT-2's regex only
_DIGITS_THEN_GPT2_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell")  # \p{N} first, then GPT-2
_REGEX_PRE = {
    **{name: _LLAMA3_SPLIT for name in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3")},
    **{name: _QWEN2_SPLIT for name in ("qwen2", "deepseek-r1-qwen")},
}
SUPPORTED_GGUF_PRE = (*_GPT2_PRE, *_DIGITS_THEN_GPT2_PRE, *_REGEX_PRE)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (Radford et al. 2019): printable Latin-1 bytes
    map to themselves, the other 68 bytes to code points 256 upwards, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    table: dict[int, str] = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_ALPHABET = frozenset(_bytes_to_unicode().values())
_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


def byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp applies for GGUF pre-tokenizer name `pre`; ValueError if unknown."""
    if pre in _GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre in _REGEX_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_REGEX_PRE[pre]), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    raise ValueError(f"GGUF tokenizer.ggml.pre={pre!r} is not supported; supported pre-tokenizers: "
                     f"{', '.join(SUPPORTED_GGUF_PRE)}")


# ------------------------------------------------------------------------------------- chat templates
def _raise_exception(message: str) -> None:
    # Templates call raise_exception('...') to reject bad conversations (e.g. roles out of order).
    raise ValueError(f"chat template error: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's built-in tojson HTML-escapes '<', '>' and '&' and forces ASCII; chat templates expect plain
    # JSON (tool schemas are shown to the model verbatim), so override it as Hugging Face does.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def render_chat_template(template: str, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                         **variables: Any) -> str:
    """Render a chat template in a sandboxed Jinja2 environment configured like Hugging Face's.

    The sandbox matters: templates come with downloaded checkpoints, and an unsandboxed Jinja template can
    reach Python internals through attribute access.
    """
    try:
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # pragma: no cover - jinja2 comes with torch
        raise ImportError("chat templates need jinja2: pip install jinja2") from e
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        compiled = env.from_string(template)
        return compiled.render(messages=list(messages), add_generation_prompt=add_generation_prompt, **variables)
    except TemplateError as e:
        raise ValueError(f"chat template failed to render: {e}") from e


# ------------------------------------------------------------------------------------- GGUF metadata
_GGUF_KINDS = {  # what a metadata value must be: name -> (test, how the refusal says it)
    "text": (lambda v: isinstance(v, str), "text"),
    "int": (lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool), "an integer"),
    "number": (lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool), "a number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "texts": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "an array of text"),
    "ints": (lambda v: isinstance(v, list) and all(isinstance(x, numbers.Integral) for x in v), "an array of integers"),
}


def gguf_field(reader: Any, key: str, kind: str | None = None, default: Any = ..., where: str = "GGUF") -> Any:
    """A GGUF metadata value, refused by `where` (the file) and key when it is missing (without a default),
    unreadable, or not of `kind` (_GGUF_KINDS: an epsilon stored as an array or text was a TypeError traceback,
    or "could not convert string to float" naming neither file nor key). The one reader of GGUF metadata."""
    f = reader.fields.get(key)
    if f is None:
        if default is ...:
            raise ValueError(f"{where}: GGUF metadata key {key!r} is missing")
        return default
    try:
        value = f.contents()
    except Exception as e:
        raise ValueError(f"{where}: GGUF metadata key {key!r} is unreadable ({e})") from e
    if kind is not None and not _GGUF_KINDS[kind][0](value):
        shown = repr(value) if len(repr(value)) < 60 else repr(value)[:57] + "..."
        raise ValueError(f"{where}: GGUF metadata key {key!r} must be {_GGUF_KINDS[kind][1]}, got {shown}")
    return value


def _special_id(reader: Any, key: str, n: int, where: str) -> int | None:
    """A special token's id from GGUF metadata, or None when absent; one outside the vocabulary is ignored
    with a warning (it was ignored in silence)."""
    v = gguf_field(reader, key, "int", None, where)
    if v is not None and not 0 <= v < n:
        warnings.warn(f"{where}: {key}={v} is outside the vocabulary of {n}; ignored")
        return None
    return None if v is None else int(v)


# --------------------------------------------------------------------------------------- the wrapper
_TEXT_LOCK = threading.Lock()  # making encode_text's own copy of a tokenizer, once


def _checked_text(text: Any, what: str) -> str:
    """`text` if it is a str the tokenizer can take: a lone surrogate ("\\ud800", valid JSON) has no UTF-8 and
    made the tokenizer raise a TypeError, a 500 from the server; here it is a ValueError naming its place."""
    if not isinstance(text, str):
        raise ValueError(f"{what}: expected a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what}: not valid Unicode (a lone surrogate at character {e.start})") from None
    return text


class TextTokenizer:
    """A pretrained model's tokenizer: text <-> ids, special ids, and the chat template."""

    def __init__(self, tokenizer: Tokenizer, *, bos_id: int | None, eos_ids: Iterable[int],
                 chat_template: str | None = None, add_bos: bool = False, vocab_size: int | None = None,
                 special_tokens: dict[str, str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.bos_id = bos_id
        ordered = [int(i) for i in eos_ids]
        self.eos_ids: set[int] = set(ordered)
        # The first id given is the one the checkpoint itself calls eos (used e.g. as a pad id).
        self.eos_id: int | None = ordered[0] if ordered else None
        self.chat_template = chat_template
        self.add_bos = add_bos  # whether encode() prepends BOS by default (the checkpoint's own setting)
        # The model's vocabulary size can exceed the tokenizer's (padded embeddings); keep the larger.
        self.vocab_size = max(vocab_size or 0, tokenizer.get_vocab_size(with_added_tokens=True))
        self.special_tokens = dict(special_tokens or {})  # bos_token/eos_token/... strings for templates
        self._bytes: tuple[str | None, set[int]] | None = None  # (`_byte_plan`, made when first asked)
        self._plain: Tokenizer | None = None  # (`encode_text`'s copy, made when first asked)
        if add_bos and bos_id is None:
            raise ValueError("add_bos=True but the tokenizer has no BOS token")

    def cover(self, vocab_size: int) -> None:
        """Ids up to `vocab_size` - 1 decode: a model's padded embedding has rows past the tokenizer's own
        vocabulary, and their ids decode to nothing (the one rule for load_pretrained and the API's LLM)."""
        self.vocab_size = max(self.vocab_size, vocab_size)

    # -- text <-> ids
    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Ids for `text`. Special-token markup in the text (e.g. "<|im_start|>") becomes its single id.
        `add_bos=None` follows the checkpoint's own default (`self.add_bos`)."""
        _checked_text(text, "encode")
        # Never let a tokenizer.json post-processor add tokens: BOS is decided here, exactly once.
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if self.add_bos if add_bos is None else add_bos:
            if self.bos_id is None:
                raise ValueError("add_bos=True but the tokenizer has no BOS token")
            ids = [self.bos_id, *ids]
        return ids

    def encode_text(self, text: str) -> list[int]:
        """Ids for `text` read as plain text: special-token markup in it ("<|im_end|>") is encoded as the
        characters it is made of, never as a control token. What user-supplied text gets (`encode_chat`)."""
        _checked_text(text, "encode_text")
        return self._plain_text_tokenizer().encode(text, add_special_tokens=False).ids

    def _plain_text_tokenizer(self) -> Tokenizer:
        """A copy of the tokenizer with encode_special_tokens set. It is a tokenizer's state: switching it on the
        shared one for a call made another thread's `encode` read "<|im_start|>" as text (the server encodes on
        two threads)."""
        with _TEXT_LOCK:
            if self._plain is None:
                plain = Tokenizer.from_str(self.tokenizer.to_str())
                plain.encode_special_tokens = True
                self._plain = plain
            return self._plain

    def _special_ids(self) -> set[int]:
        return {i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special}

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids`. An id outside the model's vocabulary is a ValueError (the tokenizer dropped it
        silently, or raised an OverflowError for a negative one); one of a padded embedding's rows beyond the
        tokenizer's own (a model can emit it) decodes to nothing."""
        ids = [int(i) for i in ids]
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"decode: token id {bad} is outside the vocabulary of {self.vocab_size}")
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes that token `token_id` adds to a decoded text. A token holding part of a multi-byte character
        decodes alone to U+FFFD, so its bytes are read from the vocabulary instead: a byte-level BPE entry through
        GPT-2's byte alphabet, a sentencepiece byte token <0xHH> as its byte, "\u2581" as a space. Special tokens,
        and vocabularies of other decoders, give the UTF-8 of their decoding. (OpenAI's logprobs `bytes`: the
        tokens' bytes joined are the text's.)"""
        kind, special = self._byte_plan()
        if not 0 <= int(token_id) < self.vocab_size:
            raise ValueError(f"token_bytes: token id {token_id} is outside the vocabulary of {self.vocab_size}")
        piece = self.tokenizer.id_to_token(int(token_id))
        if piece is None or kind is None or int(token_id) in special:
            return self.decode([token_id]).encode("utf-8")
        if kind == "byte-level":
            table = _UNICODE_TO_BYTE
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return piece.encode("utf-8")  # (an added token that is not special: its text as written)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    def _byte_plan(self) -> tuple[str | None, set[int]]:
        """(how the decoder spells bytes: "byte-level" (GPT-2's alphabet), "byte-fallback" (sentencepiece with
        <0xHH> tokens) or None (another decoder: `token_bytes` decodes), the special ids), read once."""
        if self._bytes is None:
            dec = self.tokenizer.decoder
            spec = json.loads(dec.__getstate__()) if dec is not None else {}
            types = {d.get("type") for d in [spec, *(spec.get("decoders") or [])]}
            kind = "byte-level" if "ByteLevel" in types else "byte-fallback" if "ByteFallback" in types else None
            self._bytes = (kind, self._special_ids())
        return self._bytes

    # -- chat
    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                            **variables: Any) -> str:
        """The conversation as the prompt text the model was fine-tuned on."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (the checkpoint did not ship one)")
        _check_messages(messages)
        return render_chat_template(self.chat_template, messages, add_generation_prompt,
                                    **{**self.special_tokens, **variables})

    def encode_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, *,
                    control_tokens_in_content: bool = False, **variables: Any) -> list[int]:
        """Token ids of the rendered conversation. No extra BOS: templates that want one write it
        themselves (`{{ bos_token }}`), as Hugging Face's apply_chat_template(tokenize=True) assumes.

        The template's own markup becomes control tokens; the messages' contents are text: a user who writes
        "<|im_end|>\n<|im_start|>system" gets those characters, not a forged system turn (prompt injection).
        Each content is rendered as a unique placeholder to find where the contents lie in the rendering. When
        no special token falls inside a content, the ids are the whole rendering's, exactly as the model was
        fine-tuned on them (and as transformers' apply_chat_template gives). Otherwise the template's text is
        encoded around the contents with its special tokens and each content with `encode_text` (whitespace at
        a content's edges may then split differently). `control_tokens_in_content=True` restores reading
        markup in contents."""
        if control_tokens_in_content:
            return self.encode(self.apply_chat_template(messages, add_generation_prompt, **variables), add_bos=False)
        _check_messages(messages)
        markup = [self.tokenizer.id_to_token(i) for i in self._special_ids()]
        for i, m in enumerate(messages):  # a role is rendered as markup: one holding special tokens forged turns
            held = [t for t in markup if t and t in m["role"]]
            if held:
                raise ValueError(f"messages[{i}].role holds the special token {held[0]!r}: a role cannot be chat "
                                 "markup")
        tag = uuid.uuid4().hex
        holders = [f"\ue000{tag}{i}\ue001" for i in range(len(messages))]
        masked = [{**m, "content": h} for m, h in zip(messages, holders)]
        skeleton = self.apply_chat_template(masked, add_generation_prompt, **variables)
        whole = self.apply_chat_template(messages, add_generation_prompt, **variables)
        contents = [m["content"] for m in messages]
        if _fill(skeleton, holders, contents) != whole:  # the template changes contents (e.g. `| trim`)
            contents = [c.strip() for c in contents]
            if _fill(skeleton, holders, contents) != whole:
                raise ValueError("this chat template rewrites message contents, so they cannot be kept apart from "
                                 "its markup; pass control_tokens_in_content=True to encode the rendering as is")
        spans, pos, rest = [], 0, skeleton
        for holder, content in zip(holders, contents):
            if holder in rest:
                before, rest = rest.split(holder, 1)
                pos += len(before)
                spans.append((pos, pos + len(content)))
                pos += len(content)
        enc = self.tokenizer.encode(whole, add_special_tokens=False)
        special = self._special_ids()
        if not any(i in special and any(a < e and s < b for a, b in spans) for i, (s, e) in zip(enc.ids, enc.offsets)):
            return enc.ids
        ids: list[int] = []
        rest = skeleton
        for holder, content in zip(holders, contents):
            if holder not in rest:  # a message the template leaves out
                continue
            before, rest = rest.split(holder, 1)
            ids += self.encode(before, add_bos=False) + self.encode_text(content)
        return ids + self.encode(rest, add_bos=False)

    def __repr__(self) -> str:
        return (f"TextTokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_ids={sorted(self.eos_ids)}, "
                f"chat_template={'yes' if self.chat_template else 'no'})")

    # -- constructors
    @classmethod
    def from_hf_dir(cls, path: str | Path) -> TextTokenizer:
        """Load `tokenizer.json` (+ tokenizer_config.json, chat_template.jinja, generation_config.json)."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ValueError(f"{path}: no tokenizer.json (only fast-tokenizer files are supported)")
        try:
            tokenizer = Tokenizer.from_file(str(tok_file))
        except Exception as e:
            raise ValueError(f"{tok_file}: cannot load tokenizer ({e})") from e
        tcfg = _read_json(path / "tokenizer_config.json")
        smap = _read_json(path / "special_tokens_map.json")
        mcfg = _read_json(path / "config.json")
        gcfg = _read_json(path / "generation_config.json")

        def token_str(name: str) -> str | None:
            v = tcfg.get(name, smap.get(name))
            if isinstance(v, dict):  # serialised AddedToken
                v = v.get("content")
            return v if isinstance(v, str) else None

        special = {n: s for n in ("bos_token", "eos_token", "unk_token", "pad_token") if (s := token_str(n))}
        bos_id = tokenizer.token_to_id(special["bos_token"]) if "bos_token" in special else None
        if bos_id is None and isinstance(mcfg.get("bos_token_id"), int):
            bos_id = mcfg["bos_token_id"]
        eos_list: list[int] = []
        if "eos_token" in special and tokenizer.token_to_id(special["eos_token"]) is not None:
            eos_list.append(tokenizer.token_to_id(special["eos_token"]))
        for cfg in (gcfg, mcfg):
            eos_list.extend(_as_int_list(cfg.get("eos_token_id")))
        if bos_id is not None and "bos_token" not in special:
            special["bos_token"] = tokenizer.id_to_token(bos_id)
        if eos_list and "eos_token" not in special:
            special["eos_token"] = tokenizer.id_to_token(eos_list[0])

        template = _hf_chat_template(path, tcfg)
        if "add_bos_token" in tcfg:
            add_bos = bool(tcfg["add_bos_token"]) and bos_id is not None
        else:
            # No flag: the tokenizer.json post-processor decides (Llama-3's adds BOS, GPT-2 style ones do not).
            probe = tokenizer.encode("a", add_special_tokens=True).ids
            add_bos = bos_id is not None and len(probe) > 0 and probe[0] == bos_id
        eos_list.extend(_template_end_markers(tokenizer, template))
        return cls(tokenizer, bos_id=bos_id, eos_ids=list(dict.fromkeys(eos_list)), chat_template=template,
                   add_bos=add_bos, vocab_size=mcfg.get("vocab_size"), special_tokens=special)

    @classmethod
    def from_gguf_sentencepiece(cls, path: str | Path, reader: Any) -> TextTokenizer:
        """A sentencepiece vocabulary (tokenizer.ggml.model 'llama': Gemma, Llama 2, Mistral v0.1) of the GGUF at
        `path`, built by transformers' GGUF tokenizer converter (an optional dependency: the merges are recovered
        from the vocabulary and scores, ~4 s for Gemma 3's 262k tokens). The file's chat template, or ours for
        Gemma 3 (whose files carry none; GEMMA3_CHAT_TEMPLATE)."""
        try:
            from transformers.integrations.gguf.gguf_tokenizer_mapping import (  # optional: only for these files
                convert_gguf_tokenizer, get_gguf_tokenizer)
        except ImportError as e:
            raise ValueError(f"{path}: a sentencepiece GGUF vocabulary is built with transformers' converter: "
                             f"pip install transformers ({e})") from None
        arch, spec, config = get_gguf_tokenizer(str(path))
        tokenizer, _ = convert_gguf_tokenizer(arch, spec)
        where = str(path)

        def get(key: str, kind: str, default: Any = None) -> Any:
            return gguf_field(reader, key, kind, default, where)

        n = tokenizer.get_vocab_size(with_added_tokens=True)
        ids = {k: _special_id(reader, f"tokenizer.ggml.{k}_token_id", n, where) for k in ("bos", "eos", "eot")}
        template = get("tokenizer.chat_template", "text") or (GEMMA3_CHAT_TEMPLATE if arch == "gemma3" else None)
        eos = [i for i in (ids["eos"], ids["eot"]) if i is not None] + _template_end_markers(tokenizer, template)
        special = {k: v for k, v in config.items() if k.endswith("_token") and isinstance(v, str)}
        # llama.cpp: sentencepiece vocabularies add BOS unless the file says otherwise
        add_bos = get("tokenizer.ggml.add_bos_token", "bool", True) and ids["bos"] is not None
        return cls(tokenizer, bos_id=ids["bos"], eos_ids=list(dict.fromkeys(eos)), chat_template=template,
                   add_bos=add_bos, vocab_size=n, special_tokens=special)

    @classmethod
    def from_gguf_metadata(cls, reader: Any, where: str = "GGUF") -> TextTokenizer:
        """Build the tokenizer described by a `gguf.GGUFReader`'s metadata (byte-level BPE; sentencepiece
        vocabularies: `from_gguf_sentencepiece`).

        Long: one pass over the GGUF's tokenizer keys (vocabulary, merges, token types, special ids, the
        pre-tokenizer, the chat template), each refused by name when it is not what we can run."""
        def get(key: str, kind: str, default: Any = None) -> Any:
            return gguf_field(reader, key, kind, default, where)

        model_type = get("tokenizer.ggml.model", "text")
        if model_type is None:
            raise ValueError("GGUF file has no tokenizer metadata (tokenizer.ggml.model missing)")
        if model_type != "gpt2":
            raise ValueError(f"GGUF tokenizer.ggml.model={model_type!r} is not supported: byte-level BPE "
                             "('gpt2', used by Llama-3, SmolLM, Qwen2, ...) and sentencepiece ('llama': Gemma, "
                             "through transformers' converter) are; 't5', 'bert', 'rwkv' vocabularies are not")
        tokens: list[str] = get("tokenizer.ggml.tokens", "texts") or []
        merges_raw: list[str] = get("tokenizer.ggml.merges", "texts") or []
        if not tokens or not merges_raw:
            raise ValueError("GGUF byte-level BPE tokenizer needs tokenizer.ggml.tokens and tokenizer.ggml.merges")
        types = get("tokenizer.ggml.token_type", "ints") or [TOKEN_NORMAL] * len(tokens)
        if len(types) != len(tokens):
            raise ValueError(f"GGUF tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
        pre = get("tokenizer.ggml.pre", "text", "default")

        special_types = (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN)
        vocab: dict[str, int] = {}
        for i, (tok, ttype) in enumerate(zip(tokens, types)):
            # Normal tokens are spelled in the byte alphabet; a few converters store some as raw UTF-8:
            # respell those so BPE can reach them. Control/user-defined tokens keep their literal text
            # (they are matched whole in the raw text, never produced by merges).
            if ttype not in special_types and not set(tok) <= _BYTE_ALPHABET:
                table = _bytes_to_unicode()
                tok = "".join(table[b] for b in tok.encode("utf-8"))
            if tok in vocab:
                # Two ids with one spelling cannot both live in a BPE vocabulary; the later one can never be
                # produced by encoding (llama.cpp has the same behaviour), but it still decodes.
                warnings.warn(f"GGUF vocabulary spells ids {vocab[tok]} and {i} the same ({tok!r}); "
                              f"encoding yields {vocab[tok]}")
                continue
            vocab[tok] = i
        merges: list[tuple[str, str]] = []
        for m in merges_raw:
            a, sep, b = m.partition(" ")
            if not sep:
                raise ValueError(f"GGUF merge {m!r} is not two space-separated tokens")
            merges.append((a, b))
        try:
            bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
        except Exception as e:
            raise ValueError(f"GGUF tokenizer: cannot build BPE from vocabulary and merges ({e})") from e
        tokenizer = Tokenizer(bpe)
        tokenizer.pre_tokenizer = byte_level_pre_tokenizer(pre)
        tokenizer.decoder = decoders.ByteLevel()
        # Control tokens (<|im_start|>, <|endoftext|>, ...) must be matched whole in the text before
        # pre-tokenization, and are "special" (skip_special_tokens drops them); user-defined ones are matched
        # whole but are ordinary text.
        control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types)
                   if ty == TOKEN_CONTROL and vocab.get(t) is not None]
        user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types)
                if ty == TOKEN_USER_DEFINED and vocab.get(t) is not None]
        n_before = tokenizer.get_vocab_size(with_added_tokens=True)
        if control:
            tokenizer.add_special_tokens(control)
        if user:
            tokenizer.add_tokens(user)
        if tokenizer.get_vocab_size(with_added_tokens=True) != n_before:  # pragma: no cover - defensive
            raise ValueError("GGUF tokenizer: adding special tokens changed the vocabulary size")

        def tok_id(key: str) -> int | None:
            return _special_id(reader, key, len(tokens), where)

        bos_id, eos_id = tok_id("tokenizer.ggml.bos_token_id"), tok_id("tokenizer.ggml.eos_token_id")
        eot_id = tok_id("tokenizer.ggml.eot_token_id")
        special = {name: tokens[i] for name, i in (("bos_token", bos_id), ("eos_token", eos_id),
                                                   ("unk_token", tok_id("tokenizer.ggml.unknown_token_id")),
                                                   ("pad_token", tok_id("tokenizer.ggml.padding_token_id")))
                   if i is not None}
        template = get("tokenizer.chat_template", "text")
        # llama.cpp's default for byte-level BPE vocabularies is no BOS unless the file says otherwise.
        add_bos = get("tokenizer.ggml.add_bos_token", "bool", False) and bos_id is not None
        eos = [i for i in (eos_id, eot_id) if i is not None]
        eos.extend(_template_end_markers(tokenizer, template))
        return cls(tokenizer, bos_id=bos_id, eos_ids=list(dict.fromkeys(eos)), chat_template=template,
                   add_bos=add_bos, vocab_size=len(tokens), special_tokens=special)

    def save_hf(self, out_dir: str | Path) -> None:
        """Write tokenizer.json + tokenizer_config.json (+ chat_template) that `from_hf_dir` and
        transformers' AutoTokenizer both read."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tok = Tokenizer.from_str(self.tokenizer.to_str())
        if self.add_bos and self.bos_id is not None and tok.encode("a").ids[:1] != [self.bos_id]:
            # AutoTokenizer does not read add_bos_token for PreTrainedTokenizerFast: the file's post-processor
            # prepends BOS, or it encoded Gemma's prompts without one (from_hf_dir adds its own and reads none)
            bos = processors.TemplateProcessing(single=f"{tok.id_to_token(self.bos_id)} $A",
                                                pair=f"{tok.id_to_token(self.bos_id)} $A $B:1",
                                                special_tokens=[(tok.id_to_token(self.bos_id), self.bos_id)])
            tok.post_processor = bos if tok.post_processor is None else processors.Sequence([tok.post_processor, bos])
        tok.save(str(out / "tokenizer.json"))
        cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": self.add_bos,
                               "add_eos_token": False, "clean_up_tokenization_spaces": False,
                               "model_max_length": 1_000_000}
        cfg.update(self.special_tokens)
        if self.chat_template is not None:
            cfg["chat_template"] = self.chat_template
        (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


# ------------------------------------------------------------------------------------------- helpers
def _fill(skeleton: str, holders: Sequence[str], contents: Sequence[str]) -> str:
    for holder, content in zip(holders, contents):
        skeleton = skeleton.replace(holder, content, 1)
    return skeleton


def _check_messages(messages: Sequence[dict[str, Any]]) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError("messages: expected a list of {'role': ..., 'content': ...} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"messages[{i}]: expected a dict with a 'role' key, got {m!r}")
        for key in ("role", "content"):  # (the templates concatenate them: None or a list was a TypeError)
            _checked_text(m.get(key), f"messages[{i}].{key}")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _as_int_list(v: Any) -> list[int]:
    if isinstance(v, bool) or v is None:
        return []
    if isinstance(v, int):
        return [v]
    if isinstance(v, list):
        return [x for x in v if isinstance(x, int) and not isinstance(x, bool)]
    return []


def _hf_chat_template(path: Path, tcfg: dict[str, Any]) -> str | None:
    # Newer transformers save the template beside the config; older ones inside tokenizer_config.json,
    # either as a string or as a list of named templates (the one named "default" is the chat template).
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        try:
            return jinja.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{jinja}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    t = tcfg.get("chat_template")
    if t is None:
        t = _read_json(path / "chat_template.json").get("chat_template")
    if isinstance(t, list):
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        t = named.get("default")
    return t if isinstance(t, str) else None


def _template_end_markers(tokenizer: Tokenizer, template: str | None) -> list[int]:
    if not template:
        return []
    return [i for m in END_OF_TURN_MARKERS if m in template and (i := tokenizer.token_to_id(m)) is not None]


__all__ = ["TextTokenizer", "gguf_field", "render_chat_template", "byte_level_pre_tokenizer", "SUPPORTED_GGUF_PRE"]
