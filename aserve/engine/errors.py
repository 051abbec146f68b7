"""The engine's few exception types. Bad input is a plain ValueError; these are the rest."""

from __future__ import annotations


class EngineError(RuntimeError):
    """The engine cannot serve a request (stopped, unhealthy, or overloaded)."""


class EngineOverloaded(EngineError):
    """The waiting queue is over its limit; the caller should retry later (HTTP 429)."""


class TransportClosed(EngineError):
    """A KV transfer could not be carried out because its store is gone."""


class NodeLost(EngineError):
    """A node of a cluster (aserve/cluster) stopped answering: the requests whose KV lived
    only there end with this error; a client may retry them (HTTP 503)."""


def is_retryable(error: str | None) -> bool:
    """Whether a request's error (`RequestOutput.error`) is one a client may retry: its
    node was lost, not its input or the model."""
    return error is not None and error.startswith(f"{NodeLost.__name__}:")
