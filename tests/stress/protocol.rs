//! What the parent and its workers agree on. They share nothing but the environment and
//! files outside the mount: the variables that give a worker its orders, the knobs a run
//! is tuned with, and the remote files of the shared scenario, which the parent puts into
//! the remote copy and each worker expects to read back unchanged until it changes them.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::common::pattern;

/// Set in a worker: the path of its own (not yet existing) directory in the view.
pub const ENV_WORKER: &str = "LAYERFS_STRESS_WORKER";
/// Set in a worker of the shared scenario: its remote directory in the view.
pub const ENV_REMOTE_AREA: &str = "LAYERFS_STRESS_REMOTE_AREA";
/// The worker's index (names its remote files' contents).
pub const ENV_INDEX: &str = "LAYERFS_STRESS_INDEX";
pub const ENV_SEED: &str = "LAYERFS_STRESS_SEED";
/// Milliseconds since the epoch at which the worker stops.
pub const ENV_DEADLINE: &str = "LAYERFS_STRESS_DEADLINE_MS";
/// How long the worker runs, in milliseconds (paces its copy-ups over the run).
pub const ENV_DURATION: &str = "LAYERFS_STRESS_DURATION_MS";
/// Where the worker writes its result (JSON), outside the mount.
pub const ENV_RESULT: &str = "LAYERFS_STRESS_RESULT";
/// Where the worker writes its final model (JSON), outside the mount.
pub const ENV_MODEL: &str = "LAYERFS_STRESS_MODEL";
/// L1's `diff/` through the view: fixture files to read.
pub const ENV_FIXTURE: &str = "LAYERFS_STRESS_FIXTURE";
/// The mountpoint and its local and remote trees (unset in plain mode): failures are
/// reported with what the name is on disk.
pub const ENV_MNT: &str = "LAYERFS_STRESS_MNT";
pub const ENV_LOCAL: &str = "LAYERFS_STRESS_LOCAL";
pub const ENV_REMOTE: &str = "LAYERFS_STRESS_REMOTE";

pub const DEFAULT_SECS: u64 = 50;
pub const DEFAULT_PROCS: usize = 16;
/// A worker still running this long after its deadline is killed (and the test fails).
pub const GRACE: Duration = Duration::from_secs(60);
/// Failures described in detail, per worker and in the final assertion.
pub const DETAILS: usize = 20;

/// Remote files each worker of the shared scenario gets in its remote directory.
pub const REMOTE_FILES: usize = 300;
/// Empty remote dirs, and remote symlinks, each worker gets there.
pub const REMOTE_DIRS: usize = 4;
pub const REMOTE_LINKS: usize = 4;

/// The xattr workers set on their files, which the final check reads back.
pub const XATTR: &str = "user.stress";

pub fn env_num(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a number")),
        Err(_) => default,
    }
}

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// The content of remote file `j` of worker `worker` (the parent puts it into the remote
/// copy, the worker expects it).
pub fn remote_content(worker: usize, j: usize) -> Vec<u8> {
    let len = match j % 25 {
        0 => 70 * 1024,
        1..=3 => 4096,
        _ => 10 + j % 50,
    };
    let mut v = format!("<remote w{worker} r{j:03}>").into_bytes();
    v.extend(pattern(len, (worker as u64) << 32 | j as u64));
    v.truncate(len);
    v
}

pub fn remote_name(j: usize) -> String {
    format!("r{j:03}")
}
