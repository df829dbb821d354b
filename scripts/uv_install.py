"""`pip install`, done by uv: `python scripts/uv_install.py PYTHON ARGS...` installs ARGS into PYTHON's environment.

uv resolves, fetches and unpacks in parallel and links files from its cache, so it installs in seconds what pip
takes minutes over (docs/development.md, "Where the time goes"). It reads none of pip's configuration, so this
hands pip's over (its config files and PIP_* variables, as `pip config list` shows them): a machine's package
mirror, its local wheels (torch's CPU build among them: without them `torch==2.13.0` resolves to the CUDA build)
and its constraints. Runs with an interpreter that has pip and uv (make installs uv with pip first).
"""

import ast
import os
import subprocess
import sys

from uv import find_uv_bin

# pip's options that uv takes as flags of the same name; each holds one or more whitespace-separated values
FLAGS = ("index-url", "extra-index-url", "find-links", "constraint")
# pip's option -> the variable uv reads for the same setting
VARIABLES = {"cert": "SSL_CERT_FILE", "timeout": "UV_HTTP_TIMEOUT", "default-timeout": "UV_HTTP_TIMEOUT"}


def pip_settings() -> dict[str, str]:
    """pip's settings for `pip install`, later sources overriding earlier ones as in pip (files, then PIP_*)."""
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], check=True, capture_output=True,
                             text=True).stdout
    settings = {}
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        section, _, name = key.rpartition(".")
        if section in ("global", "install", ":env:") and value:
            settings[name] = ast.literal_eval(value)
    return settings


def uv_command(python: str, args: list[str], settings: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """uv's command line and environment for `pip install ARGS` into `python`'s environment under `settings`."""
    # as pip does: the best version any index has (uv by default takes only the first index's that has the
    # package). Unlike pip, no bytecode at install: the Makefile lets Python write it at first import, for the
    # modules that run
    command = [find_uv_bin(), "pip", "install", "--python", python, "--index-strategy", "unsafe-best-match"]
    env = dict(os.environ)
    for name, value in settings.items():
        if name in FLAGS:
            for item in value.split():
                command += [f"--{name}", item]
        elif name in VARIABLES:
            env[VARIABLES[name]] = value
    return command + args, env


def main() -> int:
    python, *args = sys.argv[1:]
    command, env = uv_command(python, args, pip_settings())
    return subprocess.run(command, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
