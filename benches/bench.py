#!/usr/bin/env python3
"""Helpers for benches/run.sh (python3, stdlib only).

Subcommands:
  bytes SIZE                   print SIZE (e.g. 256M, 1G, 4096, 1GiB) in bytes (1024-based suffixes)
  mkdata PATH BYTES            write BYTES of random data to PATH (not sparse)
  mksparse PATH BYTES          a sparse file of BYTES: 1 MiB of random data every 64 MiB, holes between
  fio JSON rw|write            print "<MiB/s> <IOPS>" from a fio --output-format=json file
  meta DIR N [COUNTS [PIDS]]   metadata workload in DIR (created, or an empty dir that exists):
                               create N files, cold stat, readdir, unlink; print JSON ops/s.
                               COUNTS: a layerfs metrics URL or a `uring-probe serve --stats`
                               file (requests per operation); PIDS: the FUSE server's processes,
                               comma-separated (their CPU time per operation); "-" for none
  copyup PATH [--strict] [--trunc]
                               time the first 1-byte write into PATH (open O_WRONLY + pwrite +
                               fsync + close, after a full read so the source is cached); print ms.
                               A sparse PATH that is not sparse after the copy-up is a warning,
                               with --strict a failure. --trunc opens with O_TRUNC (a rewrite)
  memprobe                     time the first touch of 32 MiB of fresh anonymous memory, page by
                               page; print ms. What a copy-up's new pages cost at that moment
                               (on a VM that hands free memory back to its host, this varies)
  drop                         sync, drop page cache, dentries and inodes, then settle; fails
                               (exit 1) where caches cannot be dropped (not root)
  settle                       wait until the machine is all but idle (after dropping caches)
  report RESULTS TARGETS...    print the Markdown result tables
"""

import json
import mmap
import statistics
import os
import re
import sys
import time

MIB = 1024 * 1024


def parse_size(s: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgGtT]?)(i?[bB]?)\s*", s)
    if not m:
        raise SystemExit("bad size %r (use e.g. 256M, 1G, 1048576)" % s)
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(m.group(1)) * mult


def drop_caches() -> bool:
    """Write back dirty data, then drop page cache, dentries and inodes (root only), and wait
    for the machine to settle (see `settle`)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        return False
    settle()
    return True


def busy_jiffies():
    """Jiffies all CPUs spent on anything but idle and iowait, and in all."""
    with open("/proc/stat") as f:
        cpu = [int(v) for v in f.readline().split()[1:]]
    return sum(cpu) - cpu[3] - cpu[4], sum(cpu)


def settle(quiet=0.05, window=0.2, limit=5.0):
    """Waits until the machine has been all but idle (busy under `quiet` of its CPU time) for
    a `window`, `limit` seconds at most. Dropping caches frees every dentry and inode through
    RCU callbacks, and a FUSE server gets a FORGET for each node the kernel dropped: both run
    for up to a second after the write returns. A cold phase timed meanwhile shares the CPUs
    with them, which made the floor's cold stat move between 0.10 and 0.93 of overlayfs."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        busy, total = busy_jiffies()
        time.sleep(window)
        busy2, total2 = busy_jiffies()
        if total2 > total and (busy2 - busy) / (total2 - total) < quiet:
            return


def cmd_bytes(args):
    print(parse_size(args[0]))


def cmd_mkdata(args):
    path, n = args[0], int(args[1])
    chunk = 4 * MIB
    with open(path, "wb") as f:
        left = n
        while left > 0:
            k = min(chunk, left)
            f.write(os.urandom(k))
            left -= k
        f.flush()
        os.fsync(f.fileno())


def cmd_mksparse(args):
    path, n = args[0], int(args[1])
    with open(path, "wb") as f:
        f.truncate(n)
        for off in range(0, n, 64 * MIB):
            f.seek(off)
            f.write(os.urandom(min(MIB, n - off)))
        f.flush()
        os.fsync(f.fileno())


def cmd_memprobe(_args):
    size = 32 * MIB
    m = mmap.mmap(-1, size)
    if hasattr(m, "madvise") and hasattr(mmap, "MADV_NOHUGEPAGE"):
        m.madvise(mmap.MADV_NOHUGEPAGE)  # one fault per 4 KiB page, as page cache takes them
    t = time.perf_counter()
    for off in range(0, size, 4096):
        m[off] = 1
    dt = time.perf_counter() - t
    m.close()
    print("%.1f" % (dt * 1000))


