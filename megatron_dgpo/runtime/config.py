"""Typed configuration: small dataclasses per component, loaded from YAML with dotted overrides.

Each component declares its own dataclass where it lives (for example
``losses.LossHyperparams``) and documents every field with a string literal right under it, as
Megatron-Core's ``TransformerConfig`` does. A run's config is a dataclass whose fields are those
component dataclasses. This module only turns plain data into such trees and back:

    cfg = load_config(RunConfig, "recipes/tiny_cpu.yaml", ["algorithm.method=grpo", "seed=1"])

Values are checked against the annotations (``int``, ``float``, ``str``, ``bool``,
``Optional[...]``, ``Literal[...]``, ``list[...]``, ``dict[str, ...]``, nested dataclasses);
an unknown or ill-typed key fails with its full dotted name, and unknown keys get a suggestion.
A number's bounds are declared beside it, in its annotation, and checked by ``Bounds.check``
alone (on load, and by ``check_bounds`` in a section's ``__post_init__``):

    clip_grad: Annotated[float, Bounds(ge=0)] = 1.0
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import math
import textwrap
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, Union

import yaml

from megatron_dgpo.runtime.errors import InputError

T = TypeVar("T")


class ConfigError(InputError):
    """A config key is unknown, missing or of the wrong type; the message names the key."""


@dataclass(frozen=True)
class Bounds:
    """The interval a number field accepts, declared in its annotation
    (``Annotated[int, Bounds(ge=1)]``). Floats must also be finite. ``None`` passes where the
    annotation allows it (``Annotated[float | None, Bounds(gt=0)]``). ``why``: the reason a
    refusal states, where the bound is not obvious."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    why: str | None = None

    def check(self, key: str, value) -> None:
        """Raise ``ValueError`` naming ``key`` unless ``value`` is None or a number inside."""
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{key} must be a number {self}, got {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{key} must be a finite number {self}, got {value!r}")
        tests = ((self.ge, value >= (self.ge or 0)), (self.gt, value > (self.gt or 0)),
                 (self.le, value <= (self.le or 0)), (self.lt, value < (self.lt or 0)))
        if not all(ok for bound, ok in tests if bound is not None):
            raise ValueError(f"{key} must be {self}, got {value!r}"
                             + (f": {self.why}" if self.why else ""))

    def __str__(self) -> str:
        low = (f"[{_number(self.ge)}" if self.ge is not None else f"({_number(self.gt)}"
               if self.gt is not None else None)
        high = (f"{_number(self.le)}]" if self.le is not None else f"{_number(self.lt)})"
                if self.lt is not None else None)
        if low and high:
            return f"in {low}, {high}"
        if low:
            return f">= {_number(self.ge)}" if self.ge is not None else f"> {_number(self.gt)}"
        if high:
            return f"<= {_number(self.le)}" if self.le is not None else f"< {_number(self.lt)}"
        return "(any number)"


def _number(x: float) -> str:
    """A bound as written: integers exactly (2**23 is 8388608, not 8.38861e+06)."""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def field_bounds(cls) -> dict[str, Bounds]:
    """Each field of dataclass ``cls`` that declares ``Bounds`` in its annotation, by name."""
    out = {}
    for name, hint in typing.get_type_hints(cls, include_extras=True).items():
        bounds = _bounds_of(hint)
        if bounds is not None:
            out[name] = bounds
    return out


def check_bounds(obj) -> None:
    """Check every ``Bounds`` the fields of dataclass instance ``obj`` declare (for a section's
    ``__post_init__``, so a section built in code is held to its recipe's bounds); raises
    ``ValueError`` naming the first field outside. A value a union's ``Literal`` member names
    (``lr: auto`` of ``Annotated[float, Bounds(gt=0)] | Literal["auto"]``) is not a number to
    bound."""
    hints = typing.get_type_hints(type(obj), include_extras=True)
    for name, bounds in field_bounds(type(obj)).items():
        value = getattr(obj, name)
        if not _named_by_literal(hints[name], value):
            bounds.check(name, value)


def _named_by_literal(hint, value) -> bool:
    return any(typing.get_origin(arg) is Literal and value in typing.get_args(arg)
               and not isinstance(value, (int, float)) for arg in typing.get_args(hint))


def _bounds_of(hint) -> Bounds | None:
    """The ``Bounds`` of an ``Annotated`` hint, also inside ``Optional[...]``."""
    if typing.get_origin(hint) is Annotated:
        return next((m for m in hint.__metadata__ if isinstance(m, Bounds)), None)
    if typing.get_origin(hint) in (Union, types.UnionType):
        return next((b for b in map(_bounds_of, typing.get_args(hint)) if b is not None), None)
    return None


def require_choice(name: str, value, choices) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}, got {value!r}")


