"""`python -m bench.tool_parser`: the cost of parsing tool calls out of a stream, per delta.

The streaming parser re-reads the text so far at every delta (see gateway/tool_parsers.py); this
measures what that costs over a long answer, to compare with a decode step."""
from __future__ import annotations

import time

from gateway.tool_parsers import PARSER_NAMES, ToolCallStream, make_parser

DELTAS = 4000


def main() -> None:
    for name in PARSER_NAMES:
        stream = ToolCallStream(make_parser(name))
        started = time.perf_counter()
        for i in range(DELTAS):
            stream.feed(" word" if i % 7 else " the,\n")
        stream.finish()
        total = time.perf_counter() - started
        print(f"{name}: {DELTAS} deltas of plain text in {total * 1e3:.1f} ms "
              f"({total / DELTAS * 1e6:.1f} us per delta on average)")


if __name__ == "__main__":
    main()