def cmd_fio(args):
    path, kind = args[0], args[1]
    with open(path) as f:
        text = f.read()
    # fio may print warnings before the JSON document
    text = text[text.index("{"):]
    doc = json.loads(text)
    job = doc["jobs"][0]
    if job.get("error"):
        raise SystemExit("fio job failed: error %s" % job["error"])
    side = job["read" if kind == "read" else "write"]
    bw = side.get("bw_bytes", side.get("bw", 0) * 1024)
    print("%.3f %.1f" % (bw / MIB, side["iops"]))


# Requests nobody waits for: the kernel sends them and expects no reply.
NO_REPLY = ("forget", "batch_forget")


def requests(source):
    """FUSE requests served so far: by opcode from a layerfs metrics endpoint (an http URL),
    or in all from a stats file `uring-probe serve --stats` keeps ({} without a source)."""
    if not source or source == "-":
        return {}
    if not source.startswith("http"):
        time.sleep(0.06)  # the probe rewrites its file every 20 ms
        with open(source) as f:
            doc = json.load(f)
        return {"replied": float(doc["requests"]), "forget": float(doc["forgets"])}
    import urllib.request
    text = urllib.request.urlopen(source, timeout=10).read().decode()
    counts = {}
    for line in text.splitlines():
        m = re.match(r'layerfs_requests_total\{op="(\w+)"\} (\S+)', line)
        if m:
            counts[m.group(1)] = float(m.group(2))
    return counts


def daemon_cpu(pids):
    """CPU time (µs) the processes `pids` have used, all their threads together."""
    total = 0
    for pid in pids:
        try:
            tasks = os.listdir("/proc/%s/task" % pid)
        except OSError:
            continue
        for task in tasks:
            try:
                with open("/proc/%s/task/%s/schedstat" % (pid, task)) as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                pass
    return total / 1000.0


def wakeup_ipis():
    """Interrupts sent so far to wake or run work on another CPU (RES and CAL lines of
    /proc/interrupts, every CPU, the whole machine); None where the file is missing. On a VM
    each one costs an exit on both sides, and how many a request pays depends on whether the
    thread it wakes sits on an idle CPU: what moves the /dev/fuse rows from run to run."""
    try:
        with open("/proc/interrupts") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    ncpu = len(lines[0].split()) if lines else 0
    total = 0
    for line in lines[1:]:
        fields = line.split()
        if fields and fields[0] in ("RES:", "CAL:"):
            total += sum(int(x) for x in fields[1:1 + ncpu] if x.isdigit())
    return total


def per_op(before, after, n):
    """Requests per operation between two snapshots, by opcode, most first."""
    d = {k: (after.get(k, 0) - before.get(k, 0)) / n for k in after}
    return {k: round(v, 2) for k, v in sorted(d.items(), key=lambda kv: -kv[1]) if v >= 0.005}


def pin_workload():
    """Pins this process to one CPU: `META_CPU`, else the highest one it may use; "none"
    leaves it free. A caller that moves between CPUs mid-loop moves the requests after it to
    another ring queue (io_uring) or away from the server thread it just woke (/dev/fuse),
    and on a small VM a wakeup that crosses CPUs costs more than the request: unpinned, the
    floor's create moved between 65 and 145 µs from one run to the next; pinned, 65–78."""
    want = os.environ.get("META_CPU", "")
    if want == "none":
        return None
    cpu = int(want) if want else max(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    return cpu


def cmd_meta(args):
    d, n = args[0], int(args[1])
    pin_workload()
    source = args[2] if len(args) > 2 else ""
    pids = [p for p in (args[3] if len(args) > 3 else "").split(",") if p and p != "-"]
    # An empty directory that exists (a mount's root) is used as it is and left in place.
    made = not os.path.isdir(d)
    if made:
        os.mkdir(d)
    elif os.listdir(d):
        raise SystemExit("meta: %s is not empty" % d)
    names = ["f%06d" % i for i in range(n)]
    paths = [os.path.join(d, x) for x in names]
    res, counts, cpu, ipis = {}, {}, {}, {}

    def timed(key, work, ops=n):
        """Runs `work`, which does `ops` operations (or returns how many it did); records
        ops/s, requests, daemon CPU and wakeup interrupts per operation."""
        seen, used, sent = requests(source), daemon_cpu(pids), wakeup_ipis()
        t = time.perf_counter()
        done = work()
        wall = time.perf_counter() - t
        ops = done or ops
        res[key] = ops / wall
        if pids:
            cpu[key] = round((daemon_cpu(pids) - used) / ops, 1)
        if sent is not None:
            ipis[key] = round((wakeup_ipis() - sent) / ops, 2)
        counts[key] = per_op(seen, requests(source), ops)

    def create():
        for p in paths:
            os.close(os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))

    def stat():
        for p in paths:
            os.stat(p)

    def readdir():
        # Whole-directory scans for at least 3 passes and 0.3 s (one pass of 10 000 entries
        # takes only milliseconds); d_type is used, never a stat.
        passes = entries = 0
        t = time.perf_counter()
        while passes < 3 or time.perf_counter() - t < 0.3:
            with os.scandir(d) as it:
                for e in it:
                    e.is_dir(follow_symlinks=False)
                    entries += 1
            passes += 1
        if entries != passes * n:
            raise SystemExit("readdir saw %d entries in %d passes, expected %d each" % (entries, passes, n))
        return entries

    def unlink():
        for p in paths:
            os.unlink(p)

    timed("create", create)
    res["cold"] = drop_caches()
    timed("stat", stat)
    timed("readdir", readdir)
    timed("unlink", unlink)
    if made:
        os.rmdir(d)
    if source and source != "-":
        res["requests"] = counts
    if pids:
        res["cpu_us"] = cpu
    res["ipis"] = ipis
    print(json.dumps(res))


