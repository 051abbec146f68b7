"""Minimal OPT decoder (pre-LN and OPT-350m's post-LN) over a paged KV cache, in one file.

Takes token ids, positions, the KV cache and attention metadata; never sees a request.
Parameter names mirror HF's `OPTForCausalLM` except the fused `qkv_proj` (see loader).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models import cpu_bf16_gemm, cpu_gemm, cpu_isa, cpu_norm, measure, row_blocks
from models.attention import AttentionBackend, AttentionMetadata

POSITION_OFFSET = 2  # OPT's learned position table starts its positions at row 2


@dataclass(frozen=True, slots=True)
class OPTConfig:
    """Architecture of an OPT model (the names of HF's config.json, shortened)."""

    vocab_size: int = 50272  # tokens in the embedding table
    hidden_size: int = 768  # width of the residual stream
    num_layers: int = 12  # decoder layers
    num_heads: int = 12  # attention heads per layer
    ffn_dim: int = 3072  # width of the MLP
    max_position_embeddings: int = 2048  # longest sequence (tokens) the position table holds
    word_embed_proj_dim: int = 768  # embedding width; != hidden_size adds project_in/out
    do_layer_norm_before: bool = True  # pre-LN (True) or post-LN like OPT-350m (False)
    layer_norm_eps: float = 1e-5
    pad_token_id: int = 1
    bos_token_id: int = 2
    eos_token_id: int = 2
    enable_bias: bool = True  # biases on every linear layer
    remove_final_layer_norm: bool = False  # HF's `_remove_final_layer_norm` (old checkpoints)
    layer_norm_elementwise_affine: bool = True  # LayerNorms carry weight and bias

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "ffn_dim",
                     "max_position_embeddings", "word_embed_proj_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} ({getattr(self, name)}) must be >= 1")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_heads "
                f"({self.num_heads})")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_kv_heads(self) -> int:
        """K/V heads per layer (the KV cache's): OPT has one per query head."""
        return self.num_heads

    @property
    def has_final_layer_norm(self) -> bool:
        return self.do_layer_norm_before and not self.remove_final_layer_norm

    @classmethod
    def from_name(cls, name: str, max_position_embeddings: int | None = None) -> OPTConfig:
        """A preset geometry (`PRESETS`); a preset may extend its position table."""
        if name not in PRESETS:
            raise ValueError(f"model preset {name!r} is unknown; presets: {', '.join(PRESETS)}")
        kwargs = dict(PRESETS[name])
        if max_position_embeddings is not None:
            kwargs["max_position_embeddings"] = max_position_embeddings
        return cls(**kwargs)

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> OPTConfig:
        """Maps a HF `config.json` dict; raises ValueError for anything this model lacks."""
        if d.get("model_type") != "opt":
            raise ValueError(f"config.json model_type {d.get('model_type')!r} is not 'opt'")
        unsupported = {"activation_function": "relu", "tie_word_embeddings": True}
        for key, supported in unsupported.items():
            if d.get(key, supported) != supported:
                raise ValueError(f"config.json {key}={d[key]!r} is unsupported "
                                 f"(only {supported!r})")
        hidden = int(d["hidden_size"])
        return cls(
            vocab_size=int(d["vocab_size"]), hidden_size=hidden,
            num_layers=int(d["num_hidden_layers"]), num_heads=int(d["num_attention_heads"]),
            ffn_dim=int(d["ffn_dim"]), max_position_embeddings=int(d["max_position_embeddings"]),
            word_embed_proj_dim=int(d.get("word_embed_proj_dim") or hidden),
            do_layer_norm_before=bool(d.get("do_layer_norm_before", True)),
            pad_token_id=int(d.get("pad_token_id", 1)), bos_token_id=int(d.get("bos_token_id", 2)),
            eos_token_id=int(d.get("eos_token_id", 2)),
            enable_bias=bool(d.get("enable_bias", True)),
            remove_final_layer_norm=bool(d.get("_remove_final_layer_norm", False)),
            layer_norm_elementwise_affine=bool(d.get("layer_norm_elementwise_affine", True)),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _geometry(hidden: int, layers: int, heads: int, proj: int | None = None,
              pre_ln: bool = True) -> dict[str, Any]:
    return dict(hidden_size=hidden, num_layers=layers, num_heads=heads, ffn_dim=4 * hidden,
                word_embed_proj_dim=proj or hidden, do_layer_norm_before=pre_ln)


PRESETS: dict[str, dict[str, Any]] = {
    "opt-tiny": dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, ffn_dim=256,
                     word_embed_proj_dim=64, max_position_embeddings=4096),
    "opt-125m": _geometry(768, 12, 12),
    "opt-350m": _geometry(1024, 24, 16, proj=512, pre_ln=False),
    "opt-1.3b": _geometry(2048, 24, 32),
    "opt-2.7b": _geometry(2560, 32, 32),
    "opt-6.7b": _geometry(4096, 32, 32),
    "opt-13b": _geometry(5120, 40, 40),
    "opt-30b": _geometry(7168, 48, 56),
}


