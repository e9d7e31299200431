//! What happens to a `storage { size, ignore_failed }` request: the one place that decides,
//! after containerd's universal snapshot-quota design (DESIGN §6).
//!
//! A [`Snapshotter`] is a backend that makes read-write directories and may or may not be
//! able to limit them. The story of one container layer:
//!
//! 1. The runtime asks for a new read-write directory with [`prepare`], giving the key
//!    (`overlay/<cid>`), the [`Storage`] request and its labels. The limit is `size`, or,
//!    when `size` is empty, containerd's `max-size` label; neither means no quota, and the
//!    directory is simply made.
//! 2. With a limit, a backend whose [`Snapshotter::supported_quota`] is true gets the
//!    directory and then the quota. If applying it fails, the directory is removed again and
//!    the error reaches the caller: a container must never run believing it is limited
//!    when it is not.
//! 3. A backend that does not support quotas fails the request *before* anything is made,
//!    unless `ignore_failed` is set: then the directory is made without a quota, a warning is
//!    logged and the result says the quota was skipped and why.
//!
//! [`apply`] is the same decision for a directory that already exists. A malformed size or
//! label fails either before anything is touched.
//!
//! Two backends ship: a layerfs mount, which enforces the quota and is told of it over its
//! control socket (`control::quota_backend`, at the edge, since it speaks the socket), and
//! [`PlainDir`], a plain directory that cannot. `control::quota_backend::backend_for` picks
//! the right one for a path.

use std::io;
use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::size::{self, SizeError};

/// A quota request, as containerd's snapshotter config spells it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Storage {
    /// The limit as a size string ([`size::parse_size`]): `""` is no quota, `"0"` a zero
    /// one. When empty, the `max-size` label gives the limit, if there is one.
    pub size: String,
    /// Go on without a quota when the backend cannot enforce one, instead of failing.
    pub ignore_failed: bool,
}

/// A backend of read-write directories. Every directory is named by a `key`, a relative
/// path under the backend's [`root`](Snapshotter::root) such as `overlay/<cid>`.
pub trait Snapshotter {
    /// A short name for messages: `layerfs`, `plain directory`.
    fn name(&self) -> &str;
    /// Where the keys are rooted.
    fn root(&self) -> &Path;
    /// Whether [`apply_quota`](Snapshotter::apply_quota) can work here, now. Cheap: it is
    /// asked before anything is created.
    fn supported_quota(&self) -> bool;
    /// Why quotas are not supported, for the error or warning that says so.
    fn why_unsupported(&self) -> String {
        format!("the {} backend does not support quotas", self.name())
    }
    /// The directory for `key`, whether or not it exists.
    fn dir(&self, key: &str) -> PathBuf {
        self.root().join(key)
    }
    /// Makes the directory for `key` (and its missing parents) and returns it. A directory
    /// that already exists is an error: [`prepare`] removes what it made when the quota
    /// fails, and must never remove something it did not make. By default, a plain
    /// `mkdir` under [`root`](Snapshotter::root).
    fn create_dir(&self, key: &str) -> Result<PathBuf, StorageError> {
        check_key(key)?;
        create(self.dir(key))
    }
    /// Removes a directory [`create_dir`](Snapshotter::create_dir) made (still empty).
    fn remove_dir(&self, dir: &Path) -> Result<(), StorageError> {
        remove(dir)
    }
    /// Limits `dir` to `limit` bytes of allocated space and, if given, `inodes` inodes.
    fn apply_quota(&self, dir: &Path, limit: u64, inodes: Option<u64>) -> Result<(), StorageError>;
}

#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    #[error(transparent)]
    Size(#[from] SizeError),
    #[error("an inode limit needs a size limit too")]
    InodesWithoutSize,
    #[error("invalid key {0:?}: expected a relative path like overlay/<id>")]
    BadKey(String),
    #[error("{} is not inside {}", dir.display(), root.display())]
    Outside { dir: PathBuf, root: PathBuf },
    #[error(
        "cannot set a quota on {}: {reason} (ignore_failed, or --ignore-failed, goes on without one)",
        dir.display()
    )]
    Unsupported { dir: PathBuf, reason: String },
    // `cause`, not `source`: the message already says it, and a source would be said twice
    // where errors are printed with their chain.
    #[error("creating {}: {cause}", dir.display())]
    Create { dir: PathBuf, cause: io::Error },
    #[error("removing {}: {cause}", dir.display())]
    Remove { dir: PathBuf, cause: io::Error },
    #[error("{backend}: setting the quota of {}: {reason}", dir.display())]
    Apply {
        backend: String,
        dir: PathBuf,
        reason: String,
    },
    /// The backend could not be asked (a layerfs mount's control socket did not answer).
    #[error(transparent)]
    Backend(Box<dyn std::error::Error + Send + Sync>),
}

