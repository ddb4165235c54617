#!/usr/bin/env python3
"""Checks that every test docs/guarantees.md names exists.

Each guarantee on the page is a top-level list item; after the word
`Tests:` it names its tests, each in backticks:

    `blackbox MOD::NAME`   a test of tests/blackbox
    `csi MOD::NAME`        a test of tests/csi
    `vm MOD::NAME`         a kernel e2e test of tests/vm/e2e
    `unit CRATE PATH`      a unit test of the crate CRATE
    `dashboard "TITLE"`    a browser test of tests/dashboard/dashboard.test.mjs
    `script PATH`          a check script that tests/run-all.sh runs

A name ending in `*` names every test it starts; a title ending in `…` the
test whose title starts so. Either must match at least one test.

The test names come from the test binaries themselves:
    cargo test --locked --workspace -- --list --format terse   (stderr too)
    cargo test --locked --test vm -- --list --format terse
run here, or read from files given with --workspace-list and --vm-list (what
tests/run-all.sh does, so that its cargo command lines stay its own).

Exit 1 when a guarantee names no test, a reference is malformed, or a named
test does not exist. Standard library only.
"""

import argparse
import difflib
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = "docs/guarantees.md"
DASHBOARD = "tests/dashboard/dashboard.test.mjs"
RUN_ALL = "tests/run-all.sh"
INTEGRATION = ("blackbox", "csi", "vm")


def guarantees(text):
    """Yields (line number, text) of each top-level list item."""
    item, start = None, 0
    in_fence = False
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            in_fence = not in_fence
        if in_fence:
            continue
        if line.startswith("- "):
            if item is not None:
                yield start, " ".join(item)
            item, start = [line[2:].strip()], n
        elif item is not None and line.startswith("  ") and line.strip():
            item.append(line.strip())
        elif item is not None:
            yield start, " ".join(item)
            item = None
    if item is not None:
        yield start, " ".join(item)


def parse_ref(span):
    """A reference as (kind, scope, name), or None if it is malformed."""
    m = re.fullmatch(r"(blackbox|csi|vm) (\S+)", span)
    if m:
        return m.group(1), m.group(1), m.group(2)
    m = re.fullmatch(r"unit ([a-z][a-z0-9_-]*) (\S+)", span)
    if m:
        return "unit", m.group(1).replace("-", "_"), m.group(2)
    m = re.fullmatch(r'dashboard "([^"]+)"', span)
    if m:
        return "dashboard", "dashboard", m.group(1)
    m = re.fullmatch(r"script (\S+)", span)
    if m:
        return "script", "script", m.group(1)
    return None


def list_tests(output, default=None):
    """{binary: set of test names} from `cargo test -- --list --format terse`.

    With cargo's stderr in the output, each list follows a `Running ... (path)`
    line naming its binary; without it (cargo test --test vm alone) the tests
    belong to `default`."""
    tests, current = {}, default
    for line in output.splitlines():
        m = re.match(r"\s*Running .*\((.*)\)\s*$", line)
        if m:
            exe = os.path.basename(m.group(1))
            current = re.sub(r"-[0-9a-f]+$", "", exe)
            continue
        if re.match(r"\s*Doc-tests ", line):
            current = None
            continue
        m = re.match(r"^(\S+): (test|bench)$", line)
        if m and current is not None:
            tests.setdefault(current, set()).add(m.group(1))
    return tests


def dashboard_titles(path):
    with open(path, encoding="utf-8") as f:
        src = f.read()
    titles = set()
    for m in re.finditer(r"\btest\(\s*(['\"`])((?:\\.|(?!\1).)*)\1", src):
        titles.add(re.sub(r"\\(.)", r"\1", m.group(2)))
    return titles


