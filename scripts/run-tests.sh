#!/usr/bin/env bash
# Set-up command 2: install everything the tests need (only what is missing),
# build every target, and run every test. Then lists the tests that skipped,
# with their reasons; under CI (CI=true) a skip that CI could have run fails
# the run (scripts/skip_report.py). ctest's own summary closes the output.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
cd build
# A fresh build has no record of how long each test takes, so ctest would
# run them in the order they are declared and end on a long tail of slow
# ones: seed its scheduler with the times of a recent run (longest first).
if [ ! -f Testing/Temporary/CTestCostData.txt ]; then
  mkdir -p Testing/Temporary
  cp ../tests/ctest_costs.txt Testing/Temporary/CTestCostData.txt
fi
# Two ctest slots a core: a test that keeps a core busy takes two, one that
# mostly waits takes one (tests/cores.cmake), so waiting tests run beside
# the others.
status=0
ctest --output-on-failure -j "$((2 * ${LIMBO_JOBS:-2}))" --timeout 900 2>&1 | tee logs/ctest.log || status=$?
strict=()
if [ "${CI:-}" = true ]; then strict=(--strict); fi
echo
python3 ../scripts/skip_report.py . "${strict[@]}" || { if [ "$status" -eq 0 ]; then status=1; fi; }
# ctest's summary again, last, for whoever reads the closing lines.
echo
sed -n '/tests passed,/,$p' logs/ctest.log | grep -v '^$' || true
exit "$status"