/// What became of the quota part of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applied {
    /// No limit was asked for; nothing was applied.
    NoQuota,
    /// The limit is in force.
    Set { limit: u64, inodes: Option<u64> },
    /// A limit was asked for, but the backend cannot enforce it and `ignore_failed` said to
    /// go on without it.
    Skipped { limit: u64, reason: String },
}

/// A directory [`prepare`] made, and what became of its quota.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prepared {
    pub dir: PathBuf,
    pub quota: Applied,
}

/// What to do, decided before anything is touched.
enum Decision {
    Nothing,
    Apply { limit: u64, inodes: Option<u64> },
    Skip { limit: u64, reason: String },
}

/// The limit a request asks for: `size` when it is not empty, else containerd's
/// `max-size` label (which is then the only one consulted, so an explicit size can
/// override a label someone got wrong).
pub fn requested_limit(
    storage: &Storage,
    labels: &[(String, String)],
) -> Result<Option<u64>, SizeError> {
    match size::parse_size(&storage.size)? {
        Some(limit) => Ok(Some(limit)),
        None => size::from_labels(labels.iter().map(|(k, v)| (k.as_str(), v.as_str()))),
    }
}

fn decide(
    backend: &dyn Snapshotter,
    dir: &Path,
    storage: &Storage,
    inodes: Option<u64>,
    labels: &[(String, String)],
) -> Result<Decision, StorageError> {
    let Some(limit) = requested_limit(storage, labels)? else {
        // Dropping the inode limit silently would leave the caller believing it is set.
        return match inodes {
            Some(_) => Err(StorageError::InodesWithoutSize),
            None => Ok(Decision::Nothing),
        };
    };
    if backend.supported_quota() {
        return Ok(Decision::Apply { limit, inodes });
    }
    let reason = backend.why_unsupported();
    if !storage.ignore_failed {
        return Err(StorageError::Unsupported {
            dir: dir.to_owned(),
            reason,
        });
    }
    tracing::warn!(
        dir = %dir.display(),
        limit,
        %reason,
        "going on without the quota (ignore_failed is set)"
    );
    Ok(Decision::Skip { limit, reason })
}

/// Makes the read-write directory for `key` with the quota `storage` and `labels` ask for
/// (and `inodes`, if given). Nothing is created when the request cannot be honoured; a
/// directory whose quota fails to apply is removed again.
pub fn prepare(
    backend: &dyn Snapshotter,
    key: &str,
    storage: &Storage,
    inodes: Option<u64>,
    labels: &[(String, String)],
) -> Result<Prepared, StorageError> {
    check_key(key)?;
    let decision = decide(backend, &backend.dir(key), storage, inodes, labels)?;
    let dir = backend.create_dir(key)?;
    let quota = match decision {
        Decision::Nothing => Applied::NoQuota,
        Decision::Skip { limit, reason } => Applied::Skipped { limit, reason },
        Decision::Apply { limit, inodes } => {
            if let Err(e) = backend.apply_quota(&dir, limit, inodes) {
                // The caller sees why the quota failed; a failed cleanup is only logged, as
                // it is not what went wrong first.
                if let Err(cleanup) = backend.remove_dir(&dir) {
                    tracing::warn!(error = %cleanup, "leaving a directory without its quota");
                }
                return Err(e);
            }
            Applied::Set { limit, inodes }
        }
    };
    Ok(Prepared { dir, quota })
}

