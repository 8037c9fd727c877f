"""The one error type of bad input (SPEC §7) and the argument checks every public function of the
reference shares, in a module of its own so that every module that checks an argument can import
it without importing the modules whose types it checks (validate.py holds the checks of the
contract's own tensors: a call's inputs and weights)."""

from __future__ import annotations

from typing import NoReturn

import torch


class MegaMoEInputError(TypeError, ValueError):
    """An argument of a megamoe call is not what the contract (SPEC §7) accepts.

    It is both a TypeError and a ValueError: SPEC §7 covers wrong types (a dtype, a device) and
    wrong values (a shape, an expert id) with one exception, and callers that catch either of the
    built-in kinds keep working.
    """


def fail(arg: str, expected: str, actual) -> NoReturn:
    """Raise the error in the contract's words: the argument, what it accepts, what it got."""
    raise MegaMoEInputError(f"argument '{arg}': expected {expected}, got {actual}")


def check_type(arg: str, value, cls: type) -> None:
    """`value` is an instance of `cls` (a MoEConfig, a RankInputs, ...)."""
    if not isinstance(value, cls):
        fail(arg, cls.__name__, type(value).__name__)


def check_int(arg: str, value, minimum: int | None = 0, maximum: int | None = None) -> None:
    """`value` is an int in [minimum, maximum] (None: unbounded). A bool, a float or a string is
    refused, not converted: 1024.0 or '1024' for a size is a caller's mistake to show."""
    if isinstance(value, bool) or not isinstance(value, int):
        fail(arg, "an int", f"{value!r} ({type(value).__name__})")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        if maximum is None:
            fail(arg, f"an int >= {minimum}", value)
        fail(arg, f"an int in [{minimum}, {maximum}]" if minimum is not None else f"an int <= {maximum}", value)


def check_list(arg: str, value, length: int | None, what: str) -> None:
    """A list or tuple of `length` entries (None: any number, at least one); `what` says what it
    holds, in the expected-value words ("2 RankInputs, one per rank")."""
    if not isinstance(value, (list, tuple)):
        fail(arg, f"a list of {what}", type(value).__name__)
    if len(value) != length if length is not None else not value:
        fail(arg, f"a list of {what}", f"{len(value)} entries")


def check_bool(arg: str, value) -> None:
    """A bool, not a truthy stand-in ('false' is a non-empty string, so it would mean True)."""
    if not isinstance(value, bool):
        fail(arg, "a bool", f"{value!r} ({type(value).__name__})")


# Dtype classes check_tensor accepts besides torch dtypes.
FLOATING, INTEGER = "floating-point", "integer"


def check_tensor(
    arg: str, t, dtype=None, shape: tuple | None = None, device=None, *, min_dim: int = 0, contiguous: bool = False
) -> None:
    """`t` is a torch.Tensor of `dtype` (a torch.dtype, a tuple of them, FLOATING or INTEGER), of
    `shape` (None on an axis: any size) or of at least `min_dim` dims ([..., K]), on `device` (a
    torch.device), contiguous if asked."""
    if not isinstance(t, torch.Tensor):
        fail(arg, "a torch.Tensor", type(t).__name__)
    if dtype == FLOATING:
        if not t.is_floating_point():
            fail(arg, "a floating-point tensor", t.dtype)
    elif dtype == INTEGER:
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            fail(arg, "an integer tensor", t.dtype)
    elif dtype is not None:
        dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
        if t.dtype not in dtypes:
            fail(arg, "dtype " + " or ".join(map(str, dtypes)), t.dtype)
    if shape is not None and (t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape))):
        fail(arg, "shape [" + ", ".join("*" if s is None else str(s) for s in shape) + "]", list(t.shape))
    if t.dim() < min_dim:
        fail(arg, f"a tensor of at least {min_dim} dimension(s)", f"shape {list(t.shape)}")
    if device is not None and t.device != device:
        fail(arg, f"device {device}", t.device)
    if contiguous and not t.is_contiguous():
        fail(arg, "a contiguous tensor", f"strides {t.stride()}")


def check_float_dtype(arg: str, dtype) -> None:
    """A floating-point torch.dtype (what a decoder returns its values in)."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        fail(arg, "a floating-point torch.dtype", dtype)
