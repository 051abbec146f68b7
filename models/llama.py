"""The Llama family (Llama, Mistral, Qwen2 shapes) over the paged KV cache: RMSNorm, rotary
embeddings, grouped-query attention and a SiLU-gated MLP.

Takes token ids, positions, the KV cache and attention metadata; never sees a request. The
cache holds `num_kv_heads` heads per layer; the attention backends map each query head to
its KV head. Parameter names mirror HF's `LlamaForCausalLM` except the fused `qkv_proj`
(q, k, v rows) and `gate_up_proj` (gate, up rows).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models import cpu_rotary
from models.attention import AttentionBackend, AttentionMetadata
from models.cpu_norm import RMSNorm
from models.opt import Float32Linear, HalfLinear, linear_add, pack_linears, silu_mul
from models.registry import LLAMA_ARCHITECTURES as ARCHITECTURES
from models.registry import architecture

ROPE_TYPES = ("default", "linear", "llama3")
NO_EOS = -1  # eos_token_id of a config that names none: no token ends a sequence


@dataclass(frozen=True)
class LlamaConfig:
    """Architecture of a Llama-family model (the names of HF's config.json, shortened)."""

    architecture: str = "LlamaForCausalLM"  # one of ARCHITECTURES
    vocab_size: int = 32000
    hidden_size: int = 4096
    num_layers: int = 32
    num_heads: int = 32  # query heads
    num_kv_heads: int = 32  # K/V heads (GQA: fewer than num_heads; MQA: 1)
    ffn_dim: int = 11008  # intermediate size of the gated MLP
    head_dim: int = 0  # channels per head; 0: hidden_size // num_heads
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # HF's rope_scaling
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # biases on q/k/v (Qwen2; Llama's attention_bias)
    o_bias: bool = False  # bias on o_proj (Llama's attention_bias)
    mlp_bias: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int = 2
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not one of "
                             f"{', '.join(ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "ffn_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} ({getattr(self, name)}) must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if not self.head_dim:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of "
                                 f"num_heads ({self.num_heads}) when head_dim is not given")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even (rotary pairs)")
        rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_scaling type {rope_type!r} is unsupported; supported: "
                             f"{', '.join(ROPE_TYPES)}")

    @property
    def word_embed_proj_dim(self) -> int:
        """Width of the hidden states `forward` returns (as OPT's field of that name)."""
        return self.hidden_size

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> LlamaConfig:
        """Maps a HF `config.json` dict; raises ValueError for anything this model lacks."""
        arch = architecture(d)
        if arch not in ARCHITECTURES:
            raise ValueError(f"config.json names {arch}, not one of {', '.join(ARCHITECTURES)}")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json hidden_act={d['hidden_act']!r} is unsupported "
                             f"(only 'silu')")
        heads = int(d["num_attention_heads"])
        max_len = int(d.get("max_position_embeddings", 4096))
        window = d.get("sliding_window")
        if window and d.get("use_sliding_window", arch == "MistralForCausalLM"):
            # NOTE: no sliding-window attention here: contexts stay within the window, where
            # full attention is the same computation.
            max_len = min(max_len, int(window))
        eos = d.get("eos_token_id", 2)
        # NOTE: transformers 5 writes `rope_parameters` (theta and scaling in one dict)
        rope = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})
        bias = bool(d.get("attention_bias", False))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        return cls(
            architecture=arch, vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]), num_layers=int(d["num_hidden_layers"]),
            num_heads=heads, num_kv_heads=int(d.get("num_key_value_heads") or heads),
            ffn_dim=int(d["intermediate_size"]), head_dim=int(d.get("head_dim") or 0),
            max_position_embeddings=max_len, rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(d.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            rope_scaling={k: v for k, v in rope.items() if k != "rope_theta"},
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=True if is_qwen2 else bias, o_bias=False if is_qwen2 else bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=NO_EOS if eos is None else int(eos[0] if isinstance(eos, list) else eos),
            pad_token_id=d.get("pad_token_id"),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def inverse_frequencies(cfg: LlamaConfig) -> Tensor:
    """`[head_dim / 2]` float32 rotary frequencies, scaled as `rope_scaling` says (as
    transformers' rope initialisers compute them)."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "linear":
        return inv / float(scaling["factor"])
    if rope_type != "llama3":
        return inv
    factor, low, high = (float(scaling[k]) for k in ("factor", "low_freq_factor",
                                                     "high_freq_factor"))
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotate(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """Rotary embedding of `[n, heads, head_dim]` with `[n, head_dim]` cos and sin, the
    sin's first half negated (`rotary_tables`): x * cos + rotate_half(x) * sin, where
    rotate_half(x) = (-x2, x1) is x with its halves swapped (`roll`) times that sign."""
    out = cpu_rotary.rotate(x, cos, signed_sin)
    if out is not None:
        return out
    half = x.shape[-1] // 2
    return torch.addcmul(x * cos[:, None, :], x.roll(half, -1), signed_sin[:, None, :])


def rotary_tables(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype
                  ) -> tuple[Tensor, Tensor]:
    """`[n, head_dim]` cos and sin (first half negated) of `positions` in `dtype`; float32
    angles, as transformers computes them."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]  # [n, dim / 2]
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


class LlamaAttention(nn.Module):
    """Grouped-query self-attention with one fused QKV projection."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.split = (q_rows, kv_rows, kv_rows)
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_rows + 2 * kv_rows, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_rows, cfg.hidden_size, bias=cfg.o_bias)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor, layer: int,
                meta: AttentionMetadata, backend: AttentionBackend, residual: Tensor) -> Tensor:
        """Attention of `x` (`[num_tokens, hidden]`, normalised) plus `residual`."""
        n, heads = x.shape[0], self.num_heads
        qkv = self.qkv_proj(x)  # [n, q_rows + 2 * kv_rows]
        qk_rows = self.split[0] + self.split[1]
        # NOTE: q and k lie side by side in qkv: one rotation for all their heads
        qk = rotate(qkv[:, :qk_rows].view(n, heads + self.num_kv_heads, self.head_dim),
                    cos, sin)  # [n, heads + kv_heads, head_dim]
        q, k = qk[:, :heads], qk[:, heads:]
        v = qkv[:, qk_rows:].view(n, self.num_kv_heads, self.head_dim)
        out = backend.attend(q, k, v, kv_cache, layer, meta, self.scale)  # [n, heads, dim]
        return linear_add(self.o_proj, out.reshape(n, -1), residual)  # [n, hidden]


class LlamaDecoderLayer(nn.Module):
    """RMSNorm, attention, RMSNorm, SiLU-gated MLP, each block with a residual."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.ffn_dim, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor, layer: int,
                meta: AttentionMetadata, backend: AttentionBackend) -> Tensor:
        h = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, layer, meta, backend,
                           residual=x)  # [n, hidden]
        act = silu_mul(self.gate_up_proj, self.post_attention_layernorm(h))  # [n, ffn]
        return linear_add(self.down_proj, act, h)  # [n, hidden]


