#!/usr/bin/env python3
"""blockplane benchmark, run inside the test VM (see bench.sh).

One fully allocated 512 MiB image on xfs (on a linear dm device over the
virtio disk). fio 4k randrw, 2 jobs, --direct=1, once with psync and once
with io_uring at iodepth 16, against: the raw image file, the kernel loop
driver (direct I/O), and blockplane volumes of each backend/policy. Each cell
runs REPEAT times; the table gives the median IOPS, its ratio to the raw
file and to the kernel loop driver, and the spread (max-min)/median, flagged
above 10%. Absolute numbers under TCG mean nothing; the ratios do.

BENCH_PROFILE=1 also profiles the kernel loop driver and each ublk policy
under the psync load: `perf record -a -g` (cpu-clock; TCG has no PMU) while
fio runs, and `perf report` by command, by DSO and by symbol into
/results/profile-<target>.txt.
"""

import json
import os
import stat
import subprocess
import sys
import time

BIN = sys.argv[1]
RUNTIME = int(os.environ.get("BENCH_RUNTIME", "8"))
REPEAT = int(os.environ.get("BENCH_REPEAT", "3"))
DATA = "/run/bp-bench"
ROOT = os.path.join(os.environ["SCRATCH_XFS"], "bench")
SOCK = os.path.join(DATA, "blockplane.sock")
PROFILE = os.environ.get("BENCH_PROFILE") == "1"
MODES = [("psync", ["--ioengine=psync"]), ("io_uring qd16", ["--ioengine=io_uring", "--iodepth=16"])]


def cli(*args):
    out = subprocess.run([BIN, "--api", "unix:" + SOCK, "--json", *args], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"blockplane {' '.join(args)}: {out.stderr.strip()}")
    return json.loads(out.stdout) if out.stdout.strip() else None


def major_of(name):
    with open("/proc/devices") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 2 and parts[1] == name:
                return int(parts[0])
    return None


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
        backing = open(f"/sys/block/{dev}/loop/backing_file").read().strip()
        assert backing == image, f"{path} serves {backing}, not {image}"
        dio = open(f"/sys/block/{dev}/loop/dio").read().strip()
        assert dio == "1", f"{path} does not do direct I/O"
        return f"loop, backing {backing}, dio {dio}"
    if kind == "ublk":
        # ublk disks take dynamic (blkext) numbers: match the node with sysfs.
        assert dev.startswith("ublkb"), f"{path} is not named as a ublk device"
        sysdev = open(f"/sys/block/{dev}/dev").read().strip()
        assert sysdev == f"{major}:{os.minor(st.st_rdev)}", f"{path} is not /sys/block/{dev}"
        return f"ublk {sysdev}"
    if kind == "dm":
        assert major == major_of("device-mapper"), f"{path} is not a dm device (major {major})"
        table = subprocess.run(["dmsetup", "table", "-j", str(major), "-m", str(os.minor(st.st_rdev))],
                               capture_output=True, text=True, env={**os.environ, "DM_DISABLE_UDEV": "1"}).stdout
        return f"dm major {major}: {table.splitlines()[0] if table else '?'}"
    raise AssertionError(kind)


def fio(path, mode_args):
    cmd = ["fio", "--name=bench", "--filename=" + path, "--rw=randrw", "--bs=4k", "--numjobs=2",
           "--direct=1", "--group_reporting", "--time_based", f"--runtime={RUNTIME}", "--ramp_time=1",
           "--size=512M", "--randrepeat=0", "--output-format=json", *mode_args]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"fio on {path} failed: {out.stderr}")
    job = json.loads(out.stdout)["jobs"][0]
    if job["error"]:
        sys.exit(f"fio on {path}: error {job['error']}")
    return job["read"]["iops"] + job["write"]["iops"]


def measure(rows, label, kind, path, image):
    what = check_target(kind, path, image)
    print(f"  {label}: {path} ({what})", flush=True)
    for mode, args in MODES:
        vals = [fio(path, args) for _ in range(REPEAT)]
        rows.append({"target": label, "mode": mode, "iops": vals})
    if PROFILE and kind != "raw":
        profile(label, path)


