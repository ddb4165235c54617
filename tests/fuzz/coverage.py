"""Which operations of the OpenAPI document a fuzz run reached, from the
service's own request counters (blockplane_api_requests_total, by route
template, method and status).

  coverage.py snapshot URL TOKEN            > before.json
  coverage.py check OPENAPI before.json READS URL TOKEN [--skip METHOD:PATH ...]

`check` exits 1, naming them, unless every operation (less the skipped ones)
answered at least once more than in the snapshot, with a status other than
401 (a request refused before its handler ran does not count), and says how
many answered 2xx at least once (which are not required). READS is the
file hooks.py appends a line to per state read (GET /v1/images and GET
/v1/volumes each), which are not the fuzzer's."""

import json
import re
import sys
import urllib.request

SAMPLE = re.compile(r"^blockplane_api_requests_total\{(.*)\} (\S+)$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def counts(url, token, success=False):
    """{"METHOD path": answers other than 401} from /metrics; with
    `success`, only its 2xx answers."""
    req = urllib.request.Request(f"{url}/metrics", headers={"Authorization": f"Bearer {token}"})
    text = urllib.request.urlopen(req, timeout=30).read().decode()
    out = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if not m:
            continue
        labels = dict(LABEL.findall(m.group(1)))
        if labels["status"] == "401" or (success and not labels["status"].startswith("2")):
            continue
        key = f'{labels["method"]} {labels["route"]}'
        out[key] = out.get(key, 0) + float(m.group(2))
    return out


def operations(openapi):
    with open(openapi) as f:
        doc = json.load(f)
    methods = ("get", "put", "post", "delete", "patch")
    return sorted(f"{m.upper()} {p}" for p, item in doc["paths"].items() for m in item if m in methods)


def main(argv):
    if argv[1] == "snapshot":
        json.dump({"any": counts(argv[2], argv[3]), "2xx": counts(argv[2], argv[3], True)}, sys.stdout)
        return 0
    _, _, openapi, before_file, reads_file, url, token, *rest = argv
    skip = {s.replace(":", " ", 1) for s in rest[1:]} if rest[:1] == ["--skip"] else set()
    with open(before_file) as f:
        snapshot = json.load(f)
    before, before_2xx = snapshot["any"], snapshot["2xx"]
    after = counts(url, token)
    after_2xx = counts(url, token, True)
    with open(reads_file) as f:
        reads = len(f.readlines())
    for op in ("GET /v1/images", "GET /v1/volumes"):
        after[op] = after.get(op, 0) - reads
        after_2xx[op] = after_2xx.get(op, 0) - reads
    ops = [op for op in operations(openapi) if op not in skip]
    missed = [op for op in ops if after.get(op, 0) <= before.get(op, 0)]
    print(f"fuzz: {len(ops) - len(missed)} of {len(ops)} operations reached", file=sys.stderr)
    for op in missed:
        print(f"fuzz: operation never reached: {op}", file=sys.stderr)
    # Reached is not served: how many the fuzzer got a 2xx from (a measure of
    # how deep it went, not a pass condition: some need state it cannot make).
    unserved = [op for op in ops if after_2xx.get(op, 0) <= before_2xx.get(op, 0)]
    print(f"fuzz: {len(ops) - len(unserved)} of {len(ops)} operations answered 2xx", file=sys.stderr)
    for op in unserved:
        print(f"fuzz: never a 2xx: {op}", file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