/// Applies the quota `storage` and `labels` ask for to `dir`, which exists already.
pub fn apply(
    backend: &dyn Snapshotter,
    dir: &Path,
    storage: &Storage,
    inodes: Option<u64>,
    labels: &[(String, String)],
) -> Result<Applied, StorageError> {
    Ok(match decide(backend, dir, storage, inodes, labels)? {
        Decision::Nothing => Applied::NoQuota,
        Decision::Skip { limit, reason } => Applied::Skipped { limit, reason },
        Decision::Apply { limit, inodes } => {
            backend.apply_quota(dir, limit, inodes)?;
            Applied::Set { limit, inodes }
        }
    })
}

/// A key must stay under the root: plain names only, no `..`, not absolute.
fn check_key(key: &str) -> Result<(), StorageError> {
    let path = Path::new(key);
    let plain = path.components().all(|c| matches!(c, Component::Normal(_)));
    if key.is_empty() || !plain {
        return Err(StorageError::BadKey(key.to_owned()));
    }
    Ok(())
}

fn create(dir: PathBuf) -> Result<PathBuf, StorageError> {
    let made = match dir.parent() {
        Some(parent) => std::fs::create_dir_all(parent),
        None => Ok(()),
    }
    .and_then(|()| std::fs::create_dir(&dir));
    match made {
        Ok(()) => Ok(dir),
        Err(cause) => Err(StorageError::Create { dir, cause }),
    }
}

fn remove(dir: &Path) -> Result<(), StorageError> {
    // Never recursive: only the empty directory just made is ever removed.
    std::fs::remove_dir(dir).map_err(|cause| StorageError::Remove {
        dir: dir.to_owned(),
        cause,
    })
}

/// Directories in a plain directory tree, which cannot limit them.
#[derive(Debug, Clone)]
pub struct PlainDir {
    pub root: PathBuf,
}

impl Snapshotter for PlainDir {
    fn name(&self) -> &str {
        "plain directory"
    }

    fn root(&self) -> &Path {
        &self.root
    }

    fn supported_quota(&self) -> bool {
        false
    }

    fn why_unsupported(&self) -> String {
        format!(
            "{} is a plain directory, not in a layerfs mount, and cannot enforce quotas",
            self.root.display()
        )
    }

    fn apply_quota(&self, dir: &Path, _: u64, _: Option<u64>) -> Result<(), StorageError> {
        Err(StorageError::Unsupported {
            dir: dir.to_owned(),
            reason: self.why_unsupported(),
        })
    }
}

