"""Tokenizers (a checkpoint's tokenizer.json or vocab.json + merges.txt, or the byte-level one
of presets) and the incremental detokenizer that streams text deltas and matches stop strings.

Takes token ids and text, never requests.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import tokenizers
import tokenizers.decoders
import tokenizers.models
import tokenizers.pre_tokenizers
import tokenizers.processors

NUM_SPECIAL_IDS = 4  # ByteTokenizer: ids 0..3 are OPT's specials, byte b is id b + 4
SPECIAL_NAMES = ("<s>", "<pad>", "</s>", "<unk>")  # OPT's names for ids 0..3
CONTEXT_TOKENS = 5  # prompt tokens decoded ahead of the output (leading-space context)
MAX_HELD_TOKENS = 256  # tokens held for an unfinished character before emitting anyway
REPLACEMENT = "\ufffd"  # what decode shows for an incomplete UTF-8 character
BYTES = "bytes"  # --tokenizer bytes: the byte-level tokenizer, even for a checkpoint
TOKENIZER_JSON = "tokenizer.json"
BPE_FILES = ("vocab.json", "merges.txt")  # a GPT-2 / OPT byte-level BPE as the Hub ships it
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                "mask_token")  # transformers' named special tokens
GPT2_SPECIALS = {"unk_token": "<|endoftext|>", "bos_token": "<|endoftext|>",
                 "eos_token": "<|endoftext|>"}  # transformers' GPT2Tokenizer defaults


class Tokenizer(Protocol):
    """Text <-> token ids for one model."""

    eos_token_id: int
    bos_token_id: int | None
    vocab_size: int  # every id in [0, vocab_size) decodes without error

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with the special tokens the tokenizer adds (BOS for OPT)
        unless `add_special_tokens` is False (as in transformers)."""
        ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; incomplete UTF-8 shows as U+FFFD; special tokens skipped by default."""
        ...


class ByteTokenizer:
    """Byte-level fallback for presets: byte b is id b + 4; ids 0..3 are OPT's specials.

    Ids from 260 up to `vocab_size` (a preset's model can emit them) decode as the byte
    (id - 4) % 256, so any generated id has text.
    """

    def __init__(self, vocab_size: int, eos_token_id: int = 2, bos_token_id: int | None = 2
                 ) -> None:
        if vocab_size < NUM_SPECIAL_IDS + 256:
            raise ValueError(f"vocab_size ({vocab_size}) must be >= {NUM_SPECIAL_IDS + 256}")
        for name, value in (("eos_token_id", eos_token_id), ("bos_token_id", bos_token_id)):
            if value is not None and not 0 <= value < NUM_SPECIAL_IDS:
                raise ValueError(f"{name} ({value}) must be in [0, {NUM_SPECIAL_IDS})")
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [b + NUM_SPECIAL_IDS for b in text.encode("utf-8")]
        if self.bos_token_id is None or not add_special_tokens:
            return ids
        return [self.bos_token_id, *ids]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if ids and not (0 <= min(ids) and max(ids) < self.vocab_size):
            bad = min(ids) if min(ids) < 0 else max(ids)
            raise ValueError(f"token id ({bad}) must be in [0, vocab_size={self.vocab_size})")
        parts: list[str] = []
        run = bytearray()
        for i in ids:
            if i >= NUM_SPECIAL_IDS:
                run.append((i - NUM_SPECIAL_IDS) % 256)
            elif not skip_special_tokens:
                parts += [run.decode("utf-8", "replace"), SPECIAL_NAMES[i]]
                run.clear()
        parts.append(run.decode("utf-8", "replace"))
        return "".join(parts)


class HFTokenizer:
    """A checkpoint's tokenizer, built with `tokenizers` as `transformers.AutoTokenizer` builds
    it: from tokenizer.json, else from vocab.json + merges.txt as a GPT-2 byte-level BPE.

    tokenizer_config.json and special_tokens_map.json name the special tokens (bos, eos, unk,
    pad, ...) and whether BOS / EOS are added (`add_bos_token`, as OPT's config says); they
    and the added tokens are matched whole in text, and `decode` skips the special ones.
    """

    def __init__(self, path: str | Path, vocab_size: int = 0, eos_token_id: int = 2) -> None:
        directory = Path(path)
        config = _read_tokenizer_config(directory)
        if (directory / TOKENIZER_JSON).is_file():
            self._tokenizer = tokenizers.Tokenizer.from_file(str(directory / TOKENIZER_JSON))
        else:
            self._tokenizer = _byte_level_bpe(directory, bool(config.get("add_prefix_space")))
            config = {**GPT2_SPECIALS, **{k: v for k, v in config.items() if v is not None}}
        self._setup(config, vocab_size, eos_token_id)

    @classmethod
    def from_parts(cls, tokenizer: tokenizers.Tokenizer, config: dict[str, Any],
                   vocab_size: int = 0, eos_token_id: int = 2) -> HFTokenizer:
        """A tokenizer built elsewhere (e.g. from a GGUF vocabulary) plus a
        tokenizer_config-like dict (special tokens, added tokens, add_bos_token)."""
        self = cls.__new__(cls)
        self._tokenizer = tokenizer
        self._setup({"added_tokens_json": {}, **config}, vocab_size, eos_token_id)
        return self

    def _setup(self, config: dict[str, Any], vocab_size: int, eos_token_id: int) -> None:
        _add_tokens(self._tokenizer, config)
        eos_id, bos_id = (self._token_id(config.get(k)) for k in ("eos_token", "bos_token"))
        self.eos_token_id: int = eos_token_id if eos_id is None else eos_id
        self.bos_token_id: int | None = bos_id
        self.vocab_size = max(vocab_size, self._tokenizer.get_vocab_size(with_added_tokens=True))
        # NOTE: as transformers does: the config's add_bos_token / add_eos_token replace the
        # post-processor; without them a tokenizer.json keeps its own.
        if ("add_bos_token" in config or "add_eos_token" in config
                or self._tokenizer.post_processor is None):
            self._tokenizer.post_processor = _template(config, bos_id, eos_id)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The `tokenizers` object (e.g. to save it as tokenizer.json)."""
        return self._tokenizer

    def _token_id(self, token: object) -> int | None:
        content = _content(token)
        return None if content is None else self._tokenizer.token_to_id(content)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def load_tokenizer(source: str | Path | None, vocab_size: int, eos_token_id: int = 2,
                   bos_token_id: int | None = 2) -> Tokenizer:
    """The tokenizer in directory `source` or GGUF file `source`, or the byte-level one for
    None or "bytes".

    Raises:
        ValueError: `source` is not a directory, or holds no tokenizer files.
    """
    if source is None or str(source) == BYTES:
        return ByteTokenizer(vocab_size, eos_token_id, bos_token_id)
    directory = Path(source)
    if directory.suffix == ".gguf" and directory.is_file():
        from models.gguf_loader import load_gguf_tokenizer  # the gguf library, on demand

        return load_gguf_tokenizer(directory, vocab_size, eos_token_id)
    if not directory.is_dir():
        raise ValueError(f"tokenizer {str(source)!r} is neither {BYTES!r}, a directory nor "
                         f"a .gguf file")
    if (directory / TOKENIZER_JSON).is_file() or all((directory / f).is_file() for f in BPE_FILES):
        return HFTokenizer(directory, vocab_size, eos_token_id)
    raise ValueError(
        f"{directory} has no tokenizer files ({TOKENIZER_JSON}, or {' + '.join(BPE_FILES)}); "
        f"take them from another directory with --tokenizer PATH, or use the byte-level "
        f"tokenizer with --tokenizer {BYTES}")


def _byte_level_bpe(directory: Path, add_prefix_space: bool) -> tokenizers.Tokenizer:
    """vocab.json + merges.txt as transformers' GPT-2 converter builds them."""
    vocab, merges = (str(directory / f) for f in BPE_FILES)
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE.from_file(
        vocab, merges, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(
        add_prefix_space=add_prefix_space)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    return tokenizer


def _template(config: dict[str, Any], bos_id: int | None, eos_id: int | None
              ) -> tokenizers.processors.TemplateProcessing:
    """The post-processor that adds BOS and / or EOS as the config asks (transformers')."""
    bos = _content(config.get("bos_token")) if config.get("add_bos_token") else None
    eos = _content(config.get("eos_token")) if config.get("add_eos_token") else None
    specials = [(t, i) for t, i in ((bos, bos_id), (eos, eos_id)) if t is not None]
    if any(i is None for _, i in specials):
        raise ValueError(f"tokenizer_config.json adds a token that is not in the vocabulary: "
                         f"{[t for t, i in specials if i is None]}")

    def part(seq: str, type_id: int) -> str:
        return " ".join(f"{t}:{type_id}" for t in (bos, seq, eos) if t is not None)

    return tokenizers.processors.TemplateProcessing(
        single=part("$A", 0), pair=f"{part('$A', 0)} {part('$B', 1)}",
        special_tokens=specials)  # type: ignore[arg-type]


def _read_tokenizer_config(directory: Path) -> dict[str, Any]:
    """tokenizer_config.json plus added_tokens.json's tokens; special_tokens_map.json's
    tokens win over the config's unless the config lists `added_tokens_decoder` (as
    transformers reads them). An absent file counts as empty."""
    config = _read_json(directory / "tokenizer_config.json")
    if "added_tokens_decoder" not in config:
        config.update(_read_json(directory / "special_tokens_map.json"))
    config["added_tokens_json"] = _read_json(directory / "added_tokens.json")
    return config


def _add_tokens(tokenizer: tokenizers.Tokenizer, config: dict[str, Any]) -> None:
    """Registers the added tokens (in id order), then every named special token that is not
    registered yet (a registered one keeps its lstrip / rstrip / ... settings)."""
    decoder = config.get("added_tokens_decoder") or {}
    for _, spec in sorted(decoder.items(), key=lambda item: int(item[0])):
        token = _added_token(spec, special=bool(spec.get("special", False)))
        (tokenizer.add_special_tokens if token.special else tokenizer.add_tokens)([token])
    for content in sorted(config["added_tokens_json"], key=config["added_tokens_json"].get):
        tokenizer.add_tokens([tokenizers.AddedToken(content)])
    named = [config.get(k) for k in SPECIAL_KEYS]
    for key in ("additional_special_tokens", "extra_special_tokens"):
        extra = config.get(key) or []
        named += extra if isinstance(extra, list) else []
    registered = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    tokenizer.add_special_tokens([_added_token(t, special=True) for t in named
                                  if _content(t) is not None and _content(t) not in registered])


def _added_token(spec: object, special: bool) -> tokenizers.AddedToken:
    """An AddedToken from a config entry: a string, or a dict of AddedToken fields."""
    if isinstance(spec, str):
        return tokenizers.AddedToken(spec, special=special)
    if not isinstance(spec, dict) or not isinstance(spec.get("content"), str):
        raise ValueError(f"added token {spec!r} is neither a string nor a dict with content")
    fields = {k: bool(spec[k]) for k in ("single_word", "lstrip", "rstrip", "normalized")
              if k in spec}
    return tokenizers.AddedToken(spec["content"], special=special, **fields)


def _content(token: object) -> str | None:
    content = token.get("content") if isinstance(token, dict) else token
    return content if isinstance(content, str) else None


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    value = json.loads(file.read_text(encoding="utf-8"))
    if not isinstance(value, dict):
        raise ValueError(f"{file} does not hold a JSON object")
    return value


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas for streaming.

    Decodes only a window of recent tokens (vLLM's prefix/read offsets), so each step costs
    O(new tokens). Never emits a partial UTF-8 character: text ending in U+FFFD is held
    until more tokens arrive (up to MAX_HELD_TOKENS) or `finish()`. With stop strings, text
    that could begin one is held until disambiguated; the first stop string to appear (earliest
    end) ends the stream, and neither it nor anything after it is returned.

        ids:  [ emitted, decoded as prefix_text | held: not yet emitted ]
               0                               read_offset          len(ids)
        text: [ emitted (self.text) | pending: may begin a stop string ]
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], stop: Sequence[str] = (),
                 skip_special_tokens: bool = True) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(stop)
        self._ids = list(prompt_ids[max(0, len(prompt_ids) - CONTEXT_TOKENS):])
        self._prefix_text = self._decode(self._ids)
        if self._prefix_text.endswith(REPLACEMENT):  # the window must start on a character
            self._ids, self._prefix_text = [], ""
        self._read_offset = len(self._ids)
        self._pending = ""
        self._text = ""
        self._is_done = False
        self._is_stopped = False

    @property
    def stopped(self) -> bool:
        """A stop string was matched: the stream is over."""
        return self._is_stopped

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return self._text

    def feed(self, new_ids: Sequence[int]) -> str:
        """Appends `new_ids`; returns the text delta safe to emit now ("" once stopped)."""
        if self._is_done:
            return ""
        self._ids.extend(new_ids)
        return self._release(self._decode_delta(is_final=False), is_final=False)

    def finish(self) -> str:
        """Flushes all held text (up to a stop string, if one matches); ends the stream."""
        if self._is_done:
            return ""
        delta = self._release(self._decode_delta(is_final=True), is_final=True)
        self._is_done = True
        return delta

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_delta(self, is_final: bool) -> str:
        """New text of the held tokens, once it ends on a whole character; advances the window."""
        text = self._decode(self._ids)
        is_held = len(self._ids) - self._read_offset <= MAX_HELD_TOKENS
        if not is_final and is_held and (text.endswith(REPLACEMENT)
                                         or len(text) <= len(self._prefix_text)):
            return ""
        delta = text[len(self._prefix_text):]
        self._ids = self._ids[self._read_offset:]
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return delta

    def _release(self, delta: str, is_final: bool) -> str:
        """Appends `delta` to the pending text and emits what no stop string can claim."""
        self._pending += delta
        cut = _find_stop(self._pending, self._stop)
        if cut is not None:
            self._pending = self._pending[:cut]
            self._is_done = self._is_stopped = is_final = True
        num_held = 0 if is_final else _partial_stop_len(self._pending, self._stop)
        out = self._pending[:len(self._pending) - num_held]
        self._pending = self._pending[len(out):]
        self._text += out
        return out


def _find_stop(text: str, stop: Sequence[str]) -> int | None:
    """Where the first stop string to appear in `text` starts, or None.

    First to appear = earliest end (as if text arrived one character at a time), then the
    longest, so the answer does not depend on how the text was split into tokens.
    """
    matches = [(i + len(s), i) for s, i in ((s, text.find(s)) for s in stop) if i >= 0]
    return min(matches)[1] if matches else None


def _partial_stop_len(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    longest = max((len(s) for s in stop), default=1) - 1
    for length in range(min(longest, len(text)), 0, -1):
        if any(s.startswith(text[-length:]) for s in stop):
            return length
    return 0
