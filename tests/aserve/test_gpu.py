"""The GPU path: decode graphs (their padding logic also on the CPU), Triton kernels on CUDA, and
the engine on CUDA with each Triton backend. Tests marked `gpu` skip without CUDA."""

from __future__ import annotations

import pytest
import torch

from aserve import SamplingParams, generate
from aserve.engine.cuda_graphs import DecodeGraphs, bucket_at_least, width_bucket
from models.attention import AttentionMetadata, get_backend
from models.backends import GRAPH_BACKENDS, TRITON_BACKENDS
from models.loader import load_model
from models.opt import OPTForCausalLM
from tests.conftest import make_config, make_prompts
from tests.models.conftest import make_block_tables, make_kv_cache, rel_err
from transport.blocks import PAD_BLOCK_ID

BLOCK_SIZE = 16
MAX_LEN = 512  # tokens a test sequence may reach
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class DecodeScenario:
    """opt-tiny over its own paged cache (null block zeroed): prefill with `paged`, then
    decode steps that feed any subset of the sequences."""

    def __init__(self, device: str, prompt_lens: list[int]) -> None:
        self.model: OPTForCausalLM = load_model("opt-tiny", "float32", device).model.eval()
        cfg = self.model.config
        self.tables, num_blocks = make_block_tables([MAX_LEN] * len(prompt_lens), BLOCK_SIZE)
        self.kv_cache = make_kv_cache(num_blocks, cfg.num_layers, cfg.num_heads, cfg.head_dim,
                                      block_size=BLOCK_SIZE).to(device)
        self.kv_cache[PAD_BLOCK_ID].zero_()
        self.device, self.lens = device, [0] * len(prompt_lens)
        for i, n in enumerate(prompt_lens):
            self.forward(self.inputs({i: n}, advance=True), get_backend("paged"))  # prefill

    def inputs(self, new_tokens: dict[int, int], advance: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Token ids, positions and metadata feeding `new_tokens[i]` tokens to sequence i."""
        ids = list(new_tokens)
        seq_lens = [self.lens[i] + new_tokens[i] for i in ids]
        meta = AttentionMetadata.build([new_tokens[i] for i in ids], seq_lens,
                                       [self.tables[i][:-(-s // BLOCK_SIZE)]
                                        for i, s in zip(ids, seq_lens)], BLOCK_SIZE, self.device)
        positions = [p for i, s in zip(ids, seq_lens) for p in range(self.lens[i], s)]
        token_ids = [(7 * p + i) % 500 + 4 for i, s in zip(ids, seq_lens)
                     for p in range(self.lens[i], s)]
        if advance:
            for i, s in zip(ids, seq_lens):
                self.lens[i] = s
        long = dict(dtype=torch.long, device=self.device)
        return torch.tensor(token_ids, **long), torch.tensor(positions, **long), meta

    @torch.inference_mode()
    def forward(self, step: tuple[torch.Tensor, torch.Tensor, AttentionMetadata],
                backend: object) -> torch.Tensor:
        return self.model(*step[:2], self.kv_cache, step[2], backend)  # type: ignore[arg-type]


def check_graph_replays(device: str, backend_name: str, use_graphs: bool) -> None:
    """Decode steps of changing batch (3, 5, 2, 3 sequences: padded buckets, reused graphs
    with stale rows) through DecodeGraphs equal the eager forward of the same backend."""
    scenario = DecodeScenario(device, [5, 16, 40, 1, 100])
    backend = get_backend(backend_name)
    graphs = DecodeGraphs(scenario.model, backend, BLOCK_SIZE, MAX_LEN // BLOCK_SIZE,
                          max_batch_size=8, use_graphs=use_graphs)
    for seq_ids in ([0, 1, 2], [0, 1, 2, 3, 4], [4, 1], [2, 3, 0]):
        step = scenario.inputs({i: 1 for i in seq_ids}, advance=True)
        eager = scenario.forward(step, backend).clone()  # [num_seqs, proj_dim]
        with torch.inference_mode():
            replayed = graphs.forward(*step[:2], scenario.kv_cache, step[2])
        assert replayed is not None and replayed.shape == eager.shape
        assert rel_err(replayed, eager) < 1e-5
        assert not scenario.kv_cache[PAD_BLOCK_ID].any(), "padding rows left the null block dirty"
    assert len(graphs.graphs) == 3  # buckets 4 and 8, at the smallest width bucket


@pytest.mark.parametrize(("n", "bucket"), [(1, 1), (3, 4), (8, 8), (9, 16), (200, 256),
                                           (513, None)])
def test_batch_rounds_up_to_a_bucket(n: int, bucket: int | None) -> None:
    from aserve.engine.cuda_graphs import BATCH_BUCKETS

    assert bucket_at_least(n, BATCH_BUCKETS) == bucket


@pytest.mark.parametrize(("width", "bucket"), [(1, 16), (16, 16), (17, 32), (100, 128),
                                               (129, 130), (131, None)])
def test_table_width_rounds_up_to_a_power_of_two_within_the_limit(width: int,
                                                                  bucket: int | None) -> None:
    assert width_bucket(width, max_width=130) == bucket


def test_padded_static_buffers_match_eager_decode_on_cpu() -> None:
    check_graph_replays("cpu", "triton", use_graphs=False)


def test_prefill_and_oversized_steps_run_eagerly() -> None:
    scenario = DecodeScenario("cpu", [5, 9, 3])
    graphs = DecodeGraphs(scenario.model, get_backend("triton"), BLOCK_SIZE, 2,
                          max_batch_size=2, use_graphs=False)
    prefill = scenario.inputs({0: 3})
    too_many = scenario.inputs({0: 1, 1: 1, 2: 1})
    assert graphs.forward(*prefill[:2], scenario.kv_cache, prefill[2]) is None
    assert graphs.forward(*too_many[:2], scenario.kv_cache, too_many[2]) is None
    paged = DecodeGraphs(scenario.model, get_backend("paged"), BLOCK_SIZE, 2, use_graphs=False)
    step = scenario.inputs({0: 1})
    assert paged.forward(*step[:2], scenario.kv_cache, step[2]) is None


@gpu
@needs_cuda
@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_cuda_graph_replays_match_eager_decode(backend: str) -> None:
    check_graph_replays("cuda", backend, use_graphs=True)


@gpu
@needs_cuda
@pytest.mark.parametrize("backend", TRITON_BACKENDS)
@pytest.mark.parametrize(("dtype", "tolerance"), [
    (torch.float32, 1e-5), (torch.float16, 5e-3), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_cuda_kernels_match_paged_reference(backend: str, dtype: torch.dtype, tolerance: float,
                                            head_dim: int) -> None:
    g = torch.Generator().manual_seed(head_dim)
    lens = [1, 16, 17, 64, 256, 257, 4096] + torch.randint(1, 3000, (57,), generator=g).tolist()
    tables, num_blocks = make_block_tables(lens, BLOCK_SIZE)
    kv_cache = make_kv_cache(num_blocks, 2, 8, head_dim, dtype, BLOCK_SIZE).cuda()
    meta = AttentionMetadata.build([1] * len(lens), lens, tables, BLOCK_SIZE, "cuda")
    q = torch.randn(len(lens), 8, head_dim, generator=g).to(dtype).cuda()
    ref = get_backend("paged").forward(q.float(), kv_cache.float(), 1, meta, head_dim ** -0.5)
    out = get_backend(backend).forward(q, kv_cache, 1, meta, head_dim ** -0.5)
    assert out.dtype == dtype
    assert rel_err(out.float(), ref) < tolerance


@gpu
@needs_cuda
@pytest.mark.parametrize("policy", ["aligned", "continuous"])
@pytest.mark.parametrize("backend", TRITON_BACKENDS)
def test_engine_on_cuda_generates_what_the_cpu_engine_does(backend: str, policy: str) -> None:
    prompts = make_prompts(12, 1, 200, 512, seed=3)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    cpu = generate(prompts, params, make_config(policy=policy))
    cuda = generate(prompts, params, make_config(policy=policy, attention=backend,
                                                 prefill_devices="cuda", decode_devices="cuda"))
    assert [o.token_ids for o in cuda] == [o.token_ids for o in cpu]
    assert all(o.finish_reason is not None and o.error is None for o in cuda)