def _layer_norm(cfg: OPTConfig, width: int) -> nn.LayerNorm:
    # NOTE: a decode batch's norms run in the calling thread (waking the pool costs more)
    return cpu_norm.LayerNorm(width, eps=cfg.layer_norm_eps,
                              elementwise_affine=cfg.layer_norm_elementwise_affine)


PACK_BATCH = 64  # rows oneDNN packs a weight for (decode batches); any row count works
# the other layout a half weight that also serves prompts may be packed in (`half_layout`),
# the row counts the two are timed at (a decode batch's, a prompt's) and the trials
PROMPT_PACK_BATCH = 1
LAYOUT_ROWS = (PACK_BATCH, 1024)
LAYOUT_TRIALS = 3
PACK_MIN_WEIGHTS = 1 << 18  # smaller weights (opt-tiny) run faster unpacked (per-call cost)
KERNELS = ("gemm", "onednn", "torch")  # Float32Linear's GEMMs, in order of preference
WIDE_ROWS = 16  # products of fewer rows keep the C GEMM (oneDNN's wake-ups cost more there)
CHOICE_ROWS = (WIDE_ROWS, PACK_BATCH)  # row counts the float32 GEMM choice is timed at
CHOICE_TRIALS = 5  # timed products of each kernel at each row count (the fastest counts)
CHOICE_MARGIN = 0.95  # oneDNN replaces the C GEMM only at most this share of its time

# (weight shape..., dtype) -> the GEMM this process measured faster ("gemm" or "onednn")
_float32_kernels: dict[tuple[object, ...], str] = {}


def _faster_float32_kernel(weight: Tensor, bias: Tensor | None, panels: Tensor,
                           dnn: Tensor) -> str:
    """"gemm" or "onednn", whichever computes `x @ weight.T + bias` faster here over
    `CHOICE_ROWS` (geometric mean of the time ratios, oneDNN only by `CHOICE_MARGIN`), for
    products of at least `WIDE_ROWS` rows.
    Which one wins depends on the CPU, the weight's shape and the thread count
    (docs/results-cpu.md)."""
    g = torch.Generator().manual_seed(0)
    ratio = 1.0
    for rows in CHOICE_ROWS:
        x = torch.randn(rows, weight.shape[1], generator=g)  # float32 activations

        def gemm() -> Tensor | None:
            return cpu_gemm.linear(x, panels, weight.shape[0], bias)

        def onednn() -> Tensor:
            return torch.ops.mkldnn._linear_pointwise(x, dnn, bias, "none", [], "")

        if gemm() is None:  # the C GEMM cannot run this product (`forward` takes F.linear)
            return "gemm"
        onednn()  # warm-up
        best, _ = measure.best_seconds({"gemm": gemm, "onednn": onednn}, CHOICE_TRIALS)
        ratio *= best["onednn"] / best["gemm"]
    return "onednn" if ratio ** (1 / len(CHOICE_ROWS)) <= CHOICE_MARGIN else "gemm"


