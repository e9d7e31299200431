//! The control socket: how `layerfs status`, `refresh`, `layers`, `images` and `quota` talk
//! to a running mount (DESIGN §9).
//!
//! Each mount serves one unix socket. The mount answers through [`MountControl`], with the
//! core's [`report`](crate::report) types; this module only carries questions and answers.
//! The core never depends on it:
//!
//! 1. The mount calls [`serve`] with its engine handle and [`socket_path`] of its (canonical)
//!    mountpoint. A socket file left by a mount that died is removed first; a live one is
//!    never taken over. The returned [`ControlServer`] serves on its own thread until it is
//!    dropped, which removes the socket.
//! 2. A client ([`Client`]) resolves the MOUNTPOINT it was given the same way,
//!    connects, sends one request line and reads one answer line.
//!
//! **Where the socket lives.** `<run dir>/mounts/<escaped mountpoint>.sock`, so that a
//! client needs nothing but the mountpoint. The run dir is `/run/layerfs`, or
//! `$LAYERFS_RUN_DIR` when set. The mountpoint is escaped like `systemd-escape --path`:
//! slashes become `-`, and bytes other than ASCII letters, digits, `:`, `_` and `.` (and a
//! leading `.`) become `\xNN`; `/var/lib/isulad/storage` gives `var-lib-isulad-storage.sock`.
//! The `mounts/` subdir keeps these names apart from other sockets in the run dir (the CSI
//! driver's `csi.sock` would otherwise be the socket of a mount at `/csi`). A path too long
//! for a unix socket address (107 bytes) uses a digest of the mountpoint instead of its
//! escaped form.
//!
//! **Who may talk.** Root only, by default: the dirs are created 0700, the socket is 0600,
//! and the server also checks each peer's credentials (uid 0, or the uid the mount runs as),
//! so a loose mode on a pre-existing run dir does not open it up.
//!
//! **Protocol** ([`protocol`]): one JSON object per line each way. `{"op":"status"}` is
//! answered `{"ok":true,"status":{…}}`; the other ops are `refresh` (→ `round`), `layers`
//! (→ `layers`), `images` (→ `images`), and `quota_set`, `quota_get`, `quota_clear` (→
//! `quota`, with a `path` relative to the mountpoint), `quota_list` (→ `quotas`) and
//! `reconfigure` (→ `reconfigured`, with `options`; see [`reconfigure`]).
//! `layerfs quota set` does not send `quota_set` directly: it goes through
//! [`crate::quota::storage`], which decides what a request for a quota means where it is
//! made. A request the server cannot serve is answered
//! `{"ok":false,"error":"…"}` and the connection stays usable, except after a request longer
//! than [`protocol::MAX_REQUEST`], which also closes it.

pub mod client;
mod path;
pub mod protocol;
pub mod quota_backend;
pub mod reconfigure;
pub mod render;
mod server;
pub mod umount;
mod when;

pub use client::{Client, ClientError};
pub use path::{escape_path, run_dir, socket_path, socket_path_in, DEFAULT_RUN_DIR, RUN_DIR_ENV};
pub use protocol::{MountControl, Op};
pub use server::{serve, serve_with, ControlServer};

use std::path::{Path, PathBuf};

use crate::quota::size::human;
use crate::quota::storage::{self, Applied, Storage, StorageError};

/// What a control command prints, and whether it succeeded.
#[derive(Debug)]
pub struct Reply {
    /// For stdout: the rendered answer, or its JSON with `--json`.
    pub text: String,
    /// For stderr, whatever the outcome: a warning, or why nothing was done.
    pub note: Option<String>,
    /// An error to report after printing the text (a refresh round that failed to scan).
    pub outcome: Result<(), ClientError>,
}

impl Reply {
    fn text(text: String) -> Reply {
        Reply {
            text,
            note: None,
            outcome: Ok(()),
        }
    }
}

/// Runs `layerfs status|layers|images MOUNTPOINT [--json]` (and `refresh`, as
/// [`refresh`] without `--accept-empty`): asks the mount and renders its answer. An error
/// here means there is nothing to print.
pub fn command(mountpoint: &Path, op: Op, json: bool) -> Result<Reply, ClientError> {
    let client = Client::new(mountpoint);
    let text = match op {
        Op::Status => shown(&client.status()?, json, |s| render::status(s, now())),
        Op::Layers => shown(&client.layers()?, json, |l| render::layers(l)),
        Op::Images => shown(&client.images()?, json, |i| render::images(i)),
        Op::QuotaList => shown(&client.quota_list()?, json, |q| render::quotas(q)),
        Op::Refresh => return refreshed(&client, false, json),
        Op::QuotaSet | Op::QuotaGet | Op::QuotaClear | Op::Reconfigure | Op::Upgrade => {
            unreachable!(
                "{op:?} needs more than a mountpoint; see quota, quota_set, reconfigure, upgrade"
            )
        }
    };
    Ok(Reply::text(text))
}

