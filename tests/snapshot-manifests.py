#!/usr/bin/env python3
"""Checks the manifests of CRD kinds in deploy/kubernetes, which
kubernetes-validate cannot (it bundles the schemas of built-in kinds only and
passes a CRD kind with a warning): VolumeSnapshotClass and VolumeSnapshot of
snapshot.storage.k8s.io/v1 (external-snapshotter v8), field by field as that
CRD's schema defines them, with strict keys; and that they fit the rest: the
class names this driver, a snapshot names a class defined here, a claim
restored from a snapshot names one defined here, and the DaemonSet runs the
csi-snapshotter sidecar for this node. Usage: snapshot-manifests.py [DIR]."""

import pathlib
import sys

import yaml

from manifest_rules import errors, fail, keys, string

GROUP = "snapshot.storage.k8s.io"


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "deploy/kubernetes")
    docs = []
    for path in sorted(root.rglob("*.yaml")):
        for i, d in enumerate(yaml.safe_load_all(path.read_text())):
            if d:
                docs.append((f"{path}#{i}", path, d))
    drivers = {d["metadata"]["name"] for _, _, d in docs if d.get("kind") == "CSIDriver"}
    classes = set()
    snapshots = {}
    for where, path, d in docs:
        api = d.get("apiVersion", "")
        if not api.startswith(GROUP + "/"):
            continue
        if api != GROUP + "/v1":
            fail(where, f"apiVersion {api}: the CRDs of external-snapshotter v8 serve {GROUP}/v1")
        kind = d.get("kind")
        if kind == "VolumeSnapshotClass":
            keys(where, d, {"apiVersion", "kind", "metadata", "driver", "deletionPolicy", "parameters"},
                 ("metadata", "driver", "deletionPolicy"))
            string(f"{where} driver", d.get("driver"))
            if d.get("driver") not in drivers:
                fail(where, f"driver {d.get('driver')!r} is not a CSIDriver defined here ({sorted(drivers)})")
            if d.get("deletionPolicy") not in ("Delete", "Retain"):
                fail(where, f"deletionPolicy {d.get('deletionPolicy')!r} is not Delete or Retain")
            params = d.get("parameters", {})
            if not isinstance(params, dict) or not all(isinstance(v, str) for v in params.values()):
                fail(where, "parameters must map strings to strings")
            classes.add(d["metadata"]["name"])
        elif kind == "VolumeSnapshot":
            keys(where, d, {"apiVersion", "kind", "metadata", "spec"}, ("metadata", "spec"))
            spec = d.get("spec", {})
            if keys(f"{where} spec", spec, {"source", "volumeSnapshotClassName"}, ("source",)):
                src = spec.get("source", {})
                both = {"persistentVolumeClaimName", "volumeSnapshotContentName"}
                if keys(f"{where} spec.source", src, both) and len(both & set(src)) != 1:
                    fail(where, "spec.source must name exactly one of " + ", ".join(sorted(both)))
                for k in both & set(src):
                    string(f"{where} spec.source.{k}", src[k])
            snapshots[(path, d["metadata"]["name"])] = spec.get("volumeSnapshotClassName")
        else:
            fail(where, f"kind {kind!r} of {GROUP} is not checked here")
    for (path, name), cls in snapshots.items():
        if cls is not None and cls not in classes:
            fail(f"{path} VolumeSnapshot {name}", f"volumeSnapshotClassName {cls!r} is not defined here")
    for where, path, d in docs:
        source = (d.get("spec") or {}).get("dataSource") if d.get("kind") == "PersistentVolumeClaim" else None
        if source and source.get("kind") == "VolumeSnapshot":
            if source.get("apiGroup") != GROUP:
                fail(where, f"dataSource.apiGroup must be {GROUP}")
            if (path, source.get("name")) not in snapshots:
                fail(where, f"dataSource names VolumeSnapshot {source.get('name')!r}, not defined in {path}")
    sidecars = [
        c
        for _, _, d in docs
        if d.get("kind") == "DaemonSet"
        for c in d["spec"]["template"]["spec"]["containers"]
        if c["image"].startswith("registry.k8s.io/sig-storage/csi-snapshotter:")
    ]
    if classes and len(sidecars) != 1:
        fail(str(root), f"a VolumeSnapshotClass needs one csi-snapshotter sidecar in the DaemonSet, found {len(sidecars)}")
    for c in sidecars:
        if "--node-deployment=true" not in c.get("args", []):
            fail("csi-snapshotter", "volumes are local: it must run with --node-deployment=true")
        if "NODE_NAME" not in {e["name"] for e in c.get("env", [])}:
            fail("csi-snapshotter", "--node-deployment needs the NODE_NAME environment variable")
    if not classes:
        fail(str(root), "no VolumeSnapshotClass found")
    for e in errors:
        print(f"snapshot-manifests: {e}", file=sys.stderr)
    if errors:
        return 1
    print(f"snapshot-manifests: {len(classes)} VolumeSnapshotClass, {len(snapshots)} VolumeSnapshot: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
