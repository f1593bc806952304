"""kv_pressure: the pipeline with the most free KV blocks, never one that cannot fit the prompt.

Free blocks per pipeline come from the mesh (`View.kv_free`): the pipeline's last `GET /load`
(pool minus held), kept current between probes by the ledger (blocks taken at each prefill,
returned at each release). The prompt needs ceil(prompt tokens / block_size) blocks; a
pipeline with fewer free is refused. When none fits, `InsufficientKV` (503, Retry-After):
or 400 if the prompt is larger than every candidate's whole pool.
"""

from __future__ import annotations

from contract.errors import InsufficientKV, InvalidRequest
from contract.snapshot import View, Worker
from policies.base import PolicyBase, RoutingRequest


class KVPressure(PolicyBase):
    name = "kv_pressure"

    def select(self, request: RoutingRequest, view: View) -> Worker:
        tokens = request.prompt_tokens_estimate()
        best: Worker | None = None
        best_key: tuple[int, int] | None = None
        biggest_pool = 0
        for w in view.workers:
            bs = max(1, w.record.block_size)
            need = -(-tokens // bs)
            pool = w.record.num_blocks
            free = view.kv_free.get(w.id, pool if pool else need)  # unknown: assume it fits
            biggest_pool = max(biggest_pool, pool or need)
            if free < need:
                continue
            key = (free, -view.load.get(w.id, 0))
            if best_key is None or key > best_key:
                best, best_key = w, key
        if best is None:
            if all(w.record.num_blocks and -(-tokens // max(1, w.record.block_size)) > w.record.num_blocks
                   for w in view.workers):
                raise InvalidRequest(f"the prompt (~{tokens} tokens) is larger than the KV pool of every "
                                     f"pipeline serving {request.model!r}", param="prompt")
            raise InsufficientKV(f"no pipeline has enough free KV blocks for ~{tokens} prompt tokens now",
                                 headers={"Retry-After": "1"})
        return best