def load_config(cls: type[T], path: str | Path | None = None,
                overrides: list[str] | tuple[str, ...] = ()) -> T:
    """Build ``cls`` from a YAML file (optional) and ``key.sub=value`` overrides, in that order.

    Override values are parsed as YAML (``lr=1e-6``, ``tags=[a, b]``, ``ckpt=null``).
    """
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        with open(path) as f:
            try:
                data = yaml.safe_load(f) or {}
            except yaml.YAMLError as exc:
                raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping, got "
                              f"{type(data).__name__}")
    data = apply_overrides(data, overrides)
    try:
        return from_dict(cls, data)
    except ConfigError as exc:
        where = f"{path}: " if path is not None else ""
        raise ConfigError(f"{where}{exc}") from None


def apply_overrides(data: dict, overrides) -> dict:
    """Return a copy of ``data`` with each ``a.b.c=value`` written in (creating mappings)."""
    data = _deep_copy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not of the form key.sub=value")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {item!r}: value is not valid YAML: {exc}") from exc
        node = data
        parts = key.strip().split(".")
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {'.'.join(parts[:depth + 1])} is a "
                                  f"value, not a section")
            node = child
        node[parts[-1]] = value
    return data


def from_dict(cls: type[T], data: Any, key: str = "") -> T:
    """Build dataclass ``cls`` from a mapping, checking every value against its annotation."""
    if not isinstance(data, dict):
        raise ConfigError(f"{key or 'config'} must be a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        name = unknown[0]
        close = difflib.get_close_matches(str(name), list(fields), n=1)
        hint = f"; did you mean {_join(key, close[0])!r}?" if close else ""
        raise ConfigError(f"unknown key {_join(key, name)!r}{hint} (known: "
                          f"{', '.join(sorted(fields))})")
    hints = typing.get_type_hints(cls, include_extras=True)
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _convert(hints[name], value, _join(key, name))
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field without a value
        raise ConfigError(f"{key or cls.__name__}: {exc}") from None
    except ValueError as exc:  # the dataclass's own validation
        raise ConfigError(f"{key or cls.__name__}: {exc}") from None


def to_dict(obj) -> Any:
    """Plain data (for YAML/JSON) from a config tree."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, Path):
        return str(obj)
    return obj


def field_docs(cls) -> dict[str, str]:
    """The documentation string written under each field of dataclass ``cls``, its base
    classes' fields included (a subclass's own documentation wins)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(_own_field_docs(klass))
    return docs


def _own_field_docs(cls) -> dict[str, str]:
    docs: dict[str, str] = {}
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return docs
    body = tree.body[0].body
    for node, following in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(following.value.value)
    return docs


def describe(cls, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, type, documentation) for every leaf field of a config tree."""
    rows = []
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls, include_extras=True)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        key = _join(prefix, f.name)
        if dataclasses.is_dataclass(hint):
            rows.extend(describe(hint, key))
        else:
            rows.append((key, _type_name(hint), docs.get(f.name, "")))
    return rows


def _convert(hint, value, key: str):
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin is Annotated:
        value = _convert(args[0], value, key)
        bounds = _bounds_of(hint)
        if bounds is not None:
            try:
                bounds.check(key, value)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        return value
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, {} if value is None else value, key)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return _convert(option, value, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"{key}: expected {_type_name(hint)}, got {value!r}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: expected one of {', '.join(map(repr, args))}, "
                              f"got {value!r}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        item = args[0] if args else Any
        converted = [_convert(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return converted if origin is list else tuple(converted)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        item = args[1] if len(args) == 2 else Any
        return {k: _convert(item, v, f"{key}.{k}") for k, v in value.items()}
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):  # PyYAML (YAML 1.1) reads `1e-6` as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    if hint is Path:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a path, got {value!r}")
        return Path(value)
    raise ConfigError(f"{key}: unsupported annotation {hint!r}")


def _type_name(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        bounds = _bounds_of(hint)
        return _type_name(args[0]) + (f" {bounds}" if bounds is not None else "")
    if origin is Literal:
        return " | ".join(map(repr, args))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    return "null" if hint is type(None) else getattr(hint, "__name__", str(hint))


def _join(prefix: str, name) -> str:
    return f"{prefix}.{name}" if prefix else str(name)


def _deep_copy(data):
    if isinstance(data, dict):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data