class Float32Linear(nn.Module):
    """An `nn.Linear` computed in float32 from a weight prepacked once: inputs upcast
    exactly, float32 accumulation, output in the input's dtype. For a bf16/fp16 model that
    is what a native half GEMM computes, at float32 GEMM speed on CPUs that have none; for
    a float32 model it is the same product without repacking the weight per call.
    `weight` stays the original tensor (its values and dtype, e.g. for a state dict).

    `kernel` is the first of `KERNELS` that runs here: `models.cpu_gemm` (C, 16-column
    panels; faster than oneDNN at decode shapes on an AVX2 CPU), oneDNN's prepacked linear,
    or `F.linear`; weights under `PACK_MIN_WEIGHTS` elements take `F.linear`. Products of
    `WIDE_ROWS` rows or more take oneDNN instead of the C GEMM where that measured faster
    at the weight's first forward (`_faster_float32_kernel`): such a weight is packed
    twice, and a bf16/fp16 one the second time in float32 (twice its bytes)."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)  # [out, in]
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(),
                                                           requires_grad=False)
        big = weight.numel() >= PACK_MIN_WEIGHTS
        self.kernel = ("gemm" if big and cpu_gemm.is_available() else
                       "onednn" if big and torch.backends.mkldnn.is_available() else "torch")
        # NOTE: packed on the first forward, in the runner's thread: packing opt-125m takes
        # seconds on a slow CPU, which start-up (and /health) should not wait for.
        self.packed: Tensor | None = None  # the weight in `kernel`'s layout (`_pack`)
        self.wide: Tensor | None = None  # oneDNN's layout for WIDE_ROWS+ rows, if faster

    @property
    def is_packed(self) -> bool:
        return self.kernel != "torch"

    def _pack(self) -> Tensor:
        """The weight in `kernel`'s layout: `cpu_gemm` panels (bf16 weights stay bf16,
        widened exactly in the kernel: half the bytes per step and no float32 copy),
        oneDNN's float32 layout, or the float32 weight."""
        if self.kernel == "gemm":
            self.packed = cpu_gemm.pack(self.weight)
            if torch.backends.mkldnn.is_available():
                self.wide = self._wide_layout(self.packed)
            return self.packed
        w = self.weight.detach().float()  # [out, in]
        self.packed = (torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH)
                       if self.kernel == "onednn" else w)
        return self.packed

    def _wide_layout(self, panels: Tensor) -> Tensor | None:
        """The weight in oneDNN's float32 layout where oneDNN computes the wide products
        faster than the C GEMM from ``panels``, else None: measured for the weight's shape
        and dtype the first time (`_faster_float32_kernel`), every layer of that shape then
        taking the same. A bf16/fp16 weight is timed as it would run: the C GEMM's half
        panels against oneDNN's float32 copy."""
        key = (*self.weight.shape, self.weight.dtype)
        if _float32_kernels.get(key) == "gemm":
            return None
        dnn = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach().float(), PACK_BATCH)
        if key not in _float32_kernels:
            _float32_kernels[key] = _faster_float32_kernel(self.weight, self.bias, panels, dnn)
        return dnn if _float32_kernels[key] == "onednn" else None

    @classmethod
    def of(cls, linear: nn.Linear) -> Float32Linear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: Tensor, relu: bool = False, residual: Tensor | None = None,
                norm: nn.LayerNorm | None = None) -> Tensor:
        """`norm(x) @ weight.T + bias` (`norm` optional), then ReLU (`relu`) or `+ residual`,
        in x's dtype. Packed, both run on the float32 output inside the GEMM (no separate
        pass over it); with the C GEMM a float32 `norm` runs in its input pass too."""
        x32 = x.float()  # [num_tokens, in]
        packed = self._pack() if self.packed is None else self.packed
        kernel = self.kernel
        if self.wide is not None and x.shape[0] >= WIDE_ROWS:
            kernel, packed = "onednn", self.wide
        fuse_residual = residual is not None and residual.dtype == torch.float32
        if norm is not None and not (kernel == "gemm" and all(
                p.dtype == torch.float32 for p in norm.parameters())):
            x32, norm = norm(x32), None  # torch's LayerNorm, then the GEMM alone
        out: Tensor | None = None
        if kernel == "gemm":
            out = cpu_gemm.linear(x32, packed, self.weight.shape[0], self.bias, relu,
                                  residual if fuse_residual else None, norm)
            if out is not None:
                out = out.to(x.dtype)  # [num_tokens, out]
                return out if residual is None or fuse_residual else out.add_(residual)
            packed = self.weight.detach().float()  # not runnable here: F.linear below
            x32 = x32 if norm is None else norm(x32)
        elif kernel == "onednn" and fuse_residual:
            out = torch.ops.mkldnn._linear_pointwise.binary(x32, residual, packed, self.bias,
                                                            "add")
            return out.to(x.dtype)  # [num_tokens, out]
        if kernel == "onednn":
            out = torch.ops.mkldnn._linear_pointwise(x32, packed, self.bias,
                                                     "relu" if relu else "none", [], "")
        else:
            out = F.linear(x32, packed, self.bias)
            out = out.relu_() if relu else out
        out = out.to(x.dtype)  # [num_tokens, out]
        return out if residual is None else out.add_(residual)


