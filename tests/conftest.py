"""Shared factories: a real HF-format OPT checkpoint written by transformers, and configs."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

# NOTE: one intra-op thread: the engine's event loop, device worker and copy threads share
# the CPU with torch's pool, and on 2 busy cores an oversubscribed pool made a tiny forward
# take ~300 ms instead of ~2 ms. Benchmarks (bench/) keep torch's default.
torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def _step_cost_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Engines under test cache their step-cost calibrations in the session's temporary
    folder, not the user's (aserve/engine/step_probe.py `cache_dir`)."""
    import os

    from aserve.engine.step_probe import CACHE_ENV

    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("step-cost"))

TINY_HF = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, ffn_dim=128,
               num_attention_heads=4, max_position_embeddings=512, word_embed_proj_dim=64,
               do_layer_norm_before=True)


def write_hf_checkpoint(path: Path, dtype: str = "float32", seed: int = 0,
                        **overrides: object) -> Path:
    """Saves a random `transformers` OPT to `path` (config.json + model.safetensors), with
    the tokenizer files a Hub checkpoint ships (tests/hub_checkpoint.py)."""
    from transformers import OPTConfig, OPTForCausalLM

    from tests.hub_checkpoint import write_hub_tokenizer

    torch.manual_seed(seed)
    config = OPTConfig(**{**TINY_HF, **overrides})
    model = OPTForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(path)
    return write_hub_tokenizer(path)


def write_bpe_tokenizer(directory: Path, corpus: list[str]) -> Path:
    """A tiny byte-level BPE trained on `corpus`, saved as `directory`/tokenizer.json with
    OPT's special tokens as ids 0..3."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(corpus, trainer)
    raw.save(str(directory / "tokenizer.json"))
    return directory


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("opt-tiny-hf"))


def make_config(model: str = "opt-tiny", **kwargs: object):  # type: ignore[no-untyped-def]
    """An EngineConfig for tests: small caches, flat keyword overrides."""
    from aserve.engine.config import EngineConfig

    defaults: dict[str, object] = dict(model=model, dtype="float32", block_size=16,
                                       num_decode_blocks=256, num_prefill_blocks=256,
                                       num_staging_blocks=256, host_pool_gb=0.05,
                                       max_prefill_tokens=1024, min_requests=4,
                                       trace_limit=None)  # tests read the whole log
    defaults.update(kwargs)
    return EngineConfig.create(**defaults)


def make_prompts(n: int, min_len: int, max_len: int, vocab_size: int,
                 seed: int = 0) -> list[list[int]]:
    """`n` random token-id prompts with lengths in [min_len, max_len], avoiding ids 0..3."""
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab_size) for _ in range(rng.randint(min_len, max_len))]
            for _ in range(n)]
