"""Tokens in flight per client address: one client (a burst, or streams it no longer reads)
cannot take the whole engine while others wait. Nothing here knows HTTP or the engine."""

from __future__ import annotations

from aserve.entrypoints.protocol import RequestError


class ClientBudget:
    """At most `limit` tokens (prompt + max_tokens of every sample) in flight per client
    address; a client with nothing in flight is always let in, so one request never waits
    on a budget it could not fit. A request's tokens count from its admission until its
    response ends: a stream whose client does not read keeps counting until the write
    timeout aborts it."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit ({limit}) must be >= 1")
        self.limit = limit
        self.in_flight: dict[str, int] = {}  # client address -> tokens

    def take(self, client: str, num_tokens: int) -> None:
        """Counts `num_tokens` against `client`.

        Raises:
            RequestError: 429 when `client` has tokens in flight and these would pass the
                limit (nothing counted).
        """
        held = self.in_flight.get(client, 0)
        if held and held + num_tokens > self.limit:
            raise RequestError(
                f"this client has {held} tokens in flight (prompt + max_tokens); "
                f"{num_tokens} more would pass max_client_tokens ({self.limit}); retry once "
                "some finish", None, 429, "client_busy")
        self.in_flight[client] = held + num_tokens

    def give_back(self, client: str, num_tokens: int) -> None:
        left = self.in_flight.get(client, 0) - num_tokens
        if left > 0:
            self.in_flight[client] = left
        else:
            self.in_flight.pop(client, None)
