"""Load-oblivious and load-aware built-ins: round_robin, random, power_of_two, least_loaded."""

from __future__ import annotations

import random as _random

from contract.snapshot import View, Worker
from policies.base import PolicyBase, RoutingRequest


class RoundRobin(PolicyBase):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def select(self, request: RoutingRequest, view: View) -> Worker:
        i = self._next
        self._next = i + 1
        return view.workers[i % len(view.workers)]


class Random(PolicyBase):
    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = _random.Random(seed)

    def select(self, request: RoutingRequest, view: View) -> Worker:
        return self._rng.choice(view.workers)


class PowerOfTwo(PolicyBase):
    """Sample two distinct candidates, take the one with fewer requests in flight."""

    name = "power_of_two"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = _random.Random(seed)

    def select(self, request: RoutingRequest, view: View) -> Worker:
        ws = view.workers
        if len(ws) == 1:
            return ws[0]
        a, b = self._rng.sample(ws, 2)
        load = view.load
        return a if load.get(a.id, 0) <= load.get(b.id, 0) else b


class LeastLoaded(PolicyBase):
    """Fewest requests in flight; ties broken in rotation so idle fleets spread evenly."""

    name = "least_loaded"

    def __init__(self) -> None:
        self._turn = 0

    def select(self, request: RoutingRequest, view: View) -> Worker:
        ws = view.workers
        n = len(ws)
        self._turn = start = (self._turn + 1) % n
        load = view.load
        best = ws[start]
        best_load = load.get(best.id, 0)
        for k in range(1, n):
            w = ws[(start + k) % n]
            wl = load.get(w.id, 0)
            if wl < best_load:
                best, best_load = w, wl
        return best
