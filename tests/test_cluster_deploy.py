"""The KubeRay manifest parses, and what it deploys is what this code can run (no Kubernetes here)."""
from __future__ import annotations

import tomllib
from pathlib import Path

import yaml

from cluster.__main__ import cluster_parser
from engine.config import EngineConfig
from gateway.__main__ import build_parser

ROOT = Path(__file__).resolve().parents[1]


def _documents() -> dict[str, dict]:
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "rayservice.yaml").read_text()))
    return {doc["kind"]: doc for doc in docs}


def test_rayservice_deploys_the_replica_app_with_engine_settings_this_code_accepts():
    service = _documents()["RayService"]
    assert service["apiVersion"] == "ray.io/v1"
    serve_config = yaml.safe_load(service["spec"]["serveConfigV2"])
    (app,) = serve_config["applications"]
    assert app["import_path"] == "cluster.replica:build_app"
    args = dict(app["args"])
    assert (args.pop("replicas"), args.pop("app_name"), args.pop("max_load_spread")) == (4, "prefixgate", 4)
    assert args.pop("router") == "cluster.router:PrefixAffinityRouter"
    EngineConfig(**args)  # every remaining arg is an engine setting
    (pin,) = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["cluster"]
    assert pin == f"ray[serve]=={service['spec']['rayClusterConfig']['rayVersion']}"  # image and extra agree


def test_the_gateway_container_runs_a_command_the_cli_accepts_and_the_service_selects_it():
    docs = _documents()
    head = docs["RayService"]["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    (gateway,) = [c for c in head["spec"]["containers"] if c["name"] == "gateway"]
    command = gateway["command"]
    assert command[:3] == ["python", "-m", "cluster"]
    args, rest = cluster_parser().parse_known_args(command[3:])
    assert args.attach and args.app_name == "prefixgate"
    build_parser().parse_args(["serve", *rest])  # the rest are gateway flags
    assert docs["Service"]["spec"]["selector"].items() <= head["metadata"]["labels"].items()


def test_an_attached_gateway_waits_for_the_app_instead_of_exiting(caplog):
    """Before the Serve app exists `--attach` waits (nothing listens, so a readiness probe stays false);
    it used to exit 1, which KubeRay's start-up order turned into a deadlock."""
    import logging

    from ray.serve.exceptions import RayServeException

    from cluster.__main__ import wait_for_app

    class Serve:
        calls = 0

        def get_app_handle(self, name):
            self.calls += 1
            if self.calls < 4:
                raise RayServeException(f"Application '{name}' does not exist.")
            return f"handle of {name}"

    slept = []
    with caplog.at_level(logging.INFO, logger="prefixgate.cluster"):
        handle = wait_for_app(Serve(), "prefixgate", poll_s=2.0, log_every_s=4.0, sleep=slept.append)
    assert handle == "handle of prefixgate" and slept == [2.0, 2.0, 2.0]
    assert caplog.text.count("waiting for Serve app 'prefixgate'") == 2  # at 0 s and 4 s, not every poll
