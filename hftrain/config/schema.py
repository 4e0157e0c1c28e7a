"""Typed validation of nested dataclasses from YAML-like trees, with every problem collected.

Generic: it knows dataclasses, Literal, Optional/Union, list, dict, enums and the scalar types, and reports
unknown keys with the closest valid spelling. hftrain's sections live in `sections.py`.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import types
import typing
from typing import Any, Literal


def origin_of(key: str, origins: dict[str, str], default: str) -> str:
    """Where a key's value came from: the origin of the override that set it (or a parent or child of it)."""
    for k, origin in origins.items():
        if key == k or key.startswith(k + ".") or k.startswith(key + "."):
            return origin
    return default


class Ctx:
    """Problems collected while building: each 'origin: key: message'."""

    def __init__(self, source: str, origins: dict[str, str]):
        self.source, self.origins, self.problems = source, origins, []
        self.keys: set[str] = set()  # the keys that have a problem

    def where(self, key: str) -> str:
        return origin_of(key, self.origins, self.source)

    def add(self, key: str, msg: str) -> None:
        self.problems.append(f"{self.where(key)}: {key}: {msg}")
        self.keys.add(key)


def type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        enums = [a for a in args if isinstance(a, type) and issubclass(a, enum.Enum)]
        if enums:
            return type_name(enums[0])
        return " or ".join(type_name(a) for a in args if a is not type(None)) + (
            " or null" if type(None) in typing.get_args(tp) else ""
        )
    if origin is list:
        return "a list"
    if origin is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in tp)
    if tp is float:
        return "a finite number"
    return getattr(tp, "__name__", str(tp))


def _yaml11_word(value: bool, allowed) -> Any:
    """YAML 1.1 reads an unquoted `no`/`off` as false: map it back when the field wants that word."""
    for word in (("no", "off", "false") if value is False else ("yes", "on", "true")):
        if word in allowed:
            return word
    return value


def check(value: Any, tp, key: str, ctx: Ctx) -> tuple[bool, Any]:
    """(ok, converted) for value against annotation tp; nested dataclasses are built and checked."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return True, value
    if origin in (typing.Union, types.UnionType):
        return _check_union(value, typing.get_args(tp), key, ctx)
    if origin is Literal:
        if isinstance(value, bool):
            value = _yaml11_word(value, typing.get_args(tp))
        return value in typing.get_args(tp), value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            return False, value
        return True, build(tp, value, key, ctx)
    if origin is list:
        return _check_list(value, tp, key, ctx)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            return False, value
        args = typing.get_args(tp)
        if args and args[1] is str and not all(isinstance(v, str) for v in value.values()):
            return False, value
        return True, value
    return _check_scalar(value, tp)


def _check_union(value: Any, args: tuple, key: str, ctx: Ctx) -> tuple[bool, Any]:
    if value is None:
        return type(None) in args, None
    enums = [a for a in args if isinstance(a, type) and issubclass(a, enum.Enum)]
    if enums and isinstance(value, bool) and not any(a is bool for a in args):
        value = _yaml11_word(value, [m.value for e in enums for m in e])
    if enums and isinstance(value, str):  # transformers' `SchedulerType | str`: the str must still be a member
        return any(value in [m.value for m in e] for e in enums), value
    for a in args:
        if a is type(None):
            continue
        sub = Ctx(ctx.source, ctx.origins)
        ok, conv = check(value, a, key, sub)
        if ok and not sub.problems:
            return True, conv
    # A single non-null alternative: report its precise problems.
    real = [a for a in args if a is not type(None)]
    if len(real) == 1 and dataclasses.is_dataclass(real[0]) and isinstance(value, dict):
        return check(value, real[0], key, ctx)
    return False, value


def _check_list(value: Any, tp, key: str, ctx: Ctx) -> tuple[bool, Any]:
    if not isinstance(value, list):
        return False, value
    (item_tp,) = typing.get_args(tp) or (Any,)
    out = []
    for i, v in enumerate(value):
        ok, conv = check(v, item_tp, f"{key}.{i}", ctx)
        if not ok:
            ctx.add(f"{key}.{i}", f"expected {type_name(item_tp)}, got {v!r}")
        out.append(conv)
    return True, out


def _check_scalar(value: Any, tp) -> tuple[bool, Any]:
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return value in [m.value for m in tp], value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:  # finite: no recipe number means NaN or infinity (YAML's .nan, .inf trained NaN router biases)
        if isinstance(value, bool):
            return False, value
        if isinstance(value, (int, float)):
            return math.isfinite(value), float(value)
        if isinstance(value, str):  # YAML 1.1 reads `1e-5` (no dot) as a string
            try:
                return math.isfinite(float(value)), float(value)
            except ValueError:
                return False, value
        return False, value
    if tp is str:
        return isinstance(value, str), value
    if isinstance(tp, type):
        return isinstance(value, tp), value
    return True, value  # an annotation we do not model: let the library validate it


def unknown(key: str, name: str, valid: list[str], ctx: Ctx) -> None:
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    hint = f"did you mean '{key.rsplit('.', 1)[0] + '.' if '.' in key else ''}{close[0]}'?" if close else (
        "valid keys: " + ", ".join(sorted(valid))
    )
    ctx.add(key, f"unknown key; {hint}")


def build(cls, raw: dict, prefix: str, ctx: Ctx):
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    kwargs = {}
    for name, value in raw.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if name not in fields:
            unknown(key, str(name), list(fields), ctx)
            continue
        ok, conv = check(value, hints[name], key, ctx)
        if not ok:
            ctx.add(key, f"expected {type_name(hints[name])}, got {value!r}")
        kwargs[name] = conv
    for name, f in fields.items():
        if name not in raw and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            key = f"{prefix}.{name}" if prefix else name
            ctx.add(key, f"required key is missing ({f.metadata.get('help', '')})")
            kwargs[name] = None
    try:
        return cls(**kwargs)
    except TypeError:
        return None
