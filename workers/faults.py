"""What a worker does wrong on purpose: the mock fleet's `POST /mock/faults`, `mesh prefill|decode
--inject-faults`, the chaos tests. The adapters (`workers.server`, `workers.prefill`,
`workers.decode`) check each fault at the point its comment names."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from aiohttp import web


@dataclass(frozen=True, slots=True)
class Faults:
    """What a worker does wrong, on purpose (the mock fleet's `POST /mock/faults`, chaos tests).
    All off by default; the adapters check them at the point each one names."""
    status: int = 0                # answer every generation request with this HTTP status
    hang: bool = False             # accept, never answer
    garbage: bool = False          # answer 200 with a body that is not JSON
    no_kv_params: bool = False     # prefill: answer as if no kv_transfer_params were sent
    die_after_tokens: int = -1     # stream: cut the connection after this many tokens of a choice
    slow_stage: int = -1           # prefill: this stage's side-channel writes are slow ...
    slow_stage_ms: float = 0.0     # ... by this much
    drop_write_done: float = 0.0   # side channel: fraction of write_done frames lost
    drop_release: float = 0.0      # side channel: fraction of release frames lost
    unhealthy: bool = False        # GET /health answers 503
    crash_before_pull: float = 0.0  # decode: fraction of PD requests whose connection dies before the KV pull
    crash_after_pull: float = 0.0   # decode: ... dies after the pull, before any release (a lost release)

    def __post_init__(self) -> None:
        for name in ("drop_write_done", "drop_release", "crash_before_pull", "crash_after_pull"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v <= 1:
                raise ValueError(f"{name} must be a fraction in [0, 1]")
        if type(self.status) is not int or not (self.status == 0 or 400 <= self.status <= 599):
            raise ValueError("status must be 0 or an HTTP error status (400..599)")
        if not isinstance(self.slow_stage_ms, (int, float)) or self.slow_stage_ms < 0:
            raise ValueError("slow_stage_ms must be >= 0")

    @classmethod
    def from_json(cls, d: Any) -> "Faults":
        if not isinstance(d, dict):
            raise ValueError("faults must be a JSON object")
        names = {f.name for f in dataclasses.fields(cls)}
        bad = set(d) - names
        if bad:
            raise ValueError(f"unknown fault(s): {', '.join(sorted(bad))}")
        return cls(**d)


NO_FAULTS = Faults()


def cut_connection(request: web.Request) -> web.StreamResponse:
    """The connection dies with nothing more sent (a crashed engine, as the mesh sees it)."""
    if request.transport is not None:
        request.transport.abort()
    return web.Response(status=500)
