"""`python -m bench [--quick] [--model PATH] [--workloads a,b] [--out DIR] [--peers]`;
`python -m bench cluster`; `python -m bench tiers`; `python -m bench pins`; `python -m bench serving`;
`python -m bench router-sim`."""
from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import torch

from bench import report
from bench.suite import ALL_WORKLOADS, Options, Suite


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer requests (< 5 minutes on 2 cores)")
    parser.add_argument("--model", default="default", help="model directory, or 'default' (SmolLM2-135M-Instruct)")
    parser.add_argument("--workloads", default=",".join(ALL_WORKLOADS),
                        help=f"comma-separated subset of {','.join(ALL_WORKLOADS)}")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"), help="where results go")
    parser.add_argument("--peers", action="store_true",
                        help="also run `transformers serve --continuous-batching` on the chatbot workload")
    parser.add_argument("--no-http", action="store_true", help="skip the rows measured through the HTTP gateway")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for the engine and transformers alike (default: torch's own)")
    parser.add_argument("--no-micro", action="store_true", help="skip the hash and prefill micro-benchmarks")
    parser.add_argument("--structured", action="store_true",
                        help="only the decode step time with and without JSON-schema requests (bench/structured.py)")
    parser.add_argument("--no-decode", action="store_true",
                        help="skip the decode roofline and the 4-chat multi-turn benchmarks")
    args = parser.parse_args(argv)
    names = tuple(n.strip() for n in args.workloads.split(",") if n.strip())
    unknown = [n for n in names if n not in ALL_WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {list(ALL_WORKLOADS)}")
    args.workloads = names
    return args


def run(args: argparse.Namespace, **options) -> dict:
    """`options`: further Options fields (the smoke test shrinks the workloads and the KV pool)."""
    start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suite = Suite(Options(model=args.model, workloads=args.workloads, quick=args.quick, peers=args.peers,
                          http=not args.no_http, out=out, **options))
    suite.run_workloads()
    if "chatbot" in args.workloads:
        suite.log("chatbot bar: cold, warm, 8 concurrent")
        suite.chatbot_bar()
        suite.checkpoint()
    if not args.no_micro:
        suite.log("micro-benchmarks: block hash + lookup, prefill efficiency")
        suite.micro()
        suite.checkpoint()
    if not args.no_decode:
        suite.log("decode step vs the memory-bandwidth roofline; 4 multi-turn chats")
        suite.decode()
        suite.multiturn_http()
        suite.checkpoint()
    suite.optional_http()
    results = {"environment": suite.environment(), "rows": suite.rows, "extra": suite.extra}
    results["targets"] = report.evaluate_targets(suite.rows, suite.extra)
    results["environment"]["wall_s"] = time.perf_counter() - start
    results["environment"]["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    results["plots"] = [str(p) for p in report.plot(results, out)]
    report.write_json(results, out)
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["cluster"]:  # replicas on Ray Serve under three routers (needs the cluster extra)
        from bench.cluster import main as cluster_main
        return cluster_main(argv[1:])
    if argv[:1] == ["serving"]:  # the server against the engine in process (and llama.cpp's server)
        from bench import serving
        return serving.main(argv[1:])
    if argv[:1] == ["tiers"]:  # cache tiers: eviction policies, disk tier, warm restart
        from bench import tiers
        return tiers.main(argv[1:])
    if argv[:1] == ["pins"]:  # pinned prefixes (cache_control): survival through bursts, cost when unused
        from bench import pins
        return pins.main(argv[1:])
    if argv[:1] == ["router-sim"]:  # the cluster router's index at 64 and 256 replicas, simulated (no Ray, no model)
        from bench import router_sim
        return router_sim.main(argv[1:])
    args = parse_args(argv)
    if args.structured:
        from bench import structured
        return structured.main(args.model)
    results = run(args)
    print()
    print(report.render(results))
    print(f"\nwall time {results['environment']['wall_s']:.0f} s; results in {args.out}/results.json; "
          f"plots: {', '.join(Path(p).name for p in results['plots'])}")
    print("Note: a shared 2-core machine; timings are noisy (other processes compete for the cores).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
