#!/usr/bin/env bash
# Sets up and runs the whole default test suite (slow tests: add `-m slow`).
set -euo pipefail
cd "$(dirname "$0")/.."
# Debian's redis-server (the KV-tier and Responses-API tests start their own on a free port),
# nginx and prometheus (the local cluster of the deploy tests), and chromium with its
# chromedriver (the browser UI tests): whichever is missing. Each entry is program:package.
missing=""
for entry in redis-server:redis-server nginx:nginx prometheus:prometheus chromium:chromium \
             chromedriver:chromium-driver; do
    command -v "${entry%%:*}" >/dev/null 2>&1 || missing="$missing ${entry#*:}"
done
if [ -n "$missing" ]; then
    SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get install -y -q --no-install-recommends $missing >/dev/null \
        || { $SUDO apt-get update -q >/dev/null \
             && $SUDO apt-get install -y -q --no-install-recommends $missing >/dev/null; }
fi
bash scripts/setup.sh test
export TF_CPP_MIN_LOG_LEVEL=3
# Two workers, each taking whole files (module fixtures and in-file order stay as written):
# most tests wait on a server subprocess or run single-threaded Python and tracing, so a
# serial run leaves a core idle. TOKENSERVE_TEST_WORKERS=0 runs serially.
exec .venv/bin/python -m pytest -n "${TOKENSERVE_TEST_WORKERS:-2}" --dist loadfile "$@"
