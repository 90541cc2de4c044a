"""Validation of engine options: unknown names and bad values become OptionError."""

from __future__ import annotations

from jaxspec.errors import OptionError


def reject_unknown(method: str, options: dict, known: tuple[str, ...]) -> None:
    unknown = sorted(set(options) - set(known))
    if unknown:
        allowed = ", ".join(known) if known else "none"
        raise OptionError(
            f"method={method!r} does not take option(s) {', '.join(unknown)}; it takes: {allowed}."
        )


def positive_int(name: str, value, *, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise OptionError(f"{name} must be a positive integer, got {value!r}.")
    if maximum is not None and value > maximum:
        raise OptionError(f"{name} must be at most {maximum}, got {value}.")
    return value
