//! Concurrent stress on a real mount. Many worker *processes* (16 by default) run at once,
//! each alone in its own directory, through a seeded random mix of creates, writes,
//! read-backs, renames over existing names, unlinks, hard links, symlinks, mkdir/rmdir,
//! xattrs, listings with an `lstat` of every listed name, `stat`s and `mmap` reads. Each
//! worker keeps a model of its directories (name → content, kind, symlink target, xattr) and
//! checks every result against it: a failed call that should have worked is an *error*, a
//! result other than the model's is a *mismatch*. The test passes only with none of either.
//!
//! Two scenarios:
//! - `local_only_area`: each worker in a new directory at the mount root (local only);
//! - `shared_area_with_copy_ups`: each worker in a new directory inside the diff of the
//!   ready remote layer L1, plus a remote directory of its own, put into the remote copy
//!   before mounting, whose files it reads, overwrites, appends to, truncates, unlinks,
//!   renames and links (copy-ups, whiteouts, names recreated over whiteouts).
//!
//! After a failure the worker takes what the view then shows as its model of the name (so a
//! failure is counted where it happens, and less often again by every later operation on
//! the name) and leaves the name out of the final check until an operation sets it again.
//! Each worker describes its first distinct failures in detail, with what the name is on
//! disk in local and remote at that moment; the parent prints them, the operation counts
//! and the failures by kind.
//!
//! After the workers finish, the parent re-reads the final state of every worker's
//! directories through the view (as left, after dropping the kernel caches, and after a
//! remount) and compares it with the models the workers left outside the mount.
//!
//! Workers are this test binary run again (`--ignored --exact stress_worker`) with
//! `LAYERFS_STRESS_WORKER` set; without it `stress_worker` does nothing.
//!
//! The parts: `driver` is the parent (the mount, the workers' processes, their results, the
//! final check); `worker` is one worker's loop, drawing the operations in `ops` by weight;
//! `model` is what a worker believes its directories hold; `verify` compares the view with
//! it, after each operation and at the end; `protocol` is what parent and workers agree on.
//!
//! Knobs (environment):
//! - `LAYERFS_STRESS_SECS`: how long the workers run, per scenario (default 50);
//! - `LAYERFS_STRESS_PROCS`: how many workers (default 16);
//! - `LAYERFS_STRESS_OPTS`: extra `-o` mount options, e.g. `nopassthrough`;
//! - `LAYERFS_STRESS_SEED`: the base seed (default: from the clock; printed);
//! - `LAYERFS_STRESS_PLAIN`: if set, the workers work in plain directories beside the mount
//!   instead of through it (a check of the test's own model: it must pass there).
//!
//! Run it in release mode: a debug daemon is too slow to show races.
//! `cargo test --release --test stress -- --nocapture`

#[path = "../common/mod.rs"]
mod common;
mod driver;
mod model;
mod ops;
mod protocol;
mod verify;
mod worker;

/// The worker, a subprocess entry point and not a test: the scenarios run this binary again
/// with `--ignored --exact stress_worker`.
#[test]
#[ignore = "a subprocess entry point, run by the stress scenarios"]
fn stress_worker() {
    worker::run();
}

#[test]
fn local_only_area() {
    driver::run_scenario("local_only_area", false);
}

#[test]
fn shared_area_with_copy_ups() {
    driver::run_scenario("shared_area_with_copy_ups", true);
}
