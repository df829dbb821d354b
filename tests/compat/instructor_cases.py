"""instructor on chat completions, run by .venv/compat-instructor's python (see instructor.txt):
`instructor_cases.py BASE_URL MODEL MODE` prints one JSON object, what instructor parsed and what the
completion it parsed from said. tests/gateway/test_client_compat.py asserts on it."""
from __future__ import annotations

import json
import sys
from typing import Literal

import instructor
import openai
from pydantic import BaseModel


class City(BaseModel):  # enums: the tiny random model closes them at once (a free string it never ends)
    name: Literal["Paris", "Rome"]
    country: Literal["France", "Italy"]


def main(base_url: str, model: str, mode: str) -> None:
    with openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=30) as raw:
        client = instructor.from_openai(raw, mode=instructor.Mode[mode])
        city, completion = client.chat.completions.create_with_completion(
            model=model, response_model=City, max_retries=0, max_tokens=200, temperature=0,
            messages=[{"role": "user", "content": "A city in Europe"}])
    choice = completion.choices[0]
    print(json.dumps({"type": type(city).__name__, "parsed": city.model_dump(),
                      "finish_reason": choice.finish_reason, "content": choice.message.content,
                      "tool_calls": [c.function.model_dump() for c in choice.message.tool_calls or []]}))


if __name__ == "__main__":
    main(*sys.argv[1:])
