#!/usr/bin/env python3
"""blockplane benchmark, run inside the test VM (see bench.sh).

Every target serves its own fully allocated image (BENCH_IMAGE_SIZE, 512M) on
xfs (on a linear dm device over the virtio disk): the raw image file, the
kernel loop driver (direct I/O), the peer rublk (a ublk loop server from
crates.io) in copy and in zero-copy mode with blockplane's queue count and
depth, blockplane ublk volumes `nowait`/`threaded`/`direct` and dm volumes
`direct`/`nowait`, and "every default": a volume made with no options at all
(backend and dispatch the service's choice) on a full and on a sparse image.
The blockplane volumes are made with the service's defaults: only backend
and dispatch are given.

fio 4k randrw, 2 jobs, --direct=1, once with psync and once with io_uring at
iodepth 16. All targets exist for the whole run; after one short unmeasured
run per cell (BENCH_WARMUP s: the first I/O through a path is slow under
TCG, which translates code on first use), they are measured in rounds
(BENCH_REPEAT rounds, each visiting every target in both modes), each round
starting one target later than the last, so that drift of the host hits
every target alike. The table gives per target the median IOPS, its ratios to
the raw file, the kernel loop and the best rublk row, the spread
(max-min)/median, and for each userspace server (blockplane worker, rublk):
CPU time and context switches per request, from /proc/<pid>/stat
(utime+stime of the whole process) and /proc/<pid>/task/*/status
(voluntary+nonvoluntary switches of every thread) read before and after each
fio run and divided by the requests fio completed in it (no ramp time, so the
two windows match); the NOWAIT fallback share (EAGAIN fallbacks / NOWAIT
submissions, from the volume's stats); the server's largest VmRSS.

Absolute numbers under TCG mean nothing; the ratios inside one run do. A
second table pairs them by round: each round's IOPS over the kernel loop's and
the best rublk row's in the same round, the median of those ratios and their
spread. That cancels drift between rounds, not noise within one: on
2026-12-05 the paired spreads (13-160%) were no narrower than the rows' own.

BENCH_PROFILE=1 also profiles every target but the raw file under the psync
load after the rounds (BENCH_PROFILE=key,key... only those targets):
`perf record -a -g` (cpu-clock; TCG has no PMU) while fio runs, and `perf
report` by command, by DSO and by symbol, and for a userspace server by DSO
and symbol of its own process, into /results/profile-<target>.txt. A profile
that fails is noted in its file; the table still comes.

The encrypted targets (loop-enc, ublk-nowait-enc, dm-direct-enc; not in the
default set) serve a LUKS2 image through dm-crypt over that path; an
Encryption table gives each over its plain twin: IOPS, IOPS paired by round,
and the whole system's CPU per request (/proc/stat busy ticks over fio's
requests: fio, the server and the kernel's crypto workers alike), with the
guest CPU's AES support and the xts(aes) driver the kernel picked.

BENCH_ALT_BIN=/path/to/blockplane serves the targets named `<key>-alt` (any
blockplane key, e.g. ublk-nowait-alt) from a second service running that
binary, so that two builds (a release profile, a change) compare in one boot.
"""

import ctypes
import http.client
import json
import os
import socket
import stat
import subprocess
import sys
import time

BIN = sys.argv[1]
RUBLK = sys.argv[2] if len(sys.argv) > 2 else ""
ALT_BIN = os.environ.get("BENCH_ALT_BIN", "")
RUNTIME = int(os.environ.get("BENCH_RUNTIME", "5"))
REPEAT = int(os.environ.get("BENCH_REPEAT", "5"))
IMAGE_SIZE = os.environ.get("BENCH_IMAGE_SIZE", "512M")
RUBLK_QUEUES = os.environ.get("BENCH_RUBLK_QUEUES", "")
WARMUP = int(os.environ.get("BENCH_WARMUP", "2"))
PROFILE = os.environ.get("BENCH_PROFILE", "0")
RESULTS = os.environ.get("BLOCKPLANE_VM_RESULTS", "/results")
DATA = "/run/bp-bench"
ROOT = os.path.join(os.environ["SCRATCH_XFS"], "bench")
SOCK = os.path.join(DATA, "blockplane.sock")
# The second service (BENCH_ALT_BIN): its own data dir and socket, the same image root.
ALT_DATA = DATA + "-alt"
ALT_SOCK = os.path.join(ALT_DATA, "blockplane.sock")
ALT = "-alt"
MODES = [("psync", ["--ioengine=psync"]), ("qd16", ["--ioengine=io_uring", "--iodepth=16"])]
CLK_TCK = os.sysconf("SC_CLK_TCK")
# ublk device numbers for the rublk devices: far above the ones the kernel
# hands blockplane (lowest free first).
RUBLK_DEV_BASE = 900

