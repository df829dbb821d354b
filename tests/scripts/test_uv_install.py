"""scripts/uv_install.py: pip's configuration handed to uv as its flags and variables."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.scripts import load_script


@pytest.fixture(scope="module")
def uv_install():
    return load_script("uv_install")


def fake_pip_config(monkeypatch, module, listing: str) -> None:
    def run(command, **kwargs):
        assert command[1:] == ["-m", "pip", "config", "list"]
        return subprocess.CompletedProcess(command, 0, stdout=listing, stderr="")
    monkeypatch.setattr(module.subprocess, "run", run)


def test_later_sources_override_earlier_ones_as_in_pip(uv_install, monkeypatch):
    # the order `pip config list` prints: config files (global, user, site), then the PIP_* variables
    fake_pip_config(monkeypatch, uv_install, "\n".join([
        "global.find-links='/opt/wheels'",
        "global.index-url='https://mirror.example/simple'",
        "install.constraint='/etc/constraints.txt'",
        "download.dest='/tmp/ignored'",
        ":env:.find-links='/srv/wheels /more/wheels'",
        ":env:.default-timeout='180'",
    ]))
    assert uv_install.pip_settings() == {
        "find-links": "/srv/wheels /more/wheels", "index-url": "https://mirror.example/simple",
        "constraint": "/etc/constraints.txt", "default-timeout": "180"}


def test_settings_become_uv_flags_and_variables(uv_install, monkeypatch):
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    settings = {"extra-index-url": "file:///a/simple file:///b/simple", "find-links": "/opt/wheels",
                "cert": "/etc/ssl/ca.crt", "timeout": "60", "disable-pip-version-check": "1"}
    command, env = uv_install.uv_command("/venv/bin/python", ["-q", "-e", ".[test]"], settings)
    assert command[1:] == [
        "pip", "install", "--python", "/venv/bin/python", "--index-strategy", "unsafe-best-match",
        "--extra-index-url", "file:///a/simple", "--extra-index-url", "file:///b/simple",
        "--find-links", "/opt/wheels", "-q", "-e", ".[test]"]
    assert Path(command[0]).name == "uv"
    assert env["SSL_CERT_FILE"] == "/etc/ssl/ca.crt" and env["UV_HTTP_TIMEOUT"] == "60"


def test_this_machines_pip_configuration_reads(uv_install):
    # the real `pip config list` of this interpreter: every value it prints parses
    settings = uv_install.pip_settings()
    command, _ = uv_install.uv_command(sys.executable, [], settings)
    assert all(isinstance(value, str) for value in settings.values())
    assert command.count("--find-links") == len(settings.get("find-links", "").split())