/// `layerfs upgrade`: hands the mount over to the binary now on disk and waits, up to
/// `wait`, for the new daemon to serve; says which daemon took over and how long callers
/// waited.
pub fn upgrade(mountpoint: &Path, wait: std::time::Duration) -> Result<Reply, ClientError> {
    let client = Client::new(mountpoint);
    let old = client.hand_over()?;
    let deadline = std::time::Instant::now() + wait;
    loop {
        std::thread::sleep(std::time::Duration::from_millis(20));
        match client.status() {
            Ok(status) if status.daemon_pid != old => {
                let gap = status
                    .keeper
                    .and_then(|k| k.gap_ms)
                    .map(|ms| format!("; callers waited {ms:.0} ms"))
                    .unwrap_or_default();
                return Ok(Reply::text(format!(
                    "daemon {old} handed over to {}{gap}\n",
                    status.daemon_pid
                )));
            }
            _ if std::time::Instant::now() >= deadline => {
                return Err(ClientError::NoSuccessor(format!(
                    "daemon {old} handed over, but no new daemon answered within {}s; see the mount's log",
                    wait.as_secs()
                )));
            }
            _ => {}
        }
    }
}

/// `layerfs refresh`: runs a round, taking an empty remote as the truth with `accept_empty`.
pub fn refresh(mountpoint: &Path, accept_empty: bool, json: bool) -> Result<Reply, ClientError> {
    refreshed(&Client::new(mountpoint), accept_empty, json)
}

/// A round is printed also when it could not scan; that failure is the command's outcome.
fn refreshed(client: &Client, accept_empty: bool, json: bool) -> Result<Reply, ClientError> {
    let round = client.refresh(accept_empty)?;
    let outcome = match round.error.clone() {
        Some(e) => Err(ClientError::RoundFailed(e)),
        None => Ok(()),
    };
    Ok(Reply {
        text: shown(&round, json, render::round),
        note: None,
        outcome,
    })
}

/// `answer` as JSON with `--json`, else as `human` renders it.
fn shown<T: serde::Serialize>(answer: &T, json: bool, human: impl FnOnce(&T) -> String) -> String {
    if json {
        render::json(&serde_json::to_value(answer).unwrap_or_default())
    } else {
        human(answer)
    }
}

/// Runs `layerfs quota get|list|clear MOUNTPOINT [PATH] [--json]`. PATH is relative to
/// MOUNTPOINT, or absolute and inside it.
pub fn quota(
    mountpoint: &Path,
    op: Op,
    path: Option<&Path>,
    json: bool,
) -> Result<Reply, StorageError> {
    let client = Client::new(mountpoint);
    let key =
        |path: &Path| storage::key_for(client.mountpoint(), &target(client.mountpoint(), path));
    let text = match (op, path) {
        (Op::QuotaList, _) => shown(&client.quota_list()?, json, |q| render::quotas(q)),
        (Op::QuotaGet, Some(path)) => shown(&client.quota_get(&key(path)?)?, json, render::quota),
        (Op::QuotaClear, Some(path)) => shown(
            &client.quota_clear(&key(path)?)?,
            json,
            render::quota_cleared,
        ),
        (op, path) => unreachable!("quota {op:?} of {path:?}: get and clear name a directory"),
    };
    Ok(Reply::text(text))
}

/// `layerfs quota set`: what to limit and how.
#[derive(Debug, Clone, Default)]
pub struct QuotaSet {
    /// The directory: relative to the mountpoint, or absolute.
    pub path: PathBuf,
    pub storage: Storage,
    pub inodes: Option<u64>,
    /// containerd labels; `max-size` gives the limit when `storage.size` is empty.
    pub labels: Vec<(String, String)>,
    /// Create the directory (which must not exist) as containerd's `Prepare` does.
    pub create: bool,
}

