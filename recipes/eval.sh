#!/usr/bin/env bash
# Evaluate every model of a manifest on every (domain, effort) held-out slice and write eval.json + report/:
#   recipes/eval.sh runs/demo/manifest.json [n=40]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
exec "$ROOT/recipes/submit.sh" eval "$@"
