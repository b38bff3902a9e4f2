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
# Two workers (HARNESS_TEST_WORKERS; 0 runs serially): most slow tests wait on subprocesses, Slurm or
# a browser, so two share CI's two cores well (~20 min against ~32 serially, 2026-12-07). Whole files
# go to one worker (--dist loadfile): the Slurm tests share one cluster that one of them restarts, and
# module fixtures (a browser, a fresh Triton compile) are made once. (xdist_group marks would be
# finer, but pytest-xdist 3.8's loadgroup does nothing under pytest 9.2, whose nodes keep no _nodeid.)
WORKERS=${HARNESS_TEST_WORKERS:-2}
PAR=(); [ "$WORKERS" != 0 ] && PAR=(-n "$WORKERS" --dist loadfile)
python -m pytest -q "${PAR[@]}" --durations=15 "$@"  # the slowest tests listed: CI must stay well inside 90 minutes
