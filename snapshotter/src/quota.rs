//! Snapshot quotas from labels, decided by layerfs's one quota core
//! (`layerfs::quota::storage`, DESIGN §6).
//!
//! Only labels under `containerd.io/snapshot/` reach a proxy snapshotter, so the universal
//! quota request `storage { size, ignoreFailed }` travels as two labels of that prefix:
//!
//! | label | meaning |
//! |---|---|
//! | `containerd.io/snapshot/layerfs.storage.size` | a size string: absent or `""` = no quota, `"0"` = zero bytes, `K/M/G/T` suffixes |
//! | `containerd.io/snapshot/layerfs.storage.ignore-failed` | `true` or `false` (default): go on without a quota where none can be enforced |
//! | `containerd.io/snapshot/max-size` | containerd's own label: decimal bytes, used when `layerfs.storage.size` gives none |
//!
//! containerd defines `max-size` as a hint, so when it alone asks for a limit, a root that
//! cannot enforce one goes on with a warning unless `ignore-failed` is `false` explicitly.
//! The layerfs labels are strict by default: where quotas are not supported, Prepare fails
//! with FailedPrecondition before anything is made.

use std::collections::BTreeMap;
use std::os::fd::AsFd;
use std::path::Path;

use layerfs::control::{quota_backend, Client};
use layerfs::quota::size::MAX_SIZE_LABEL;
use layerfs::quota::storage::{self, Applied, Storage};
use layerfs::report::QuotaInfo;

use crate::error::Error;
use crate::meta::Usage;

pub const SIZE_LABEL: &str = "containerd.io/snapshot/layerfs.storage.size";
pub const IGNORE_FAILED_LABEL: &str = "containerd.io/snapshot/layerfs.storage.ignore-failed";

/// What a snapshot's labels ask for, checked before anything is made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wanted {
    pub storage: Storage,
    /// The `max-size` label, for the core to read when `storage.size` is empty.
    pub labels: Vec<(String, String)>,
}

impl Wanted {
    /// Whether it asks for a limit at all: one that asks for none needs no quota root.
    pub fn limits(&self) -> bool {
        matches!(
            storage::requested_limit(&self.storage, &self.labels),
            Ok(Some(_))
        )
    }
}

/// Reads the quota labels. A malformed value is an error here, before anything is made.
pub fn from_labels(labels: &BTreeMap<String, String>) -> Result<Wanted, Error> {
    let size = labels.get(SIZE_LABEL).cloned().unwrap_or_default();
    let ignore_failed = match labels.get(IGNORE_FAILED_LABEL).map(String::as_str) {
        None => None,
        Some("true") => Some(true),
        Some("false") => Some(false),
        Some(other) => {
            return Err(Error::InvalidArgument(format!(
                "label {IGNORE_FAILED_LABEL}={other:?}: expected true or false"
            )))
        }
    };
    let max_size = labels.get(MAX_SIZE_LABEL);
    // A hint when it is the only request, strict otherwise.
    let hint = size.is_empty() && max_size.is_some();
    let request = Wanted {
        storage: Storage {
            size,
            ignore_failed: ignore_failed.unwrap_or(hint),
        },
        labels: max_size
            .map(|v| vec![(MAX_SIZE_LABEL.to_owned(), v.clone())])
            .unwrap_or_default(),
    };
    // Parse now, so a bad size fails before a directory exists.
    storage::requested_limit(&request.storage, &request.labels)
        .map_err(storage::StorageError::from)?;
    Ok(request)
}

/// Makes `dir` (which must not exist) with the quota `request` asks for, where `root` lies:
/// enforced in a layerfs mount, refused or skipped with a warning elsewhere. Returns the
/// limit in force.
pub fn make_dir(root: &Path, dir: &Path, request: &Wanted) -> Result<Option<u64>, Error> {
    let backend = quota_backend::backend_for(root);
    let key = storage::key_for(backend.root(), dir)?;
    let prepared = storage::prepare(
        backend.as_ref(),
        &key,
        &request.storage,
        None,
        &request.labels,
    )?;
    Ok(match prepared.quota {
        Applied::Set { limit, .. } => Some(limit),
        Applied::NoQuota | Applied::Skipped { .. } => None,
    })
}

