"""The engine's few exception types. Bad input is a plain ValueError; these are the rest."""

from __future__ import annotations


class EngineError(RuntimeError):
    """The engine cannot serve a request (stopped, unhealthy, or overloaded)."""


class EngineOverloaded(EngineError):
    """The waiting queue is over its limit; the caller should retry later (HTTP 429)."""


class TransportClosed(EngineError):
    """A KV transfer could not be carried out because its store is gone."""