/// Runs `layerfs quota set MOUNTPOINT PATH [SIZE] …` through the storage core, with the
/// backend MOUNTPOINT calls for: a layerfs mount enforces the quota, a plain directory
/// cannot (an error, or a warning in [`Reply::note`] with `ignore_failed`).
pub fn quota_set(mountpoint: &Path, set: &QuotaSet, json: bool) -> Result<Reply, StorageError> {
    let backend = quota_backend::backend_for(mountpoint);
    let dir = target(
        &crate::store::mountinfo::resolve_mountpoint(mountpoint),
        &set.path,
    );
    let (dir, applied) = if set.create {
        let key = storage::key_for(backend.root(), &dir)?;
        let prepared = storage::prepare(
            backend.as_ref(),
            &key,
            &set.storage,
            set.inodes,
            &set.labels,
        )?;
        (prepared.dir, prepared.quota)
    } else {
        let applied = storage::apply(
            backend.as_ref(),
            &dir,
            &set.storage,
            set.inodes,
            &set.labels,
        )?;
        (dir, applied)
    };
    let made = if set.create { "created; " } else { "" };
    // Without a quota there is no answer to print: `null` keeps `--json` output parseable.
    let nothing = if json { "null\n" } else { "" };
    Ok(match applied {
        Applied::Set { .. } => {
            let key = storage::key_for(backend.root(), &dir)?;
            let info = Client::new(backend.root())
                .quota_get(&key)
                .map_err(|e| StorageError::Backend(Box::new(e)))?;
            Reply::text(shown(&info, json, render::quota))
        }
        Applied::NoQuota => Reply {
            note: Some(format!(
                "{}: {made}no quota set (no size given, and no {} label)",
                dir.display(),
                crate::quota::size::MAX_SIZE_LABEL
            )),
            ..Reply::text(nothing.to_owned())
        },
        Applied::Skipped { limit, reason } => Reply {
            note: Some(format!(
                "warning: {}: {made}quota of {} not set: {reason}",
                dir.display(),
                human(limit)
            )),
            ..Reply::text(nothing.to_owned())
        },
    })
}

/// A command line's PATH: absolute (resolved like a mountpoint, symlinks and all), or
/// relative to the (resolved) mountpoint.
fn target(mountpoint: &Path, path: &Path) -> PathBuf {
    if path.is_absolute() {
        crate::store::mountinfo::resolve_mountpoint(path)
    } else {
        mountpoint.join(path)
    }
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(path: &str, size: &str, ignore_failed: bool, create: bool) -> QuotaSet {
        QuotaSet {
            path: path.into(),
            storage: Storage {
                size: size.into(),
                ignore_failed,
            },
            create,
            ..QuotaSet::default()
        }
    }

    #[test]
    fn set_on_a_plain_directory_fails_unless_told_to_go_on() {
        let tmp = tempfile::tempdir().unwrap();
        let e = quota_set(tmp.path(), &set("c1", "10G", false, true), false).unwrap_err();
        assert!(matches!(e, StorageError::Unsupported { .. }), "{e}");
        assert!(!tmp.path().join("c1").exists());

        let reply = quota_set(tmp.path(), &set("c1", "10G", true, true), true).unwrap();
        assert!(tmp.path().join("c1").is_dir());
        assert_eq!(reply.text, "null\n");
        let note = reply.note.unwrap();
        assert!(
            note.starts_with("warning: ") && note.contains("created; quota of 10G not set: "),
            "{note}"
        );
        assert!(reply.outcome.is_ok());

        let abs = tmp.path().join("c1");
        let reply = quota_set(
            tmp.path(),
            &set(abs.to_str().unwrap(), "1G", true, false),
            false,
        )
        .unwrap();
        assert_eq!(reply.text, "");
        assert!(reply.note.unwrap().contains("quota of 1.0G not set"));
    }

    #[test]
    fn an_empty_size_does_nothing_and_says_so() {
        let tmp = tempfile::tempdir().unwrap();
        let reply = quota_set(tmp.path(), &set("c1", "", false, false), false).unwrap();
        assert_eq!(reply.text, "");
        let note = reply.note.unwrap();
        assert!(note.contains("no quota set"), "{note}");
        assert!(!tmp.path().join("c1").exists());
        let e = quota_set(tmp.path(), &set("c1", "1.5G", true, true), false).unwrap_err();
        assert!(e.to_string().starts_with("invalid size \"1.5G\""), "{e}");
        assert!(!tmp.path().join("c1").exists());
    }

    #[test]
    fn paths_must_stay_inside_the_mountpoint() {
        let tmp = tempfile::tempdir().unwrap();
        let e = quota_set(tmp.path(), &set("../x", "1G", true, true), false).unwrap_err();
        assert!(matches!(e, StorageError::Outside { .. }), "{e}");
        let e = quota(
            tmp.path(),
            Op::QuotaGet,
            Some(Path::new("/elsewhere")),
            false,
        )
        .unwrap_err();
        assert!(matches!(e, StorageError::Outside { .. }), "{e}");
        // Inside, but nothing is mounted: the client's error, as the other commands give.
        let e = quota(tmp.path(), Op::QuotaGet, Some(Path::new("c1")), false).unwrap_err();
        assert!(e.to_string().starts_with("no layerfs mount at "), "{e}");
    }

    #[test]
    fn relative_and_absolute_paths() {
        let m = Path::new("/mnt/view");
        assert_eq!(target(m, Path::new("overlay/c1")), m.join("overlay/c1"));
        assert_eq!(
            storage::key_for(m, &target(m, Path::new("./overlay/c1/"))).unwrap(),
            "overlay/c1"
        );
    }
}
