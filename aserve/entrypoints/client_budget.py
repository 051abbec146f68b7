"""Tokens in flight per client address: one client (a burst, or streams it no longer reads)
cannot take the whole engine while others wait. Nothing here knows HTTP or the engine."""

from __future__ import annotations

from aserve.entrypoints.protocol import RequestError


class ClientBudget:
    """Tokens (prompt + max_tokens of every sample) in flight per client address, counted
    from a request's admission until its response ends: a stream whose client does not read
    keeps counting until the write timeout aborts it. A client with nothing in flight is
    always let in, so one request never waits on a budget it could not fit. Past that, 429:

    - `limit` (0: none): a fixed cap per client;
    - the fair share (`window` > 0): while the tokens in flight would pass `capacity` (the
      decode KV's tokens: more than it can hold at once, so requests queue), a client may
      hold at most `capacity` / the number of active clients, those with tokens in flight or
      a completion request in the last `window` seconds. A lone client is never refused:
      its requests only queue behind its own.
    """

    def __init__(self, limit: int, capacity: int, window: float) -> None:
        if limit < 0 or capacity < 1 or window < 0:
            raise ValueError(f"limit ({limit}) must be >= 0, capacity ({capacity}) >= 1 and "
                             f"window ({window}) >= 0")
        self.limit, self.capacity, self.window = limit, capacity, window
        self.in_flight: dict[str, int] = {}  # client address -> tokens
        self.num_in_flight = 0  # tokens, over every client
        self.last_seen: dict[str, float] = {}  # client address -> time of its last request

    def take(self, client: str, num_tokens: int, now: float) -> None:
        """Counts `num_tokens` against `client`, whose request arrived at `now` (seconds).

        Raises:
            RequestError: 429 when `client` has tokens in flight and these would pass its
                fixed limit or its fair share (nothing counted).
        """
        self._seen(client, now)
        held = self.in_flight.get(client, 0)
        if held and self.limit and held + num_tokens > self.limit:
            raise self._refusal(held, num_tokens, f"max_client_tokens ({self.limit})")
        if held and self.window and self.num_in_flight + num_tokens > self.capacity:
            num_active = len(self.last_seen.keys() | self.in_flight.keys())
            share = self.capacity // num_active
            if num_active > 1 and held + num_tokens > share:
                raise self._refusal(held, num_tokens, (
                    f"this client's fair share ({share}) of the decode KV's {self.capacity} "
                    f"tokens while {num_active} clients are active and it is full"))
        self.in_flight[client] = held + num_tokens
        self.num_in_flight += num_tokens

    def give_back(self, client: str, num_tokens: int) -> None:
        left = self.in_flight.get(client, 0) - num_tokens
        self.num_in_flight -= min(num_tokens, self.in_flight.get(client, 0))
        if left > 0:
            self.in_flight[client] = left
        else:
            self.in_flight.pop(client, None)

    def _seen(self, client: str, now: float) -> None:
        """Records `client`'s request and forgets the clients idle for `window`."""
        self.last_seen.pop(client, None)
        self.last_seen[client] = now  # insertion order is last-seen order: oldest first
        while (oldest := next(iter(self.last_seen))) != client \
                and now - self.last_seen[oldest] > self.window:
            del self.last_seen[oldest]

    @staticmethod
    def _refusal(held: int, num_tokens: int, limit: str) -> RequestError:
        return RequestError(
            f"this client has {held} tokens in flight (prompt + max_tokens); {num_tokens} "
            f"more would pass {limit}; retry once some finish", None, 429, "client_busy")
