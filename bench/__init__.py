"""Benchmark harness and workloads. Importing it imports aserve first, so that OpenMP's idle
threads wait in every `python -m bench.*` tool as they do under the `aserve` command
(aserve/__init__.py), whatever the tool imports next."""

import aserve  # noqa: F401