def _packed_product(x: Tensor, packed: Tensor) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # type: ignore[no-any-return]


# (weight shape, dtype) -> the batch oneDNN packs such weights for (`half_layout`)
_half_layouts: dict[tuple[tuple[int, ...], torch.dtype], int] = {}


def half_layout(weight: Tensor) -> int:
    """The batch size oneDNN packs ``weight`` (half, [out, in]) for, `PACK_BATCH` or
    `PROMPT_PACK_BATCH`: the layout whose products at the `LAYOUT_ROWS` row counts take
    the least time relative to the faster layout at each (ties keep `PACK_BATCH`), timed
    once per shape and dtype in this process.

    NOTE: oneDNN picks a packed layout (and the kernels that read it) from the batch size
    it is told, and neither layout is the faster one at every shape and row count; which
    one wins where depends on the CPU, the thread count and oneDNN's version, so it is
    timed here (docs/results-cpu.md has the measurements that led to it). The two differ
    in the last bit of some outputs, as `row_blocks`' choices do; a process keeps its
    choice."""
    key = (tuple(weight.shape), weight.dtype)
    if key not in _half_layouts:
        packs = {str(b): torch.ops.mkldnn._reorder_linear_weight(weight, b)
                 for b in (PACK_BATCH, PROMPT_PACK_BATCH)}
        cost = dict.fromkeys(packs, 0.0)
        for rows in LAYOUT_ROWS:
            x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(0)
                            ).to(weight.dtype)  # its own generator: seeded runs stay as they were
            best, _ = measure.best_seconds({b: partial(_packed_product, x, p)
                                            for b, p in packs.items()}, LAYOUT_TRIALS)
            for b in packs:
                cost[b] += best[b] / min(best.values())
        _half_layouts[key] = int(min(packs, key=lambda b: (cost[b], b != str(PACK_BATCH))))
    return _half_layouts[key]


