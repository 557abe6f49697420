#!/usr/bin/env bash
# Set-up command 1: install what is missing, build, and run the default job
# (LeNet on Fashion-MNIST, two epochs). Extra arguments go to `limbo train`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec ./build/src/cli/limbo train --config configs/default.toml "$@"
