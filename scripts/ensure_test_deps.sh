#!/usr/bin/env bash
# Installs the real server parts the end-to-end tests use (Prometheus, promtool, PostgreSQL, and
# Chromium for the chat page's browser tests) when they are missing and we may install
# them (root). Tests fail when CI is set and a part is still missing.
set -u

# ensure PACKAGE PURPOSE COMMAND...: apt-get installs PACKAGE unless every COMMAND is on the PATH
ensure() {
  local package=$1 purpose=$2 command
  shift 2
  for command in "$@"; do
    command -v "$command" >/dev/null 2>&1 && continue
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
      echo "installing $package (Debian package) for $purpose"
      (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$package" >/dev/null) \
        || echo "warning: could not install $package"
    else
      echo "warning: $package is not installed; $purpose will fail under CI"
    fi
    return
  done
}

ensure chromium "the chat page's browser tests" chromium
ensure prometheus "the metrics end-to-end tests" prometheus promtool
# the server binaries live in /usr/lib/postgresql/*/bin (tests/support/postgres.py finds them); pg_ctlcluster is
# postgresql-common's, installed with them
ensure postgresql "the stored-responses tests on a shared PostgreSQL" pg_ctlcluster
