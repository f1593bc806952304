"""What a rank process of the reference engine does beyond the model, injected at its start
(`workers.engine.rank.RankStartup`): the engine knows neither transports nor etcd.

- the KV side: the rank's pool registered with the transport (`--kv-backend`), and, on a PP stage
  or a TP prefill rank, the side-channel server thread that serves its layers / KV heads;
- `enroll`: a stage's own liveness key in etcd, under its own lease, kept by its own process
  (with its own credentials from its environment: none travel on the control channel).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Callable, Mapping

from contract.etcd import EtcdConfig
from contract.protocol import StageRecord
from workers.engine.rank import Answer, Rank
from workers.kv.stage import register_pool, start_stage_thread
from workers.register import EnrollConfig, Enrollment


class RankKV:
    """A rank's KV side and its enrollment (`RankSide`)."""

    def __init__(self, rank: Rank) -> None:
        spec = rank.spec
        assert spec.kv_backend is not None
        # kept for the rank's life: the transport (and its registered memory) lives as long as it does
        self.ep = ep = register_pool(rank.pool, spec.kv_backend, spec.kv_host)
        self.info: dict[str, Any] = {"segment": ep.transport.segment, "regions": ep.regions}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.enrollment: Enrollment | None = None
        self.commands: Mapping[str, Callable[..., Answer | None]] = {"enroll": self.enroll}
        if spec.kind == "pp":
            self.info["kv_port"], self.loop = start_stage_thread(ep, spec.kv_host, spec.par.pp_rank,
                                                                 spec.par.layer_start, spec.par.layer_end,
                                                                 grant_key=spec.secret)
        elif spec.producer:  # TP prefill rank r: every layer, its slice of the KV heads
            self.info["kv_port"], self.loop = start_stage_thread(ep, spec.kv_host, spec.rank, 0,
                                                                 rank.mc.num_hidden_layers,
                                                                 head0=spec.rank * rank.model.kv_heads,
                                                                 grant_key=spec.secret)

    def enroll(self, etcd_map: dict[str, Any], pipeline_id: str, stage_map: dict[str, Any], ttl: int) -> Answer:
        """This stage's liveness key, under its own lease, kept on its side-channel loop."""
        try:
            if self.loop is None:
                raise RuntimeError("enroll needs a stage with a KV side channel")
            etcd_cfg = EtcdConfig(**{**etcd_map, "endpoints": tuple(etcd_map.get("endpoints") or ()),
                                     "username": os.environ.get("ATOMESH_ETCD_USER"),   # as --etcd-user
                                     "password": os.environ.get("ATOMESH_ETCD_PASSWORD")})
            self.enrollment = Enrollment(etcd=etcd_cfg, record=None, stages=(StageRecord.decode(stage_map, "stage"),),
                                         pipeline_id=pipeline_id, cfg=EnrollConfig(ttl=ttl))
            asyncio.run_coroutine_threadsafe(self.enrollment.start(), self.loop).result(60)
            return ("ok",)
        except Exception as e:  # noqa: BLE001 - told to rank 0, which fails its start clearly
            return ("error", str(e))

    def close(self) -> None:
        """Withdraw the stage's liveness key (its lease would expire anyway)."""
        if self.enrollment is not None and self.loop is not None:
            try:
                asyncio.run_coroutine_threadsafe(self.enrollment.close(), self.loop).result(10)
            except Exception:  # noqa: BLE001 - its lease expires anyway
                pass


def startup(rank: Rank) -> RankKV:
    """The reference engine's rank start-up hook (`Ranks(startup=...)`, `serve_remote_stage`)."""
    return RankKV(rank)
