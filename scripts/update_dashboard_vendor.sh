#!/usr/bin/env bash
# Re-vendor uPlot (MIT) into the dashboard: the package ships it, so the dashboard never loads
# anything from the internet. Not run by tests or CI; run by hand, then review the diff and
# check the dashboard tests (tests/integration/test_server_dashboard.py).
#
#   scripts/update_dashboard_vendor.sh            # the version in vendor/VERSION
#   scripts/update_dashboard_vendor.sh 1.6.33     # another version (npm's `uplot` package)
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENDOR="$ROOT/src/lorarl/server/dashboard/vendor"
VERSION="${1:-$(sed -n 's/^uplot //p' "$VENDOR/VERSION")}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

cd "$TMP"
npm pack --silent "uplot@$VERSION" >/dev/null
tar xzf "uplot-$VERSION.tgz"
for f in dist/uPlot.iife.min.js dist/uPlot.min.css LICENSE; do
  test -s "package/$f" || { echo "uplot@$VERSION has no $f" >&2; exit 1; }
done
cp package/dist/uPlot.iife.min.js "$VENDOR/uPlot.iife.min.js"
cp package/dist/uPlot.min.css "$VENDOR/uPlot.min.css"
cp package/LICENSE "$VENDOR/LICENSE.uPlot"
printf 'uplot %s\n' "$VERSION" >"$VENDOR/VERSION"
echo "vendored uplot $VERSION into $VENDOR"
