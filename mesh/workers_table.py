"""`mesh workers`: a readable table of the fleet, read from etcd or from a running mesh."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import httpx
import orjson

from contract.dialects import ATOM
from contract.etcd import EtcdConfig, open_client
from contract.protocol import DecodeRecord, PrefillRecord
from mesh.etcd_registry import build_workers

COLUMNS = ("role", "id", "model", "url", "dialect", "parallel", "stages", "layers", "health", "draining", "in_flight",
           "held")


async def _load(session: aiohttp.ClientSession, url: str) -> dict[str, Any] | None:
    try:
        async with session.get(url + "/load", timeout=aiohttp.ClientTimeout(total=1.5)) as r:
            return orjson.loads(await r.read()) if r.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError):
        return None


async def from_etcd(cfg: EtcdConfig) -> list[dict[str, Any]]:
    client = open_client(cfg)
    try:
        res = await client.get_prefix(cfg.keys.root.encode())
    finally:
        await client.close()
    kv = {x.key: x.value for x in res.kvs}
    routable, meshes, stages = build_workers(cfg.keys, kv)
    routable_ids = {w.id for w in routable}
    records: list[PrefillRecord | DecodeRecord] = []
    for key, value in kv.items():
        what = cfg.keys.parse(key)
        if what and what[0] in ("prefill", "decode"):
            cls = PrefillRecord if what[0] == "prefill" else DecodeRecord
            try:
                records.append(cls.decode(orjson.loads(value)))
            except Exception:  # noqa: BLE001 - a bad record is shown as such, not fatal for the table
                continue
    rows = []
    async with aiohttp.ClientSession() as s:
        loads = await asyncio.gather(*(_load(s, r.url) for r in records))
    for rec, load in zip(records, loads):
        if isinstance(rec, PrefillRecord):
            live = stages.get(rec.id, {})
            rows.append({"role": "prefill", "id": rec.id, "model": rec.model, "url": rec.url, "dialect": rec.dialect,
                         "parallel": f"pp={rec.pp_size}", "stages": f"{len(live)}/{rec.pp_size}",
                         "layers": " ".join(f"{s.layers[0]}-{s.layers[1]}" for s in rec.stages) or "-",
                         "health": "routable" if rec.id in routable_ids else "INCOMPLETE",
                         "draining": rec.draining, "load": load})
        else:
            rows.append({"role": "decode", "id": rec.id, "model": rec.model, "url": rec.url, "dialect": rec.dialect,
                         "parallel": f"tp={rec.tp_size}", "stages": "-", "layers": "-",
                         "health": "routable", "draining": rec.draining, "load": load})
    for mid, m in meshes.items():
        rows.append({"role": "mesh", "id": mid, "model": "-", "url": m.url, "parallel": "-", "stages": "-",
                     "layers": "-", "health": f"v{m.version}", "draining": False, "load": None})
    return sorted(rows, key=lambda r: (r["role"], r["id"]))


def from_mesh(url: str, token: str | None) -> list[dict[str, Any]]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    data = httpx.get(url.rstrip("/") + "/workers", headers=headers, timeout=5).raise_for_status().json()
    rows = []
    for w in data["workers"]:
        rec = w["record"]
        pp = rec.get("pp_size")
        rows.append({"role": w["role"], "id": w["id"], "model": w["model"], "url": w["url"],
                     "dialect": rec.get("dialect", ATOM),
                     "parallel": f"pp={pp}" if w["role"] == "prefill" else f"tp={rec.get('tp_size', 1)}",
                     "stages": "-", "health": "healthy" if w["healthy"] else "UNHEALTHY",
                     "layers": " ".join(f"{s['layers'][0]}-{s['layers'][1]}" for s in rec.get("stages", [])) or "-",
                     "draining": w["draining"], "load": w["load"], "mesh_in_flight": w["in_flight"]})
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no workers registered"
    table = [COLUMNS]
    for r in rows:
        load = r.get("load") or {}
        table.append((r["role"], r["id"], r["model"], r["url"], r.get("dialect", "-"), r["parallel"], r["stages"],
                      r["layers"],
                      r["health"] if r.get("load") is not None or r["role"] == "mesh" else r["health"] + " (no /load)",
                      "yes" if r["draining"] else "no", str(load.get("in_flight", "-")),
                      str(load.get("held_transfers", "-"))))
    widths = [max(len(str(row[i])) for row in table) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in table)
