"""The secret tenant salts derive from (gateway/auth.py). Configured (`--salt-secret`, YAML, a Kubernetes
Secret) it is used as given; otherwise it is kept in a file beside the model cache, created on first start
with mode 0600, so tenant salts, and with them the disk tier's blocks and pins, stay the same across
restarts and for every gateway that shares the folder. A folder that cannot keep it leaves salts random for
this start, with a warning."""
from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

from engine.paths import default_cache_dir

log = logging.getLogger("gateway")
SALT_SECRET_FILE = "salt-secret"


def resolve_salt_secret(configured: str | None, folder: Path | None = None) -> str | None:
    """The configured secret, else the kept one (made now if there is none); None: random salts this start."""
    if configured:
        return configured
    path = (folder or default_cache_dir()) / SALT_SECRET_FILE
    try:
        return _kept(path)
    except OSError as exc:
        log.warning("no salt_secret configured and %s cannot keep one (%s): tenant salts are random at this start, "
                    "so no cached prefix outlives it", path, exc.strerror or exc)
        return None


def _kept(path: Path) -> str:
    if path.exists():
        log.info("tenant salts derive from the salt secret kept in %s (--salt-secret sets one)", path)
        return _read(path)
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
    log.warning("generated a salt secret in %s (mode 0600): tenant salts derive from it from now on; give "
                "gateways on other machines the same --salt-secret to share their cache", path)
    return secret


def _read(path: Path) -> str:
    secret = path.read_text().strip()
    if not secret:
        raise OSError(f"{path} is empty")
    return secret
