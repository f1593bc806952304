"""consistent_hash: the same session sticks to the same worker while membership allows.

The session key comes from the request (a header the mesh is configured to read, else the
OpenAI `user` field). Workers sit on a hash ring with `replicas` virtual nodes each, so a
worker joining or leaving moves only about 1/n of the sessions. Requests without a key go
to the least-loaded candidate.
"""

from __future__ import annotations

import bisect
import hashlib

from contract.snapshot import View, Worker
from policies.base import PolicyBase, RoutingRequest


def _h(s: str) -> int:
    return int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "big")


class ConsistentHash(PolicyBase):
    name = "consistent_hash"

    def __init__(self, replicas: int = 160) -> None:
        if replicas < 1:
            raise ValueError("replicas must be >= 1")
        self.replicas = replicas
        self._ring_ids: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[Worker] = []

    def _ring(self, ws: tuple[Worker, ...]) -> None:
        ids = tuple(w.id for w in ws)
        if ids == self._ring_ids:
            return
        pts = sorted((_h(f"{w.id}#{i}"), w.id) for w in ws for i in range(self.replicas))
        by_id = {w.id: w for w in ws}
        self._points = [p for p, _ in pts]
        self._owners = [by_id[i] for _, i in pts]
        self._ring_ids = ids

    def select(self, request: RoutingRequest, view: View) -> Worker:
        ws = view.workers
        key = request.session_key
        if not key:
            return min(ws, key=lambda w: view.load.get(w.id, 0))
        if len(ws) == 1:
            return ws[0]
        self._ring(ws)
        i = bisect.bisect(self._points, _h(key)) % len(self._points)
        return self._owners[i]
