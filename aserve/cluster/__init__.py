"""The Ray driver: an engine whose prefill, decode and colocated instances run on the nodes
of a Ray cluster (docs/cluster.md). Importing this package does not import Ray; only an
engine with `ray_address` set needs it (the `cluster` extra).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aserve.engine.config import EngineConfig
from aserve.engine.engine import Engine

if TYPE_CHECKING:
    from aserve.cluster.engine import ClusterEngine


def engine_for(config: EngineConfig) -> Engine:
    """The engine `config` asks for: on a Ray cluster when it names one, else in this
    process.

    Raises:
        ImportError: `ray_address` is set and Ray is not installed.
    """
    if config.ray_address is None:
        return Engine(config)
    try:
        import ray  # noqa: F401
    except ImportError as exc:
        raise ImportError("ray_address needs Ray: pip install 'aserve[cluster]'") from exc
    from aserve.cluster.engine import ClusterEngine

    return ClusterEngine(config)


def __getattr__(name: str) -> object:
    if name == "ClusterEngine":
        from aserve.cluster.engine import ClusterEngine

        return ClusterEngine
    raise AttributeError(f"module 'aserve.cluster' has no attribute {name!r}")


__all__ = ["ClusterEngine", "engine_for"]
