#!/usr/bin/env python3
"""Checks the manifests of changed-block tracking (the external-snapshot-metadata
sidecar, v1.x), which kubernetes-validate checks only in part (it passes the
SnapshotMetadataService, a CRD kind, with a warning, and cannot read a patch).
They are opt-in: DIR/snapshot-metadata/ holds the sidecar's objects, and a
strategic-merge patch that adds the sidecar to the DaemonSet of DIR.

- the default DaemonSet has no sidecar and no volume of its Secret, and
  none of the sidecar's objects is among DIR's top-level files (what
  `kubectl apply -f DIR/` applies): the sidecar exits without a real TLS
  Secret, so it must not be part of the default install;
- the patch and the removal patch are patches, not objects (no apiVersion
  or kind, so that `kubectl apply -f` refuses them), add only containers and
  volumes the default pod does not have, and the removal patch gives the
  default DaemonSet back;
- the patched DaemonSet (the patch applied as a strategic merge does:
  containers and volumes merged by name, new ones put first, as kubectl
  patch puts them) keeps blockplane the container kubectl logs and exec
  take, passes kubernetes-validate --strict for each -k VERSION, and every
  check below;
- the SnapshotMetadataService as the CRD's schema defines it
  (cbt.storage.k8s.io/v1beta1, cluster-scoped, strict keys, spec.address,
  .audience and .caCert required strings, caCert base64 of a PEM certificate
  or of the example value), named after the CSIDriver defined here;
- its address names the Service defined here, by name, namespace and port;
  that Service has internalTrafficPolicy Local (snapshots are node-local),
  selects the DaemonSet's pods, and its targetPort is the sidecar's --port;
- the patched DaemonSet runs the sidecar once, with --csi-address at the
  driver's socket through the same volume, its --tls-cert/--tls-key files
  from a volume of the kubernetes.io/tls Secret defined here, ports no other
  container of the host-network pod uses, a readiness probe on its
  --http-endpoint, and an --audience, if it is given one, equal to the CR's;
- the DaemonSet's service account is granted what the sidecar needs (the
  rules of upstream's ClusterRole, and VolumeSnapshotClasses, which its code
  reads).

Usage: snapshot-metadata-manifests.py [-k VERSION]... [DIR]
(DIR defaults to deploy/kubernetes; kubernetes-validate is taken from beside
this Python, as in the test venv, or from PATH.)"""

import argparse
import base64
import binascii
import copy
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import yaml

from manifest_rules import errors, fail, keys, string

GROUP = "cbt.storage.k8s.io"
VERSION = "v1beta1"
KIND = "SnapshotMetadataService"
IMAGE = "registry.k8s.io/sig-storage/csi-snapshot-metadata:"
DEFAULT_PORT = 50051  # the sidecar's --port default
DEFAULT_HTTP = ":8080"  # its --http-endpoint default
PLACEHOLDER = b"REPLACE-ME"  # how the example caCert value starts, decoded
DEFAULT_CONTAINER = "kubectl.kubernetes.io/default-container"
OPT_IN = "snapshot-metadata"  # the directory of the sidecar's files, in DIR
PATCH = "daemonset-patch.yaml"  # adds the sidecar to the DaemonSet
REMOVE = "daemonset-patch-remove.yaml"  # takes it out again
# The patch merge keys of the pod's lists (k8s.io/api core/v1): a strategic
# merge merges these lists' items by that key and replaces any other list.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "ports": "containerPort",
    "env": "name",
    "imagePullSecrets": "name",
}
# What the sidecar is granted: the rules of upstream's ClusterRole
# external-snapshot-metadata-runner (deploy/snapshot-metadata-cluster-role.yaml
# of v1.1.0), and the VolumeSnapshotClasses its code reads (the class of a
# snapshot, or the list for the driver's default, for a snapshotter secret).
NEEDED = [
    ("cbt.storage.k8s.io", "snapshotmetadataservices",
     ("get", "list", "watch", "create", "update", "patch", "delete")),
    ("authentication.k8s.io", "tokenreviews", ("create", "get")),
    ("authorization.k8s.io", "subjectaccessreviews", ("create", "get")),
    ("snapshot.storage.k8s.io", "volumesnapshots", ("get", "list")),
    ("snapshot.storage.k8s.io", "volumesnapshotcontents", ("get", "list")),
    ("snapshot.storage.k8s.io", "volumesnapshotclasses", ("get", "list")),
]