/// Whether quotas can be enforced under `root` (containerd's `SupportedQuota`).
pub fn supported(root: &Path) -> bool {
    quota_backend::backend_for(root).supported_quota()
}

/// What the quota root `dir` uses: the quota's own figures, or a walk of the tree where
/// they cannot be had.
pub fn usage(root: &Path, dir: &Path) -> Result<Usage, Error> {
    match quota_figures(root, dir) {
        Ok(info) => Ok(Usage {
            size: info.used,
            inodes: info.inodes_used,
        }),
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "quota figures unavailable; walking the tree");
            walk(dir)
        }
    }
}

fn quota_figures(root: &Path, dir: &Path) -> Result<QuotaInfo, Error> {
    let backend = quota_backend::backend_for(root);
    let key = storage::key_for(backend.root(), dir)?;
    Client::new(backend.root())
        .quota_get(&key)
        .map_err(|e| Error::Quota(storage::StorageError::Backend(Box::new(e))))
}

/// Allocated bytes and inodes under `dir`, hard links once, never leaving its filesystem.
pub fn walk(dir: &Path) -> Result<Usage, Error> {
    let fd = layerfs::store::open_root(dir)
        .map_err(|e| Error::io(format!("opening {}", dir.display()), e.into()))?;
    let usage = layerfs::quota::measure(fd.as_fd())
        .map_err(|e| Error::io(format!("measuring {}", dir.display()), e.into()))?;
    Ok(Usage {
        size: usage.bytes,
        inodes: usage.inodes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn labels_make_the_seed_s_storage_request() {
        let r = from_labels(&labels(&[])).unwrap();
        assert_eq!(r.storage, Storage::default());
        assert!(r.labels.is_empty());

        let r = from_labels(&labels(&[(SIZE_LABEL, "10M")])).unwrap();
        assert_eq!(r.storage.size, "10M");
        assert!(!r.storage.ignore_failed, "strict by default");

        let r = from_labels(&labels(&[(SIZE_LABEL, "0"), (IGNORE_FAILED_LABEL, "true")])).unwrap();
        assert_eq!(r.storage.size, "0");
        assert!(r.storage.ignore_failed);

        // max-size alone is a hint; made strict only on request.
        let r = from_labels(&labels(&[(MAX_SIZE_LABEL, "1048576")])).unwrap();
        assert!(r.storage.ignore_failed);
        assert_eq!(
            storage::requested_limit(&r.storage, &r.labels).unwrap(),
            Some(1 << 20)
        );
        let r = from_labels(&labels(&[
            (MAX_SIZE_LABEL, "1048576"),
            (IGNORE_FAILED_LABEL, "false"),
        ]))
        .unwrap();
        assert!(!r.storage.ignore_failed);

        // Both: the layerfs size wins, strictly.
        let r = from_labels(&labels(&[(MAX_SIZE_LABEL, "1048576"), (SIZE_LABEL, "2M")])).unwrap();
        assert_eq!(
            storage::requested_limit(&r.storage, &r.labels).unwrap(),
            Some(2 << 20)
        );
        assert!(!r.storage.ignore_failed);
    }

    #[test]
    fn malformed_labels_are_refused_before_anything_is_made() {
        for bad in [
            labels(&[(SIZE_LABEL, "ten")]),
            labels(&[(MAX_SIZE_LABEL, "10G")]),
            labels(&[(SIZE_LABEL, "1G"), (IGNORE_FAILED_LABEL, "yes")]),
        ] {
            let e = from_labels(&bad).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
        }
    }
}
