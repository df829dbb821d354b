"""`python -m cluster serve --replicas N [--address ADDR] [gateway/engine flags]`.

Starts (or joins) Ray, deploys N engine replicas behind the prefix-affinity router, and serves
the same aiohttp gateway as `python -m gateway serve` in front of them.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from gateway.__main__ import StartupError, build_parser, settings_from_args, setup_logging
from gateway.app import scoped_settings
from cluster.prefix_index import DEFAULT_MEAN_LOAD_FACTOR

log = logging.getLogger("prefixgate.cluster")
ROUTERS = {
    "prefix": "cluster.router:PrefixAffinityRouter",
    "round_robin": "cluster.router:RoundRobinRouter",
    "pow2": "cluster.router:PowerOfTwoRouter",  # Ray's default policy
    "ray_prefix": "cluster.router:RayPrefixCacheRouter",  # Ray's own prefix router
}


def cluster_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m cluster serve", add_help=False,
                                     description="engine replicas on Ray Serve; every other flag is "
                                                 "`python -m gateway serve`'s")
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("--replicas", type=int, default=2, help="engine replicas (default: 2)")
    parser.add_argument("--address", default=None,
                        help="join this Ray cluster (e.g. auto, or ray://head:10001); default: start a local one")
    parser.add_argument("--router", choices=sorted(ROUTERS), default="prefix", help="request router (default: prefix)")
    parser.add_argument("--mean-load-factor", type=float, default=DEFAULT_MEAN_LOAD_FACTOR,
                        help="prefix router: no replica is given more than this x the mean load; a prefix whose "
                             "replica is at that bound goes to the best match under it (default: "
                             f"{DEFAULT_MEAN_LOAD_FACTOR})")
    parser.add_argument("--app-name", default="prefixgate", help="Serve application name (default: prefixgate)")
    parser.add_argument("--attach", action="store_true",
                        help="deploy nothing: front the replicas of an app already running (e.g. KubeRay's)")
    return parser


def deploy(settings, replicas: int, router: str, mean_load_factor: float, app_name: str, shared: bool):
    """Deploys the replicas (Ray must be initialised) and returns the engine handle. `shared`: a cluster
    joined with --address, where each replica reserves its threads' CPUs (so Ray spreads them over the
    machines); on our own local Ray they share this machine's cores unreserved."""
    from ray import serve

    from cluster.replica import deployment

    engine = settings.engine
    if engine.threads is None:  # replicas on one machine share its cores
        share = max(1, (os.cpu_count() or 1) // replicas)
        engine = engine.replace(threads=share, threads_batch=engine.threads_batch or share)
    app = deployment(engine, replicas, ROUTERS[router], index=app_name, mean_load_factor=mean_load_factor,
                     max_ongoing_requests=max(engine.max_num_seqs * 4, 8),
                     num_cpus=float(engine.threads) if shared else 0.0)
    return serve.run(app, name=app_name, route_prefix=None), engine


async def run(settings, handle, engine, replicas: int, app_name: str) -> None:
    from cluster.client import ClusterEngine
    from gateway.__main__ import serve as serve_gateway
    from gateway.app import create_app

    client = await ClusterEngine.connect(handle, engine, index=app_name, num_replicas=replicas)
    log.info("%d replicas of %s up", client.replicas_up(), client.model_name)
    await serve_gateway(settings, create_app(settings, engine=client))


def wait_for_app(serve, app_name: str, poll_s: float = 2.0, log_every_s: float = 30.0, sleep=time.sleep):
    """The app's handle, once it exists: KubeRay deploys the Serve app only after the head pod is Ready, and
    the head pod holds this gateway, so exiting here (as before) deadlocked the RayService. Until then
    nothing listens, so a readiness probe on /health stays false and the container keeps running."""
    from ray.serve.exceptions import RayServeException

    waited, logged = 0.0, None
    while True:
        try:
            return serve.get_app_handle(app_name)
        except RayServeException as exc:
            if logged is None or waited - logged >= log_every_s:
                log.info("waiting for Serve app %r to exist (%s); waited %.0f s", app_name, exc, waited)
                logged = waited
        sleep(poll_s)
        waited += poll_s


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in ([], ["-h"], ["--help"]) or "-h" in argv or "--help" in argv:  # (`serve --help` too)
        cluster_parser().print_help()
        return 0
    args, rest = cluster_parser().parse_known_args(argv)
    gateway_args = build_parser().parse_args(["serve", *rest])
    try:
        if args.replicas < 1:
            raise ValueError("--replicas must be >= 1")
        # the replicas' engines restore only the saved pins this gateway's tenants can hit (the secret resolved
        # once here, so the gateway derives the same salts): unscoped, they restored every tenant's
        settings, _, salt_secret = scoped_settings(settings_from_args(gateway_args))
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings.gateway.log_level)
    salt_secret.log()  # (the gateway finds it configured: where it came from is said here)
    import ray
    import uvloop
    from ray import serve

    from cluster import kv_event_log

    ray.init(address=args.address, include_dashboard=False, namespace="prefixgate")
    if not args.attach:  # an attached gateway leaves Serve's settings (its proxy) to whoever deployed the app
        serve.start(proxy_location="Disabled")  # the aiohttp gateway is the HTTP face, not Serve's proxy
    try:
        if args.attach:
            handle, engine = wait_for_app(serve, args.app_name), settings.engine
        else:
            handle, engine = deploy(settings, args.replicas, args.router, args.mean_load_factor, args.app_name,
                                    shared=args.address is not None)
        uvloop.run(run(settings, handle, engine, args.replicas, args.app_name))
    except StartupError as exc:  # (a port in use, ...: one line, as the gateway's own)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if args.address is None:  # our own local Ray: everything goes
            serve.shutdown()
            ray.shutdown()
        elif not args.attach:  # a shared cluster: remove only the app we deployed, and its KV event log
            serve.delete(args.app_name)
            kv_event_log.remove(args.app_name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
