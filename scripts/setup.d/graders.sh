#!/usr/bin/env bash
# rewards/ (issue 5): what the graders need on the machine.
# - bubblewrap: the local sandbox the graders judge in (and the tests use);
# - chromium: the real headless browser the webdev grader drives; nodejs/npm: the web build;
# - the webdev template's node_modules, installed once from the committed lockfile into .cache/graders/,
#   so that grading-time builds run offline. Idempotent: each step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")/../.."

need=()
command -v bwrap >/dev/null || need+=(bubblewrap)
command -v chromium >/dev/null || need+=(chromium)
command -v node >/dev/null || need+=(nodejs)
command -v npm >/dev/null || need+=(npm)
if [ ${#need[@]} -gt 0 ]; then
  echo "graders: apt-get install ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

template=rewards/webdev/template
dest=.cache/graders/webdev-template
lock_hash=$(cat "$template/package.json" "$template/package-lock.json" | sha1sum | cut -c1-12)
if [ ! -f "$dest/.installed-$lock_hash" ]; then
  rm -rf "$dest"
  mkdir -p "$dest"
  cp "$template/package.json" "$template/package-lock.json" "$dest/"
  # esbuild's platform binary ships inside @esbuild/linux-x64; its install script only re-checks it
  (cd "$dest" && npm ci --no-audit --no-fund --ignore-scripts --cache "$PWD/../npm-cache" >/dev/null)
  test -x "$dest/node_modules/@esbuild/linux-x64/bin/esbuild"
  touch "$dest/.installed-$lock_hash"
fi
echo "graders: bwrap $(bwrap --version | cut -d' ' -f2), $(chromium --version 2>/dev/null | head -1), node $(node -v)"
