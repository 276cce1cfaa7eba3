#!/usr/bin/env bash
# Debian packages the test suite needs, and why. Run by `make test`, never by `make setup` or
# `make demo`: a user who only wants to train does not get browsers or firewall tools installed.
#
#   chromium   headless browser for the dashboard tests (tests/integration/test_server_dashboard.py)
#   nftables   enforces the per-job NetworkPolicy inside each pod's network namespace
#   iproute2   network namespaces, the test bridge and veth pairs of the process kubelet
#   util-linux unshare (a mount namespace per pod, read-only root) and setpriv (the pod's user)
#   bubblewrap the OS sandbox of the python_tests reward (namespaces, read-only root, private tmpfs)
#
# Each is installed only when its command is missing. Without apt-get (not Debian) or without
# root, it says what is missing and stops, so the suite never runs half-equipped by surprise.
set -euo pipefail

declare -A needs=(
  [chromium]=chromium
  [nft]=nftables
  [ip]=iproute2
  [unshare]=util-linux
  [setpriv]=util-linux
  [bwrap]=bubblewrap
)

missing=()
for cmd in "${!needs[@]}"; do
  command -v "$cmd" >/dev/null 2>&1 || missing+=("${needs[$cmd]}")
done
[ ${#missing[@]} -eq 0 ] && exit 0
mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)

echo "make test needs these Debian packages: ${missing[*]} (see $0 for why)"
if ! command -v apt-get >/dev/null 2>&1 || [ "$(id -u)" -ne 0 ]; then
  echo "error: install them (as root: apt-get install ${missing[*]}), then run make test again" >&2
  exit 1
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
echo "installed: ${missing[*]}"
