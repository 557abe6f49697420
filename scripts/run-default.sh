#!/usr/bin/env bash
# Set-up command 1: install what `limbo` needs (only what is missing), build
# only `limbo`, and run the default job (LeNet on Fashion-MNIST, two epochs).
# Extra arguments go to `limbo train`. One line per phase with the time since
# the start; full logs in build/logs/.
set -euo pipefail
cd "$(dirname "$0")/.."
LIMBO_T0="$(date +%s)"
export LIMBO_T0
./scripts/setup.sh --limbo
elapsed() {
  local s=$(($(date +%s) - LIMBO_T0))
  printf '%d:%02d' $((s / 60)) $((s % 60))
}
printf '[%s] training the default job (configs/default.toml: LeNet on Fashion-MNIST, 2 epochs)%s\n' "$(elapsed)" \
  "$([ $# -gt 0 ] && printf ', with: %s' "$*")"
status=0
./build/src/cli/limbo train --config configs/default.toml "$@" || status=$?
if [ "$status" -ne 0 ]; then
  printf '[%s] the default job failed (exit %d; its messages are above)\n' "$(elapsed)" "$status" >&2
  exit "$status"
fi
printf '[%s] done\n' "$(elapsed)"
