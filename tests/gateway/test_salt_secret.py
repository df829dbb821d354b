"""The salt secret: configured wins; otherwise one is generated on first start, kept with mode 0600 beside the
model cache and reused, so a restart (or a second gateway on that folder) keeps every tenant's salt; a folder
that cannot keep it costs the cache across restarts, never the start."""
from __future__ import annotations

import logging
import os
import stat

from gateway import salt_secret
from gateway.auth import Authenticator
from gateway.salt_secret import SALT_SECRET_ENV, SALT_SECRET_FILE, resolve_salt_secret
from gateway.settings import ApiKey, GatewaySettings


def test_a_configured_secret_is_used_as_given(tmp_path):
    assert resolve_salt_secret("from-a-k8s-secret", tmp_path).value == "from-a-k8s-secret"
    assert not (tmp_path / SALT_SECRET_FILE).exists()


def test_the_environment_gives_a_secret_the_command_line_does_not_show(tmp_path, monkeypatch):
    """$PREFIXGATE_SALT_SECRET, e.g. from a Kubernetes Secret (deploy/rayservice.yaml); the flag still wins."""
    monkeypatch.setenv(SALT_SECRET_ENV, "from-the-env")
    assert resolve_salt_secret(None, tmp_path).value == "from-the-env"
    assert resolve_salt_secret("flag", tmp_path).value == "flag"
    assert not (tmp_path / SALT_SECRET_FILE).exists()


def test_the_first_start_generates_a_private_secret_and_later_starts_keep_it(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="gateway"):
        first = resolve_salt_secret(None, tmp_path)
        second = resolve_salt_secret(None, tmp_path)
        first.log(), second.log()
    assert first.value == second.value and len(first.value) == 64
    assert stat.S_IMODE(os.stat(tmp_path / SALT_SECRET_FILE).st_mode) == 0o600
    assert "generated a salt secret" in caplog.text and "kept in" in caplog.text
    assert not [p for p in tmp_path.iterdir() if p.name != SALT_SECRET_FILE]  # no temporary left behind


def test_two_gateways_sharing_the_folder_derive_the_same_salts(tmp_path):
    def alice_salt() -> str:
        settings = GatewaySettings(api_keys=(ApiKey("k", "alice"),),
                                   salt_secret=resolve_salt_secret(None, tmp_path).value)
        return Authenticator(settings)._lookup("k").salt
    assert alice_salt() == alice_salt()


def test_a_folder_that_cannot_keep_it_leaves_salts_random_with_a_warning(tmp_path, monkeypatch, caplog):
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(salt_secret.os, "open", refuse)
    with caplog.at_level(logging.WARNING, logger="gateway"):
        kept = resolve_salt_secret(None, tmp_path / "cache")
        kept.log()
    assert kept.value is None
    assert "random at this start" in caplog.text