def cmd_requests(args):
    """requests URL: the request counts by opcode, as JSON; requests URL BEFORE [N]: what was
    served since the snapshot BEFORE (a JSON file), per operation if N is given."""
    now = requests(args[0])
    if len(args) == 1:
        print(json.dumps(now))
        return
    with open(args[1]) as f:
        before = json.load(f)
    print(json.dumps(per_op(before, now, float(args[2]) if len(args) > 2 else 1.0)))


def cmd_copyup(args):
    path = args[0]
    strict = "--strict" in args[1:]
    trunc = os.O_TRUNC if "--trunc" in args[1:] else 0
    before = os.stat(path)
    sparse = before.st_blocks * 512 < before.st_size // 2
    with open(path, "rb") as f:  # read through the target: source cached, nothing dirty
        while f.read(4 * MIB):
            pass
    os.sync()
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | trunc)
    os.pwrite(fd, b"x", 0)
    os.fsync(fd)
    os.close(fd)
    dt = time.perf_counter() - t
    with open(path, "rb") as f:
        if f.read(1) != b"x":
            raise SystemExit("copy-up: write not visible")
    after = os.stat(path)
    if trunc and after.st_size != 1:
        raise SystemExit("copy-up: O_TRUNC left %d bytes" % after.st_size)
    if sparse and not trunc and after.st_blocks * 512 > after.st_size // 2:
        msg = ("copy-up: the holes of a sparse file were filled (%d of %d bytes allocated)"
               % (after.st_blocks * 512, after.st_size))
        if strict:
            raise SystemExit(msg)
        print("warning: " + msg, file=sys.stderr)
    print("%.3f" % (dt * 1000))


# workload key -> (label, unit, higher_is_better, DESIGN §10 target vs kernel overlayfs; None:
# the metadata rows, whose target follows the FUSE floor measured in the same run)
WORKLOADS = [
    ("seqread_first", "seq read 1 MiB, first (cold cache)", "MiB/s", True, 0.95),
    ("seqread_again", "seq read 1 MiB, re-read", "MiB/s", True, 0.95),
    ("seqwrite", "seq write 1 MiB (+fsync)", "MiB/s", True, 0.95),
    ("randread", "rand read 4 KiB", "IOPS", True, 0.95),
    ("randwrite", "rand write 4 KiB (+fsync)", "IOPS", True, 0.95),
    ("meta_create", "create", "ops/s", True, None),
    ("meta_stat", "stat (cold)", "ops/s", True, None),
    ("meta_readdir", "readdir", "entries/s", True, 1.0),
    ("meta_unlink", "unlink", "ops/s", True, None),
    ("copyup_ms", "copy-up: 1st write into 64 MiB lower file", "ms", False, 1.0),
    ("copyup_sparse_ms", "copy-up: 1st write into 1 GiB sparse lower file", "ms", False, 1.0),
]


def fmt(v):
    if v is None:
        return "n/a"
    if v >= 1000:
        return "{:,.0f}".format(v)
    if v >= 10:
        return "%.1f" % v
    return "%.2f" % v