class HalfLinear(nn.Module):
    """An `nn.Linear` of a bf16/fp16 model on a CPU with a native half GEMM, from a weight
    oneDNN prepacks once: the product `F.linear` computes there (oneDNN either way) without
    reordering the weight on every call, with the residual add fused into the GEMM's
    output. Weights under `PACK_MIN_WEIGHTS` elements take `F.linear`. A layer that also
    serves prompts (`for_prompts`: not an LM head, which sees sampled rows only) is packed
    in the layout `half_layout` measured faster for its shape. On a CPU with AMX or AVX-512
    BF16, products of up to `cpu_bf16_gemm.MAX_ROWS` rows (decode steps) take that module's
    kernel, from a copy of the weight packed as its tiles, with the same post-ops; each copy
    is made on the first product that needs it."""

    def __init__(self, weight: Tensor, bias: Tensor | None, for_prompts: bool = True) -> None:
        super().__init__()
        self.for_prompts = for_prompts
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)  # [out, in]
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.is_packed = weight.numel() >= PACK_MIN_WEIGHTS
        self.shape = tuple(weight.shape)  # what `row_blocks` keys its choices by
        # NOTE: packed on the first forward, in the runner's thread (as Float32Linear).
        self.packed: Tensor | None = None
        self.halves: tuple[tuple[Tensor, Tensor | None], ...] | None = None  # `silu_mul`'s
        self.tiles: Tensor | None = None  # `cpu_bf16_gemm.pack(weight)`, where it is used
        self.has_decode_kernel = (self.is_packed and cpu_bf16_gemm.fits(weight)
                                  and cpu_bf16_gemm.is_available())

    @classmethod
    def of(cls, linear: nn.Linear) -> HalfLinear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: Tensor, relu: bool = False, residual: Tensor | None = None,
                norm: nn.Module | None = None) -> Tensor:
        """`norm(x) @ weight.T + bias` (`norm` optional), then ReLU (`relu`) or
        `+ residual`, in the weight's dtype."""
        x = x if norm is None else norm(x)  # [num_tokens, in]
        if not self.is_packed:
            out = F.linear(x, self.weight, self.bias)
            out = out.relu_() if relu else out
            return out if residual is None else out.add_(residual)
        fused = residual if residual is not None and residual.dtype == x.dtype else None
        op = "add" if fused is not None else "relu" if relu else "none"
        if (decoded := self._decode_kernel(x, op, fused)) is not None:
            return decoded if residual is None or fused is not None else decoded.add_(residual)
        if self.packed is None:
            self.packed = self._pack(self.weight)
        packed, bias, shape = self.packed, self.bias, self.shape
        if fused is not None:
            return row_blocks.by_rows(
                (shape, "add"), lambda x, r: torch.ops.mkldnn._linear_pointwise.binary(
                    x, r, packed, bias, "add"), x, fused)
        act = "relu" if relu else "none"
        out = row_blocks.by_rows((shape, act), lambda x: torch.ops.mkldnn._linear_pointwise(
            x, packed, bias, act, [], ""), x)
        return out if residual is None else out.add_(residual)

    def _decode_kernel(self, x: Tensor, op: str, residual: Tensor | None = None) -> Tensor | None:
        """`cpu_bf16_gemm.linear` of `x` with `op` where this layer has that kernel and `x` is
        a decode step's rows (the tiles packed on the first such product); None otherwise."""
        if not self.has_decode_kernel or x.shape[0] > cpu_bf16_gemm.MAX_ROWS:
            return None
        if self.tiles is None:
            self.tiles = cpu_bf16_gemm.pack(self.weight.detach())
        return cpu_bf16_gemm.linear(x, self.tiles, self.bias, op, residual)

    def _pack(self, weight: Tensor) -> Tensor:
        batch = half_layout(weight) if self.for_prompts else PACK_BATCH
        return torch.ops.mkldnn._reorder_linear_weight(weight, batch)  # type: ignore[no-any-return]

    def silu_mul(self, x: Tensor) -> Tensor:
        """silu(gate) * up of a fused gate/up layer (gate rows, then up rows): two GEMMs
        over the halves' own packed weights, SiLU and the product fused into their outputs
        (oneDNN's swish and binary-mul post-ops), so no pass over the gate/up output. Up to
        `cpu_bf16_gemm.MAX_ROWS` rows: one pass of that kernel over both halves."""
        if (decoded := self._decode_kernel(x, "silu_mul")) is not None:
            return decoded
        if self.halves is None:
            rows = self.weight.shape[0] // 2
            self.halves = tuple(  # type: ignore[assignment]
                (self._pack(w.contiguous()),
                 None if self.bias is None else self.bias[i * rows:(i + 1) * rows])
                for i, w in enumerate(self.weight.split(rows)))
        assert self.halves is not None
        (gate, gate_bias), (up, up_bias) = self.halves

        def product(x: Tensor) -> Tensor:
            g = torch.ops.mkldnn._linear_pointwise(x, gate, gate_bias, "swish", [], "")
            return torch.ops.mkldnn._linear_pointwise.binary(  # type: ignore[no-any-return]
                x, g, up, up_bias, "mul")

        return row_blocks.by_rows((self.shape, "silu_mul"), product, x)


def silu_mul(layer: nn.Module, x: Tensor) -> Tensor:
    """silu(gate) * up of fused gate/up layer `layer` on `x`, in GEMM post-ops where `layer`
    is a packed `HalfLinear`."""
    if isinstance(layer, HalfLinear) and layer.is_packed:
        return layer.silu_mul(x)
    gate, up = layer(x).chunk(2, dim=-1)
    return F.silu(gate) * up  # type: ignore[no-any-return]


PACKED_LINEARS = (Float32Linear, HalfLinear)  # the layers whose forward fuses norm/residual


def linear_norm(layer: nn.Module, x: Tensor, norm: nn.LayerNorm | None = None,
                relu: bool = False) -> Tensor:
    """`layer(norm(x))` (`norm` optional), then ReLU (`relu`), fused where `layer` is a
    packed linear layer."""
    if isinstance(layer, PACKED_LINEARS):
        return layer(x, relu=relu, norm=norm)  # type: ignore[no-any-return]
    y = layer(x if norm is None else norm(x))
    return F.relu_(y) if relu else y  # type: ignore[no-any-return]


def linear_add(layer: nn.Module, x: Tensor, residual: Tensor) -> Tensor:
    """`layer(x) + residual`, fused where `layer` is a packed linear layer."""
    if isinstance(layer, PACKED_LINEARS):
        return layer(x, residual=residual)  # type: ignore[no-any-return]
    return layer(x).add_(residual)  # type: ignore[no-any-return]


