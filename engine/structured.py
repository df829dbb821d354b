from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    kind: str   # "json_object" | "json_schema" | "regex" | "choice" | "grammar"
    spec: str | None = None
