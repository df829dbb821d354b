"""A real PostgreSQL server for the tests, from the Debian package's binaries (make test installs it): a
throwaway cluster on a unix socket, run as the `postgres` user when the tests run as root (initdb refuses root).
Missing binaries fail the test under CI and skip it elsewhere."""
from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


def _bindir() -> Path | None:
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).resolve().parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    return Path(versions[-1]).parent if versions else None


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """Yields the URL of a fresh server (database `postgres`, trust auth on its socket); stopped afterwards."""
    bindir = _bindir()
    if bindir is None:
        message = "PostgreSQL is not installed (apt-get install postgresql; make test does it as root)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    folder = Path(tempfile.mkdtemp(prefix="pg-"))  # short: a socket path has at most 107 bytes
    run_as: list[str] = []
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres")
        os.chown(folder, user.pw_uid, user.pw_gid)
        run_as = ["runuser", "-u", "postgres", "--"]
    data = folder / "data"

    def run(*cmd: str) -> None:
        subprocess.run([*run_as, *cmd], check=True, capture_output=True, timeout=120)

    try:
        run(str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync")
        run(str(bindir / "pg_ctl"), "-D", str(data), "-w", "-l", str(folder / "log"), "-o",
            f"-k {folder} -c listen_addresses='' -c fsync=off", "start")
        yield f"postgresql://postgres@/postgres?host={folder}"
    finally:
        if (data / "postmaster.pid").exists():
            run(str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop")
        shutil.rmtree(folder, ignore_errors=True)
