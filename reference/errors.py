"""The one error type of bad input (SPEC §7), in a module of its own so that every module that
checks an argument can import it without importing the modules whose types it checks."""

from __future__ import annotations


class MegaMoEInputError(TypeError, ValueError):
    """An argument of a megamoe call is not what the contract (SPEC §7) accepts.

    It is both a TypeError and a ValueError: SPEC §7 covers wrong types (a dtype, a device) and
    wrong values (a shape, an expert id) with one exception, and callers that catch either of the
    built-in kinds keep working.
    """


def fail(arg: str, expected: str, actual) -> None:
    """Raise the error in the contract's words: the argument, what it accepts, what it got."""
    raise MegaMoEInputError(f"argument '{arg}': expected {expected}, got {actual}")
