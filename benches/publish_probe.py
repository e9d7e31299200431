#!/usr/bin/env python3
"""The measuring side of benches/publish.sh: idle remote requests per reader, then publication
latency on every reader while a third process keeps reading a file in an existing layer.

    publish_probe.py REAL MOUNT_A LOG_A MOUNT_B LOG_B --first K --count N --depth D --idle S

REAL is the writer host's tree (where a publisher runs); MOUNT_A/B are layerfs readers whose
remote reaches REAL through sshfs; LOG_A/B are those sshfs processes' `sshfs_debug` output,
one line `[nnnnn] OP` per remote request. Prints a JSON summary on stdout.
"""

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import scale_gen  # noqa: E402

REQUEST = re.compile(rb"^\[\d+\] ")


def requests(log):
    with open(log, "rb") as f:
        return sum(1 for line in f if REQUEST.match(line))


def journal_state(layerfs, mount):
    out = subprocess.run([layerfs, "status", "--json", mount], capture_output=True, check=False)
    try:
        return json.loads(out.stdout).get("journal", {}).get("state")
    except ValueError:
        return None


def percentile(values, p):
    ordered = sorted(values)
    if not ordered:
        return None
    k = max(0, min(len(ordered) - 1, int(round(p / 100.0 * len(ordered) + 0.5)) - 1))
    return ordered[k]


class Reader(threading.Thread):
    """Keeps reading one file of an existing layer through a mount, checking its content."""

    def __init__(self, path, expected):
        super().__init__(daemon=True)
        self.path, self.expected = path, expected
        self.reads = self.errors = 0
        self.first_error = None
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            try:
                with open(self.path, "rb") as f:
                    data = f.read()
                if data != self.expected:
                    raise OSError(f"content {data!r}, expected {self.expected!r}")
                self.reads += 1
            except OSError as e:
                self.errors += 1
                self.first_error = self.first_error or str(e)
            time.sleep(0.01)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("real")
    p.add_argument("mount_a")
    p.add_argument("log_a")
    p.add_argument("mount_b")
    p.add_argument("log_b")
    p.add_argument("--layerfs", required=True)
    p.add_argument("--first", type=int, required=True)
    p.add_argument("--count", type=int, default=50)
    p.add_argument("--depth", type=int, default=10)
    p.add_argument("--idle", type=float, default=30.0)
    p.add_argument("--timeout", type=float, default=20.0)
    p.add_argument("--no-journal", action="store_true", help="readers mounted with nojournal")
    a = p.parse_args()
    mounts = [(a.mount_a, a.log_a), (a.mount_b, a.log_b)]

    deadline = time.monotonic() + 60
    while not a.no_journal and any(journal_state(a.layerfs, m) != "following" for m, _ in mounts):
        if time.monotonic() > deadline:
            states = [journal_state(a.layerfs, m) for m, _ in mounts]
            sys.exit(f"publish-probe: readers not following the journal after 60 s: {states}")
        time.sleep(0.5)

    # Idle: nothing published, nothing read, the publisher's heartbeat only.
    before = [requests(log) for _, log in mounts]
    time.sleep(a.idle)
    after = [requests(log) for _, log in mounts]
    idle = [(y - x) / a.idle for x, y in zip(before, after)]

    layer0 = scale_gen.hexid("layer", 0, 0)
    reader = Reader(os.path.join(a.mount_a, "overlay/RO", layer0, "diff/file"), b"0/0\n")
    reader.start()

    latencies = [[] for _ in mounts]
    missed = [0 for _ in mounts]
    for i in range(a.count):
        chain = a.first + i
        scale_gen.make_chain(a.real, chain, a.depth)
        # The writer has finished: the image is complete in the shared tree.
        done = time.monotonic()
        iid = scale_gen.hexid("image", chain)
        waiting = set(range(len(mounts)))
        while waiting and time.monotonic() - done < a.timeout:
            for r in list(waiting):
                if os.path.isdir(os.path.join(mounts[r][0], "overlay-images", iid)):
                    latencies[r].append(time.monotonic() - done)
                    waiting.discard(r)
            time.sleep(0.005)
        for r in waiting:
            missed[r] += 1
        time.sleep(random.uniform(0.3, 1.5))

    reader.stop.set()
    reader.join()
    summary = {
        "idle_requests_per_s": [round(x, 2) for x in idle],
        "publications": a.count,
        "readers": [
            {
                "mount": m,
                "median_s": round(statistics.median(lat), 3) if lat else None,
                "p99_s": round(percentile(lat, 99), 3) if lat else None,
                "max_s": round(max(lat), 3) if lat else None,
                "missed": missed[r],
            }
            for r, ((m, _), lat) in enumerate(zip(mounts, latencies))
        ],
        "third_process": {
            "reads": reader.reads,
            "errors": reader.errors,
            "first_error": reader.first_error,
        },
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