def flags(container):
    """--name=value arguments as a dict (the sidecar's flags all take one)."""
    out = {}
    for a in container.get("args", []) or []:
        m = re.match(r"^--?([\w-]+)=(.*)$", str(a))
        if m:
            out[m.group(1)] = m.group(2)
    return out


def port_of(endpoint):
    m = re.search(r":(\d+)$", endpoint or "")
    return int(m.group(1)) if m else None


def mount_of(container, path):
    """(volume name, path inside the mount) of the deepest mount holding path."""
    best = None
    for vm in container.get("volumeMounts", []) or []:
        mp = vm["mountPath"].rstrip("/")
        if path == mp or path.startswith(mp + "/"):
            if best is None or len(mp) > len(best[2]):
                best = (vm["name"], path[len(mp):].lstrip("/"), mp)
    return (best[0], best[1]) if best else (None, None)


def check_cr(where, d, drivers):
    """The CR against the v1beta1 schema; its spec, or None."""
    if d.get("apiVersion") != f"{GROUP}/{VERSION}":
        fail(where, f"apiVersion {d.get('apiVersion')}: external-snapshot-metadata v1.x serves {GROUP}/{VERSION}")
    if d.get("kind") != KIND:
        fail(where, f"kind {d.get('kind')!r} of {GROUP} is not checked here (only {KIND})")
        return None
    keys(where, d, {"apiVersion", "kind", "metadata", "spec"}, ("metadata", "spec"))
    meta = d.get("metadata") or {}
    if "namespace" in meta:
        fail(where, f"{KIND} is cluster-scoped: metadata.namespace must not be set")
    name = meta.get("name")
    if name not in drivers:
        fail(where, f"name {name!r} must be the driver's: a CSIDriver defined here ({sorted(drivers)})")
    spec = d.get("spec")
    if not keys(f"{where} spec", spec, {"address", "audience", "caCert"}, ("address", "audience", "caCert")):
        return None
    for k in ("address", "audience", "caCert"):
        if k in spec:
            string(f"{where} spec.{k}", spec[k])
    ca = spec.get("caCert")
    if isinstance(ca, str) and ca:
        try:
            pem = base64.b64decode(ca, validate=True)
        except (binascii.Error, ValueError) as e:
            fail(where, f"spec.caCert is not base64 (format: byte): {e}")
        else:
            if not pem.startswith(PLACEHOLDER) and not (
                b"-----BEGIN CERTIFICATE-----" in pem and b"-----END CERTIFICATE-----" in pem
            ):
                fail(where, "spec.caCert must be the base64 of a PEM certificate (or of the example value)")
    return spec


