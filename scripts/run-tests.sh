#!/usr/bin/env bash
# Set-up command 2: install everything the tests need (only what is missing),
# build every target, and run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
cd build
exec ctest --output-on-failure -j "${LIMBO_JOBS:-2}" --timeout 900