def profile(label, path):
    """Where the CPU goes while fio (psync) runs on `path`: perf, system-wide."""
    name = label.replace(" ", "-").replace("(", "").replace(")", "")
    data = f"/run/perf-{name}.data"
    job = subprocess.Popen(["fio", "--name=prof", "--filename=" + path, "--rw=randrw", "--bs=4k",
                            "--numjobs=2", "--direct=1", "--time_based", f"--runtime={RUNTIME + 2}",
                            "--size=512M", "--ioengine=psync"], stdout=subprocess.DEVNULL)
    time.sleep(1)
    subprocess.run(["perf", "record", "-a", "-g", "-F", "499", "-e", "cpu-clock", "-o", data,
                    "--", "sleep", str(RUNTIME)], capture_output=True, check=True)
    job.wait()
    parts = []
    for sort in ["comm", "comm,dso", "sym"]:
        out = subprocess.run(["perf", "report", "-i", data, "--stdio", "--no-children", "-g", "none",
                              "--percent-limit", "1", "--sort", sort], capture_output=True, text=True)
        parts.append(f"### perf report --sort {sort}\n" + out.stdout)
    with open(f"/results/profile-{name}.txt", "w") as f:
        f.write("\n".join(parts))
    print(f"  profile: /results/profile-{name}.txt", flush=True)


def peak_rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def main():
    os.makedirs(DATA, exist_ok=True)
    os.makedirs(ROOT, exist_ok=True)
    serve = subprocess.Popen([BIN, "serve", "--data-dir", DATA, "--image-root", ROOT],
                             stdout=open("/results/bench-serve.log", "w"), stderr=subprocess.STDOUT)
    for _ in range(100):
        if os.path.exists(SOCK):
            break
        time.sleep(0.1)
    image = os.path.join(ROOT, "bench.img")
    cli("image", "create", "bench", image, "--size", "512M", "--allocation", "full")
    host = cli("host")
    print(f"kernel {host['kernel']}; ublk features {host['backends']['ublk'].get('features')}", flush=True)
    rows, rss = [], {}

    measure(rows, "raw file", "raw", image, image)

    v = cli("volume", "create", "bl", "--image", "bench", "--backend", "loop")
    measure(rows, "kernel loop (dio)", "loop", v["device"], image)
    cli("volume", "rm", "bl")

    extra = os.environ.get("BENCH_BACKENDS", "ublk").split(",")
    for backend in extra:
        first = True
        for policy in ["nowait", "threaded", "direct"]:
            if first:
                v = cli("volume", "create", "bv", "--image", "bench", "--backend", backend, "--dispatch", policy)
                first = False
            else:
                v = cli("volume", "set", "bv", "--dispatch", policy)
            assert v["dispatch"] == policy, v
            measure(rows, f"{backend} {policy}", backend, v["device"], image)
            if v.get("worker_pid"):
                rss[f"{backend} {policy}"] = peak_rss_kib(v["worker_pid"])
        cli("volume", "rm", "bv")

    serve.terminate()
    serve.wait()
    report(rows, rss)


def median(v):
    s = sorted(v)
    return s[len(s) // 2]


def report(rows, rss):
    base = {}
    for r in rows:
        r["median"] = median(r["iops"])
        r["spread"] = (max(r["iops"]) - min(r["iops"])) / r["median"] if r["median"] else 0
        base.setdefault((r["target"], r["mode"]), r["median"])
    lines = [f"{'target':<20} {'mode':<14} {'IOPS':>9} {'x raw':>7} {'x loop':>7} {'spread':>7}  runs"]
    for r in rows:
        raw = base[("raw file", r["mode"])]
        loop = base[("kernel loop (dio)", r["mode"])]
        flag = "  SPREAD>10%" if r["spread"] > 0.10 else ""
        runs = " ".join(f"{x:.0f}" for x in r["iops"])
        lines.append(f"{r['target']:<20} {r['mode']:<14} {r['median']:>9.0f} {r['median'] / raw:>7.2f} "
                     f"{r['median'] / loop:>7.2f} {r['spread']:>6.1%}  {runs}{flag}")
    lines.append("")
    lines.append("worker peak RSS (VmHWM): " + ", ".join(f"{k} {v / 1024:.1f} MiB" for k, v in rss.items()))
    text = "\n".join(lines)
    print(text)
    with open("/results/bench.txt", "w") as f:
        f.write(text + "\n")
    with open("/results/bench.json", "w") as f:
        json.dump({"rows": rows, "worker_peak_rss_kib": rss}, f, indent=1)


if __name__ == "__main__":
    main()
