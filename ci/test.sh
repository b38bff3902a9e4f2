#!/usr/bin/env bash
# The project's test command (`make test` runs it after `make setup`): starts the services the
# tests need (a real single-node Slurm, headless Chromium), then runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
if [ "$(id -u)" = 0 ] && [ "${HARNESS_NO_SLURM:-0}" != 1 ] && [ -x ci/slurm-up.sh ]; then
  bash ci/slurm-up.sh
  trap 'bash ci/slurm-down.sh >/dev/null' EXIT
fi
if [ "${HARNESS_NO_BROWSER:-0}" != 1 ] && ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1 || \
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }
fi
export TRITON_INTERPRET=1
python -m pytest -q --durations=15 "$@"  # the slowest tests listed: CI must stay well inside 90 minutes
