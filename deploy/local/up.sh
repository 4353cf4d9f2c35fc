#!/usr/bin/env bash
# A local tokenserve cluster from real parts, on loopback, in one command: Debian's
# redis-server and prometheus, three `tokenserve serve` replicas (the built-in model) and
# nginx with deploy/nginx/nginx.conf. Ctrl-C stops everything.
#
#   bash deploy/local/up.sh                      # 3 replicas
#   bash deploy/local/up.sh --replicas 2 --canary 1 --canary_percent 10
#   bash deploy/local/up.sh --run_dir /tmp/cluster   # keep logs and configs there
set -euo pipefail
export TF_CPP_MIN_LOG_LEVEL=3
cd "$(dirname "$0")/../.."
missing=""
for program in redis-server nginx prometheus; do
    command -v "$program" >/dev/null 2>&1 || missing="$missing $program"
done
if [ -n "$missing" ]; then
    SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -q >/dev/null
    $SUDO apt-get install -y -q --no-install-recommends $missing >/dev/null
fi
[ -x .venv/bin/tokenserve ] || bash scripts/setup.sh
.venv/bin/python -c 'import yaml' 2>/dev/null || .venv/bin/python -m pip install --quiet pyyaml
exec .venv/bin/python -m deploy.local.cluster "$@"
