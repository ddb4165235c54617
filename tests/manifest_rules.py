"""The rules the manifest checks share (tests/snapshot-manifests.py,
tests/snapshot-metadata-manifests.py): failures gathered in `errors`, an
object's fields checked strictly against the ones its schema knows, and a
required string."""

errors = []


def fail(where, msg):
    errors.append(f"{where}: {msg}")


def keys(where, obj, allowed, required=()):
    if not isinstance(obj, dict):
        fail(where, f"is not an object: {obj!r}")
        return False
    for k in obj:
        if k not in allowed:
            fail(where, f"unknown field '{k}' (known: {', '.join(sorted(allowed))})")
    for k in required:
        if k not in obj:
            fail(where, f"required field '{k}' is missing")
    return True


def string(where, v):
    if not isinstance(v, str) or not v:
        fail(where, f"must be a non-empty string, not {v!r}")
        return False
    return True
