#!/usr/bin/env bash
# Install the Debian packages a make target needs, skipping what is already there.
#
# Usage: scripts/system_deps.sh PACKAGE...
#
# Quiet when nothing is missing. As root with apt-get, installs the rest (one
# `apt-get update`, non-interactive). Otherwise stops with the one command to run, so a
# newcomer's `make run` / `make test` never half-works because a system package is absent.
# The Makefile names the packages per target (RUN_SYSTEM_DEPS, TEST_SYSTEM_DEPS, ...).
set -euo pipefail

missing=()
for pkg in "$@"; do
  # `dpkg -s` also reports packages that were removed but left their config behind.
  status=$(dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null || true)
  [ "$status" = "installed" ] || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0

command="apt-get install -y ${missing[*]}"
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "system_deps: missing Debian packages; run: sudo apt-get update && sudo $command" >&2
  exit 1
fi

echo "==> installing system packages: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
# Wait for another apt/dpkg run (an unattended upgrade, a parallel make) instead of failing.
lock_wait=(-o DPkg::Lock::Timeout=300)
apt-get "${lock_wait[@]}" update -qq
apt-get "${lock_wait[@]}" install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
