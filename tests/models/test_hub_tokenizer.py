"""The Hub's OPT tokenizer files (vocab.json + merges.txt, tokenizer_config.json,
special_tokens_map.json, no tokenizer.json) against `transformers.AutoTokenizer` on the
same directory: token ids, decoding, and streamed text for every prefix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from models.tokenizer import HFTokenizer, IncrementalDetokenizer, load_tokenizer
from tests.hub_checkpoint import VOCAB_SIZE, write_hub_tokenizer

TEXTS = [
    "Hello, my name is", "The quick brown fox", " leading space", "  two leading spaces",
    "double  space inside", "trailing space ", "new\nline", "\n\nstarts with new lines",
    "tabs\tand\ttabs", "Héllo wörld", "naïve café — dash", "世界 你好", "emoji 🙂👍🏽 skin tone",
    "🙂", "mixed 🙂 text 世界 and café", "</s> special in text", "a</s>b<pad>c",
    "<s> is not special for OPT", "<unk> and <pad>", "unseen words: zyxwv qqq", "", " ",
    "Once upon a time there was a small model.", "punctuation!?.,;:()[]{}", "1234 5678.90",
]


@pytest.fixture(scope="module")
def hub_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_hub_tokenizer(tmp_path_factory.mktemp("hub-tok"))
    # NOTE: transformers picks OPT's tokenizer class from config.json, as for a Hub repo.
    (path / "config.json").write_text(json.dumps({"model_type": "opt",
                                                  "vocab_size": VOCAB_SIZE}))
    return path


@pytest.fixture(scope="module")
def reference(hub_dir: Path) -> transformers.PreTrainedTokenizerBase:
    return transformers.AutoTokenizer.from_pretrained(str(hub_dir))


@pytest.fixture(scope="module")
def ours(hub_dir: Path) -> HFTokenizer:
    tokenizer = load_tokenizer(hub_dir, VOCAB_SIZE)
    assert isinstance(tokenizer, HFTokenizer)
    return tokenizer


def test_hub_files_have_no_tokenizer_json(hub_dir: Path) -> None:
    assert not (hub_dir / "tokenizer.json").exists()
    assert (hub_dir / "vocab.json").is_file() and (hub_dir / "merges.txt").is_file()


@pytest.mark.parametrize("text", TEXTS)
def test_prompt_ids_equal_autotokenizers(text: str, ours: HFTokenizer,
                                         reference: transformers.PreTrainedTokenizerBase
                                         ) -> None:
    assert ours.encode(text) == reference(text)["input_ids"]


def test_special_tokens_equal_autotokenizers(ours: HFTokenizer,
                                             reference: transformers.PreTrainedTokenizerBase
                                             ) -> None:
    assert (ours.bos_token_id, ours.eos_token_id) == (reference.bos_token_id,
                                                      reference.eos_token_id) == (2, 2)
    assert ours.encode("</s>") == [2, 2]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_equals_autotokenizers(skip_special_tokens: bool, ours: HFTokenizer,
                                      reference: transformers.PreTrainedTokenizerBase) -> None:
    for text in TEXTS:
        ids = reference(text)["input_ids"]
        for part in (ids, ids[1:], ids[:3], ids[2:5]):
            assert ours.decode(part, skip_special_tokens) == reference.decode(
                part, skip_special_tokens=skip_special_tokens), (text, part)


@pytest.mark.parametrize("text", [t for t in TEXTS if t.strip()])
def test_stream_equals_decode_of_every_prefix(text: str, ours: HFTokenizer,
                                              reference: transformers.PreTrainedTokenizerBase
                                              ) -> None:
    """One token at a time, the streamed text is the reference decode of the tokens so far,
    held back only while that decode ends in a split character (U+FFFD)."""
    prompt = ours.encode("Hello, my name is")
    ids = ours.encode(text)[1:]
    ids = ids[:2] + [2] + ids[2:]  # an EOS in the middle is skipped as decode skips it
    detok = IncrementalDetokenizer(ours, prompt)
    for k in range(1, len(ids) + 1):
        detok.feed(ids[k - 1:k])
        expected = reference.decode(ids[:k], skip_special_tokens=True)
        if expected.endswith("\ufffd"):
            assert expected.startswith(detok.text) and "\ufffd" not in detok.text
        else:
            assert detok.text == expected, (k, ids[:k])
    detok.finish()
    assert detok.text == reference.decode(ids, skip_special_tokens=True)


def test_multibyte_characters_split_across_tokens_are_held(ours: HFTokenizer) -> None:
    ids = ours.encode("🙂👍🏽 世界")[1:]
    pieces = [ours.decode(ids[:k]) for k in range(1, len(ids) + 1)]
    assert any(p.endswith("\ufffd") for p in pieces), "no split character: test is vacuous"
    detok = IncrementalDetokenizer(ours, [])
    deltas = [detok.feed([i]) for i in ids] + [detok.finish()]
    assert "".join(deltas) == "🙂👍🏽 世界" and not any("\ufffd" in d for d in deltas)


def test_tokenizer_from_another_directory(hub_dir: Path, tmp_path: Path) -> None:
    """`--tokenizer PATH`: a checkpoint without tokenizer files takes them from PATH."""
    with pytest.raises(ValueError, match="has no tokenizer files"):
        load_tokenizer(tmp_path, VOCAB_SIZE)
    assert load_tokenizer(hub_dir, VOCAB_SIZE).encode("Hello") == load_tokenizer(
        str(hub_dir), VOCAB_SIZE).encode("Hello")
