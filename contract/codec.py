"""A small typed codec for wire messages: frozen dataclasses <-> plain dicts.

`@message` turns a subclass of `Message` into a frozen slotted dataclass whose `decode(dict)` and
`encode()` are built once from its fields (the base class declares them for the type checker).
Field types come from the annotations: str, int, float, bool, dict, Any, another
message, `tuple[T, ...]` of those, and `T | None`. Unknown keys are kept in `extra` and
written back by `encode()`, so a message passes through the mesh untouched (engines add
fields of their own). A bad value raises `ProtocolError` naming the field's path.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Callable, Self, TypeVar, dataclass_transform

from contract.errors import ProtocolError

M = TypeVar("M", bound="Message")
_Check = Callable[[Any, str], Any]
_Enc = Callable[[Any], Any]


def _fail(path: str, what: str) -> typing.NoReturn:
    raise ProtocolError(f"{path}: {what}", param=path)


def _scalar(kind: type) -> _Check:
    name = kind.__name__

    def check(v: Any, path: str) -> Any:
        # bool is an int in Python; refuse it where a number is meant, and vice versa
        if type(v) is kind or (kind is float and type(v) is int):
            return v
        if kind is str and isinstance(v, str):   # a str subclass (a `Dialect`): its plain value
            return str.__str__(v)
        _fail(path, f"expected {name}, got {type(v).__name__}")

    return check


def _any(v: Any, path: str) -> Any:
    return v


def _dict(v: Any, path: str) -> Any:
    if isinstance(v, dict):
        return v
    _fail(path, f"expected object, got {type(v).__name__}")


# the element types a sequence of scalars accepts as they are (float takes int; bool is not an int)
_EXACT: dict[Any, frozenset[type]] = {int: frozenset({int}), str: frozenset({str}), bool: frozenset({bool}),
                                      float: frozenset({int, float})}


def _plan(tp: Any) -> tuple[_Check, _Enc | None]:
    """A checker and an encoder (None: the value encodes as itself) for annotation `tp`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        inner, enc = _plan(args[0])

        def opt(v: Any, path: str) -> Any:
            return None if v is None else inner(v, path)

        if enc is None:
            return opt, None
        inner_enc = enc
        return opt, (lambda v: None if v is None else inner_enc(v))
    if origin is tuple:
        elem = typing.get_args(tp)[0]
        inner, enc = _plan(elem)
        ok_types = _EXACT.get(elem)

        def seq(v: Any, path: str) -> Any:
            # block ids and the like: every element's type checked at C speed (no call per element)
            if ok_types is not None and type(v) in (list, tuple) and set(map(type, v)) <= ok_types:
                return tuple(v)
            if not isinstance(v, (list, tuple)):
                _fail(path, f"expected array, got {type(v).__name__}")
            try:   # the usual case first, without an element path per element
                return tuple([inner(x, path) for x in v])
            except ProtocolError:   # again, to name the element at fault
                return tuple(inner(x, f"{path}[{i}]") for i, x in enumerate(v))

        return seq, (lambda v: [enc(x) for x in v]) if enc else list
    if isinstance(tp, type) and issubclass(tp, Message):
        return (lambda v, path: tp.decode(v, path)), (lambda v: v.encode())
    if tp is Any:
        return _any, None
    if tp is dict:
        return _dict, None
    if tp in (str, int, float, bool):
        return _scalar(tp), None
    raise TypeError(f"unsupported wire type {tp!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class Message:
    """A wire message: what `@message` builds on. `extra`: the keys this side does not know, kept
    and written back (keyword-only, so a subclass's required fields may follow it)."""
    extra: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, kw_only=True)

    @classmethod
    def decode(cls, data: Any, path: str = "") -> Self:
        """The message in `data` (a dict off the wire), every field checked; `path` names it in errors."""
        raise TypeError(f"{cls.__name__} is not decorated with @message")

    def encode(self) -> dict[str, Any]:
        """The message as a plain dict (msgpack / JSON ready), `extra` included."""
        raise TypeError(f"{type(self).__name__} is not decorated with @message")


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field,))
def message(cls: type[M]) -> type[M]:
    """Class decorator on a `Message` subclass: a frozen slotted dataclass with `decode`/`encode`."""
    dc = dataclasses.dataclass(frozen=True, slots=True)(cls)
    hints = typing.get_type_hints(dc)
    plan: list[tuple[str, _Check, _Enc | None, bool]] = []
    for f in dataclasses.fields(dc):
        if f.name == "extra":
            continue
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        check, enc = _plan(hints[f.name])
        plan.append((f.name, check, enc, required))
    known = frozenset(p[0] for p in plan)

    def decode(klass: type[M], data: Any, path: str = "") -> M:
        if not isinstance(data, dict):
            _fail(path or klass.__name__, f"expected object, got {type(data).__name__}")
        kw: dict[str, Any] = {}
        try:   # the usual case first, without building each field's path
            for name, check, _enc, required in plan:
                if name in data:
                    kw[name] = check(data[name], name)
                elif required:
                    raise ProtocolError(name)
        except ProtocolError:   # again, to name the field at fault by its whole path
            for name, check, _enc, required in plan:
                if name in data:
                    kw[name] = check(data[name], f"{path}.{name}" if path else name)
                elif required:
                    _fail(f"{path}.{name}" if path else name, "missing")
        if len(data) > len(kw):
            kw["extra"] = {k: v for k, v in data.items() if k not in known}
        return klass(**kw)

    def encode(self: Message) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.extra) if self.extra else {}
        for name, _check, enc, _req in plan:
            v = getattr(self, name)
            out[name] = enc(v) if enc is not None else v
        return out

    # built per class, over its own field plan: no per-call lookups on the hot path
    setattr(dc, "decode", classmethod(decode))
    setattr(dc, "encode", encode)
    return dc
