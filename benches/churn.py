"""Creates N empty files in 100 directories of a mounted view, then deletes them, and reports
the daemon's memory (VmRSS, VmHWM) and open descriptors before, while creating, and after.

Usage: churn.py MOUNTPOINT DAEMON_PID N
"""
import os
import sys
import time


def state(pid):
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, value = line.split(":", 1)
            if key in ("VmRSS", "VmHWM"):
                out[key + "_KiB"] = int(value.split()[0])
    out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return out


def main():
    mnt, pid, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    base = os.path.join(mnt, "churn")
    os.mkdir(base)
    dirs = [os.path.join(base, f"d{i}") for i in range(100)]
    for d in dirs:
        os.mkdir(d)
    print("before ", state(pid), flush=True)
    most_fds = 0
    started = time.time()
    for i in range(n):
        os.close(os.open(os.path.join(dirs[i % 100], f"f{i}"), os.O_CREAT | os.O_WRONLY, 0o644))
        if i % (n // 10 or 1) == 0:
            now = state(pid)
            most_fds = max(most_fds, now["fds"])
            print(f"created {i:>9}", now, flush=True)
    print(f"created {n} files in {time.time() - started:.0f} s", state(pid), flush=True)
    started = time.time()
    for i in range(n):
        os.unlink(os.path.join(dirs[i % 100], f"f{i}"))
    print(f"deleted {n} files in {time.time() - started:.0f} s", flush=True)
    time.sleep(1)
    print("after  ", state(pid), f"(most descriptors seen: {most_fds})", flush=True)


main()
