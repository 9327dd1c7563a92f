"""Settings dataclasses' plumbing: a field that is also a flag (:func:`option`), the checks
their validation shares, and their flags flattened (:func:`flag_fields`, :func:`flags_of`)."""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Sequence
from dataclasses import field
from typing import Any

from raytrain_mnist.errors import ConfigError


def option(default: Any, help: str, choices: tuple | None = None, flag: str | None = None):
    """A dataclass field whose metadata also drives the command line (its help, its choices):
    the one way a settings dataclass of this package declares a flag."""
    return field(default=default, metadata={"help": help, "choices": choices, "flag": flag})


def check_int(flag: str, value: Any, low: int, high: int | None = None) -> None:
    """``--flag`` must be an int (not a bool) in ``low..high`` (no upper bound when None)."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    if not ok or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in {low}..{high}"
        raise ConfigError(f"--{flag} must be an integer {bound}, got {value!r}")


def check_float(flag: str, value: Any, positive: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        kind = "a positive number" if positive else "a number >= 0"
        raise ConfigError(f"--{flag} must be {kind}, got {value!r}")


def check_choice(flag: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"--{flag} must be one of {', '.join(choices)}; got {value!r}")


def section_of(f: dataclasses.Field) -> type | None:
    """The settings dataclass a field holds (a section of its class), or None for a flag."""
    factory = f.default_factory
    return factory if isinstance(factory, type) and dataclasses.is_dataclass(factory) else None


def flag_fields(cls: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    """The flags of settings dataclass ``cls`` by name, each with its field and type: its
    own fields, and in place of a section (a field holding a settings dataclass) that
    section's, in ``cls.flag_order`` where it has one."""
    found: dict[str, tuple[dataclasses.Field, Any]] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        section = section_of(f)
        if section is None:
            found[f.name] = (f, hints[f.name])
        else:
            found.update(flag_fields(section))
    order = [n for n in getattr(cls, "flag_order", ()) if n in found]
    return {n: found[n] for n in [*order, *(n for n in found if n not in order)]}


def flag_values(config: Any) -> dict[str, Any]:
    """The value of each of ``config``'s flags (:func:`flag_fields`), by name."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        values.update(flag_values(value) if section_of(f) else {f.name: value})
    return {n: values[n] for n in flag_fields(type(config))}


def flags_of(
    *configs: Any, skip: Sequence[str] = (), defaults: dict[str, Any] | None = None
) -> list[str]:
    """The flags that rebuild ``configs`` (dataclass instances): every value that differs
    from its default (or from the one ``defaults`` gives: a recipe's), in field order.
    Inverse of ``_cli.add_dataclass_args``."""
    words: list[str] = []
    for config in configs:
        fields = flag_fields(type(config))
        for name, value in flag_values(config).items():
            default = (defaults or {}).get(name, fields[name][0].default)
            if name in skip or value == default or value is None:
                continue
            flag = "--" + name.replace("_", "-")
            if value is True:
                words.append(flag)
            elif value is not False:
                words += [flag, repr(value) if isinstance(value, float) else str(value)]
    return words