# key -> (label, kind, how): kind says what check_target expects; `how` is the
# blockplane (backend, dispatch) or the rublk mode.
TARGETS = {
    "raw": ("raw file", "raw", None),
    "loop": ("kernel loop (dio)", "loop", ("loop", None)),
    # The same driver on a sparse image: what "every default (sparse
    # image)" compares with (a dm table over a loop device is its path).
    "loop-sparse": ("kernel loop (dio), sparse image", "loop", ("loop", None)),
    "rublk": ("rublk copy", "rublk", "copy"),
    "rublk-zc": ("rublk zero-copy", "rublk", "zero-copy"),
    "ublk-nowait": ("blockplane ublk nowait", "ublk", ("ublk", "nowait")),
    "ublk-threaded": ("blockplane ublk threaded", "ublk", ("ublk", "threaded")),
    "ublk-direct": ("blockplane ublk direct", "ublk", ("ublk", "direct")),
    "dm-direct": ("blockplane dm direct", "dm", ("dm", "direct")),
    "dm-nowait": ("blockplane dm nowait", "dm", ("dm", "nowait")),
    # The volume a user gets with no options at all: its backend and policy
    # are the service's choice (kind "default": read from the volume).
    "default-full": ("blockplane, every default (full image)", "default", (None, None)),
    "default-sparse": ("blockplane, every default (sparse image)", "default", (None, None)),
    # A dm volume under `auto` given a QoS limit far above what the guest
    # reaches: it moves live off `direct` to its worker (`nowait`), so the
    # row is the worker path's cost on dm.
    "dm-qos": ("blockplane dm auto + QoS", "dm", ("dm", None)),
    # Not in the default set (BENCH_TARGETS adds it).
    "dm-threaded": ("blockplane dm threaded", "dm", ("dm", "threaded")),
    # Encrypted (LUKS2, dm-crypt over the path): each against its plain
    # twin in the Encryption table. Not in the default set.
    "loop-enc": ("blockplane loop, encrypted", "loop", ("loop", None)),
    "ublk-nowait-enc": ("blockplane ublk nowait, encrypted", "ublk", ("ublk", "nowait")),
    "dm-direct-enc": ("blockplane dm direct, encrypted", "dm", ("dm", "direct")),
}
ENCRYPTED = {"loop-enc": "loop", "ublk-nowait-enc": "ublk-nowait", "dm-direct-enc": "dm-direct"}
DEFAULT_TARGETS = [k for k in TARGETS if k != "dm-threaded" and k not in ENCRYPTED]
# The encrypted targets' key, and their images' LUKS2 header (on top of the
# image size, so that every device is the same size).
KEY = "bench-key"
HEADER = 16 << 20
# What a target's image and volume get beyond the defaults (by key).
ALLOCATION = {"default-sparse": "sparse", "loop-sparse": "sparse"}
QOS = {"dm-qos": {"iops": 100_000_000, "bytes_per_sec": 1 << 40}}


def target_of(key):
    """(label, kind, how, socket) of a target key; None for an unknown key.
    `<key>-alt` is a blockplane target served by the BENCH_ALT_BIN service."""
    if key in TARGETS:
        label, kind, how = TARGETS[key]
        return label, kind, how, SOCK
    base = key[: -len(ALT)] if key.endswith(ALT) else None
    if ALT_BIN and base in TARGETS and TARGETS[base][1] in ("ublk", "dm", "default"):
        label, kind, how = TARGETS[base]
        return f"{label} (alt)", kind, how, ALT_SOCK
    return None


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP to the service's unix socket."""

    def __init__(self, path):
        super().__init__("localhost", timeout=300)
        self.unix_path = path

    def connect(self):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        s.connect(self.unix_path)
        self.sock = s


def api(method, path, body=None, sock=SOCK):
    """One API call to the service on `sock`; the JSON answer. Any error status ends the bench."""
    conn = UnixHTTPConnection(sock)
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        conn.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    if resp.status >= 300:
        sys.exit(f"{method} {path}: HTTP {resp.status}: {data.decode(errors='replace')}")
    return json.loads(data) if data.strip() else None