def has_half_matmul(dtype: torch.dtype) -> bool:
    """Whether this CPU has a native GEMM for `dtype` (oneDNN: AVX-512 BF16/FP16 or AMX);
    without one, torch's bf16/fp16 matmuls run several times slower than float32."""
    if dtype == torch.bfloat16:
        return cpu_isa.detect().native_bf16_matmul
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return True


def fit_matmuls_to(model: OPTForCausalLM, device: torch.device) -> bool:
    """On a CPU, switches `model` to prepacked float32 matmuls (`Float32Linear`) when its
    dtype is float32, or bf16/fp16 without a native GEMM (`has_half_matmul`); bf16/fp16
    with a native GEMM get prepacked half matmuls (`HalfLinear`); float64 stays as it is.
    Returns whether it switched to float32."""
    dtype = next(model.parameters()).dtype  # the embedding table's (any family)
    if device.type != "cpu" or dtype == torch.float64:
        return False
    if dtype != torch.float32 and has_half_matmul(dtype):
        if torch.backends.mkldnn.is_available():
            model.use_packed_half_matmuls()
        return False
    model.use_float32_matmuls()
    return True


def pack_linears(model: nn.Module, tied_weight: Tensor, kind: type[nn.Module]) -> None:
    """Replaces every `nn.Linear` of `model` by `kind.of(it)` and, when `model.lm_head`
    is None (an LM head tied to `tied_weight`), makes it `kind(tied_weight, None)`."""
    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, nn.Linear):
                setattr(module, name, kind.of(child))  # type: ignore[attr-defined]
    if getattr(model, "lm_head", None) is None:
        # NOTE: not a submodule: the tied weight must not appear twice in parameters().
        object.__setattr__(model, "lm_head", kind(tied_weight, None))
    if isinstance(head := getattr(model, "lm_head", None), HalfLinear):
        head.for_prompts = False  # it computes the logits of sampled rows only


class OPTAttention(nn.Module):
    """Self-attention with one fused QKV projection (HF's q/k/v weights concatenated)."""

    def __init__(self, cfg: OPTConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=cfg.enable_bias)
        self.out_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.enable_bias)

    def forward(self, x: Tensor, kv_cache: Tensor, layer: int, meta: AttentionMetadata,
                backend: AttentionBackend, residual: Tensor,
                norm: nn.LayerNorm | None = None) -> Tensor:
        """Attention of `norm(x)` (`x`: `[num_tokens, hidden]`; `norm` optional, fused into
        the QKV projection where it can be) plus `residual`."""
        num_tokens = x.shape[0]
        qkv = linear_norm(self.qkv_proj, x, norm).view(num_tokens, 3, self.num_heads,
                                                       self.head_dim)
        q, k, v = qkv.unbind(1)  # [num_tokens, num_heads, head_dim] each
        out = backend.attend(q, k, v, kv_cache, layer, meta, self.scale)  # [n, heads, dim]
        return linear_add(self.out_proj, out.reshape(num_tokens, -1), residual)  # [n, hidden]


class OPTDecoderLayer(nn.Module):
    """Attention then ReLU MLP, each with a residual; LayerNorm before (pre-LN) or after."""

    def __init__(self, cfg: OPTConfig) -> None:
        super().__init__()
        self.is_pre_ln = cfg.do_layer_norm_before
        self.self_attn = OPTAttention(cfg)
        self.self_attn_layer_norm = _layer_norm(cfg, cfg.hidden_size)
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.ffn_dim, bias=cfg.enable_bias)
        self.fc2 = nn.Linear(cfg.ffn_dim, cfg.hidden_size, bias=cfg.enable_bias)
        self.final_layer_norm = _layer_norm(cfg, cfg.hidden_size)

    def forward(self, x: Tensor, kv_cache: Tensor, layer: int, meta: AttentionMetadata,
                backend: AttentionBackend) -> Tensor:
        # NOTE: pre-LN hands its LayerNorms to the projections that read them (the C GEMM
        # normalizes in its input pass); post-LN normalizes the residual stream itself.
        pre = self.is_pre_ln
        h = self.self_attn(x, kv_cache, layer, meta, backend, residual=x,
                           norm=self.self_attn_layer_norm if pre else None)  # [n, hidden]
        if not pre:
            h = self.self_attn_layer_norm(h)
        y = linear_norm(self.fc1, h, self.final_layer_norm if pre else None, relu=True)
        y = linear_add(self.fc2, y, h)  # [num_tokens, hidden]
        return y if pre else self.final_layer_norm(y)


