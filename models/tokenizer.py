"""Tokenizers (a checkpoint's tokenizer.json, or a byte-level fallback for presets) and the
incremental detokenizer that streams text deltas and matches stop strings.

Takes token ids and text, never requests.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import tokenizers

NUM_SPECIAL_IDS = 4  # ByteTokenizer: ids 0..3 are OPT's specials, byte b is id b + 4
SPECIAL_NAMES = ("<s>", "<pad>", "</s>", "<unk>")  # OPT's names for ids 0..3
CONTEXT_TOKENS = 5  # prompt tokens decoded ahead of the output (leading-space context)
MAX_HELD_TOKENS = 256  # tokens held for an unfinished character before emitting anyway
REPLACEMENT = "\ufffd"  # what decode shows for an incomplete UTF-8 character


class Tokenizer(Protocol):
    """Text <-> token ids for one model."""

    eos_token_id: int
    bos_token_id: int | None
    vocab_size: int  # every id in [0, vocab_size) decodes without error

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with BOS prepended (as HF's OPT tokenizer does)."""
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

    def encode(self, text: str) -> list[int]:
        ids = [b + NUM_SPECIAL_IDS for b in text.encode("utf-8")]
        return ids if self.bos_token_id is None else [self.bos_token_id, *ids]

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
    """A `tokenizers` tokenizer loaded from <path>/tokenizer.json.

    BOS and EOS come from tokenizer_config.json or special_tokens_map.json when they name
    a known token, else from the given ids.
    """

    def __init__(self, path: str | Path, vocab_size: int = 0, eos_token_id: int = 2,
                 bos_token_id: int | None = 2) -> None:
        directory = Path(path)
        self._tokenizer = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
        specials = _read_special_tokens(directory)
        eos_id, bos_id = (self._token_id(specials.get(k)) for k in ("eos_token", "bos_token"))
        self.eos_token_id: int = eos_token_id if eos_id is None else eos_id
        self.bos_token_id: int | None = bos_token_id if bos_id is None else bos_id
        self.vocab_size = max(vocab_size, self._tokenizer.get_vocab_size(with_added_tokens=True))

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._tokenizer.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return ids if self.bos_token_id is None else [self.bos_token_id, *ids]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def load_tokenizer(path: str | Path | None, vocab_size: int, eos_token_id: int = 2,
                   bos_token_id: int | None = 2) -> Tokenizer:
    """The checkpoint's tokenizer if `path` holds a tokenizer.json, else a ByteTokenizer."""
    if path is not None and (Path(path) / "tokenizer.json").is_file():
        return HFTokenizer(path, vocab_size, eos_token_id, bos_token_id)
    return ByteTokenizer(vocab_size, eos_token_id, bos_token_id)


def _read_special_tokens(directory: Path) -> dict[str, str]:
    """{"bos_token": "</s>", ...} from special_tokens_map.json, then tokenizer_config.json."""
    found: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        file = directory / name
        if not file.is_file():
            continue
        config = json.loads(file.read_text(encoding="utf-8"))
        for key in ("bos_token", "eos_token"):
            value = config.get(key)
            content = value.get("content") if isinstance(value, dict) else value
            if isinstance(content, str):
                found[key] = content
    return found


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