def size_bytes(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text[-1:].upper() in units:
        return int(text[:-1]) * units[text[-1].upper()]
    return int(text)


def major_of(name):
    with open("/proc/devices") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 2 and parts[1] == name:
                return int(parts[0])
    return None


def read(path):
    with open(path) as f:
        return f.read().strip()


def check_target(kind, path, image):
    """Refuse to measure something other than what the row claims."""
    st = os.stat(path)
    if kind == "raw":
        assert stat.S_ISREG(st.st_mode), f"{path} is not a regular file"
        return f"regular file on {os.statvfs(path).f_fsid:x}"
    assert stat.S_ISBLK(st.st_mode), f"{path} is not a block device"
    major = os.major(st.st_rdev)
    dev = os.path.basename(path)
    if kind == "loop":
        assert major == 7, f"{path} is not a loop device (major {major})"
        backing = read(f"/sys/block/{dev}/loop/backing_file")
        assert backing == image, f"{path} serves {backing}, not {image}"
        dio = read(f"/sys/block/{dev}/loop/dio")
        assert dio == "1", f"{path} does not do direct I/O"
        return f"loop, backing {backing}, dio {dio}"
    if kind in ("ublk", "rublk"):
        # ublk disks take dynamic (blkext) numbers: match the node with sysfs.
        assert dev.startswith("ublkb"), f"{path} is not named as a ublk device"
        sysdev = read(f"/sys/block/{dev}/dev")
        assert sysdev == f"{major}:{os.minor(st.st_rdev)}", f"{path} is not /sys/block/{dev}"
        return f"ublk {sysdev}, {read(f'/sys/block/{dev}/queue/nr_requests')} requests per queue"
    if kind == "dm":
        assert major == major_of("device-mapper"), f"{path} is not a dm device (major {major})"
        table = subprocess.run(["dmsetup", "table", "-j", str(major), "-m", str(os.minor(st.st_rdev))],
                               capture_output=True, text=True, env={**os.environ, "DM_DISABLE_UDEV": "1"}).stdout
        return f"dm major {major}: {table.splitlines()[0] if table else '?'}"
    raise AssertionError(kind)


def check_crypt(path):
    """What a plaintext device is: a dm `crypt` table, and its cipher."""
    st = os.stat(path)
    table = subprocess.run(["dmsetup", "table", "-j", str(os.major(st.st_rdev)), "-m", str(os.minor(st.st_rdev))],
                           capture_output=True, text=True, env={**os.environ, "DM_DISABLE_UDEV": "1"}).stdout.split()
    assert len(table) > 3 and table[2] == "crypt", f"{path} is not a dm-crypt device: {table[:3]}"
    return f"dm-crypt {table[3]}"


def aes_support():
    """Whether the guest CPU has AES instructions, and which xts(aes) the
    kernel's crypto API uses for dm-crypt (the highest priority)."""
    with open("/proc/cpuinfo") as f:
        flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    best, prio, name = None, -1, None
    with open("/proc/crypto") as f:
        for line in f:
            key, _, value = line.partition(":")
            key, value = key.strip(), value.strip()
            if key == "name":
                name = value
            elif key == "driver" and name == "xts(aes)":
                driver = value
            elif key == "priority" and name == "xts(aes)" and int(value) > prio:
                best, prio = driver, int(value)
    return f"CPU aes flag {'yes' if 'aes' in flags else 'no'}; xts(aes) by {best or 'not loaded yet'}"


def system_busy_ticks():
    """CPU ticks every CPU spent busy (not idle, not waiting for I/O): the
    whole cost of a request, the kernel's crypto workers included."""
    with open("/proc/stat") as f:
        cpu = [int(x) for x in f.readline().split()[1:]]
    return sum(cpu) - cpu[3] - cpu[4]


def worker_pid_of(vol):
    """The process serving a blockplane volume: `worker_pid`, or for a dm
    volume's private ublk device (which the API does not show) the worker
    whose --spec names the volume."""
    if vol.get("worker_pid"):
        return vol["worker_pid"]
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if len(args) > 3 and args[1] == b"worker" and b"--spec" in args:
            try:
                spec = json.loads(args[args.index(b"--spec") + 1])
            except ValueError:
                continue
            if spec.get("volume_id") == vol["id"]:
                return int(d)
    return None


def proc_sample(pid):
    """CPU ticks (all threads, dead ones included), context switches (live
    threads) and VmRSS (KiB) of a process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    ctx = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith(("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")):
                        ctx += int(line.split()[1])
        except OSError:
            pass  # the thread exited meanwhile
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    return {"ticks": ticks, "ctx": ctx, "rss_kib": rss}


def nowait_counters(t):
    if not t.get("volume_id"):
        return None
    n = api("GET", f"/v1/volumes/{t['volume_id']}/stats", sock=t["sock"]).get("nowait") or {}
    # Tolerant of a reshaped object: a missing counter reads as no counters.
    if "submitted" not in n or "eagain_fallbacks" not in n:
        return None
    return n["submitted"], n["eagain_fallbacks"]


def fio(path, mode_args, size, runtime=RUNTIME):
    cmd = ["fio", "--name=bench", "--filename=" + path, "--rw=randrw", "--bs=4k", "--numjobs=2",
           "--direct=1", "--group_reporting", "--time_based", f"--runtime={runtime}",
           f"--size={size}", "--randrepeat=0", "--output-format=json", *mode_args]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"fio on {path} failed: {out.stderr}")
    job = json.loads(out.stdout)["jobs"][0]
    if job["error"]:
        sys.exit(f"fio on {path}: error {job['error']}")
    return job["read"]["iops"] + job["write"]["iops"], job["read"]["total_ios"] + job["write"]["total_ios"]


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


_libc = ctypes.CDLL(None, use_errno=True)


def cached_bytes(path):
    """Bytes of the file or device at `path` in the page cache: cachestat(2)
    (syscall 451, kernel 6.5+), the call the service makes; None without it.
    Opening reads nothing (the kernel drops a device's cache at its last
    close, so a device nobody holds open shows 0)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        rng, out = _CachestatRange(0, 0), _Cachestat()
        if _libc.syscall(451, fd, ctypes.byref(rng), ctypes.byref(out), 0) != 0:
            return None
        return out.nr_cache * os.sysconf("SC_PAGE_SIZE")
    finally:
        os.close(fd)


def page_cache(t):
    """(device, image) bytes cached of a target (the raw target's device is its image)."""
    dev = cached_bytes(t["path"]) if t["path"] != t["image"] else None
    return dev, cached_bytes(t["image"])


def bimodal(iops):
    """Whether the rounds split into two clusters: sorted, the largest gap
    between neighbours is over 20% of the median and over twice the range
    of either side, with at least two rounds on each side (so 4 rounds or
    more)."""
    s = sorted(iops)
    if len(s) < 4 or not median(s):
        return False
    gap, i = max((s[k + 1] - s[k], k + 1) for k in range(len(s) - 1))
    low, high = s[:i], s[i:]
    if len(low) < 2 or len(high) < 2:
        return False
    return gap > 0.20 * median(s) and gap > 2 * max(low[-1] - low[0], high[-1] - high[0])


def run_cell(t, mode, args, size):
    """One fio run on a target, with the server's costs around it."""
    pid = t.get("pid")
    before = proc_sample(pid) if pid else None
    nw_before = nowait_counters(t)
    busy_before = system_busy_ticks()
    iops, reqs = fio(t["path"], args, size)
    run = {"iops": iops, "requests": reqs,
           "system_cpu_us_per_req": (system_busy_ticks() - busy_before) * 1e6 / CLK_TCK / max(reqs, 1)}
    if pid:
        after = proc_sample(pid)
        run["cpu_us_per_req"] = (after["ticks"] - before["ticks"]) * 1e6 / CLK_TCK / max(reqs, 1)
        run["ctx_per_req"] = (after["ctx"] - before["ctx"]) / max(reqs, 1)
        run["rss_kib"] = after["rss_kib"]
    nw_after = nowait_counters(t)
    if nw_before and nw_after:
        run["nowait_submitted"] = nw_after[0] - nw_before[0]
        run["nowait_fallbacks"] = nw_after[1] - nw_before[1]
    t["runs"][mode].append(run)


def start_rublk(t, n, queues, depth):
    """A rublk loop device in the foreground (so its pid is ours); the reason
    it did not start, or None."""
    dev = f"/dev/ublkb{n}"
    cmd = [RUBLK, "add", "loop", "-n", str(n), "-q", str(queues), "-d", str(depth), "-f", t["image"],
           "--foreground"]
    if t["how"] == "zero-copy":
        cmd.append("-z")
    log_path = f"{RESULTS}/rublk-{n}.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    t["cmd"] = " ".join(cmd[1:])
    deadline = time.time() + 60
    while time.time() < deadline:
        if proc.poll() is not None:
            with open(log_path) as f:
                lines = [ln.strip() for ln in f if ln.strip()]
            return f"rublk exited {proc.returncode}: {lines[-1] if lines else 'no output'}"
        if os.path.exists(dev) and os.path.exists(f"/sys/block/ublkb{n}"):
            t.update(proc=proc, pid=proc.pid, path=dev, dev_number=n)
            return None
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    return f"{dev} did not appear within 60 s"


def stop_rublk(t):
    subprocess.run([RUBLK, "del", "-n", str(t["dev_number"])], capture_output=True)
    try:
        t["proc"].wait(timeout=30)
    except subprocess.TimeoutExpired:
        t["proc"].kill()
        t["proc"].wait()


def profile(t, size):
    """Where the CPU goes while fio (psync) runs on a target: perf, system-wide,
    over fio's whole run (under TCG fio can take seconds to start its I/O, so
    a window of its own could miss it; the start reads as idle)."""
    name = t["key"]
    data = f"/run/perf-{name}.data"
    rec = subprocess.run(["perf", "record", "-a", "-g", "-F", "499", "-e", "cpu-clock", "-o", data, "--",
                          "fio", "--name=prof", "--filename=" + t["path"], "--rw=randrw", "--bs=4k",
                          "--numjobs=2", "--direct=1", "--time_based", f"--runtime={max(RUNTIME, 20)}",
                          f"--size={size}", "--ioengine=psync", "--group_reporting", "--output-format=terse"],
                         capture_output=True, text=True)
    parts = [f"### perf record: exit {rec.returncode}\n{rec.stderr}"]
    reports = [(sort, []) for sort in ["comm", "comm,dso", "sym"]]
    if t.get("pid"):
        # The server alone (all its threads, io-wq's included), in shares of
        # its own samples: where its CPU time per request goes.
        reports.append(("comm,dso,sym", ["--pid", str(t["pid"]), "--percentage", "relative"]))
        # Its own code alone, down to small symbols: what it adds to the
        # kernel's work per request.
        exe = os.path.basename(os.readlink(f"/proc/{t['pid']}/exe"))
        reports.append(("sym", ["--pid", str(t["pid"]), "--percentage", "relative", "--dsos", exe,
                                "--percent-limit", "0.05"]))
    for sort, only in reports if rec.returncode == 0 else []:
        limit = [] if "--percent-limit" in only else ["--percent-limit", "0.5"]
        out = subprocess.run(["perf", "report", "-i", data, "--stdio", "--no-children", "-g", "none",
                              *limit, "--sort", sort, *only], capture_output=True, text=True)
        failed = f"perf report failed ({out.returncode}): {out.stderr[-2000:]}\n" if out.returncode else ""
        parts.append(f"### perf report --sort {sort} {' '.join(only)}\n{failed}{out.stdout}")
    if os.path.exists(data):
        os.unlink(data)
    with open(f"{RESULTS}/profile-{name}.txt", "w") as f:
        f.write("\n".join(parts))
    print(f"  profile: {RESULTS}/profile-{name}.txt", flush=True)


def setup(keys, size):
    """Images, volumes and rublk devices for every target; the targets."""
    targets = []
    for key in keys:
        label, kind, how, sock = target_of(key)
        t = {"key": key, "label": label, "kind": kind, "how": how, "image": os.path.join(ROOT, f"{key}.img"),
             "sock": sock, "runs": {m: [] for m, _ in MODES}}
        started = time.time()
        allocation = ALLOCATION.get(key.removesuffix(ALT), "full")
        create = {"size_bytes": size, "allocation": allocation}
        encrypted = key.removesuffix(ALT) in ENCRYPTED
        if encrypted:
            create.update(size_bytes=size + HEADER, encryption={"key": KEY})
        api("POST", "/v1/images", {"name": f"img-{key}", "path": t["image"], "create": create}, sock)
        print(f"  image {t['image']}: {size >> 20} MiB, {allocation} in {time.time() - started:.0f} s", flush=True)
        if kind == "raw":
            t["path"] = t["image"]
        elif kind != "rublk":
            backend, dispatch = how
            body = {"name": key, "image": f"img-{key}"}
            if backend:
                body["backend"] = backend
            if dispatch:
                body["dispatch"] = dispatch
            if encrypted:
                body["key"] = KEY
            vol = api("POST", "/v1/volumes", body, sock)
            if key.removesuffix(ALT) in QOS:
                api("PATCH", f"/v1/volumes/{vol['id']}", {"qos": QOS[key.removesuffix(ALT)]}, sock)
            vol = api("GET", f"/v1/volumes/{vol['id']}", sock=sock)
            if kind == "default":
                # Checked and measured as what the service chose.
                t["kind"] = kind = vol["backend"]
            assert backend is None or vol["backend"] == backend, vol
            assert dispatch is None or vol["dispatch"] == dispatch, vol
            t.update(volume=vol, volume_id=vol["id"], path=vol["device"])
            # Every ublk volume has a worker; a dm volume only on a worker's
            # path (not direct, not kernel).
            if kind == "ublk" or (kind == "dm" and vol["dispatch"] not in ("direct", "kernel")):
                t["pid"] = worker_pid_of(vol)
                assert t["pid"], f"no worker process found for volume {key}"
        targets.append(t)

    ref = next((t["volume"] for t in targets if t["kind"] in ("ublk", "dm") and t["volume"].get("worker_pid")), None)
    queues = int(RUBLK_QUEUES) if RUBLK_QUEUES else (ref["queues"] if ref else os.cpu_count())
    depth = ref["queue_depth"] if ref else 128
    for i, t in enumerate(t for t in targets if t["kind"] == "rublk"):
        t["rublk_queues"], t["rublk_depth"] = queues, depth
        t["refused"] = start_rublk(t, RUBLK_DEV_BASE + i, queues, depth) if RUBLK else "rublk not installed"

    for t in targets:
        if t.get("refused"):
            print(f"  {t['label']}: REFUSED: {t['refused']}", flush=True)
            continue
        if t.get("volume", {}).get("encrypted"):
            # The plaintext is a crypt table over the path the row names.
            what = check_target(t["kind"], t["volume"]["backing_device"], t["image"])
            what += "; under " + check_crypt(t["path"])
        else:
            what = check_target("ublk" if t["kind"] == "rublk" else t["kind"], t["path"], t["image"])
        print(f"  {t['label']}: {t['path']} ({what}){describe(t)}", flush=True)
    return targets


def describe(t):
    """How a target is set up, for the log and the table's notes."""
    if t["kind"] == "rublk":
        return f"; `rublk {t['cmd']}`, pid {t['pid']}"
    vol = t.get("volume")
    if not vol:
        return ""
    parts = [f"queues {vol['queues']} x depth {vol['queue_depth']}", f"dispatch {vol['dispatch']} ({vol['dispatch_reason']})"]
    # Fields the data path may add (copy mode, zero-copy): shown as they come.
    parts += [f"{k} {json.dumps(v)}" for k, v in vol.items() if "copy" in k]
    if t.get("pid"):
        parts.append(f"worker pid {t['pid']}")
    return "; " + ", ".join(parts)


def main():
    keys = os.environ.get("BENCH_TARGETS", ",".join(DEFAULT_TARGETS)).split(",")
    unknown = [k for k in keys if not target_of(k)]
    if unknown or "raw" not in keys or "loop" not in keys:
        sys.exit(f"BENCH_TARGETS: keys from {','.join(TARGETS)} (and <key>{ALT} with BENCH_ALT_BIN), "
                 f"raw and loop included (got {','.join(keys)})")
    profiled = set(keys) - {"raw"} if PROFILE == "1" else set(PROFILE.split(",")) - {"0", ""}
    size = size_bytes(IMAGE_SIZE)
    os.makedirs(ROOT, exist_ok=True)
    services = [(BIN, DATA, SOCK, "bench-serve.log")]
    if any(k.endswith(ALT) for k in keys):
        services.append((ALT_BIN, ALT_DATA, ALT_SOCK, "bench-serve-alt.log"))
    serves = []
    for binary, data, sock, log in services:
        os.makedirs(data, exist_ok=True)
        serves.append(subprocess.Popen([binary, "serve", "--data-dir", data, "--image-root", ROOT],
                                       stdout=open(f"{RESULTS}/{log}", "w"), stderr=subprocess.STDOUT))
        for _ in range(100):
            if os.path.exists(sock):
                break
            time.sleep(0.1)
    host = api("GET", "/v1/host")
    icount = os.environ.get("BENCH_ICOUNT")
    clock = (f"icount {icount}: seconds and IOPS in instructions, not host time"
             if icount else "wall clock")
    disk = (f"xfs in guest RAM ({os.environ['BENCH_RAM_MIB']} MiB brd)"
            if os.environ.get("BENCH_RAM_MIB") else "xfs")
    header = [f"kernel {host['kernel']}, {os.cpu_count()} vCPUs ({os.environ.get('BENCH_TCG', '?')} TCG, "
              f"{clock}); ublk features {host['backends']['ublk'].get('features')}",
              f"fio 4k randrw, 2 jobs, direct, {RUNTIME} s per run, {REPEAT} rounds; "
              f"each target on its own fully allocated {size >> 20} MiB image on {disk}"]
    if len(serves) > 1:
        header.append(f"(alt) rows: a second service running {ALT_BIN}; the others {BIN}")
    print("\n".join(header), flush=True)
    targets = setup(keys, size)
    live = [t for t in targets if not t.get("refused")]

    # The first I/O through each path is slow under TCG (code translated on
    # first use) and the fresh images' writeback still runs: one unmeasured
    # run per cell first.
    if WARMUP:
        subprocess.run(["sync"], check=True)
        for t in live:
            for _, args in MODES:
                fio(t["path"], args, size, WARMUP)
        print(f"warm-up: {WARMUP} s per cell, not measured", flush=True)
    for t in live:
        t["cache_before"] = page_cache(t)
    started = time.time()
    for r in range(REPEAT):
        order = live[r % len(live):] + live[:r % len(live)]
        print(f"round {r + 1}/{REPEAT}: from {order[0]['label']}", flush=True)
        for t in order:
            for mode, args in MODES:
                run_cell(t, mode, args, size)
            print(f"  {t['label']}: " + ", ".join(f"{m} {t['runs'][m][-1]['iops']:.0f}" for m, _ in MODES),
                  flush=True)
    print(f"rounds took {time.time() - started:.0f} s", flush=True)
    for t in live:
        t["cache_after"] = page_cache(t)

    for t in live:
        if t["key"] in profiled:
            profile(t, size)

    for t in live:
        if t["kind"] == "rublk":
            stop_rublk(t)
    for t in live:
        if t.get("volume_id"):
            api("DELETE", f"/v1/volumes/{t['volume_id']}", sock=t["sock"])
    for serve in serves:
        serve.terminate()
        serve.wait()
    report(header, targets)


def median(v):
    s = sorted(v)
    n = len(s)
    return (s[n // 2] + s[(n - 1) // 2]) / 2 if n else None


def summarize(t):
    """Per mode: median IOPS, spread and the server's costs."""
    out = {}
    for mode, _ in MODES:
        runs = t["runs"][mode]
        iops = [r["iops"] for r in runs]
        m = {"iops": median(iops), "runs": iops}
        m["spread"] = (max(iops) - min(iops)) / m["iops"] if iops and m["iops"] else None
        m["bimodal"] = bimodal(iops)
        for k in ("cpu_us_per_req", "ctx_per_req", "system_cpu_us_per_req"):
            vals = [r[k] for r in runs if k in r]
            m[k] = median(vals) if vals else None
        sub = sum(r.get("nowait_submitted", 0) for r in runs)
        m["nowait_fallback_share"] = sum(r.get("nowait_fallbacks", 0) for r in runs) / sub if sub else None
        m["nowait_submitted"] = sub if any("nowait_submitted" in r for r in runs) else None
        rss = [r["rss_kib"] for r in runs if "rss_kib" in r]
        m["rss_kib"] = max(rss) if rss else None
        out[mode] = m
    return out


def paired(t, base, mode):
    """Per round, t's IOPS over base's in the same round: (median, spread).
    Every round visits every target once, so drift between rounds cancels in
    the ratio (noise within a round does not)."""
    ratios = [r["iops"] / b["iops"] for r, b in zip(t["runs"][mode], base["runs"][mode]) if b["iops"]]
    m = median(ratios)
    return (m, (max(ratios) - min(ratios)) / m) if m else (None, None)


def paired_table(live, modes, best):
    """The ratios to the kernel loop and to the best rublk row taken round
    by round, with their spread."""
    loop = next(t for t in live if t["key"] == "loop")
    rublk = {m: next((t for t in live if t["label"] == best[m][0]), None) for m in best}
    lines = ["Paired by round (each round's IOPS over the same round's base, median and "
             "(max-min)/median of the rounds' ratios):", "",
             "| target | × kernel loop psync, qd16 | × best rublk psync, qd16 |", "|---|---|---|"]

    def cell(t, base_of):
        out = []
        for m in modes:
            base = base_of(m)
            r, spread = paired(t, base, m) if base else (None, None)
            out.append("–" if r is None else f"{r:.2f} ({spread:.0%})")
        return ", ".join(out)

    for t in live:
        if t["key"] == "raw":
            continue
        lines.append(f"| {t['label']} | {cell(t, lambda m: loop)} | {cell(t, lambda m: rublk.get(m))} |")
    return lines


def encryption_table(live, modes):
    """Each encrypted target over its plain twin: IOPS (and paired by
    round), and the whole system's CPU per request (fio, the server and the
    kernel's crypto workers alike)."""
    rows = [(t, next((b for b in live if b["key"] == ENCRYPTED[t["key"]]), None))
            for t in live if t["key"] in ENCRYPTED]
    rows = [(t, b) for t, b in rows if b]
    if not rows:
        return []
    lines = [f"Encryption ({aes_support()}): encrypted ÷ plain, psync, qd16:", "",
             "| path | IOPS | IOPS paired by round | system CPU µs/req (plain → encrypted) | system CPU |",
             "|---|---|---|---|---|"]
    for t, b in rows:
        s, p = t["summary"], b["summary"]
        iops = pair([s[m]["iops"] / p[m]["iops"] if p[m]["iops"] else None for m in modes], "{:.2f}")
        paired_r = pair([paired(t, b, m)[0] for m in modes], "{:.2f}")
        cpu = ", ".join(f"{p[m]['system_cpu_us_per_req']:.0f} → {s[m]['system_cpu_us_per_req']:.0f}" for m in modes)
        cpu_r = pair([s[m]["system_cpu_us_per_req"] / p[m]["system_cpu_us_per_req"]
                      if p[m]["system_cpu_us_per_req"] else None for m in modes], "{:.2f}")
        lines.append(f"| {b['label']} | {iops} | {paired_r} | {cpu} | {cpu_r} |")
    return lines + [""]


def pair(values, fmt):
    return ", ".join("–" if v is None else fmt.format(v) for v in values)


def report(header, targets):
    modes = [m for m, _ in MODES]
    for t in targets:
        if not t.get("refused"):
            t["summary"] = summarize(t)
    live = [t for t in targets if "summary" in t]
    raw = next(t for t in live if t["key"] == "raw")["summary"]
    loop = next(t for t in live if t["key"] == "loop")["summary"]
    best = {}
    for mode in modes:
        rublks = [t for t in live if t["kind"] == "rublk"]
        if rublks:
            b = max(rublks, key=lambda t: t["summary"][mode]["iops"])
            best[mode] = (b["label"], b["summary"][mode]["iops"])

    def ratios(s, base):
        return pair([s[m]["iops"] / base[m] if base.get(m) else None for m in modes], "{:.2f}")

    lines = header + ["", "| target | IOPS psync, qd16 | × raw | × kernel loop | × best rublk | spread "
                      "| server CPU µs/req | ctx switches/req | NOWAIT fallback | server VmRSS MiB "
                      "| page cache device KiB | page cache image KiB |",
                      "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def cache_cell(t, i):
        b, a = (t.get(k, (None, None))[i] for k in ("cache_before", "cache_after"))
        return "–" if b is None and a is None else " → ".join(
            "–" if x is None else f"{x >> 10}" for x in (b, a))

    for t in targets:
        if t.get("refused"):
            lines.append(f"| {t['label']} | refused: {t['refused']} | | | | | | | | | | |")
            continue
        s = t["summary"]
        spread = pair([s[m]["spread"] for m in modes], "{:.0%}")
        if any((s[m]["spread"] or 0) > 0.10 for m in modes):
            spread += " (>10%)"
        if any(s[m]["bimodal"] for m in modes):
            spread += " BIMODAL (" + ", ".join(m for m in modes if s[m]["bimodal"]) + ")"
        nowait = "–"
        if any(s[m]["nowait_submitted"] is not None for m in modes):
            nowait = pair([s[m]["nowait_fallback_share"] for m in modes], "{:.1%}")
        rss = max((s[m]["rss_kib"] or 0) for m in modes)
        lines.append(
            f"| {t['label']} | {pair([s[m]['iops'] for m in modes], '{:.0f}')} "
            f"| {ratios(s, {m: raw[m]['iops'] for m in modes})} "
            f"| {ratios(s, {m: loop[m]['iops'] for m in modes})} "
            f"| {ratios(s, {m: best[m][1] for m in best})} | {spread} "
            f"| {pair([s[m]['cpu_us_per_req'] for m in modes], '{:.0f}') if t.get('pid') else '–'} "
            f"| {pair([s[m]['ctx_per_req'] for m in modes], '{:.2f}') if t.get('pid') else '–'} "
            f"| {nowait} | {f'{rss / 1024:.1f}' if rss else '–'} "
            f"| {cache_cell(t, 0)} | {cache_cell(t, 1)} |")
    lines.append("")
    lines.append("Pairs are psync, iodepth 16. IOPS: median of the rounds; spread: (max-min)/median. "
                 "Best rublk: " + (", ".join(f"{m} {best[m][0]}" for m in best) or "none") + ". "
                 "Server CPU and context switches: medians over the runs of the server process's "
                 "delta per request fio completed; NOWAIT fallback: EAGAIN fallbacks / NOWAIT submissions "
                 "(– where the volume's stats have no such counters: dm volumes report kernel block stats); "
                 "VmRSS: largest after a run. Page cache: KiB of the target's device and image cached "
                 "(cachestat(2)) before its first round → after its last (– where not read; a device nobody "
                 "holds open shows 0: the kernel drops its cache at the last close). "
                 "BIMODAL: the rounds split into two clusters (sorted, the largest gap between neighbours "
                 "is over 20% of the median and over twice either side's range, two rounds or more a side).")
    lines.append("")
    lines += paired_table(live, modes, best)
    lines.append("")
    lines += encryption_table(live, modes)
    for t in targets:
        lines.append(f"- {t['label']}: {t.get('path', '-')}{describe(t) if not t.get('refused') else ''}")
    text = "\n".join(lines)
    print(text, flush=True)
    with open(RESULTS + "/bench.txt", "w") as f:
        f.write(text + "\n")
    with open(RESULTS + "/bench.json", "w") as f:
        json.dump([{k: v for k, v in t.items() if k != "proc"} for t in targets], f, indent=1, default=str)


if __name__ == "__main__":
    main()
