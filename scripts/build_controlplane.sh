#!/usr/bin/env bash
# Builds the real Kubernetes control plane the cluster tests run on (kube-apiserver,
# kube-controller-manager, kube-scheduler and etcd) from Kubernetes' own Go modules at the release
# pinned in tests/cluster/controlplane/go.mod. Binaries go to OUT/<version>/ (default
# .cache/controlplane, ignored by git); a second run finds them and exits at once. Go's build cache
# (GOCACHE) makes a rebuild after `git clean` a link step (~1 min); a cold one is ~15 min on 2 cores.
#
# Usage: scripts/build_controlplane.sh [OUT] [MODULE]   prints the bin directory on its last line
#   MODULE: the Go module that pins the release (default tests/cluster/controlplane, the oldest
#   served; tests/cluster/controlplane-newest pins the newest).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
mod="$(cd "${2:-$here/tests/cluster/controlplane}" && pwd)"
version="$(awk '$1 == "k8s.io/kubernetes" {print $2}' "$mod/go.mod")"
etcd_version="$(awk '$1 == "go.etcd.io/etcd/server/v3" {print $2}' "$mod/go.mod")"
[ -n "$version" ] && [ -n "$etcd_version" ] || { echo "no pinned versions in $mod/go.mod" >&2; exit 1; }
out="$(mkdir -p "${1:-$here/.cache/controlplane}" && cd "${1:-$here/.cache/controlplane}" && pwd)/$version"
bins=(kube-apiserver kube-controller-manager kube-scheduler etcd)

missing=()
for b in "${bins[@]}"; do [ -x "$out/$b" ] || missing+=("$b"); done
if [ ${#missing[@]} -eq 0 ]; then echo "$out"; exit 0; fi

command -v go >/dev/null || { echo "go is required to build the control plane (Go >= 1.24)" >&2; exit 1; }
start=$(date +%s)
mkdir -p "$out.tmp"
cd "$mod"
export CGO_ENABLED=0 GOFLAGS="${GOFLAGS:-} -mod=mod -trimpath"
ldflags="-s -w -X k8s.io/component-base/version.gitVersion=$version -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$(echo "$version" | cut -d. -f2)"
for b in "${missing[@]}"; do
  case "$b" in
    etcd) go build -ldflags "-s -w" -o "$out.tmp/etcd" ./etcd ;;
    *) go build -tags providerless -ldflags "$ldflags" -o "$out.tmp/$b" "k8s.io/kubernetes/cmd/$b" ;;
  esac
  echo "built $b ($(( $(date +%s) - start )) s)" >&2
done
mkdir -p "$out"
for b in "${missing[@]}"; do mv "$out.tmp/$b" "$out/$b"; done
rmdir "$out.tmp"
echo "control plane $version (etcd $etcd_version) built in $(( $(date +%s) - start )) s" >&2
echo "$out"