/// The key of `dir` under `root`: the relative path between them, which must lead down and
/// be valid UTF-8 (keys travel as JSON strings).
pub fn key_for(root: &Path, dir: &Path) -> Result<String, StorageError> {
    let outside = || StorageError::Outside {
        dir: dir.to_owned(),
        root: root.to_owned(),
    };
    let rel = dir.strip_prefix(root).map_err(|_| outside())?;
    let plain = rel.components().all(|c| matches!(c, Component::Normal(_)));
    match rel.to_str() {
        Some(s) if plain && !s.is_empty() => Ok(s.to_owned()),
        _ => Err(outside()),
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use super::*;

    /// A backend that claims quota support, records what it was asked, and fails applies
    /// when told to.
    struct Recording {
        plain: PlainDir,
        fail: bool,
        applied: RefCell<Vec<(PathBuf, u64, Option<u64>)>>,
    }

    impl Recording {
        fn new(root: &Path, fail: bool) -> Recording {
            Recording {
                plain: PlainDir {
                    root: root.to_owned(),
                },
                fail,
                applied: RefCell::default(),
            }
        }
    }

    impl Snapshotter for Recording {
        fn name(&self) -> &str {
            "recording"
        }
        fn root(&self) -> &Path {
            self.plain.root()
        }
        fn supported_quota(&self) -> bool {
            true
        }
        fn create_dir(&self, key: &str) -> Result<PathBuf, StorageError> {
            self.plain.create_dir(key)
        }
        fn remove_dir(&self, dir: &Path) -> Result<(), StorageError> {
            self.plain.remove_dir(dir)
        }
        fn apply_quota(
            &self,
            dir: &Path,
            limit: u64,
            inodes: Option<u64>,
        ) -> Result<(), StorageError> {
            if self.fail {
                return Err(StorageError::Apply {
                    backend: "recording".into(),
                    dir: dir.to_owned(),
                    reason: "disk on fire".into(),
                });
            }
            self.applied
                .borrow_mut()
                .push((dir.to_owned(), limit, inodes));
            Ok(())
        }
    }

    fn storage(size: &str, ignore_failed: bool) -> Storage {
        Storage {
            size: size.into(),
            ignore_failed,
        }
    }

    fn label(value: &str) -> Vec<(String, String)> {
        vec![(size::MAX_SIZE_LABEL.to_owned(), value.to_owned())]
    }

    fn is_empty(dir: &Path) -> bool {
        std::fs::read_dir(dir).unwrap().next().is_none()
    }

    #[test]
    fn supported_backend_gets_the_quota() {
        let tmp = tempfile::tempdir().unwrap();
        let b = Recording::new(tmp.path(), false);
        let p = prepare(&b, "overlay/c1", &storage("10G", false), Some(100), &[]).unwrap();
        assert_eq!(p.dir, tmp.path().join("overlay/c1"));
        assert!(p.dir.is_dir());
        assert_eq!(
            p.quota,
            Applied::Set {
                limit: 10 << 30,
                inodes: Some(100)
            }
        );
        assert_eq!(*b.applied.borrow(), [(p.dir.clone(), 10 << 30, Some(100))]);
    }

    #[test]
    fn zero_is_a_limit_and_empty_is_none() {
        let tmp = tempfile::tempdir().unwrap();
        let b = Recording::new(tmp.path(), false);
        let p = prepare(&b, "zero", &storage("0", false), None, &[]).unwrap();
        assert_eq!(
            p.quota,
            Applied::Set {
                limit: 0,
                inodes: None
            }
        );
        let p = prepare(&b, "none", &storage("", false), None, &[]).unwrap();
        assert_eq!(p.quota, Applied::NoQuota);
        assert!(p.dir.is_dir());
        assert_eq!(b.applied.borrow().len(), 1);
        // Nothing asked for is nothing refused, even where quotas are unsupported.
        let plain = PlainDir {
            root: tmp.path().to_owned(),
        };
        let p = prepare(&plain, "plain", &Storage::default(), None, &[]).unwrap();
        assert_eq!(p.quota, Applied::NoQuota);
        assert_eq!(
            apply(&plain, &p.dir, &storage("  ", false), None, &[]).unwrap(),
            Applied::NoQuota
        );
    }

    #[test]
    fn the_label_is_honoured_and_size_wins_over_it() {
        let tmp = tempfile::tempdir().unwrap();
        let b = Recording::new(tmp.path(), false);
        let p = prepare(&b, "l", &Storage::default(), None, &label("4096")).unwrap();
        assert_eq!(
            p.quota,
            Applied::Set {
                limit: 4096,
                inodes: None
            }
        );
        let got = apply(&b, &p.dir, &storage("1K", false), None, &label("4096")).unwrap();
        assert_eq!(
            got,
            Applied::Set {
                limit: 1024,
                inodes: None
            }
        );
        // With a size given, the label is not consulted at all.
        let got = apply(&b, &p.dir, &storage("1K", false), None, &label("junk")).unwrap();
        assert_eq!(
            got,
            Applied::Set {
                limit: 1024,
                inodes: None
            }
        );
        let others = vec![("containerd.io/other".to_owned(), "1".to_owned())];
        let got = apply(&b, &p.dir, &Storage::default(), None, &others).unwrap();
        assert_eq!(got, Applied::NoQuota);
    }

    #[test]
    fn bad_sizes_and_labels_fail_before_anything_is_made() {
        let tmp = tempfile::tempdir().unwrap();
        let b = Recording::new(tmp.path(), false);
        let e = prepare(&b, "c", &storage("10X", true), None, &[]).unwrap_err();
        assert!(
            matches!(e, StorageError::Size(SizeError::Invalid { .. })),
            "{e}"
        );
        let e = prepare(&b, "c", &Storage::default(), None, &label("10G")).unwrap_err();
        assert!(
            matches!(e, StorageError::Size(SizeError::Label { .. })),
            "{e}"
        );
        assert!(e.to_string().contains(size::MAX_SIZE_LABEL), "{e}");
        let e = prepare(&b, "c", &Storage::default(), Some(5), &[]).unwrap_err();
        assert!(matches!(e, StorageError::InodesWithoutSize), "{e}");
        for key in ["", "/abs", "../up", "a/../b", "./c"] {
            let e = prepare(&b, key, &storage("1G", false), None, &[]).unwrap_err();
            assert!(matches!(e, StorageError::BadKey(_)), "{key}: {e}");
        }
        assert!(is_empty(tmp.path()));
        assert!(b.applied.borrow().is_empty());
    }

    #[test]
    fn unsupported_and_strict_creates_nothing_and_says_why() {
        let tmp = tempfile::tempdir().unwrap();
        let plain = PlainDir {
            root: tmp.path().to_owned(),
        };
        let e = prepare(&plain, "overlay/c1", &storage("1G", false), None, &[]).unwrap_err();
        assert!(matches!(e, StorageError::Unsupported { .. }), "{e}");
        let text = e.to_string();
        let dir = tmp.path().join("overlay/c1");
        assert!(text.contains(&dir.display().to_string()), "{text}");
        assert!(text.contains("plain directory"), "{text}");
        assert!(text.contains("ignore_failed"), "{text}");
        assert!(is_empty(tmp.path()));
        // The same for a directory that exists.
        std::fs::create_dir(tmp.path().join("d")).unwrap();
        let d = tmp.path().join("d");
        let e = apply(&plain, &d, &Storage::default(), None, &label("1")).unwrap_err();
        assert!(matches!(e, StorageError::Unsupported { .. }), "{e}");
    }

    #[test]
    fn unsupported_and_ignore_failed_goes_on_without_a_quota() {
        let tmp = tempfile::tempdir().unwrap();
        let plain = PlainDir {
            root: tmp.path().to_owned(),
        };
        let p = prepare(&plain, "overlay/c1", &storage("1G", true), None, &[]).unwrap();
        assert!(p.dir.is_dir());
        match &p.quota {
            Applied::Skipped { limit, reason } => {
                assert_eq!(*limit, 1 << 30);
                assert!(reason.contains("plain directory"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        let got = apply(&plain, &p.dir, &storage("0", true), None, &[]).unwrap();
        assert!(matches!(got, Applied::Skipped { limit: 0, .. }), "{got:?}");
    }

    #[test]
    fn a_failed_apply_reaches_the_caller_and_prepare_removes_its_dir() {
        let tmp = tempfile::tempdir().unwrap();
        let b = Recording::new(tmp.path(), true);
        let e = prepare(&b, "c1", &storage("1G", true), None, &[]).unwrap_err();
        assert!(e.to_string().contains("disk on fire"), "{e}");
        assert!(!tmp.path().join("c1").exists());
        std::fs::create_dir(tmp.path().join("c2")).unwrap();
        let e = apply(&b, &tmp.path().join("c2"), &storage("1G", true), None, &[]).unwrap_err();
        assert!(matches!(e, StorageError::Apply { .. }), "{e}");
        // apply never removes what it did not make.
        assert!(tmp.path().join("c2").is_dir());
    }

    #[test]
    fn prepare_never_takes_over_an_existing_dir() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir(tmp.path().join("c1")).unwrap();
        std::fs::write(tmp.path().join("c1/data"), b"x").unwrap();
        let b = Recording::new(tmp.path(), true);
        let e = prepare(&b, "c1", &storage("1G", false), None, &[]).unwrap_err();
        assert!(matches!(e, StorageError::Create { .. }), "{e}");
        assert!(tmp.path().join("c1/data").exists());
    }

    #[test]
    fn plain_dir_refuses_quotas_outright() {
        let tmp = tempfile::tempdir().unwrap();
        let plain = PlainDir {
            root: tmp.path().to_owned(),
        };
        assert!(!plain.supported_quota());
        let e = plain.apply_quota(tmp.path(), 1, None).unwrap_err();
        assert!(matches!(e, StorageError::Unsupported { .. }), "{e}");
    }

    #[test]
    fn storage_reads_containerd_style_config() {
        let s: Storage = serde_json::from_str(r#"{"size":"10G"}"#).unwrap();
        assert_eq!(s, storage("10G", false));
        let s: Storage = serde_json::from_str(r#"{"ignore_failed":true}"#).unwrap();
        assert_eq!(s, storage("", true));
    }
}
