#!/usr/bin/env bash
# Produce server/static/vendor/livekit-client.umd.js from the npm registry.
#
# The demo page loads this file (same origin, no CDN) when the server runs with
# the LiveKit transport. It is fetched at build/package time, never at run time.
#
#   usage: server/static/build_vendor.sh [VERSION_SPEC]     (default: livekit-client@2)
#
# Needs: npm (Node >= 18). Writes vendor/livekit-client.umd.js and vendor/VERSION.
set -euo pipefail

SPEC="${1:-livekit-client@2}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENDOR="$HERE/vendor"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

command -v npm >/dev/null || { echo "build_vendor.sh: npm is required" >&2; exit 1; }

# npm pack downloads the published tarball only (no install scripts run).
(cd "$WORK" && npm pack --silent "$SPEC" >"$WORK/packed.txt")
TARBALL="$WORK/$(tail -n 1 "$WORK/packed.txt")"
tar -xzf "$TARBALL" -C "$WORK"

UMD="$WORK/package/dist/livekit-client.umd.js"
[ -f "$UMD" ] || { echo "build_vendor.sh: $UMD not found in $SPEC" >&2; exit 1; }

mkdir -p "$VENDOR"
cp "$UMD" "$VENDOR/livekit-client.umd.js"
VERSION="$(node -p "require('$WORK/package/package.json').version" 2>/dev/null || echo unknown)"
printf 'livekit-client %s\n' "$VERSION" >"$VENDOR/VERSION"
[ -f "$WORK/package/LICENSE" ] && cp "$WORK/package/LICENSE" "$VENDOR/LICENSE.livekit-client"

SIZE="$(wc -c <"$VENDOR/livekit-client.umd.js")"
echo "vendored livekit-client $VERSION: vendor/livekit-client.umd.js ($SIZE bytes)"
