#!/usr/bin/env bash
# Builds Kueue's controller manager from its own Go module at the release pinned in
# tests/cluster/kueue/go.mod, and copies that release's CRDs and webhook manifests next to it:
# OUT/<version>/{kueue,crds/,webhook/} (default .cache/kueue, ignored by git). A second run finds
# them and exits at once. OUT/<version>/crd-patches holds the CRD patches of Kueue's kustomization. Cold: a few minutes on 2 cores (shares Go's caches with the control plane).
#
# Usage: scripts/build_kueue.sh [OUT]     prints the output directory on its last line
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
mod="$here/tests/cluster/kueue"
version="$(grep -oE 'sigs\.k8s\.io/kueue v[^ ]+' "$mod/go.mod" | head -1 | cut -d' ' -f2)"
[ -n "$version" ] || { echo "no pinned Kueue version in $mod/go.mod" >&2; exit 1; }
out="$(mkdir -p "${1:-$here/.cache/kueue}" && cd "${1:-$here/.cache/kueue}" && pwd)/$version"
if [ -x "$out/kueue" ] && [ -d "$out/crds" ] && [ -d "$out/crd-patches" ] && [ -d "$out/webhook" ]; then
  echo "$out"; exit 0
fi

command -v go >/dev/null || { echo "go is required to build Kueue (Go >= 1.25)" >&2; exit 1; }
start=$(date +%s)
cd "$mod"
export CGO_ENABLED=0 GOFLAGS="${GOFLAGS:-} -mod=mod -trimpath"
rm -rf "$out.tmp" && mkdir -p "$out.tmp/crds" "$out.tmp/crd-patches" "$out.tmp/webhook"
go build -ldflags "-s -w" -o "$out.tmp/kueue" sigs.k8s.io/kueue/cmd/kueue
src="$(go list -m -f '{{.Dir}}' sigs.k8s.io/kueue)"
cp "$src"/config/components/crd/bases/*.yaml "$out.tmp/crds/"
# The conversion-webhook patches its kustomization applies to the CRDs (kustomization.yaml says which).
cp "$src"/config/components/crd/kustomization.yaml "$src"/config/components/crd/patches/*.yaml \
  "$out.tmp/crd-patches/"
cp "$src"/config/components/webhook/manifests.yaml "$out.tmp/webhook/"
chmod -R u+w "$out.tmp"
rm -rf "$out" && mv "$out.tmp" "$out"
echo "kueue $version built in $(( $(date +%s) - start )) s" >&2
echo "$out"
