"""The secret tenant salts derive from (gateway/auth.py). Configured (`--salt-secret`, YAML, or
$PREFIXGATE_SALT_SECRET, e.g. from a Kubernetes Secret) it is used as given; otherwise it is kept in a
file beside the model cache, created on first start with mode 0600, so tenant salts, and with them the
disk tier's blocks and pins, stay the same across restarts and for every gateway that shares the folder.
A folder that cannot keep it leaves salts random for this start, with a warning."""
from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from engine.paths import default_cache_dir

log = logging.getLogger("gateway")
SALT_SECRET_FILE = "salt-secret"
SALT_SECRET_ENV = "PREFIXGATE_SALT_SECRET"  # e.g. from a Kubernetes Secret, kept out of the command line


@dataclass(frozen=True, slots=True)
class SaltSecret:
    """The secret (None: random salts this start) and what to log about it once logging is set up."""

    value: str | None
    level: int = logging.DEBUG
    message: str = "tenant salts derive from the configured salt_secret"

    def log(self) -> None:
        log.log(self.level, self.message)


def resolve_salt_secret(configured: str | None, folder: Path | None = None) -> SaltSecret:
    """The configured secret, else $PREFIXGATE_SALT_SECRET, else the kept one (made now if there is none)."""
    if configured:
        return SaltSecret(configured)
    if os.environ.get(SALT_SECRET_ENV):
        return SaltSecret(os.environ[SALT_SECRET_ENV], logging.INFO,
                          f"tenant salts derive from the salt secret in ${SALT_SECRET_ENV}")
    path = (folder or default_cache_dir()) / SALT_SECRET_FILE
    try:
        if path.exists():
            return SaltSecret(_read(path), logging.INFO,
                              f"tenant salts derive from the salt secret kept in {path} (--salt-secret sets one)")
        return SaltSecret(_create(path), logging.WARNING,
                          f"generated a salt secret in {path} (mode 0600): tenant salts derive from it from now on; "
                          "give gateways on other machines the same --salt-secret to share their cache")
    except OSError as exc:
        return SaltSecret(None, logging.WARNING,
                          f"no salt_secret configured and {path} cannot keep one ({exc.strerror or exc}): tenant "
                          "salts are random at this start, so no cached prefix outlives it")


def _create(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    secret = secrets.token_hex(32)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, secret.encode())
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # whole or absent; a start that loses the race reads the winner's
    except FileExistsError:
        return _read(path)
    finally:
        os.unlink(tmp)
    return secret


def _read(path: Path) -> str:
    secret = path.read_text().strip()
    if not secret:
        raise OSError(f"{path} is empty")
    return secret
