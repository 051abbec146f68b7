"""`models.cpu_rotary.rotate`: the one-pass rotary embedding gives torch's operators' answer
(bit for bit in bf16, within a float32 rounding in float32) on strided views of a fused
projection, for decode rows and prompt-sized inputs shared out to threads; what it cannot
take goes back to torch's path."""

import pytest
import torch

from models import cpu_rotary, llama

pytestmark = pytest.mark.skipif(cpu_rotary._library() is None, reason="needs a C compiler")


def tables(n: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    return llama.rotary_tables(torch.arange(n) * 7 + 3, inv, dtype)


def operators(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """torch's path (`models.llama.rotate` without the kernel)."""
    return torch.addcmul(x * cos[:, None, :], x.roll(x.shape[-1] // 2, -1), sin[:, None, :])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("n", "dim"), [(1, 64), (48, 64), (3000, 64), (5, 128), (7, 32)])
def test_matches_torchs_operators_on_a_fused_projection(dtype: torch.dtype, n: int,
                                                         dim: int) -> None:
    torch.manual_seed(n + dim)
    qkv = (torch.randn(n, 15 * dim) * 4).to(dtype)  # q 9 heads, k 3, v 3
    x = qkv[:, :12 * dim].view(n, 12, dim)
    cos, sin = tables(n, dim, dtype)
    with torch.inference_mode():
        ours = cpu_rotary.rotate(x, cos, sin)
        theirs = operators(x, cos, sin)
    assert ours is not None and ours.is_contiguous() and ours.shape == x.shape
    if dtype == torch.bfloat16:
        assert torch.equal(ours, theirs)
    else:
        assert torch.allclose(ours, theirs, rtol=2 ** -22, atol=1e-6)


def test_what_it_cannot_take_goes_to_torch() -> None:
    cos, sin = tables(4, 48, torch.bfloat16)
    with torch.inference_mode():
        assert cpu_rotary.rotate(torch.randn(4, 2, 48).bfloat16(), cos, sin) is None  # dim
        cos, sin = tables(4, 64, torch.float64)
        assert cpu_rotary.rotate(torch.randn(4, 2, 64, dtype=torch.float64), cos, sin) is None
    x = torch.randn(4, 2, 64, requires_grad=True)
    assert cpu_rotary.rotate(x, *tables(4, 64, torch.float32)) is None  # autograd
    out = llama.rotate(x, *tables(4, 64, torch.float32))  # torch's path, with gradients
    out.sum().backward()
    assert x.grad is not None
