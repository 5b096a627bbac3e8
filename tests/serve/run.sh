#!/usr/bin/env bash
# Client tests of `frugal serve` with the official OpenAI Python client, against a server the
# tests spawn on the real model. Makes its virtual environment on first use.
#   FRUGAL_SERVE_VENV  the virtual environment (default target/serve-venv)
#   FRUGAL_BIN         the frugal binary (default target/release/frugal)
#   SOAK_SECONDS       length of the soak test (default 30)
# Extra arguments go to pytest (e.g. -k stream).
set -euo pipefail
cd "$(dirname "$0")/../.."

OPENAI_VERSION=2.54.0
PYTEST_VERSION=9.2.0
# Drives Debian's chromium through chromedriver for test_page.py (which skips without them);
# 4.52 and later need a certifi newer than this machine's package index holds.
SELENIUM_VERSION=4.51.0
VENV="${FRUGAL_SERVE_VENV:-target/serve-venv}"
STAMP="$VENV/.frugal-serve-deps"
WANT="openai==$OPENAI_VERSION pytest==$PYTEST_VERSION selenium==$SELENIUM_VERSION"

if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check $WANT
    echo "$WANT" >"$STAMP"
fi

export FRUGAL_BIN="${FRUGAL_BIN:-target/release/frugal}"
[ -x "$FRUGAL_BIN" ] || { echo "tests/serve/run.sh: no frugal binary at $FRUGAL_BIN" >&2; exit 1; }
export PYTHONDONTWRITEBYTECODE=1
# A hard bound on the whole suite (it takes ~2-5 minutes on 2 cores): a hung server fails CI
# instead of eating its time.
exec timeout -k 30 1200 "$VENV/bin/python" -m pytest tests/serve/test_openai.py tests/serve/test_limits.py tests/serve/test_page.py \
    -v -ra --durations=10 -p no:cacheprovider "$@"
