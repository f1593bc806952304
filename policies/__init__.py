"""Routing policies: built-ins plus third-party ones from the entry-point group `atomesh.policies`.

    from policies import create, available
    policy = create("cache_aware", chunk_chars=128)

A third-party package declares, in its pyproject.toml::

    [project.entry-points."atomesh.policies"]
    my_policy = "my_pkg.module:MyPolicy"

and `mesh serve --prefill-policy my_policy` picks it up once the package is installed.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any, Callable

from policies.base import Policy, PolicyBase, RoutingRequest
from policies.cache_aware import CacheAware
from policies.consistent_hash import ConsistentHash
from policies.kv_pressure import KVPressure
from policies.simple import LeastLoaded, PowerOfTwo, Random, RoundRobin

ENTRY_POINT_GROUP = "atomesh.policies"

BUILTINS: dict[str, Callable[..., Policy]] = {
    cls.name: cls for cls in (RoundRobin, Random, PowerOfTwo, LeastLoaded, CacheAware, ConsistentHash, KVPressure)
}


def _plugins() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available() -> list[str]:
    return sorted(set(BUILTINS) | set(_plugins()))


def register(name: str, factory: Callable[..., Policy]) -> None:
    """Register a policy in-process (tests, embedding); entry points are the packaged way."""
    if name in BUILTINS:
        raise ValueError(f"policy {name!r} is already registered")
    BUILTINS[name] = factory


def create(name: str, **options: Any) -> Policy:
    """Build the policy called `name`; unknown names raise ValueError listing the known ones."""
    factory = BUILTINS.get(name)
    if factory is None:
        ep = _plugins().get(name)
        if ep is None:
            raise ValueError(f"unknown policy {name!r}; available: {', '.join(available())}")
        factory = ep.load()
    policy = factory(**options)
    if not callable(getattr(policy, "select", None)):
        raise ValueError(f"policy {name!r} has no select(request, view) method")
    return policy


__all__ = ["Policy", "PolicyBase", "RoutingRequest", "available", "create", "register", "BUILTINS",
           "ENTRY_POINT_GROUP"]
