"""What every section module shares: the field helper (default + help) and what counts as a number (or a value of a
type) to judge."""

from __future__ import annotations

import dataclasses
from dataclasses import field


def is_number(x) -> bool:
    """An int or float that is not a bool (YAML's true is an int to Python); the rules judge ranges only of these."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def is_of_type(value, tp) -> bool:
    """`value` is a `tp` and not a bool (YAML's true is an int to Python): launch.preflight judges only such values."""
    return isinstance(value, tp) and not isinstance(value, bool)


def option(default=dataclasses.MISSING, help: str = "", factory=None):
    """A recipe field with its help text (what `hftrain config --all` and the errors show): its default, or
    `factory` for a mutable one. Public: the methods' sections declare their fields with it too."""
    if factory is not None:
        return field(default_factory=factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})
