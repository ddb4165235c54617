#!/usr/bin/env python3
"""Reads tests/vm/lanes: which kernel lane runs each VM test.

  lanes.py check --vm-list FILE --csi-list FILE
      fails unless every `vm` test and every csi `node::`/`expand::`/`modify::` test
      (from `TEST_BINARY --list --format terse`) has exactly one line, and
      every line names a test that exists
  lanes.py tests TARGET {latest|lts}
      prints the tests of TARGET (`vm` or `csi`) that the lane runs
"""

import argparse
import pathlib
import sys

LANES = pathlib.Path(__file__).with_name("lanes")
NAME = "tests/vm/lanes"  # in messages
# `bench`: a benchmark (an ignored test), run by its own script, never by a lane.
KERNELS = ("both", "latest", "lts", "bench")
# The csi target's tests that need the VM's kernel (dm, ublk); the rest run on
# the host.
CSI_VM_MODULES = ("node::", "expand::", "modify::")


def read():
    """(target, test, kernels, line number) of every line of the file."""
    rows = []
    for n, line in enumerate(LANES.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) != 3 or fields[0] not in ("vm", "csi") or fields[2] not in KERNELS:
            sys.exit(f"{NAME}:{n}: want `vm|csi TEST both|latest|lts|bench`, got {line!r}")
        rows.append((fields[0], fields[1], fields[2], n))
    return rows


def listed(path):
    """Test names from a `--list --format terse` output."""
    out = []
    for line in pathlib.Path(path).read_text().splitlines():
        if line.endswith(": test"):
            out.append(line[: -len(": test")])
    return out


def check(vm_list, csi_list):
    rows = read()
    want = {
        "vm": set(listed(vm_list)),
        "csi": {t for t in listed(csi_list) if t.startswith(CSI_VM_MODULES)},
    }
    problems = []
    seen = {}
    for target, test, _, n in rows:
        if (target, test) in seen:
            problems.append(f"{NAME}:{n}: {target} {test} is already on line {seen[target, test]}")
        seen[target, test] = n
        if test not in want[target]:
            problems.append(f"{NAME}:{n}: {target} {test}: no such test")
    for target, tests in want.items():
        for test in sorted(tests - {t for g, t in seen if g == target}):
            problems.append(f"{NAME}: {target} {test} has no line: say which kernels run it")
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        sys.exit(f"lanes: {len(problems)} problem(s)")
    for flavor in ("latest", "lts"):
        counts = {g: sum(1 for t, _, k, _ in rows if t == g and k in ("both", flavor)) for g in want}
        print(f"lanes: {flavor}: {counts['vm']} vm and {counts['csi']} csi tests", file=sys.stderr)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check")
    c.add_argument("--vm-list", required=True)
    c.add_argument("--csi-list", required=True)
    t = sub.add_parser("tests")
    t.add_argument("target", choices=("vm", "csi"))
    t.add_argument("flavor", choices=("latest", "lts"))
    a = p.parse_args()
    if a.cmd == "check":
        check(a.vm_list, a.csi_list)
    else:
        for target, test, kernels, _ in read():
            if target == a.target and kernels in ("both", a.flavor):
                print(test)


if __name__ == "__main__":
    main()
