"""Benchmarks time the engine as `aserve` runs it: aserve is imported before any benchmark
imports torch, so that OpenMP's idle threads wait as they do under the `aserve` command
(aserve/__init__.py)."""

import aserve  # noqa: F401
