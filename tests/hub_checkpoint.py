"""Checkpoint directories laid out as the Hub's facebook/opt-* repositories: config.json,
generation_config.json, OPT weights as `pytorch_model.bin` (`decoder.*` keys, no `model.`
prefix, no lm_head) or as safetensors, and a byte-level BPE as vocab.json + merges.txt with
OPT's tokenizer_config.json and special_tokens_map.json, and no tokenizer.json."""

from __future__ import annotations

import json
from pathlib import Path

import torch

PARAGRAPHS = [
    "The quick brown fox jumps over the lazy dog. Hello, my name is Alice, and I write "
    "code for a living. Serving large language models is costly: every decode step reads "
    "the whole KV cache of every request in the batch.",
    "Héllo wörld! Ünïcödé text, 世界 你好, emoji 🙂👍🏽 and a naïve café — all of it in "
    "one paragraph, so that the merges cover multi-byte characters too.",
    "  Leading spaces, double  spaces,\nnew lines\n\nand tabs\tare here too. The weather "
    "today is sunny; tomorrow it will rain. Once upon a time there was a small model.",
]
SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]  # OPT's ids 0..3
VOCAB_SIZE = 512  # the model's vocabulary (the trained BPE has fewer tokens, as OPT's has)


def _added(content: str) -> dict[str, object]:
    """An AddedToken as OPT's Hub files spell it."""
    return {"content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": True, "__type": "AddedToken"}


def write_hub_tokenizer(path: Path) -> Path:
    """A byte-level BPE trained with `tokenizers` on PARAGRAPHS, saved as OPT ships it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(PARAGRAPHS, trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.model.save(str(path))  # vocab.json + merges.txt
    specials = {"bos_token": _added("</s>"), "eos_token": _added("</s>"),
                "unk_token": _added("</s>"), "pad_token": _added("<pad>")}
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"errors": "replace", **specials, "add_prefix_space": False, "add_bos_token": True}))
    (path / "special_tokens_map.json").write_text(json.dumps(specials))
    return path


def write_hub_checkpoint(path: Path, weights: str = "bin", seed: int = 0) -> Path:
    """A random OPTForCausalLM saved Hub-style: `weights` is "bin" (pytorch_model.bin with
    `decoder.*` keys, no lm_head) or "safetensors" (transformers' save_pretrained)."""
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(seed)
    config = OPTConfig(vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=2,
                       ffn_dim=128, num_attention_heads=4, max_position_embeddings=256,
                       word_embed_proj_dim=64, init_std=0.1, dropout=0.0)
    model = OPTForCausalLM(config).eval()
    model.save_pretrained(path)
    if weights == "bin":
        (path / "model.safetensors").unlink()
        state = {k.removeprefix("model."): v.clone() for k, v in model.state_dict().items()
                 if k != "lm_head.weight"}
        torch.save(state, path / "pytorch_model.bin")
    elif weights != "safetensors":
        raise ValueError(f"weights ({weights!r}) must be 'bin' or 'safetensors'")
    return write_hub_tokenizer(path)
