"""Helpers for models/ tests: KV caches, block tables, a dense attention oracle, HF checkpoints.

The real block allocator is transport's; here a seeded shuffle of block ids stands in for it.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
import transformers

from models.attention import AttentionMetadata, gather_seq_kv, get_backend
from models.llama import LlamaForCausalLM
from models.opt import OPTForCausalLM

BLOCK_SIZE = 4  # tokens per block: tiny so that sequences cross many block boundaries


def make_kv_cache(num_blocks: int, num_layers: int, num_heads: int, head_dim: int,
                  dtype: torch.dtype = torch.float32, block_size: int = BLOCK_SIZE
                  ) -> torch.Tensor:
    """`[num_blocks, num_layers, 2, block_size, num_heads, head_dim]`, filled with noise so
    that a read of an unwritten or wrong slot shows up as a mismatch."""
    shape = (num_blocks, num_layers, 2, block_size, num_heads, head_dim)
    return torch.randn(shape, generator=torch.Generator().manual_seed(123)).to(dtype)


def make_block_tables(max_lens: list[int], block_size: int = BLOCK_SIZE, seed: int = 0
                      ) -> tuple[list[list[int]], int]:
    """Gives each sequence enough distinct blocks for `max_lens` tokens, in shuffled order
    (block 0 stays the reserved null block). Returns the tables and the blocks needed."""
    counts = [math.ceil(n / block_size) for n in max_lens]
    ids = list(range(1, sum(counts) + 1))
    random.Random(seed).shuffle(ids)
    tables, start = [], 0
    for count in counts:
        tables.append(ids[start:start + count])
        start += count
    return tables, sum(counts) + 1


def dense_reference(q: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Plain float64 causal attention, one sequence at a time: the test oracle. Query head h
    reads KV head h // (query heads / the cache's KV heads)."""
    out = torch.empty(q.shape, dtype=torch.float64)  # [num_tokens, num_heads, head_dim]
    start = 0
    for i, (q_len, s_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
        k, v = gather_seq_kv(kv_cache, layer, meta.block_tables[i], s_len)
        group = q.shape[1] // k.shape[1]  # query heads per KV head (transformers' repeat_kv)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:start + q_len].double(), k.double())
        pos = torch.arange(s_len)  # [s_len]
        visible = pos[None, :] <= pos[s_len - q_len:, None]  # [q_len, s_len]
        scores = (scores * scale).masked_fill(~visible, float("-inf"))  # [heads, q, s]
        out[start:start + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double())
        start += q_len
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max absolute difference relative to the largest magnitude of the reference `b`."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


class PagedRunner:
    """Drives a model over its own paged cache: packed prefill, chunks, batched decode."""

    def __init__(self, model: OPTForCausalLM | LlamaForCausalLM, max_lens: list[int],
                 backend: str = "paged", block_size: int = BLOCK_SIZE) -> None:
        cfg = model.config
        dtype = next(model.parameters()).dtype
        self.model, self.block_size = model, block_size
        self.backend = get_backend(backend)
        self.tables, num_blocks = make_block_tables(max_lens, block_size)
        self.kv_cache = make_kv_cache(num_blocks, cfg.num_layers, cfg.num_kv_heads,
                                      cfg.head_dim, dtype, block_size)
        self.lens = [0] * len(max_lens)

    def step(self, new_tokens: dict[int, list[int]]) -> list[torch.Tensor]:
        """Feeds each listed sequence its new tokens in one packed forward; returns, per
        listed sequence, the `[num_new, vocab]` logits of those tokens."""
        seq_ids = list(new_tokens)
        query_lens = [len(new_tokens[i]) for i in seq_ids]
        seq_lens = [self.lens[i] + n for i, n in zip(seq_ids, query_lens)]
        meta = AttentionMetadata.build(query_lens, seq_lens, [self.tables[i] for i in seq_ids],
                                       self.block_size, "cpu")
        ids = torch.tensor([t for i in seq_ids for t in new_tokens[i]])  # [num_tokens]
        positions = torch.tensor([p for i, s in zip(seq_ids, seq_lens)
                                  for p in range(self.lens[i], s)])  # [num_tokens]
        with torch.inference_mode():
            logits = self.model.compute_logits(
                self.model(ids, positions, self.kv_cache, meta, self.backend))
        for i, s in zip(seq_ids, seq_lens):
            self.lens[i] = s
        return list(logits.split(query_lens))

    def greedy(self, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
        """Greedy ids: one packed prefill, then batched decode steps of every sequence."""
        logits = self.step(dict(enumerate(prompts)))
        out = [[int(x[-1].argmax())] for x in logits]
        for _ in range(num_tokens - 1):
            logits = self.step({i: [ids[-1]] for i, ids in enumerate(out)})
            for ids, x in zip(out, logits):
                ids.append(int(x[-1].argmax()))
        return out


HF_CONFIGS = {
    "pre_ln": dict(hidden_size=32, word_embed_proj_dim=32, do_layer_norm_before=True),
    "post_ln": dict(hidden_size=32, word_embed_proj_dim=16, do_layer_norm_before=False),
}


def make_hf_model(kind: str, seed: int = 0) -> transformers.OPTForCausalLM:
    """A tiny HF OPT (2 layers, 4 heads, vocab 96) with weights large enough to matter."""
    torch.manual_seed(seed)
    cfg = transformers.OPTConfig(
        vocab_size=96, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
        max_position_embeddings=160, dropout=0.0, init_std=0.1, **HF_CONFIGS[kind])
    return transformers.OPTForCausalLM(cfg).eval()


@pytest.fixture(scope="session", params=sorted(HF_CONFIGS))
def hf_checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                  ) -> tuple[transformers.OPTForCausalLM, Path]:
    """A saved HF checkpoint (safetensors) of each config kind and the HF model itself."""
    hf = make_hf_model(request.param)
    path = tmp_path_factory.mktemp(f"hf-{request.param}")
    hf.save_pretrained(path)
    return hf, path


def random_prompts(lens: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]
