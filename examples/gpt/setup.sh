#!/bin/sh
# The GPT example's set-up: installs its corpus (Debian's bible-kjv-text,
# whose `bible` command prints the King James Bible) and writes the token
# streams and the scripted module into data/gpt. Needs python3-torch and
# python3-numpy, which the project's set-up installs.
set -e
cd "$(dirname "$0")/../.."
if ! command -v bible >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then apt-get install -y -q bible-kjv-text; else sudo apt-get install -y -q bible-kjv-text; fi
fi
/usr/bin/python3 examples/gpt/prepare.py data/gpt "$@"