def merge(where, base, patch):
    """base with patch applied as a strategic merge (apimachinery's
    strategicpatch, which kubectl patch and the API server run) applies it,
    for the patches here: maps merge key by key and a null removes a key; the
    lists of MERGE_KEYS merge item by item on their key (merge_list); any
    other list, and any other value, is replaced. Other directives ($patch in
    a map, $setElementOrder, $retainKeys...) are reported, not modelled."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(base) if isinstance(base, dict) else {}
    for k, v in patch.items():
        if str(k).startswith("$"):
            fail(where, f"directive {k} is not modelled here")
        elif v is None:
            out.pop(k, None)
        elif k in MERGE_KEYS and isinstance(v, list):
            out[k] = merge_list(f"{where}.{k}", out.get(k) or [], v, MERGE_KEYS[k])
        else:
            out[k] = merge(f"{where}.{k}", out.get(k), v)
    return out


def merge_list(where, base, patch, key):
    """A list merged on its merge key: an item of the patch with a key of the
    base's is merged into that item, one with `$patch: delete` removes it,
    a new one is added. The order is strategicpatch's without
    $setElementOrder (normalizeElementOrder): the patch's items in the
    patch's order and the base's other items in the base's order, merged by
    their places in the base, a new item going before any base item still to
    come. So a patch of new items alone puts them first."""
    out = copy.deepcopy(base)
    order = []
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            fail(where, f"an item without its merge key {key!r}: {item!r}")
            continue
        directive = item.get("$patch")
        at = next((i for i, x in enumerate(out) if isinstance(x, dict) and x.get(key) == item[key]), None)
        if directive == "delete":
            if at is not None:
                del out[at]
            continue
        if directive is not None:
            fail(where, f"$patch: {directive} is not modelled here")
            continue
        if at is None:
            out.append(merge(f"{where}[{item[key]}]", {}, item))
        else:
            out[at] = merge(f"{where}[{item[key]}]", out[at], item)
        if item[key] not in order:
            order.append(item[key])
    place = {x.get(key): i for i, x in enumerate(base) if isinstance(x, dict)}
    by_key = {x.get(key): x for x in out if isinstance(x, dict)}
    left = [by_key[k] for k in order]
    right = [x for x in out if not isinstance(x, dict) or x.get(key) not in order]
    merged, i, j = [], 0, 0
    while i < len(left) and j < len(right):
        lk = left[i][key]
        if lk not in place or place[lk] < place.get(right[j].get(key), -1):
            merged.append(left[i])
            i += 1
        else:
            merged.append(right[j])
            j += 1
    return merged + left[i:] + right[j:]


def pruned(x):
    """x without the maps a null left empty (Kubernetes' API types omit an
    empty map: an object stored without annotations has none)."""
    if isinstance(x, dict):
        return {k: v for k, v in ((k, pruned(v)) for k, v in x.items()) if v != {}}
    if isinstance(x, list):
        return [pruned(v) for v in x]
    return x


def load_patch(path):
    """The patch of path (its pod spec's containers and volumes only), or None."""
    where = str(path)
    if not path.is_file():
        fail(where, "missing: the opt-in's DaemonSet patch")
        return None
    ds = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    if len(ds) != 1 or not isinstance(ds[0], dict):
        fail(where, f"must be one YAML mapping (a strategic-merge patch), not {len(ds)} documents")
        return None
    d = ds[0]
    named = [k for k in ("apiVersion", "kind") if k in d]
    if named:
        fail(where, f"a patch, not an object: with {' and '.join(named)}, `kubectl apply -f` would take it for "
                    "the whole DaemonSet (dropping every other container) instead of refusing it")
    keys(where, {k: v for k, v in d.items() if k not in ("apiVersion", "kind")}, {"spec"}, ("spec",))
    spec = d.get("spec")
    if not keys(f"{where} spec", spec, {"template"}, ("template",)):
        return None
    template = spec["template"]
    if not keys(f"{where} spec.template", template, {"metadata", "spec"}, ("spec",)):
        return None
    if "metadata" in template and not keys(f"{where} spec.template.metadata", template["metadata"], {"annotations"}):
        return None
    if not keys(f"{where} spec.template.spec", template["spec"], {"containers", "volumes"}):
        return None
    return d


def default_container(pod):
    """The container kubectl logs and exec take without -c."""
    return (pod["metadata"].get("annotations") or {}).get(DEFAULT_CONTAINER) or pod["spec"]["containers"][0]["name"]


def validate(where, obj, versions):
    """kubernetes-validate --strict of obj, through a temporary file, as
    tests/run-all.sh runs it on the manifests."""
    if not versions:
        return
    exe = pathlib.Path(sys.executable).parent / "kubernetes-validate"
    exe = str(exe) if exe.is_file() else shutil.which("kubernetes-validate")
    if not exe:
        fail(where, "kubernetes-validate is neither beside this Python nor on PATH: not validated")
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "daemonset-patched.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(obj, f, sort_keys=False)
        for v in versions:
            r = subprocess.run([exe, "--strict", "--quiet", "-k", v, path], capture_output=True, text=True)
            if r.returncode != 0:
                out = (r.stdout + r.stderr).strip().replace(path, "(the patched DaemonSet)")
                fail(where, f"kubernetes-validate --strict -k {v} refuses it:\n{out}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-k", "--kubernetes-version", dest="versions", action="append", default=[], metavar="VERSION",
                    help="validate the patched DaemonSet against this Kubernetes version's schemas "
                         "(kubernetes-validate --strict); repeatable")
    ap.add_argument("dir", nargs="?", default="deploy/kubernetes", metavar="DIR")
    args = ap.parse_args()
    root = pathlib.Path(args.dir)
    opt_in = root / OPT_IN
    patch_paths = {opt_in / PATCH, opt_in / REMOVE}
    docs = []
    for path in sorted(root.rglob("*.yaml")):
        if path in patch_paths:
            continue
        for i, d in enumerate(yaml.safe_load_all(path.read_text())):
            if d:
                docs.append((f"{path}#{i}", d))

    def of_kind(kind):
        return [(w, d) for w, d in docs if d.get("kind") == kind]

    def by_default(where):
        """Whether `kubectl apply -f DIR/` applies it (DIR's own files, not
        its subdirectories')."""
        return pathlib.Path(where.rsplit("#", 1)[0]).parent == root

    def opt_in_only(where, what):
        if by_default(where):
            fail(where, f"{what} is among the files `kubectl apply -f {root}/` applies: the sidecar is opt-in, "
                        f"its objects belong in {opt_in}/")

    drivers = {d["metadata"]["name"] for _, d in of_kind("CSIDriver")}

    crs = []
    for where, d in docs:
        if str(d.get("apiVersion", "")).startswith(GROUP + "/"):
            opt_in_only(where, f"the {KIND}")
            spec = check_cr(where, d, drivers)
            if spec is not None:
                crs.append((where, d["metadata"].get("name"), spec))
    if len(crs) != 1:
        fail(str(root), f"expected one {KIND}, found {len(crs)}")
        return report()
    cr_where, cr_name, spec = crs[0]

    daemonsets = of_kind("DaemonSet")
    if len(daemonsets) != 1:
        fail(str(root), f"expected one DaemonSet, found {len(daemonsets)}")
        return report()
    default_where, default = daemonsets[0]

    # The default DaemonSet: no sidecar, no volume of a TLS Secret of here.
    tls_names = {d["metadata"].get("name") for _, d in of_kind("Secret") if d.get("type") == "kubernetes.io/tls"}
    dpod = default["spec"]["template"]["spec"]
    for c in dpod["containers"]:
        if str(c.get("image", "")).startswith(IMAGE):
            fail(default_where, f"container {c.get('name')} runs the csi-snapshot-metadata sidecar by default: "
                                "without a real TLS Secret it exits and every pod stays not Ready "
                                f"(it belongs in {opt_in / PATCH})")
    for v in dpod.get("volumes", []) or []:
        if (v.get("secret") or {}).get("secretName") in tls_names:
            fail(default_where, f"volume {v['name']} of the sidecar's TLS Secret is in the default DaemonSet "
                                f"(it belongs in {opt_in / PATCH})")

    # The patch adds the sidecar and its volume, nothing of the default's;
    # the removal patch takes them out again.
    patch = load_patch(opt_in / PATCH)
    remove = load_patch(opt_in / REMOVE)
    if patch is None or remove is None:
        return report()
    ppod = patch["spec"]["template"]["spec"]
    for lst in ("containers", "volumes"):
        have = {x.get("name") for x in dpod.get(lst, []) or []}
        for x in ppod.get(lst, []) or []:
            if x.get("name") in have:
                fail(str(opt_in / PATCH), f"{lst[:-1]} {x.get('name')} is the default DaemonSet's already: "
                                          "the patch adds the sidecar only, it changes nothing of the default pod")
    have = default["spec"]["template"]["metadata"].get("annotations") or {}
    for k in (patch["spec"]["template"].get("metadata") or {}).get("annotations") or {}:
        if k in have:
            fail(str(opt_in / PATCH), f"annotation {k} is the default pod's already: the patch changes nothing of it")
    ds = merge(str(opt_in / PATCH), default, patch)
    ds_where = f"{default_where} patched with {opt_in / PATCH}"
    before, after = default_container(default["spec"]["template"]), default_container(ds["spec"]["template"])
    if after != before:
        fail(ds_where, f"kubectl logs and exec without -c take container {after} instead of {before} "
                       f"(a strategic merge puts new containers first: set the annotation {DEFAULT_CONTAINER})")
    back = merge(str(opt_in / REMOVE), ds, remove)
    if pruned(back) != pruned(default):
        what = []
        for lst in ("containers", "volumes"):
            got, want = ([x.get("name") for x in d["spec"]["template"]["spec"].get(lst, []) or []]
                         for d in (back, default))
            if got != want:
                what.append(f"{lst} {got}, not {want}")
        fail(str(opt_in / REMOVE), "does not give the default DaemonSet back from the patched one: "
                                   + ("; ".join(what) or "the pod differs beyond its containers and volumes"))
    validate(ds_where, ds, args.versions)

    ds_ns = ds["metadata"].get("namespace")
    pod = ds["spec"]["template"]
    containers = pod["spec"]["containers"]
    volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
    sidecars = [c for c in containers if str(c.get("image", "")).startswith(IMAGE)]
    if len(sidecars) != 1:
        fail(ds_where, f"a {KIND} needs one csi-snapshot-metadata sidecar ({IMAGE}...) in the DaemonSet, found {len(sidecars)}")
        return report()
    side = sidecars[0]
    sw = f"{ds_where} container {side.get('name')}"
    sf = flags(side)
    grpc_port = int(sf.get("port", DEFAULT_PORT))

    # The address: <service>.<namespace>[.svc[.<domain>]]:<port>, a Service here.
    addr = spec.get("address", "")
    m = re.match(r"^([a-z0-9-]+)\.([a-z0-9-]+)(\.svc(\.[a-z0-9.-]+)?)?:(\d+)$", str(addr))
    if not m:
        fail(cr_where, f"spec.address {addr!r} is not <service>.<namespace>[.svc...]:<port>")
        return report()
    svc_name, svc_ns, svc_port = m.group(1), m.group(2), int(m.group(5))
    services = [(w, d) for w, d in of_kind("Service")
                if d["metadata"].get("name") == svc_name and d["metadata"].get("namespace") == svc_ns]
    if len(services) != 1:
        fail(cr_where, f"spec.address names Service {svc_ns}/{svc_name}, defined here {len(services)} times")
        return report()
    svc_where, svc = services[0]
    opt_in_only(svc_where, f"the Service {svc_name} of the {KIND}'s address")
    sspec = svc.get("spec") or {}
    if sspec.get("internalTrafficPolicy") != "Local":
        fail(svc_where, "internalTrafficPolicy must be Local: a snapshot is served by its own node's pod only")
    if svc_ns != ds_ns:
        fail(svc_where, f"namespace {svc_ns!r} is not the DaemonSet's ({ds_ns!r}): it cannot select its pods")
    labels = pod["metadata"].get("labels", {})
    selector = sspec.get("selector") or {}
    if not selector or any(labels.get(k) != v for k, v in selector.items()):
        fail(svc_where, f"selector {selector} does not select the DaemonSet's pods (labels {labels})")
    ports = [p for p in sspec.get("ports", []) if p.get("port") == svc_port]
    if len(ports) != 1:
        fail(svc_where, f"no port {svc_port}, the port of the {KIND}'s address")
    else:
        target = ports[0].get("targetPort", svc_port)
        if isinstance(target, str):
            named = [p["containerPort"] for c in containers for p in c.get("ports", []) or [] if p.get("name") == target]
            target = named[0] if len(named) == 1 else target
        if target != grpc_port:
            fail(svc_where, f"targetPort {ports[0].get('targetPort', svc_port)!r} is not the sidecar's --port ({grpc_port})")

    # The sidecar's socket: the driver's, through the same volume.
    drivers_c = [c for c in containers if any(str(a).startswith("--endpoint=") for a in c.get("args", []) or [])]
    if len(drivers_c) != 1:
        fail(ds_where, f"expected one driver container (with --endpoint), found {len(drivers_c)}")
    else:
        endpoint = flags(drivers_c[0])["endpoint"]
        dpath = re.sub(r"^unix:(//)?", "", endpoint)
        want = mount_of(drivers_c[0], dpath)
        caddr = re.sub(r"^unix:(//)?", "", sf.get("csi-address", "/run/csi/socket"))
        got = mount_of(side, caddr)
        if want[0] is None or got != want:
            fail(sw, f"--csi-address {caddr} is not the driver's socket {dpath} (volume {want[0]!r}, file {want[1]!r}; "
                     f"here volume {got[0]!r}, file {got[1]!r})")

    # The TLS files: the keys of the kubernetes.io/tls Secret defined here.
    tls = [(w, d) for w, d in of_kind("Secret") if d.get("type") == "kubernetes.io/tls"]
    if len(tls) != 1:
        fail(str(root), f"expected one kubernetes.io/tls Secret (the sidecar's), found {len(tls)}")
    else:
        tls_where, secret = tls[0]
        opt_in_only(tls_where, "the sidecar's TLS Secret (example values)")
        sname = secret["metadata"].get("name")
        if secret["metadata"].get("namespace") != ds_ns:
            fail(tls_where, f"namespace {secret['metadata'].get('namespace')!r} is not the DaemonSet's ({ds_ns!r})")
        data = {**(secret.get("data") or {}), **(secret.get("stringData") or {})}
        for k in ("tls.crt", "tls.key"):
            if k not in data:
                fail(tls_where, f"a kubernetes.io/tls Secret needs the key {k}")
        for flag, key in (("tls-cert", "tls.crt"), ("tls-key", "tls.key")):
            path = sf.get(flag)
            if not path:
                fail(sw, f"--{flag} is missing (the sidecar serves TLS only)")
                continue
            vol, inner = mount_of(side, path)
            source = (volumes.get(vol) or {}).get("secret")
            if not source or source.get("secretName") != sname:
                fail(sw, f"--{flag}={path} is not in a volume of the Secret {sname} (volume {vol!r})")
                continue
            items = {i["path"]: i["key"] for i in source.get("items", []) or []}
            if items.get(inner, inner if not items else None) != key:
                fail(sw, f"--{flag}={path} is not the Secret's key {key}")

    # Host network: the sidecar's ports against the rest of the pod's.
    http_port = port_of(sf.get("http-endpoint", DEFAULT_HTTP))
    declared = {p["containerPort"] for p in side.get("ports", []) or []}
    if pod["spec"].get("hostNetwork") and grpc_port not in declared:
        fail(sw, f"--port {grpc_port} is not among its declared ports {sorted(declared)} (host network: a host port)")
    taken = {}
    for c in containers:
        if c is side:
            continue
        for p in c.get("ports", []) or []:
            taken[p["containerPort"]] = c["name"]
        for a in c.get("args", []) or []:
            m2 = re.match(r"^--([\w-]+)=(.*)$", str(a))
            if m2 and (port_of(m2.group(2)) or (m2.group(1).endswith("port") and m2.group(2).isdigit())):
                taken[port_of(m2.group(2)) or int(m2.group(2))] = c["name"]
    for what, p in (("--port", grpc_port), ("--http-endpoint", http_port)):
        if p in taken:
            fail(sw, f"{what} {p} is taken by container {taken[p]} of the same host-network pod")
    probe = (side.get("readinessProbe") or {}).get("httpGet")
    if probe and probe.get("port") != http_port:
        fail(sw, f"readinessProbe port {probe.get('port')!r} is not the --http-endpoint port ({http_port})")

    # The audience, if the sidecar is given one (v1.1.0 ignores it; later
    # releases prefer it to the CR's).
    if "audience" in sf and sf["audience"] != spec.get("audience"):
        fail(sw, f"--audience {sf['audience']!r} is not the {KIND}'s audience {spec.get('audience')!r}")

    # RBAC: what the DaemonSet's service account is granted, cluster-wide.
    sa = pod["spec"].get("serviceAccountName", "default")
    roles = {d["metadata"]["name"]: d for _, d in of_kind("ClusterRole")}
    for where, d in of_kind("ClusterRole"):
        if any(GROUP in (r.get("apiGroups") or []) for r in d.get("rules", []) or []):
            opt_in_only(where, f"the sidecar's ClusterRole {d['metadata']['name']} (rules on {GROUP})")
    granted = set()
    for _, b in of_kind("ClusterRoleBinding"):
        if not any(s.get("kind") == "ServiceAccount" and s.get("name") == sa and s.get("namespace") == ds_ns
                   for s in b.get("subjects", []) or []):
            continue
        for r in (roles.get(b["roleRef"]["name"]) or {}).get("rules", []):
            for g in r.get("apiGroups", []):
                for res in r.get("resources", []):
                    for v in r.get("verbs", []):
                        granted.add((g, res, v))
    for g, res, verbs in NEEDED:
        missing = [v for v in verbs if (g, res, v) not in granted and (g, res, "*") not in granted]
        if missing:
            fail(ds_where, f"service account {ds_ns}/{sa} lacks {', '.join(missing)} on {res}.{g} "
                           "(the sidecar's ClusterRole)")
    return report(cr_name, svc_ns, svc_name, svc_port, opt_in / PATCH, args.versions)


def report(*ok):
    for e in errors:
        print(f"snapshot-metadata-manifests: {e}", file=sys.stderr)
    if errors:
        return 1
    name, ns, svc, port, patch, versions = ok
    valid = f"kubernetes-validate --strict {', '.join(versions)}" if versions else "not validated: no -k"
    print(f"snapshot-metadata-manifests: {KIND} {name} -> Service {ns}/{svc}:{port} "
          f"(internalTrafficPolicy Local) -> DaemonSet sidecar, opt-in with {patch} ({valid}); "
          "none by default: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
