#!/usr/bin/env bash
# Installs the real server parts the end-to-end tests use (Prometheus, promtool, and
# Chromium for the chat page's browser tests) when they are missing and we may install
# them (root). Tests fail when CI is set and a part is still missing.
set -u
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing chromium (Debian package) for the chat page's browser tests"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
      || echo "warning: could not install chromium"
  else
    echo "warning: chromium is not installed; the chat page's browser tests will fail under CI"
  fi
fi
if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing prometheus (Debian package) for the metrics tests"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null) \
      || echo "warning: could not install prometheus"
  else
    echo "warning: prometheus is not installed; the metrics end-to-end tests will fail under CI"
  fi
fi