def ratio(v, base, higher_better):
    """Speed ratio target/base: > 1 means the target is faster, for every unit."""
    if v is None or base is None or v == 0 or base == 0:
        return None
    return v / base if higher_better else base / v


# Metadata rows held to DESIGN §10's rule: time per operation at most the FUSE floor's plus
# kernel overlayfs's, on the same transport.
TIMED_META = ("meta_create", "meta_stat", "meta_unlink")
# The floor each layerfs target is held to.
FLOOR_OF = {"layerfs": "fuse-floor", "layerfs-uring": "fuse-floor-uring"}


def meta_limit(res, target, key, share=1.0):
    """The §10 limit on `target`'s time per operation (µs) in metadata row `key`: the floor's
    time plus `share` of overlayfs's; None without both in the run."""
    floor, over = res.get((FLOOR_OF.get(target), key)), res.get(("overlayfs", key))
    if not floor or not over:
        return None
    return 1e6 / floor + share * 1e6 / over


def target_ratio(res, target, key, fixed):
    """The §10 target of `target` in row `key` as a speed ratio to overlayfs."""
    if fixed is not None:
        return fixed
    limit, over = meta_limit(res, target, key), res.get(("overlayfs", key))
    return None if limit is None or not over else (1e6 / over) / limit


def meta_table(runs, res, reqs, cpus, ipis, targets):
    """Per metadata row and target: time, requests, server CPU and wakeup interrupts per
    operation, the spread over rounds, and for layerfs the §10 limit with ✓/✗."""
    out = ["", "### Metadata per operation (median of the rounds)\n",
           "Time is wall time per operation (per entry for readdir); requests are those the "
           "server answered (FORGETs apart), CPU is the server's (all its threads) per "
           "operation; IPIs are the interrupts sent to wake a thread on another CPU (RES and CAL, "
           "whole machine) per operation, the rounds' median; spread is (max − min) / median of "
           "the rounds' rates, the goal ≤ 20 %. "
           "Limit (§10): the FUSE floor's time plus overlayfs's on the same transport, "
           "stretch: floor plus half of overlayfs.\n",
           "| row | target | µs/op | requests/op | server CPU µs/op | IPIs/op | spread | limit µs/op (stretch) |",
           "|---|---|---:|---:|---:|---:|---:|---|"]
    for key, label, _unit, _hb, _tgt in WORKLOADS:
        if not key.startswith("meta_"):
            continue
        for t in targets:
            rate = res.get((t, key))
            if not rate:
                continue
            us = 1e6 / rate
            counts = json.loads(reqs[(t, key)][-1]) if (t, key) in reqs else None
            asked = "n/a" if counts is None else "%.2f" % sum(
                v for op, v in counts.items() if op not in NO_REPLY)
            cpu = cpus.get((t, key))
            cpu = "n/a" if not cpu else "%.1f" % statistics.median(cpu)
            sent = ipis.get((t, key))
            sent = "n/a" if not sent else "%.2f" % statistics.median(sent)
            v = runs.get((t, key), [])
            spread = "n/a" if len(v) < 2 else "%.0f %%%s" % (
                100 * (max(v) - min(v)) / statistics.median(v),
                " ✗" if (max(v) - min(v)) / statistics.median(v) > 0.2 else "")
            limit = ""
            if key in TIMED_META and t in FLOOR_OF:
                hard, soft = meta_limit(res, t, key), meta_limit(res, t, key, 0.5)
                if hard is not None:
                    limit = "≤ %.1f (%.1f) %s" % (hard, soft, "✓" if us <= hard else "✗")
            out.append("| %s | %s | %.1f | %s | %s | %s | %s | %s |" % (label, t, us, asked, cpu, sent, spread, limit))
    return out