class LlamaModel(nn.Module):
    """Embeddings, the decoder layers and the final norm."""

    inv_freq: Tensor  # [head_dim / 2] float32 rotary frequencies (a buffer, not saved)

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.register_buffer("inv_freq", inverse_frequencies(cfg), persistent=False)
        self.activation_dtype: torch.dtype | None = None  # float32 after use_float32_matmuls


class LlamaForCausalLM(nn.Module):
    """The decoder plus its LM head (the embedding table when tied)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head: nn.Module | None = (
            None if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False))

    def use_float32_matmuls(self) -> None:
        """Linear layers compute in float32 from weights prepacked once (`Float32Linear`),
        and the residual stream is float32; the embedding table and the KV cache keep the
        model's dtype. The norms become float32 (exact copies)."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.float()
        pack_linears(self, self.model.embed_tokens.weight, Float32Linear)
        self.model.activation_dtype = torch.float32

    def use_packed_half_matmuls(self) -> None:
        """Every linear layer and the LM head from weights oneDNN prepacks (`HalfLinear`),
        in the model's own dtype."""
        pack_linears(self, self.model.embed_tokens.weight, HalfLinear)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_cache: Tensor,
                meta: AttentionMetadata, backend: AttentionBackend) -> Tensor:
        """`input_ids`, `positions`: `[num_tokens]` long. Returns `[num_tokens, hidden]`."""
        m = self.model
        x = m.embed_tokens(input_ids)  # [n, hidden]
        if m.activation_dtype is not None:
            x = x.to(m.activation_dtype)
        cos, sin = rotary_tables(positions, m.inv_freq, x.dtype)  # [n, head_dim] each
        for i, layer in enumerate(m.layers):
            x = layer(x, cos, sin, kv_cache, i, meta, backend)
        return m.norm(x)  # type: ignore[no-any-return]

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """`[n, hidden]` hidden states -> `[n, vocab_size]` logits (float32 after
        `use_float32_matmuls`)."""
        if isinstance(self.lm_head, Float32Linear):
            return self.lm_head(hidden.float())  # type: ignore[no-any-return]
        if self.lm_head is not None:
            return self.lm_head(hidden)  # type: ignore[no-any-return]
        return F.linear(hidden, self.model.embed_tokens.weight)


def _geometry(hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int,
              max_len: int, **extra: Any) -> dict[str, Any]:
    return dict(hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                ffn_dim=ffn, vocab_size=vocab, max_position_embeddings=max_len, **extra)


# Random-weight geometries (the simulator's and the benchmarks' shapes; tests use the tiny one).
PRESETS: dict[str, dict[str, Any]] = {
    "llama-tiny": _geometry(64, 2, 4, 2, 128, 512, 4096),
    "llama-7b": _geometry(4096, 32, 32, 32, 11008, 32000, 4096),
    "llama-13b": _geometry(5120, 40, 40, 40, 13824, 32000, 4096),
    "llama3-8b": _geometry(4096, 32, 32, 8, 14336, 128256, 8192, rope_theta=500000.0,
                           bos_token_id=128000, eos_token_id=128001),
}
