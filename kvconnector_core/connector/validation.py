"""The boundary where msgspec's validation errors become the project's messages.

msgspec checks a Struct's annotated types (``Literal``, ``Annotated[int, Meta(ge=1)]``)
on ``convert`` / ``decode`` and reports the first failure as one line of text. The
project's messages name the bad key, its value and the nearest valid choice, so when a
conversion fails :func:`find_field_problem` finds which field of the input is wrong by
checking each field on its own against its type (no reading of msgspec's text); the
caller words the message.

Primitives: :class:`FieldProblem`, :func:`find_field_problem`, :func:`field_choices`.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

__all__ = ["FieldProblem", "field_choices", "find_field_problem"]


@dataclass(frozen=True, slots=True)
class FieldProblem:
    """What is wrong with one field of the input to a Struct.

    Attributes:
        field: the field (for ``kind == "unknown"``, the key the Struct does not have).
        kind: ``"unknown"`` key, ``"missing"`` required field, or ``"invalid"`` value.
        reason: for an invalid value, msgspec's reason (``"Expected `int` >= 1"``);
            a value nested in the field adds where in it (`` - at `$[1]` ``).
    """

    field: str
    kind: Literal["unknown", "missing", "invalid"]
    reason: str = ""


def find_field_problem(struct_type: type[msgspec.Struct], data: Any, *,
                       strict: bool = True) -> FieldProblem | None:
    """The first problem msgspec would report converting ``data`` to ``struct_type``.

    Unknown keys come first, then invalid values in the order of ``data``, then missing
    required fields (msgspec's own order).

    Args:
        struct_type: the Struct type.
        data: the input (a mapping of field names to values).
        strict: as for ``msgspec.convert`` (False converts ``"64"`` to an int).

    Returns:
        The problem, or None when every field converts on its own (the failure is then
        the Struct's as a whole: ``data`` is not a mapping, or its ``__post_init__``
        refused it).
    """
    if not isinstance(data, Mapping):
        return None
    fields = {f.encode_name: f for f in msgspec.structs.fields(struct_type)}
    unknown = next((key for key in data if key not in fields), None)
    if unknown is not None:
        return FieldProblem(str(unknown), "unknown")
    for key, value in data.items():
        try:
            msgspec.convert(value, type=fields[key].type, strict=strict)
        except msgspec.ValidationError as exc:
            return FieldProblem(key, "invalid", str(exc))
    missing = next((key for key, f in fields.items() if f.required and key not in data), None)
    return None if missing is None else FieldProblem(missing, "missing")


def field_choices(struct_type: type[msgspec.Struct], field: str) -> tuple[Any, ...]:
    """The valid values of ``field`` when its type is a closed choice: a ``Literal``
    (optional or not) or a bool (as JSON writes it; ``"true"`` / ``"false"`` strings
    convert too); else ``()``."""
    hint = typing.get_type_hints(struct_type).get(field)
    if hint is bool:
        return ("true", "false")
    for option in (hint, *typing.get_args(hint)):
        if typing.get_origin(option) is Literal:
            return typing.get_args(option)
    return ()
