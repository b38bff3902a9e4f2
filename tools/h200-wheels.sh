#!/usr/bin/env bash
# Download, for the H200 machine's python 3.12 (no network there), exactly the wheels in
# tools/h200-wheels.txt into .whl/ (git-ignored); a device run then carries `.whl` and installs
# them with: python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
grep -v '^#' tools/h200-wheels.txt | grep -v '^$' | while read -r req; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_25_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl "$req"
done
ls -la .whl
