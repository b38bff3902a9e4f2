#!/usr/bin/env bash
# The target repository of experiments/fla-*.yaml: the seed's fla (fla-org/flash-linear-attention at
# 27967b97, from the git bundle in ../shared/data) cloned into targets/fla (git-ignored), with one
# branch per experiments/fla/<name>.patch committed on top of the baseline as fla/<name> (fixed
# identity and dates: the same patch always gives the same SHA), and .bundle/fla.bundle (every
# branch of it) for device runs: tools/h200_session.sh clones each .bundle/<name>.bundle other than
# repo.bundle into targets/<name> of the device's checkout.
#   bash tools/fla_target.sh [SEED_BUNDLE]      (default ../shared/data/fla-seed-27967b97.bundle)
# Idempotent: an existing targets/fla is reused, each candidate branch rewritten to the same commit.
set -euo pipefail
cd "$(dirname "$0")/.."
SEED=$(realpath "${1:-../shared/data/fla-seed-27967b97.bundle}")
BASE=27967b970eaaf982a6960abf6cba8add9c34c7cc
TARGET=targets/fla
if [ ! -d "$TARGET/.git" ]; then
  mkdir -p targets
  git clone -q -b seed-baseline "$SEED" "$TARGET"
fi
git -C "$TARGET" cat-file -e "$BASE^{commit}"
export GIT_COMMITTER_NAME=kernel-harness GIT_COMMITTER_EMAIL=kernel-harness@localhost
for patch in experiments/fla/*.patch; do
  branch=fla/$(basename "$patch" .patch)
  git -C "$TARGET" checkout -q --detach "$BASE"
  git -C "$TARGET" am -q --keep-non-patch --committer-date-is-author-date "$PWD/$patch"
  git -C "$TARGET" branch -q -f "$branch" HEAD
  echo "$branch = $(git -C "$TARGET" rev-parse HEAD) ($(git -C "$TARGET" diff --stat "$BASE" HEAD | tail -1))"
done
git -C "$TARGET" checkout -q seed-baseline
mkdir -p .bundle
git -C "$TARGET" bundle create -q "$PWD/.bundle/fla.bundle" --branches
echo ".bundle/fla.bundle: $(git bundle list-heads .bundle/fla.bundle | wc -l) branches"
