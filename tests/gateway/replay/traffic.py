"""What the recorder writes and the replay reads: SSE bodies as events, dotted paths into answers, JSON types."""
from __future__ import annotations

import json
from typing import Any


def sse_events(raw: bytes) -> list[dict]:
    """`event:` / `data:` blocks of an SSE body; data parsed as JSON ("[DONE]" kept as the string)."""
    events = []
    for block in raw.decode().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in fields:
            data = fields["data"]
            events.append({"event": fields.get("event"), "data": data if data == "[DONE]" else json.loads(data)})
    return events


def lookup(value: Any, path: str) -> tuple[bool, Any]:
    """(found, value) at a dotted path; list indexes are numbers."""
    for key in path.split("."):
        if isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        elif isinstance(value, dict) and key in value:
            value = value[key]
        else:
            return False, None
    return True, value


def json_type(value: Any) -> str:
    """JSON's name for the type of a parsed value (an integer apart from other numbers, as clients parse them)."""
    for kind, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"),
                       (dict, "object")):
        if isinstance(value, kind):
            return name
    return "null"


def event_kind(data: dict) -> str:
    """A Responses event by its type, a chat chunk by its object."""
    return data.get("type") or data.get("object")


def events_by_kind(events: list[dict]) -> dict[str, list[dict]]:
    by_kind: dict[str, list[dict]] = {}
    for event in events:
        if event["data"] != "[DONE]":
            by_kind.setdefault(event_kind(event["data"]), []).append(event["data"])
    return by_kind


def types_at(items: list[dict], path: str) -> list[str]:
    """The JSON types `path` has in the items that carry it, sorted."""
    return sorted({json_type(value) for item in items for found, value in [lookup(item, path)] if found})
