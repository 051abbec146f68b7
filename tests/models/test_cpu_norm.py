"""`models.cpu_norm.LayerNorm` and `RMSNorm`: the one-thread C norms of small inputs are
within rounding of the float64 answer, as close as torch's own (LayerNorm with and without
affine parameters; RMSNorm bit-exact in bf16 with transformers' LlamaRMSNorm); other inputs
take torch's path unchanged."""

import pytest
import torch
import torch.nn.functional as F

from models import cpu_norm

pytestmark = pytest.mark.skipif(cpu_norm._library() is None, reason="needs a C compiler")


def exact(x: torch.Tensor, norm: torch.nn.LayerNorm) -> torch.Tensor:
    weight, bias = (None if p is None else p.double() for p in (norm.weight, norm.bias))
    return F.layer_norm(x.double(), norm.normalized_shape, weight, bias, norm.eps)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("shape", [(1, 768), (64, 768), (3, 5, 32)])
def test_matches_float64_as_closely_as_torch(dtype: torch.dtype, affine: bool,
                                             shape: tuple[int, ...]) -> None:
    torch.manual_seed(len(shape) * shape[-1])
    norm = cpu_norm.LayerNorm(shape[-1], elementwise_affine=affine).to(dtype)
    if affine:
        with torch.no_grad():
            norm.weight.copy_(torch.randn(shape[-1]))
            norm.bias.copy_(torch.randn(shape[-1]))
    x = (torch.randn(shape) * 3 + 1).to(dtype)
    with torch.inference_mode():
        ours = norm(x)
        theirs = F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
    want = exact(x, norm)
    assert ours.dtype == dtype and ours.shape == x.shape
    ulp = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -22  # relative rounding step
    slack = ulp * want.abs() + 1e-6
    assert ((ours.double() - want).abs() <= (theirs.double() - want).abs() + slack).all()


def count_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[object, ...]]:
    """The arguments of every call into the kernel library from now on (calls go through)."""
    calls: list[tuple[object, ...]] = []
    real = cpu_norm._library()
    assert real is not None

    class Counted:
        def __getattr__(self, name: str) -> object:
            def call(*args: object) -> int:
                calls.append(args)
                return int(getattr(real, name)(*args))
            return call

    monkeypatch.setattr(cpu_norm, "_library", lambda: Counted())
    return calls


def test_other_inputs_take_torchs_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inputs past MAX_ELEMENTS, widths not a multiple of 16, float64 and inputs that need
    gradients never reach the kernel."""
    calls = count_calls(monkeypatch)
    wide = cpu_norm.LayerNorm(64)
    with torch.inference_mode():
        wide(torch.randn(8, 64))
        assert len(calls) == 1
        wide(torch.randn(cpu_norm.MAX_ELEMENTS // 64 + 1, 64))
        cpu_norm.LayerNorm(40)(torch.randn(8, 40))
        wide.double()(torch.randn(8, 64, dtype=torch.float64))
    x = torch.randn(8, 64, requires_grad=True)
    cpu_norm.LayerNorm(64)(x).sum().backward()
    assert len(calls) == 1 and x.grad is not None


def llama_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, as written there."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 576), (48, 576), (3, 5, 64)])
def test_rms_norm_matches_llamas(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    torch.manual_seed(shape[0] * shape[-1])
    norm = cpu_norm.RMSNorm(shape[-1], 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1]))
    x = (torch.randn(shape) * 3 + 1).to(dtype)
    with torch.inference_mode():
        ours, theirs = norm(x), llama_rms_norm(x, norm.weight, norm.eps)
    assert ours.dtype == dtype and ours.shape == x.shape
    if dtype == torch.bfloat16:  # the row rounded to bf16, then times the weight: both exact
        assert (ours.view(torch.int16) == theirs.view(torch.int16)).float().mean() > 0.999
    want = llama_rms_norm(x.double(), norm.weight.double(), norm.eps)
    ulp = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -22
    slack = 2 * ulp * want.abs() + 1e-6
    assert ((ours.double() - want).abs() <= (theirs.double() - want).abs() + slack).all()


def test_rms_norm_of_other_inputs_takes_torchs_path(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = count_calls(monkeypatch)
    norm = cpu_norm.RMSNorm(64, 1e-6)
    with torch.inference_mode():
        norm(torch.randn(8, 64))
        cpu_norm.RMSNorm(40, 1e-6)(torch.randn(8, 40))
        norm(torch.randn(8, 64, dtype=torch.bfloat16))  # weight float32, input bf16
        norm.double()(torch.randn(8, 64, dtype=torch.float64))
    assert len(calls) == 1


def test_rms_norm_of_a_prompt_shares_its_rows_out() -> None:
    """Past MAX_ELEMENTS (a prompt's rows) every OpenMP thread takes a share of the rows,
    and the answer is the same as one thread's."""
    torch.manual_seed(5)
    norm = cpu_norm.RMSNorm(576, 1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576))
    x = torch.randn(cpu_norm.MAX_ELEMENTS // 576 * 3 + 7, 576).to(torch.bfloat16)
    with torch.inference_mode():
        ours = norm(x)
        rows = torch.cat([norm(part) for part in x.split(64)])  # each in one thread
    assert torch.equal(ours, rows)
    assert (ours.view(torch.int16) == llama_rms_norm(x, norm.weight, norm.eps).view(
        torch.int16)).float().mean() > 0.999
