"""`models.cpu_norm.LayerNorm`: the one-thread C LayerNorm of small inputs is within rounding
of the float64 answer, as close as torch's own, with and without affine parameters; other
inputs take torch's path unchanged."""

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


def test_other_inputs_take_torchs_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inputs past MAX_ELEMENTS, widths not a multiple of 16, float64 and inputs that need
    gradients never reach the kernel."""
    calls = []
    real = cpu_norm._library()
    assert real is not None

    class Counted:
        def layer_norm(self, *args: object) -> int:
            calls.append(args)
            return int(real.layer_norm(*args))

    monkeypatch.setattr(cpu_norm, "_library", lambda: Counted())
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