class OPTDecoder(nn.Module):
    """Embeddings, the decoder layers, the final LayerNorm and the output projection."""

    def __init__(self, cfg: OPTConfig) -> None:
        super().__init__()
        self.max_positions = cfg.max_position_embeddings
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.word_embed_proj_dim)
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings + POSITION_OFFSET,
                                            cfg.hidden_size)
        is_projected = cfg.word_embed_proj_dim != cfg.hidden_size
        self.project_in = (nn.Linear(cfg.word_embed_proj_dim, cfg.hidden_size, bias=False)
                           if is_projected else None)
        self.project_out = (nn.Linear(cfg.hidden_size, cfg.word_embed_proj_dim, bias=False)
                            if is_projected else None)
        self.final_layer_norm = (_layer_norm(cfg, cfg.hidden_size)
                                 if cfg.has_final_layer_norm else None)
        self.layers = nn.ModuleList(OPTDecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.activation_dtype: torch.dtype | None = None  # None: the embeddings' dtype

    def forward(self, input_ids: Tensor, positions: Tensor, kv_cache: Tensor,
                meta: AttentionMetadata, backend: AttentionBackend) -> Tensor:
        longest = max(meta.seq_lens_list)
        if longest > self.max_positions:
            raise ValueError(f"sequence length {longest} exceeds max_position_embeddings "
                             f"({self.max_positions})")
        x = self.embed_tokens(input_ids)  # [num_tokens, word_embed_proj_dim]
        if self.activation_dtype is not None:
            x = x.to(self.activation_dtype)
        if self.project_in is not None:
            x = self.project_in(x)  # [num_tokens, hidden]
        x = x + self.embed_positions(positions + POSITION_OFFSET)
        for i, layer in enumerate(self.layers):
            x = layer(x, kv_cache, i, meta, backend)
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)  # [num_tokens, word_embed_proj_dim]
        return x


class _OPTModel(nn.Module):
    """Holds the decoder so that parameter names read `model.decoder.*` as in HF."""

    def __init__(self, cfg: OPTConfig) -> None:
        super().__init__()
        self.decoder = OPTDecoder(cfg)


class OPTForCausalLM(nn.Module):
    """OPT with a tied LM head. `forward` returns hidden states; `compute_logits` projects
    only the rows the caller selects (the LM head is the largest cost of a decode step)."""

    def __init__(self, cfg: OPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = _OPTModel(cfg)
        self.lm_head: nn.Module | None = None  # set by `use_*_matmuls`

    def use_float32_matmuls(self) -> None:
        """Computes every linear layer and the LM head in float32 from prepacked weights
        (`Float32Linear`; memory: one packed copy of the matmul weights besides the
        originals, in float32 or, with the C GEMM, in a bf16 model's bf16, and a float32
        one more where oneDNN measured faster for wide products), and keeps
        the activations between them (residual stream, LayerNorms, queries and attention
        outputs) in float32, so that nothing converts
        around each matmul; the embedding tables and the KV cache keep the model's dtype
        (K/V are rounded to it when written). The LayerNorm parameters become float32
        (exact copies of their values)."""
        for module in self.modules():
            if isinstance(module, nn.LayerNorm):
                module.float()
        pack_linears(self, self.model.decoder.embed_tokens.weight, Float32Linear)
        self.model.decoder.activation_dtype = torch.float32

    def use_packed_half_matmuls(self) -> None:
        """Every linear layer and the LM head from weights oneDNN prepacks (`HalfLinear`),
        in the model's own dtype."""
        pack_linears(self, self.model.decoder.embed_tokens.weight, HalfLinear)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_cache: Tensor,
                meta: AttentionMetadata, backend: AttentionBackend) -> Tensor:
        """`input_ids`, `positions`: `[num_tokens]` long. Returns `[num_tokens, proj_dim]`.

        Raises:
            ValueError: a sequence is longer than `max_position_embeddings`.
        """
        return self.model.decoder(input_ids, positions, kv_cache, meta, backend)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """`[n, word_embed_proj_dim]` hidden states -> `[n, vocab_size]` logits (float32
        after `use_float32_matmuls`)."""
        if isinstance(self.lm_head, Float32Linear):
            return self.lm_head(hidden.float())  # type: ignore[no-any-return]
        if self.lm_head is not None:
            return self.lm_head(hidden)  # type: ignore[no-any-return]
        return F.linear(hidden, self.model.decoder.embed_tokens.weight)
