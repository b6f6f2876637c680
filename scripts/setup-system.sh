#!/usr/bin/env bash
# Runs every scripts/setup.d/*.sh once per content hash. Each script installs what one part of rlk3 needs
# (apt packages, builds) and must be idempotent; a stamp under .cache/system/ skips it on re-runs.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .cache/system
shopt -s nullglob
for script in scripts/setup.d/*.sh; do
  name=$(basename "$script" .sh)
  # a script's "# inputs: a b" line names other files whose change must re-run it (sources it builds)
  read -ra inputs <<< "$(sed -n 's/^# inputs: //p' "$script")"
  stamp=".cache/system/$name.$(cat "$script" "${inputs[@]}" | sha1sum | cut -c1-12)"
  [ -f "$stamp" ] && continue
  echo "== setup: $name"
  bash "$script"
  rm -f .cache/system/"$name".*
  touch "$stamp"
done
