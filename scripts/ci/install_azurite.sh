#!/usr/bin/env bash
# Azurite (Microsoft's Azure Storage emulator, an npm package) for the az:// OUTDIR tests: a pinned version
# installed into a cache folder, never globally. Idempotent: when that version is already there it prints one
# line and returns in well under a second. The tests find it at $AZURITE_DIR/node_modules/.bin/azurite-blob
# (tests/objstore/azurite.py), or on PATH, or at $DSPINE_AZURITE.
# 3.35.0: the newest that runs on Node 20 (3.36 wants Node >= 21). Needs Node >= 18 and npm (and the npm registry, the first time only).
set -euo pipefail
VERSION=${AZURITE_VERSION:-3.35.0}
DIR=${AZURITE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dspine-batch/azurite}
BIN="$DIR/node_modules/.bin/azurite-blob"
have=$(node -e "try{console.log(require('$DIR/node_modules/azurite/package.json').version)}catch(e){}" 2>/dev/null || true)
if [ "$have" = "$VERSION" ] && [ -x "$BIN" ]; then
  echo "[azurite] $VERSION already installed ($BIN)"
  exit 0
fi
command -v npm >/dev/null 2>&1 || { echo "[azurite] npm not found: install Node.js >= 18 (with npm) first" >&2; exit 1; }
mkdir -p "$DIR"
echo "[azurite] installing azurite@$VERSION into $DIR ..."
npm install --prefix "$DIR" --no-save --no-audit --no-fund --loglevel=error "azurite@$VERSION" >/dev/null
[ -x "$BIN" ] || { echo "[azurite] installed, but $BIN is missing" >&2; exit 1; }
echo "[azurite] installed $VERSION ($BIN)"
