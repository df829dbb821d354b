"""Request bodies -> JSON values a handler can trust: standard JSON only, finite numbers that fit in
64 bits, no lone UTF-16 surrogates, bounded depth. Any other body is a 400 naming the offending field."""
from __future__ import annotations

import json
import math
from typing import Any

from gateway.errors import invalid

MAX_DEPTH = 64  # far deeper than any OpenAI body; deeper would only burden every recursive reader after us
INT_LIMIT = 2**63  # token ids, seeds and counts all fit in 64 bits


class _Rejected:
    """A number the parser met that no field may hold; reported with its path by the walk."""

    __slots__ = ("text", "why")

    def __init__(self, text: str, why: str) -> None:
        self.text = text
        self.why = why


def _constant(name: str) -> _Rejected:  # Python's json reads NaN, Infinity and -Infinity; JSON has none of them
    return _Rejected(name, "is not valid JSON (numbers must be finite)")


def _float(text: str) -> float | _Rejected:
    value = float(text)
    return value if math.isfinite(value) else _Rejected(text[:32], "is out of range (numbers must be finite)")


def _int(text: str) -> int | _Rejected:
    # bounded by its length first: int() of a very long digit string is slow (and refused past 4,300 digits)
    if len(text.lstrip("-")) > 19 or not -INT_LIMIT <= (value := int(text)) < INT_LIMIT:
        return _Rejected(text[:32] + ("..." if len(text) > 32 else ""), "is out of range (at most 64 bits)")
    return value


def parse_body(raw: bytes) -> Any:
    """The parsed body, or a 400 APIError whose param names the field at fault."""
    try:
        text = raw.decode("utf-8")
        value = json.loads(text, parse_constant=_constant, parse_float=_float, parse_int=_int)
    except RecursionError:
        raise invalid(f"the request body is nested too deeply (at most {MAX_DEPTH} levels)", None) from None
    except (ValueError, UnicodeDecodeError):
        raise invalid("the request body is not valid JSON", None) from None
    _check(value)
    return value


def _check(root: Any) -> None:
    """Walks the value without recursion (its depth is the client's to choose)."""
    stack: list[tuple[Any, str, int]] = [(root, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value, path, "")
        elif isinstance(value, _Rejected):
            raise invalid(f"{path or 'the body'}: the number {value.text} {value.why}", path or None)
        elif isinstance(value, (dict, list)):
            if depth >= MAX_DEPTH:
                raise invalid(f"the request body is nested too deeply (at most {MAX_DEPTH} levels)", path or None)
            if isinstance(value, dict):
                for key, item in value.items():
                    _check_text(key, path, " has a key that")
                    stack.append((item, f"{path}.{key}" if path else key, depth + 1))
            else:
                stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))


def _check_text(text: str, path: str, what: str) -> None:
    # a lone surrogate ("\ud800") is valid JSON but no Unicode text: it cannot be encoded or tokenized
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid(f"{path or 'the body'}{what} contains a lone UTF-16 surrogate (not valid Unicode text)",
                      path or None) from None
