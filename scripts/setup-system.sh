#!/usr/bin/env bash
# Runs every scripts/setup.d/*.sh once per content hash. Each script installs what one part of rlk3 needs
# (apt packages, builds) and must be idempotent; a stamp under .cache/system/ skips it on re-runs.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .cache/system
shopt -s nullglob
for script in scripts/setup.d/*.sh; do
  name=$(basename "$script" .sh)
  stamp=".cache/system/$name.$(sha1sum "$script" | cut -c1-12)"
  [ -f "$stamp" ] && continue
  echo "== setup: $name"
  bash "$script"
  rm -f .cache/system/"$name".*
  touch "$stamp"
done
