#!/usr/bin/env python3
"""Checks the links and paths of the repository's Markdown pages.

For every tracked *.md file:
  - a link [text](target) to a file must resolve inside the repository, and
    its #anchor, if any, must be a heading of the target (GitHub's slugs);
  - a path in backticks that starts with a top-level directory of the
    repository (`service/...`, `tests/...`, `deploy/...`, ...) must exist,
    so a page cannot name a file that moved. A command in backticks is
    checked by its first word; `{a,b}` is expanded.
Links to http(s) and mailto are not followed. Standard library only.
"""

import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tracked_markdown():
    out = subprocess.run(["git", "ls-files", "--", "*.md"], cwd=REPO,
                         check=True, stdout=subprocess.PIPE, text=True).stdout
    return [p for p in out.splitlines() if p]


def prose_lines(text):
    """(line number, line) outside fenced and indented code blocks."""
    fence, prev_blank, indented = False, True, False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if fence:
            continue
        if line.startswith("    ") and (prev_blank or indented):
            indented = True
            continue
        indented = False
        prev_blank = not line.strip()
        yield n, line


def slug(heading):
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(path, cache={}):
    if path not in cache:
        found, seen = set(), {}
        with open(path, encoding="utf-8") as f:
            for _, line in prose_lines(f.read()):
                m = re.match(r"#{1,6} +(.*?) *#* *$", line)
                if m:
                    base = slug(m.group(1))
                    k = seen.get(base, 0)
                    found.add(base if k == 0 else f"{base}-{k}")
                    seen[base] = k + 1
        cache[path] = found
    return cache[path]


def expand(path):
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [q for alt in m.group(1).split(",")
            for q in expand(path[:m.start()] + alt + path[m.end():])]


def main():
    tops = {e for e in os.listdir(REPO) if os.path.isdir(os.path.join(REPO, e))
            and e not in (".git", "target")}
    errors, links, paths = [], 0, 0
    for page in tracked_markdown():
        here = os.path.dirname(os.path.join(REPO, page))
        with open(os.path.join(REPO, page), encoding="utf-8") as f:
            text = f.read()
        for n, line in prose_lines(text):
            for m in re.finditer(r"\[[^\]]*\]\(([^)\s]+)\)", line):
                target = m.group(1)
                if re.match(r"(https?|mailto):", target):
                    continue
                links += 1
                file, _, anchor = target.partition("#")
                dest = os.path.normpath(os.path.join(here, file)) if file else os.path.join(REPO, page)
                if os.path.relpath(dest, REPO).startswith(".."):
                    errors.append(f"{page}:{n}: {target} points outside the repository")
                elif not os.path.exists(dest):
                    errors.append(f"{page}:{n}: {target}: no such file")
                elif anchor and (not dest.endswith(".md") or anchor not in anchors(dest)):
                    errors.append(f"{page}:{n}: {target}: no heading #{anchor}")
            for m in re.finditer(r"`([^`]+)`", line):
                word = m.group(1).split()[0] if m.group(1).split() else ""
                if "/" not in word or word.split("/")[0] not in tops:
                    continue
                if re.search(r"[<>*$]|\.\.\.", word):
                    continue
                for p in expand(word.rstrip(".,;:")):
                    paths += 1
                    if not os.path.exists(os.path.join(REPO, p.rstrip("/"))):
                        errors.append(f"{page}:{n}: `{p}`: no such file or directory")
    for e in errors:
        print(e, file=sys.stderr)
    if errors:
        print(f"doc-links: {len(errors)} broken link(s) or path(s)", file=sys.stderr)
        return 1
    print(f"doc-links: {links} links and {paths} paths in the Markdown pages resolve")
    return 0


if __name__ == "__main__":
    sys.exit(main())
