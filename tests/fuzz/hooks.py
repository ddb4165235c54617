"""Schemathesis hooks for blockplane: no request may change state unless it
answered 2xx. Before each call the visible state (images, volumes, and the
loop devices under the test's image root) is read; after a non-2xx answer it
must be the same."""

import os
import subprocess

import requests
import schemathesis

BASE = os.environ["BP_FUZZ_URL"]
TOKEN = os.environ.get("BP_FUZZ_TOKEN")
ROOT = os.environ["BP_FUZZ_ROOT"]
READS = os.environ.get("BP_FUZZ_STATE_READS")
HEADERS = {"Authorization": f"Bearer {TOKEN}"} if TOKEN else {}
_before = {}


def _state():
    # Counted, so that coverage.py can tell these reads from the fuzzer's.
    if READS:
        with open(READS, "a") as f:
            f.write("1\n")
    images = requests.get(f"{BASE}/v1/images", headers=HEADERS, timeout=30).json()
    volumes = requests.get(f"{BASE}/v1/volumes", headers=HEADERS, timeout=30).json()
    loops = subprocess.run(["losetup", "-l", "-n", "-O", "NAME,BACK-FILE"], capture_output=True, text=True).stdout
    # Columns are padded to the longest name on the host (another test's
    # /dev/loop10 widens them): compare the fields, not the padding.
    mine = sorted(" ".join(line.split()) for line in loops.splitlines() if ROOT in line)
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(ROOT) for f in fs)
    # Volatile fields (live sizes move with I/O) are left out.
    return (
        sorted((i["id"], i["name"], i["path"], i["size_bytes"]) for i in images),
        sorted((v["id"], v["name"], v["state"], v["dispatch"], v["read_only"], str(v["qos"])) for v in volumes),
        mine,
        files,
    )


@schemathesis.hook
def before_call(ctx, case, **kwargs):
    _before[id(case)] = _state()


@schemathesis.check
def state_unchanged_unless_2xx(ctx, response, case):
    before = _before.pop(id(case), None)
    if before is None or 200 <= response.status_code < 300:
        return
    after = _state()
    if after != before:
        raise AssertionError(
            f"{case.method} {case.formatted_path} answered {response.status_code} but changed state:\n"
            f"before {before}\nafter  {after}"
        )


# Codes a schema-valid request may be refused with (422 or 507): each depends
# on something besides the request, which JSON Schema cannot state (an image
# path's byte limits are in its pattern). See schemathesis.toml.
STATE_CODES = {
    # The file on disk and its filesystem.
    "not_regular_file",
    "hard_links",
    "loose_permissions",
    "invalid_size",
    "too_large",
    "no_space",
    "storage_full",
    # What the file holds: a registration declared full over a hole.
    "allocation_mismatch",
    # The registry: the file is registered, the image's size, the cap.
    "already_registered",
    "shrink_refused",
    "volume_limit",
    # The image is a read-only snapshot, or is not one (changed ranges);
    # two snapshots are of different images.
    "image_read_only",
    "not_a_snapshot",
    "snapshots_of_different_images",
    # The backend (`auto` picks it by host) and what the host's kernel offers.
    "backend_unavailable",
    "unsupported",
    "refused",
    "not_live",
    # Whether the image is encrypted, and whether this host has dm-crypt;
    # a file's LUKS header that is not LUKS2, or not readable.
    "not_encrypted",
    "key_required",
    "encryption_unavailable",
    "luks_version_unsupported",
    "luks_header_unreadable",
    # Exports and remote volumes: whether this service has export addresses
    # (and loopback ones only, for an export without authentication), an
    # NVMe target or initiator, whether the volume is read-only, whether
    # another host answers, and a key's content (its base64 and CRC-32; the
    # schema states its form).
    "export_unavailable",
    "auth_required",
    "export_read_only",
    "initiator_unavailable",
    "remote_unreachable",
    "invalid_key",
    # A backup schedule's cron expression: its ranges and whether it ever
    # matches (Feb 30) are the parser's to say, not a pattern's.
    "invalid_cron",
    # How many labels an image has: a patch's own count says nothing of
    # the labels it merges into.
    "too_many_labels",
}


@schemathesis.check
def positive_data_refused_only_by_state(ctx, response, case):
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive:
        return
    if response.status_code not in (422, 507):
        return
    try:
        code = response.json()["error"]["code"]
    except Exception:
        code = None
    if code not in STATE_CODES:
        raise AssertionError(
            f"{case.method} {case.formatted_path}: a schema-valid request was refused "
            f"{response.status_code} {code!r}, a rule the schema should state: {response.text}"
        )


# 507 is a refusal the API documents (no room on the image's filesystem, a
# full data dir, the overcommit limit), with the same JSON error shape as a
# 4xx: a fuzzer that grows an image past its 512 MiB root and then allocates
# it gets one. Any other 5xx, or a 507 without one of these codes, is a
# server error. Replaces schemathesis' not_a_server_error (run.sh excludes it).
STORAGE_CODES = {"no_space", "storage_full", "overcommit_refused"}


@schemathesis.check
def no_server_error_but_documented_storage_refusals(ctx, response, case):
    if response.status_code < 500:
        return
    try:
        code = response.json()["error"]["code"]
    except Exception:
        code = None
    if response.status_code == 507 and code in STORAGE_CODES:
        return
    raise AssertionError(
        f"{case.method} {case.formatted_path}: server error {response.status_code} {code!r}: {response.text}"
    )
