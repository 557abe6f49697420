#!/usr/bin/env bash
# Regenerates the schema table in docs/config.md from the code (keeps the prose
# above the "## Keys" heading).
set -euo pipefail
cd "$(dirname "$0")/.."
bin="${1:-build/src/cli/limbo}"
{ sed '/^## Keys$/q' docs/config.md; "$bin" config --schema; } > docs/config.md.new
mv docs/config.md.new docs/config.md