def cmd_report(args):
    results_path, targets = args[0], args[1:]
    runs = {}
    reqs = {}
    cpus = {}
    ipis = {}
    with open(results_path) as f:
        for line in f:
            parts = line.split(None, 2)
            if len(parts) == 3 and parts[1].startswith("requests_"):
                reqs.setdefault((parts[0], parts[1][len("requests_"):]), []).append(parts[2].strip())
                continue
            if len(parts) == 3 and parts[1].startswith("cpu_"):
                cpus.setdefault((parts[0], parts[1][len("cpu_"):]), []).append(float(parts[2]))
                continue
            if len(parts) == 3 and parts[1].startswith("ipi_"):
                ipis.setdefault((parts[0], parts[1][len("ipi_"):]), []).append(float(parts[2]))
                continue
            if len(parts) == 3:
                try:
                    runs.setdefault((parts[0], parts[1]), []).append(float(parts[2]))
                except ValueError:
                    pass
    # Medians over the rounds (copy-ups: over every sample); the spread is shown beside the
    # absolute figures.
    res = {k: statistics.median(v) for k, v in runs.items()}
    rounds = max((len(v) for k, v in runs.items() if not k[1].startswith("copyup")), default=1)
    samples = max((len(v) for k, v in runs.items() if k[1].startswith("copyup")), default=0)
    out = []
    out.append("### Absolute figures%s\n" % (" (median of %d rounds, min–max)" % rounds if rounds > 1 else ""))
    if samples > rounds:
        out.append("Copy-up rows: median of %d copy-ups, each of a file of its own.\n" % samples)
    out.append("| workload | unit | " + " | ".join(targets) + " |")
    out.append("|---|---|" + "---:|" * len(targets))
    for key, label, unit, _hb, _tgt in WORKLOADS:
        cells = []
        for t in targets:
            v = runs.get((t, key))
            cell = fmt(res.get((t, key)))
            if v and len(v) > 1:
                cell += " (%s–%s)" % (fmt(min(v)), fmt(max(v)))
            cells.append(cell)
        out.append("| %s | %s | %s |" % (label, unit, " | ".join(cells)))

    for base, title in (("overlayfs", "kernel overlayfs"), ("plain", "the plain directory")):
        if base not in targets:
            continue
        others = [t for t in targets if t != base]
        if not others:
            continue
        out.append("")
        out.append("### Ratios vs %s (speed ratio: > 1.00 = faster; for ms it is %s time / target time)\n"
                   % (title, base))
        held = [t for t in FLOOR_OF if t in others] if base == "overlayfs" else []
        head = "| workload | " + " | ".join(others) + "".join(" | §10 target (%s)" % t for t in held) + " |"
        out.append(head)
        out.append("|---|" + "---:|" * len(others) + "---|" * len(held))
        for key, label, unit, hb, tgt in WORKLOADS:
            b = res.get((base, key))
            cells = []
            for t in others:
                r = ratio(res.get((t, key)), b, hb)
                if base == "plain" and key.startswith("copyup"):
                    cells.append("n/a")  # the plain dir has no lower: nothing is copied up
                else:
                    cells.append("n/a" if r is None else "%.2f" % r)
            line = "| %s | %s |" % (label, " | ".join(cells))
            for t in held:
                want = target_ratio(res, t, key, tgt)
                r = ratio(res.get((t, key)), b, hb)
                if want is None:
                    line += " n/a (needs %s) |" % FLOOR_OF[t]
                    continue
                mark = "" if r is None else (" ✓" if r >= want else " ✗")
                line += " ≥ %.2f%s |" % (want, mark)
            out.append(line)
    if any(k[1].startswith("meta_") for k in runs):
        out += meta_table(runs, res, reqs, cpus, ipis, targets)
    if reqs:
        out.append("")
        out.append("### FUSE requests per operation (layerfs, from its metrics; last round)\n")
        out.append("| workload | requests by opcode |")
        out.append("|---|---|")
        for key, label, _unit, _hb, _tgt in WORKLOADS:
            for t in targets:
                if (t, key) in reqs:
                    counts = json.loads(reqs[(t, key)][-1])
                    total = sum(counts.values())
                    text = ", ".join("%s %g" % (op, c) for op, c in counts.items()) or "none"
                    name = label if t == "layerfs" else "%s (%s)" % (label, t)
                    out.append("| %s | %g: %s |" % (name, round(total, 2), text))
    print("\n".join(out))


def main():
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    cmd, args = sys.argv[1], sys.argv[2:]
    fn = {"settle": lambda _args: settle(), "drop": lambda _args: sys.exit(0 if drop_caches() else 1), "bytes": cmd_bytes, "mkdata": cmd_mkdata, "fio": cmd_fio, "meta": cmd_meta,
          "copyup": cmd_copyup, "mksparse": cmd_mksparse, "memprobe": cmd_memprobe, "report": cmd_report, "requests": cmd_requests}.get(cmd)
    if fn is None:
        raise SystemExit(__doc__)
    fn(args)


if __name__ == "__main__":
    main()