def cargo_list(args):
    cmd = ["cargo", "test", "--locked", *args, "--", "--list", "--format", "terse"]
    r = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stdout)
        sys.exit(f"guarantees: {' '.join(cmd)} failed")
    return r.stdout


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--page", default=os.path.join(REPO, PAGE))
    ap.add_argument("--workspace-list", metavar="FILE",
                    help="saved output (stdout and stderr) of cargo test --locked --workspace -- --list --format terse")
    ap.add_argument("--vm-list", metavar="FILE",
                    help="saved output of cargo test --locked --test vm -- --list --format terse")
    ap.add_argument("--unnamed", action="store_true",
                    help="also list the tests no guarantee names (never fails)")
    opts = ap.parse_args()

    workspace = read(opts.workspace_list) if opts.workspace_list else cargo_list(["--workspace"])
    vm = read(opts.vm_list) if opts.vm_list else cargo_list(["--test", "vm"])
    tests = list_tests(workspace)
    tests.setdefault("vm", set()).update(list_tests(vm, default="vm").get("vm", set()))
    for target in INTEGRATION:
        if not tests.get(target):
            sys.exit(f"guarantees: no tests listed for the `{target}` target: is the list complete?")
    titles = dashboard_titles(os.path.join(REPO, DASHBOARD))
    run_all = read(os.path.join(REPO, RUN_ALL))

    page = os.path.relpath(opts.page, REPO)
    if page.startswith(".."):
        page = opts.page
    errors, named, count, refs = [], set(), 0, 0

    def err(line, msg):
        errors.append(f"{page}:{line}: {msg}")

    for line, item in guarantees(read(opts.page)):
        count += 1
        if item.count("Tests:") != 1:
            err(line, "a guarantee needs exactly one `Tests:`: " + item[:70])
            continue
        spans = re.findall(r"`([^`]+)`", item.split("Tests:", 1)[1])
        if not spans:
            err(line, "`Tests:` names no test")
        for span in spans:
            refs += 1
            ref = parse_ref(span)
            if ref is None:
                err(line, f"`{span}` is not a reference (blackbox|csi|vm MOD::NAME, "
                          "unit CRATE PATH, dashboard \"TITLE\", script PATH)")
                continue
            kind, scope, name = ref
            if kind == "script":
                if not os.path.isfile(os.path.join(REPO, name)):
                    err(line, f"`{span}`: no such file")
                elif name not in run_all:
                    err(line, f"`{span}`: {RUN_ALL} does not run it")
                continue
            pool = titles if kind == "dashboard" else tests.get(scope, set())
            if kind == "unit" and scope not in tests:
                err(line, f"`{span}`: no crate `{scope.replace('_', '-')}` with unit tests "
                          f"(crates: {', '.join(sorted(k.replace('_', '-') for k in tests if k not in INTEGRATION))})")
                continue
            if kind == "dashboard" and name.endswith("…"):
                prefix = name[:-1].rstrip()
                hits = {t for t in pool if t.startswith(prefix)}
            elif kind != "dashboard" and name.endswith("*"):
                hits = {t for t in pool if t.startswith(name[:-1])}
            else:
                hits = {name} & pool
            if not hits:
                want = name.rstrip("*…").rstrip()
                # A prefix is compared with the names cut to its length.
                cut = {t[:len(want)] if name != want else t: t for t in sorted(pool)}
                near = difflib.get_close_matches(want, list(cut), n=1, cutoff=0.6)
                hint = f"; did you mean `{cut[near[0]]}`?" if near else ""
                err(line, f"`{span}`: no such test{hint}")
            named.update((scope, t) for t in hits)

    if count == 0:
        errors.append(f"{page}: no guarantees found")
    for e in errors:
        print(e, file=sys.stderr)
    if errors:
        print(f"guarantees: {len(errors)} problem(s) in {page}", file=sys.stderr)
        return 1
    print(f"guarantees: {count} guarantees in {page}, {refs} references to "
          f"{len(named)} tests; every one exists")
    if opts.unnamed:
        for scope in sorted(tests):
            for t in sorted(tests[scope]):
                if (scope, t) not in named:
                    print(f"not named by a guarantee: {scope} {t}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
