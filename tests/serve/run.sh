#!/usr/bin/env bash
# Client tests of `frugal serve` with the official OpenAI Python client, against a server the
# tests spawn on the real model. Makes its virtual environments on first use.
#
# Two passes: the whole suite with the pinned client (OPENAI_VERSION), then the tests that go
# through the client with the newest openai on PyPI (upgraded at every run, its version
# printed), so a new client release that breaks against the server is seen here first. The
# second pass leaves out what does not depend on the client (soak, concurrency, shutdown,
# admission, speculation, slow and vanishing readers, timeouts, raw HTTP, the browser): the
# whole suite twice would double a 2-5 minute run for nothing more.
#   FRUGAL_SERVE_VENV         the pinned environment (default target/serve-venv)
#   FRUGAL_SERVE_NEWEST_VENV  the newest-client environment (default target/serve-venv-newest)
#   FRUGAL_SERVE_NEWEST=0     skips the second pass (offline, or to iterate quickly)
#   FRUGAL_BIN                the frugal binary (default target/release/frugal)
#   SOAK_SECONDS              length of the soak test (default 30)
# Extra arguments go to pytest in both passes (e.g. -k stream; a -k given here replaces the
# second pass's selection).
set -euo pipefail
cd "$(dirname "$0")/../.."

OPENAI_VERSION=2.54.0
PYTEST_VERSION=9.2.0
JSONSCHEMA_VERSION=4.26.0
# The tests' raw HTTP client (openai 2 brings it; the newest-client pass installs it).
HTTPX_VERSION=0.29.0
# Drives Debian's chromium through chromedriver for test_page.py (which skips without them);
# 4.52 and later need a certifi newer than this machine's package index holds.
SELENIUM_VERSION=4.51.0
VENV="${FRUGAL_SERVE_VENV:-target/serve-venv}"
STAMP="$VENV/.frugal-serve-deps"
WANT="openai==$OPENAI_VERSION pytest==$PYTEST_VERSION jsonschema==$JSONSCHEMA_VERSION selenium==$SELENIUM_VERSION"

if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check $WANT
    echo "$WANT" >"$STAMP"
fi

export FRUGAL_BIN="${FRUGAL_BIN:-target/release/frugal}"
[ -x "$FRUGAL_BIN" ] || { echo "tests/serve/run.sh: no frugal binary at $FRUGAL_BIN" >&2; exit 1; }
export PYTHONDONTWRITEBYTECODE=1

# A hard bound on each pass (the first takes ~2-5 minutes on 2 cores, the second about one): a
# hung server fails CI instead of eating its time.
echo "tests/serve/run.sh: pass 1: openai $OPENAI_VERSION (pinned), whole suite"
rc=0
timeout -k 30 1200 "$VENV/bin/python" -m pytest \
    tests/serve/test_openai.py tests/serve/test_limits.py tests/serve/test_page.py \
    tests/serve/test_structured.py tests/serve/test_tools.py \
    tests/serve/test_embeddings.py tests/serve/test_responses.py \
    -v -ra --durations=10 -p no:cacheprovider "$@" || rc=$?

if [ "${FRUGAL_SERVE_NEWEST:-1}" != 0 ]; then
    NEWEST="${FRUGAL_SERVE_NEWEST_VENV:-target/serve-venv-newest}"
    [ -x "$NEWEST/bin/python" ] || python3 -m venv "$NEWEST"
    # openai 3 moved from httpx to httpx2; the tests' raw HTTP still uses httpx.
    "$NEWEST/bin/python" -m pip install -q --disable-pip-version-check -U openai \
        "pytest==$PYTEST_VERSION" "httpx==$HTTPX_VERSION" \
        "jsonschema==$JSONSCHEMA_VERSION"
    newest=$("$NEWEST/bin/python" -c 'import openai; print(openai.__version__)')
    echo "tests/serve/run.sh: pass 2: openai $newest (newest on PyPI), the client tests"
    # Not the client's business: what the server does under load, at shutdown, with slow or
    # vanishing readers and timeouts, on raw HTTP, and in the browser.
    server_side="soak or concurrent_streams or graceful_shutdown or admission_queue or speculation"
    server_side="$server_side or slow_reader or disconnect or timeout or keep_alive or malformed_json"
    server_side="$server_side or wrong_types_and_bodies or loopback"
    timeout -k 30 600 "$NEWEST/bin/python" -m pytest tests/serve/test_openai.py tests/serve/test_limits.py \
        tests/serve/test_structured.py tests/serve/test_tools.py \
        tests/serve/test_embeddings.py tests/serve/test_responses.py \
        -k "not ($server_side)" -ra --durations=5 -p no:cacheprovider "$@" || rc=$?
fi
exit $rc
