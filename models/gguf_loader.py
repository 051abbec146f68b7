"""GGUF files (llama.cpp's format) through the `gguf` library: the model config from the
metadata, the tensors dequantized by the library's own routines, the tokenizer built from
the vocabulary and merges with `tokenizers` (as transformers' GGUF converter builds it),
and the chat template.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import tokenizers
import tokenizers.decoders
import tokenizers.models
import tokenizers.pre_tokenizers
import torch
from torch import Tensor

from models.tokenizer import HFTokenizer

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM"}  # general.architecture -> HF architecture
PLAIN_TYPES = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
               gguf.GGMLQuantizationType.F64}  # stored as numpy floats
QUANT_TYPES = tuple(gguf.GGMLQuantizationType[name] for name in (
    "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"))
SUPPORTED_TYPES = tuple(sorted(t.name for t in (*PLAIN_TYPES, *QUANT_TYPES)))
# GGUF tensor names (after "blk.N.") -> HF names (after "model.layers.N.")
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
             "output": "lm_head"}
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values
# transformers' split regexes for `tokenizer.ggml.pre` values whose merges were learned on
# another split than GPT-2's
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
                        "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
                        "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf") and Path(path).is_file()


@cache
def _reader(path: str) -> gguf.GGUFReader:
    if not Path(path).is_file():
        raise ValueError(f"GGUF file {path} does not exist")
    return gguf.GGUFReader(path)


def metadata(path: str | Path, key: str) -> Any:
    """The value of metadata `key`, or None when the file lacks it."""
    return _metadata(str(path), key)


@cache
def _metadata(path: str, key: str) -> Any:
    field = _reader(path).fields.get(key)
    return None if field is None else field.contents()


def hf_config(path: str | Path) -> dict[str, Any]:
    """The file's model as a HF `config.json` dict (`LlamaConfig.from_hf_config` reads it).

    Raises:
        ValueError: an architecture other than `ARCHITECTURES`, or missing metadata.
    """
    arch = metadata(path, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF {path}: architecture {arch!r} is unsupported; supported: "
                         f"{', '.join(ARCHITECTURES)}")

    def get(key: str, default: Any = None) -> Any:
        value = metadata(path, f"{arch}.{key}")
        if value is None and default is None:
            raise ValueError(f"GGUF {path} lacks metadata {arch}.{key}")
        return default if value is None else value

    names = {t.name for t in _reader(str(path)).tensors}
    heads = int(get("attention.head_count"))
    tokens = metadata(path, "tokenizer.ggml.tokens")
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]], "model_type": arch,
        "vocab_size": int(get("vocab_size", len(tokens) if tokens else 0)),
        "hidden_size": int(get("embedding_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "intermediate_size": int(get("feed_forward_length")),
        "head_dim": int(get("attention.key_length", 0)) or None,
        "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": metadata(path, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata(path, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata(path, "tokenizer.ggml.padding_token_id"),
    }
    scaling = metadata(path, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        config["rope_scaling"] = {"rope_type": scaling,
                                  "factor": float(get("rope.scaling.factor"))}
    return config


def read_tensors(path: str | Path, num_heads: int, num_kv_heads: int) -> dict[str, Tensor]:
    """Every tensor under its HF name, dequantized to float32 by the `gguf` library.

    llama.cpp stores Llama's q / k rows permuted for its rotary layout; they are put back
    in HF's order, as transformers' GGUF loader does.

    Raises:
        ValueError: a tensor of a type outside `SUPPORTED_TYPES` (named), or an unknown name.
    """
    reader = _reader(str(path))
    arch = metadata(path, "general.architecture")
    tensors: dict[str, Tensor] = {}
    for t in reader.tensors:
        if t.tensor_type in PLAIN_TYPES:
            values = np.asarray(t.data, dtype=np.float32)
        elif t.tensor_type in QUANT_TYPES:
            values = gguf.quants.dequantize(t.data, t.tensor_type)
        else:
            raise ValueError(f"GGUF {path}: tensor {t.name} has type {t.tensor_type.name}, "
                             f"which is unsupported; supported: {', '.join(SUPPORTED_TYPES)}")
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists the fastest dim first
        values = values.reshape(shape)
        name = hf_name(t.name)
        if arch in ("llama", "mistral") and name.endswith(("q_proj.weight", "k_proj.weight")):
            values = _unpermute(values, num_heads if "q_proj" in name else num_kv_heads)
        tensors[name] = torch.from_numpy(np.array(values, dtype=np.float32))  # a writable copy
    return tensors


def hf_name(name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    stem, _, kind = name.rpartition(".")
    parts = stem.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{kind}"
    if stem in TOP_NAMES:
        return f"{TOP_NAMES[stem]}.{kind}"
    raise ValueError(f"GGUF tensor {name!r} is unknown to the Llama family")


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def chat_template(path: str | Path) -> str | None:
    value = metadata(path, "tokenizer.chat_template")
    return value if isinstance(value, str) else None


def special_tokens(path: str | Path) -> dict[str, str]:
    """bos / eos / unk / pad token strings named by the metadata (those it has)."""
    tokens = metadata(path, "tokenizer.ggml.tokens") or []
    found: dict[str, str] = {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        index = metadata(path, f"tokenizer.ggml.{key}")
        if index is not None and 0 <= index < len(tokens):
            found[name] = tokens[index]
    return found


def load_gguf_tokenizer(path: str | Path, vocab_size: int = 0, eos_token_id: int = 2
                        ) -> HFTokenizer:
    """The file's byte-level BPE tokenizer (`tokenizer.ggml.model` "gpt2").

    Raises:
        ValueError: another tokenizer model (e.g. a sentencepiece "llama" vocabulary).
    """
    kind = metadata(path, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF {path}: tokenizer model {kind!r} is unsupported (only the "
                         f"byte-level BPE 'gpt2'); give a tokenizer directory with --tokenizer")
    tokens: list[str] = metadata(path, "tokenizer.ggml.tokens")
    types: list[int] = metadata(path, "tokenizer.ggml.token_type") or [0] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in metadata(path, "tokenizer.ggml.merges") or []]
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()): i
             for i, t in enumerate(tokens)}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(
        vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix="",
        fuse_unk=False))
    split = PRE_TOKENIZER_SPLITS.get(metadata(path, "tokenizer.ggml.pre"))
    byte_level = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                     use_regex=split is None)
    tok.pre_tokenizer = byte_level if split is None else tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.Split(tokenizers.Regex(split), behavior="isolated"),
        byte_level])
    tok.decoder = tokenizers.decoders.ByteLevel()
    # NOTE: as transformers: control tokens spelled outside the byte alphabet are llama.cpp
    # mislabels and stay out; user-defined tokens are matched whole but are not special.
    added = {str(i): {"content": t, "special": ttype == CONTROL, "normalized": False}
             for i, (t, ttype) in enumerate(zip(tokens, types))
             if ttype == USER_DEFINED or (ttype == CONTROL and set(t) <= alphabet)}
    config: dict[str, Any] = {**special_tokens(path), "added_tokens_decoder": added,
                              "added_tokens_json": {},
                              "add_bos_token": bool(metadata(path, "tokenizer.ggml.add_bos_token")),
                              "add_eos_token": bool(metadata(path, "tokenizer.ggml.add_eos_token"))}
    return HFTokenizer.from_parts(tok, config, vocab_size, eos_token_id)


@cache
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the byte-level BPE alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in printable]
    chars = [*printable, *(256 + n for n in range(len(extra)))]
    return {b: chr(c) for b, c in zip([*printable, *extra], chars)}
