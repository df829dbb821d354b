"""Structured outputs, as a request states them: a grammar kind (JSON schema, JSON, regex, choice list, EBNF)
and its spec, checked without a tokenizer. Plain data, no torch: the API process checks specs with it, and
engine/grammar.py compiles them against the vocabulary in the engine.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    kind: str  # "json_object" | "json_schema" | "regex" | "choice" | "grammar"
    spec: str | None = None  # JSON schema text, regex, JSON list of choices, or EBNF grammar

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown structured output kind {self.kind!r}; expected one of {KINDS}")
        if self.kind != "json_object" and not isinstance(self.spec, str):
            raise ValueError(f"a {self.kind} structured output needs its spec")


def build_grammar(so: StructuredOutput) -> str:
    """llguidance's grammar text for `so`, checked without a tokenizer; ValueError saying what is wrong."""
    import llguidance
    if so.kind == "choice":
        _check_choices(so.spec)
    try:
        if so.kind == "json_object":
            # compact separators: free whitespace lets a weak model pad forever instead of closing the object
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                '{"type": "object"}', defaults={"whitespace_flexible": False})
        elif so.kind == "json_schema":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                closed_objects(load_json_object(so.spec, "the schema")), defaults={"whitespace_flexible": False})
        else:
            grammar = llguidance.grammar_from("grammar" if so.kind == "grammar" else so.kind, so.spec)
    except ValueError as exc:
        raise ValueError(f"invalid {so.kind}: {exc}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"invalid {so.kind}: {error.strip()}")
    return grammar


def load_json_object(text: str, name: str) -> dict:
    """`text` parsed as a JSON object; ValueError naming `name` where it is not JSON or not an object."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{name} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object")
    return value


def closed_objects(node):
    """Objects admit no property the schema does not name, unless it says otherwise (OpenAI's strict
    mode, and xgrammar's default): an open object lets a model invent keys instead of closing it."""
    if isinstance(node, list):
        return [closed_objects(n) for n in node]
    if not isinstance(node, dict):
        return node
    closed = {k: closed_objects(v) for k, v in node.items()}
    if "properties" in node and "additionalProperties" not in node:
        closed["additionalProperties"] = False
    return closed


def _check_choices(spec: str) -> None:
    try:
        choices = json.loads(spec)
    except ValueError:
        raise ValueError("invalid choice: the spec must be a JSON array of strings") from None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("invalid choice: expected a non-empty array of non-empty strings")
