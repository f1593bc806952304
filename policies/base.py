"""The routing-policy contract.

A policy is pure: `select(request, view)` reads the request and an immutable `View` and
returns one of `view.workers`. It does no I/O and never blocks; it may keep state of its
own (a round-robin counter, a prefix index) that only it touches. The mesh calls it with a
non-empty candidate list, already filtered to healthy workers of the right role and model.
"""

from __future__ import annotations

from typing import ClassVar, Iterable, Protocol, runtime_checkable

from contract.snapshot import View, Worker


class RoutingRequest(Protocol):
    """What a policy may read of a client request."""

    @property
    def model(self) -> str: ...

    @property
    def session_key(self) -> str | None: ...

    def prompt_text(self) -> str:
        """The whole rendered prompt (chat: every message), for prefix-aware policies."""
        ...

    def prompt_tokens_estimate(self) -> int: ...


@runtime_checkable
class Policy(Protocol):
    name: ClassVar[str]

    def select(self, request: RoutingRequest, view: View) -> Worker: ...


class PolicyBase:
    """Optional base: a name and a no-op membership hook."""

    name: ClassVar[str] = ""

    def retain(self, worker_ids: Iterable[str]) -> None:
        """Called when membership changes: drop state kept for workers that left."""

    def select(self, request: RoutingRequest, view: View) -> Worker:  # pragma: no cover
        raise NotImplementedError
