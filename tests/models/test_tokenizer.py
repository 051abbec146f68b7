"""Tests for models/tokenizer.py: byte and HF tokenizers, streaming detokenizer, stop strings."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    IncrementalDetokenizer,
    Tokenizer,
    load_tokenizer,
)
from tests.conftest import write_bpe_tokenizer

UNICODE_TEXT = "Hé, 世界! 🙂👍🏽 naïve café — 你好"
BYTES = ByteTokenizer(vocab_size=50272)
CORPUS = ["hello world, this is a tiny corpus", "héllo wörld 你好 世界 🙂 emoji text",
          "the quick brown fox jumps over the lazy dog"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny byte-level BPE saved as a checkpoint's tokenizer files."""
    directory = write_bpe_tokenizer(tmp_path_factory.mktemp("tok"), CORPUS)
    config = {"bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>",
              "add_bos_token": True}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def _stream(tokenizer: Tokenizer, ids: Sequence[int], chunks: Sequence[int],
            stop: Sequence[str] = (), prompt_ids: Sequence[int] = ()) -> tuple[list[str], str]:
    """Feeds `ids` in chunks of the given sizes (cycled); returns (deltas, final flush)."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, stop)
    deltas: list[str] = []
    start, i = 0, 0
    while start < len(ids):
        size = chunks[i % len(chunks)] if chunks else 1
        deltas.append(detok.feed(ids[start:start + size]))
        start, i = start + size, i + 1
    tail = detok.finish()
    assert detok.text == "".join(deltas) + tail
    return deltas, tail


def test_byte_tokenizer_round_trips_unicode_and_prepends_bos() -> None:
    ids = BYTES.encode(UNICODE_TEXT)
    assert ids[0] == 2
    assert all(4 <= i < 260 for i in ids[1:])
    assert BYTES.decode(ids) == UNICODE_TEXT


def test_byte_tokenizer_shows_specials_only_when_asked_and_maps_high_ids() -> None:
    assert BYTES.decode([2, 4 + ord("a"), 1, 260 + ord("b")]) == "ab"
    assert BYTES.decode([2, 4 + ord("a"), 1], skip_special_tokens=False) == "</s>a<pad>"


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"vocab_size": 259}, "vocab_size"),
    ({"vocab_size": 300, "eos_token_id": 7}, "eos_token_id"),
])
def test_byte_tokenizer_rejects_bad_settings(kwargs: dict[str, int], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ByteTokenizer(**kwargs)


def test_byte_tokenizer_rejects_ids_outside_the_vocab() -> None:
    with pytest.raises(ValueError, match="token id"):
        BYTES.decode([5, 50272])


def test_hf_tokenizer_loads_specials_from_config_and_round_trips(hf_dir: Path) -> None:
    tokenizer = load_tokenizer(hf_dir, vocab_size=512, eos_token_id=9, bos_token_id=8)
    assert isinstance(tokenizer, HFTokenizer)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.vocab_size) == (0, 2, 512)
    ids = tokenizer.encode(UNICODE_TEXT)
    assert ids[0] == 0 and 0 not in ids[1:]
    assert tokenizer.decode(ids) == UNICODE_TEXT
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<s>" + UNICODE_TEXT


def test_byte_tokenizer_only_for_presets_or_when_asked(tmp_path: Path) -> None:
    assert isinstance(load_tokenizer(None, vocab_size=300), ByteTokenizer)
    tokenizer = load_tokenizer("bytes", vocab_size=300, eos_token_id=2)
    assert isinstance(tokenizer, ByteTokenizer)
    assert tokenizer.decode(tokenizer.encode("ok")) == "ok"
    with pytest.raises(ValueError, match=f"{tmp_path} has no tokenizer files .*--tokenizer"):
        load_tokenizer(tmp_path, vocab_size=300)
    with pytest.raises(ValueError, match="'nowhere' is neither 'bytes', a directory nor a"):
        load_tokenizer("nowhere", vocab_size=300)


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=40), chunks=st.lists(st.integers(1, 4), max_size=5),
       specials=st.sets(st.integers(0, 60), max_size=4))
def test_byte_deltas_join_to_the_full_decode_and_never_split_characters(
        text: str, chunks: list[int], specials: set[int]) -> None:
    ids = BYTES.encode(text)[1:]
    for position in sorted(specials, reverse=True):
        ids.insert(min(position, len(ids)), 2)
    deltas, tail = _stream(BYTES, ids, chunks, prompt_ids=BYTES.encode("prompt 你"))
    assert "".join(deltas) + tail == BYTES.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


@settings(max_examples=150, deadline=None)
@given(ids=st.lists(st.integers(0, 50271), max_size=40),
       chunks=st.lists(st.integers(1, 3), max_size=4))
def test_byte_deltas_join_to_the_full_decode_of_arbitrary_ids(
        ids: list[int], chunks: list[int]) -> None:
    deltas, tail = _stream(BYTES, ids, chunks)
    assert "".join(deltas) + tail == BYTES.decode(ids)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_hf_deltas_join_to_the_full_decode(hf_dir: Path, data: st.DataObject) -> None:
    tokenizer = HFTokenizer(hf_dir)
    ids = data.draw(st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=30))
    chunks = data.draw(st.lists(st.integers(1, 3), max_size=4))
    deltas, tail = _stream(tokenizer, ids, chunks, prompt_ids=tokenizer.encode("hello"))
    assert "".join(deltas) + tail == tokenizer.decode(ids)


def test_hf_stream_of_real_text_emits_whole_characters(hf_dir: Path) -> None:
    tokenizer = HFTokenizer(hf_dir)
    ids = tokenizer.encode(UNICODE_TEXT)[1:]
    deltas, tail = _stream(tokenizer, ids, [1])
    assert "".join(deltas) == UNICODE_TEXT and tail == ""
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize(("text", "stop", "expected"), [
    ("Hello world STOP more", ["STOP"], "Hello world "),
    ("abc 你好世界 xyz", ["好世"], "abc 你"),
    ("one two three", ["three", "two"], "one "),
    ("xbaa", ["a", "baa"], "xb"),
    ("aaab", ["aab"], "a"),
])
def test_stop_strings_spanning_tokens_are_found_and_cut(
        text: str, stop: list[str], expected: str) -> None:
    detok = IncrementalDetokenizer(BYTES, [2], stop)
    deltas = [detok.feed([i]) for i in BYTES.encode(text)[1:]]
    assert detok.stopped
    assert "".join(deltas) == detok.text == expected
    assert detok.feed(BYTES.encode("more")) == "" and detok.finish() == ""


def test_text_that_only_resembles_a_stop_string_is_released() -> None:
    detok = IncrementalDetokenizer(BYTES, [], ["abcd"])
    assert detok.feed(BYTES.encode("xab")[1:]) == "x"
    assert detok.feed(BYTES.encode("c")[1:]) == ""
    assert detok.feed(BYTES.encode("e")[1:]) == "abce"
    assert detok.feed(BYTES.encode("ab")[1:]) == ""
    assert detok.finish() == "ab"
    assert not detok.stopped and detok.text == "xabceab"


@settings(max_examples=150, deadline=None)
@given(text=st.text(alphabet="abc你", max_size=30),
       stop=st.lists(st.text(alphabet="abc你", min_size=1, max_size=4), min_size=1, max_size=3))
def test_stream_with_stops_emits_all_text_before_the_first_stop(
        text: str, stop: list[str]) -> None:
    detok = IncrementalDetokenizer(BYTES, [], stop)
    longest = max(len(s) for s in stop)
    for i, char in enumerate(text):
        detok.feed(BYTES.encode(char)[1:])
        seen = text[:i + 1]
        if not detok.stopped:  # held back: at most a possible stop string's beginning
            assert seen.startswith(detok.text) and len(seen) - len(detok.text) < longest
    detok.finish()
    ends = [end for end in range(len(text) + 1) if any(text[:end].endswith(s) for s in stop)]
    if ends:  # the first stop string to appear, the longest ending there, is cut
        cut = ends[0] - max(len(s) for s in stop if text[:ends[0]].endswith(s))
    assert detok.text == (text[:cut] if ends else text)
    assert detok.stopped == bool(ends)


class _CountingTokenizer(ByteTokenizer):
    """Records the longest id list it was asked to decode."""

    max_decoded = 0

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.max_decoded = max(self.max_decoded, len(ids))
        return super().decode(ids, skip_special_tokens)


def test_each_step_decodes_a_short_window_not_the_whole_output() -> None:
    tokenizer = _CountingTokenizer(vocab_size=300)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("a prompt"), ["never"])
    text = UNICODE_TEXT * 100
    for i in tokenizer.encode(text)[1:]:
        detok.feed([i])
    detok.finish()
    assert detok.text == text
    assert tokenizer.max_decoded <= 10
