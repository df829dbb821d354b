"""TTFT of the quick chatbot workload in a fresh engine, as JSON: `python -m bench.chatbot_ttft`.

For A/B runs against another checkout, run it alternately in both, one process per run (the whole
`python -m bench` suite is not like for like across versions: its order and its other rows change):

    for i in 1 2 3 4 5 6; do (cd ../old && python -m bench.chatbot_ttft); python -m bench.chatbot_ttft; done
"""
from __future__ import annotations

import argparse
import json
import statistics

from bench import driver, workloads


def run(model: str = "default", scale: workloads.Scale = workloads.QUICK) -> dict:
    probe = driver.EngineCore(driver.EngineConfig(model=model, num_kv_blocks=16))
    workload = workloads.build("chatbot", probe.tokenizer, scale)
    del probe
    core = driver.make_core(model, workload)
    driver.warm_up(core)
    ttfts = sorted(t.ttft for t in driver.run_engine(core, workload, "cache-on").timings)
    return {"ttft_p50_s": round(statistics.median(ttfts), 3), "ttft_max_s": round(ttfts[-1], 3),
            "ttfts_s": [round(t, 3) for t in ttfts]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chatbot_ttft", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    print(json.dumps(run(parser.parse_args(argv).model)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
