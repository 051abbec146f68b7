"""The parts of a profiler table that bench.vllm_profile sums (no vLLM needed)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from bench.vllm_profile import split_table


def test_a_real_table_splits_into_parts_that_add_up_to_its_total() -> None:
    x, w = torch.randn(64, 256), torch.randn(512, 256)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        y = F.layer_norm(F.linear(x, w).relu(), (512,))
        torch.log_softmax(y, -1).argmax(-1)
    parts, total = split_table(prof.key_averages().table(sort_by="self_cpu_time_total"))
    assert {"linear", "norms/activations", "sampler"} <= parts.keys()
    assert sum(parts.values()) == pytest.approx(total, rel=0.01)


def test_units_and_names_map_to_parts() -> None:
    table = """\
                 Name    Self CPU %      Self CPU   CPU total %
     _C::onednn_mm        50.00%      2.000ms        50.00%
  _C::paged_attention     25.00%       1000.000us    25.00%
  aten::layer_norm        25.00%      0.001s         25.00%
Self CPU time total: 4.000ms
"""
    parts, total = split_table(table)
    assert parts == {"linear": 2.0, "attention": 1.0, "norms/activations": 1.0}
    assert total == 4.0
