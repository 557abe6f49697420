#!/usr/bin/env python3
"""Lists the tests of the last ctest run that skipped, with their reasons.

    scripts/skip_report.py BUILD_DIR [--strict]

Reads BUILD_DIR/Testing/Temporary/LastTest.log (ctest writes it on every
run). Prints "N tests skipped" and one line per reason with the tests it
skipped. With --strict (CI), exits 1 when a test skipped for a reason that
is not in ALLOWED: on a machine where CI runs (root, the packages that
scripts/setup.sh installs), every other test can run, and a skip there hides
a test that did not run.
"""
import re
import sys
from collections import OrderedDict

# Reasons that hold on a machine of CI's kind through no fault of its set-up.
ALLOWED = [
    r"sudo is installed here",  # the no-root test needs a machine without sudo
]


def skipped_tests(log_text):
    """(test name, reason) for every skipped test in a LastTest.log."""
    out = []
    blocks = re.split(r"^(?=\d+/\d+ Testing: )", log_text, flags=re.M)
    for block in blocks:
        m = re.match(r"\d+/\d+ Testing: (\S+)", block)
        if not m:
            continue
        body, _, tail = block.partition("<end of output>")
        gtest_skip = "[  SKIPPED ]" in body
        ctest_skip = re.search(r"^Test Skipped", tail, re.M) is not None  # e.g. exit code 77
        if not gtest_skip and not ctest_skip:
            continue
        r = re.search(r": Skipped\n(.*)", body)
        if r and r.group(1).strip():
            reason = r.group(1).strip()
        else:
            lines = [l.strip() for l in body.splitlines()
                     if l.strip() and not l.startswith(("[", "Running main", "Note:", "Output:", "-----"))]
            reason = lines[-1] if lines else ""
        out.append((m.group(1), reason or "(no reason given)"))
    return out


def main():
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    strict = "--strict" in sys.argv[2:]
    path = sys.argv[1] + "/Testing/Temporary/LastTest.log"
    try:
        text = open(path, encoding="utf-8", errors="replace").read()
    except OSError as e:
        print(f"skip report: cannot read {path}: {e}", file=sys.stderr)
        return 1 if strict else 0
    skipped = skipped_tests(text)
    by_reason = OrderedDict()
    for name, reason in skipped:
        by_reason.setdefault(reason, []).append(name)
    print(f"{len(skipped)} tests skipped" + (":" if skipped else ""))
    bad = []
    for reason, names in by_reason.items():
        allowed = any(re.search(a, reason) for a in ALLOWED)
        if not allowed:
            bad.extend(names)
        shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        print(f"  {len(names)} ({'allowed' if allowed else 'not allowed in CI'}): {reason}\n      {shown}")
    if strict and bad:
        print(f"skip report: {len(bad)} tests skipped that CI can run; a skip there hides a test that did not run",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
