//! Quota roots the kernel enforces (DESIGN §6): with local on btrfs, a root is a subvolume
//! whose qgroup carries the limit. The kernel counts every write, those done with FUSE
//! passthrough included, so files in such a root keep passthrough, and the data path of
//! the daemon does nothing for them. An allocation past the limit fails with the kernel's
//! `EDQUOT` (`quota_errno` applies to the FUSE backend only).
//!
//! Full qgroups, not simple quotas: simple quotas charge an extent to the subvolume that
//! first allocated it, so a directory converted by reflink (and any reflink into a root)
//! would hold data its root is never charged for. Full qgroups count what each subvolume
//! references; without snapshots, their cost at commit stays small. A filesystem whose
//! quotas are already on is used in the mode it has.
//!
//! btrfs has no inode limits: under `quota_backend=auto`, a root asked for one is enforced
//! by the FUSE backend.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use serde::{Deserialize, Serialize};
use tracing::info;

use super::error::QuotaError;
use super::ledger::Ledger;
use super::table::{Limit, QuotaRoot, Usage};
use crate::store::{self, btrfs};

/// Which backend new quota roots get (`quota_backend=`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Choice {
    /// btrfs where local is on btrfs and the limit is one btrfs can express, else FUSE.
    #[default]
    Auto,
    Fuse,
    Btrfs,
}

impl Choice {
    pub fn parse(text: &str) -> Option<Choice> {
        match text.to_ascii_lowercase().as_str() {
            "auto" => Some(Choice::Auto),
            "fuse" => Some(Choice::Fuse),
            "btrfs" => Some(Choice::Btrfs),
            _ => None,
        }
    }
}

/// Who enforces a root's limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// The daemon, on every call that allocates; files in the root lose passthrough.
    #[default]
    Fuse,
    /// The btrfs qgroup of the subvolume the root is.
    Btrfs,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Fuse => "fuse",
            Backend::Btrfs => "btrfs",
        }
    }
}

/// A mount's way to btrfs's quotas: local's root, open for ioctls.
#[derive(Debug)]
pub(super) struct Btrfs {
    fd: OwnedFd,
}

impl Btrfs {
    /// For the local root `local`, if it is on btrfs.
    pub(super) fn of(local: BorrowedFd<'_>) -> Option<Btrfs> {
        if !btrfs::is_btrfs(local) {
            return None;
        }
        let fd = store::reopen(local, OFlag::O_RDONLY | OFlag::O_DIRECTORY).ok()?;
        Some(Btrfs { fd })
    }

    /// Limits the subvolume's qgroup to `bytes` (none: no limit), turning quotas on first
    /// if they are off.
    pub(super) fn limit(&self, subvolume: u64, bytes: Option<u64>) -> Result<(), Errno> {
        if bytes.is_some() {
            self.quotas_on()?;
        }
        btrfs::set_limit(self.fd.as_fd(), subvolume, bytes)
    }

    /// Commits, which sets btrfs's cleaner to work on a deleted subvolume: its space comes
    /// back in the background, not at the next commit interval.
    pub(super) fn commit(&self) {
        if let Err(e) = btrfs::commit(self.fd.as_fd()) {
            tracing::warn!(error = %e, "committing local's btrfs after a quota root was deleted");
        }
    }

    /// What the subvolume's qgroup counts, as of the last commit.
    pub(super) fn usage(&self, subvolume: u64) -> Result<Usage, Errno> {
        let counted = btrfs::qgroup(self.fd.as_fd(), subvolume)?;
        Ok(Usage {
            bytes: counted.referenced,
            inodes: 0,
        })
    }

    fn quotas_on(&self) -> Result<(), Errno> {
        let (mode, inconsistent) = btrfs::quota_mode(self.fd.as_fd())?;
        match mode {
            btrfs::QuotaMode::Off => {
                info!("turning btrfs quotas (full qgroups) on for local's filesystem");
                btrfs::enable_quota(self.fd.as_fd())?;
            }
            btrfs::QuotaMode::Simple => {
                info!("local's btrfs counts simple quotas: reflinked data is charged to the subvolume that first wrote it");
            }
            btrfs::QuotaMode::Full if inconsistent => {
                tracing::warn!("local's btrfs qgroup counts are marked inconsistent; `btrfs quota rescan` fixes them");
            }
            btrfs::QuotaMode::Full => {}
        }
        Ok(())
    }
}

impl Ledger {
    /// Whether a new root over the local directory `local` with `limit` is enforced by
    /// btrfs, as `quota_backend` asks.
    pub(super) fn wants_btrfs(
        &self,
        local: BorrowedFd<'_>,
        limit: Limit,
        shown: &str,
    ) -> Result<bool, QuotaError> {
        let on_btrfs = self.btrfs.is_some() && btrfs::is_btrfs(local);
        match self.choice {
            Choice::Fuse => Ok(false),
            Choice::Auto => Ok(on_btrfs && limit.inodes.is_none()),
            Choice::Btrfs if !on_btrfs => Err(QuotaError::Backend {
                path: shown.to_owned(),
                reason: "quota_backend=btrfs, but local is not on btrfs".into(),
            }),
            Choice::Btrfs if limit.inodes.is_some() => Err(no_inode_limits(shown)),
            Choice::Btrfs => Ok(true),
        }
    }

    /// The kernel's limit of a btrfs root is set to `bytes` (none: taken away).
    pub(super) fn kernel_limit(&self, root: &QuotaRoot, bytes: Option<u64>) -> Result<(), Errno> {
        match (root.subvolume(), &self.btrfs) {
            (Some(subvolume), Some(btrfs)) => btrfs.limit(subvolume, bytes),
            (None, _) => Ok(()),
            (Some(_), None) => Err(Errno::EOPNOTSUPP),
        }
    }

    /// What a root holds: counted by the kernel for a btrfs root, else by the ledger.
    pub(super) fn usage_of(&self, root: &QuotaRoot) -> Usage {
        match (root.subvolume(), &self.btrfs) {
            (Some(subvolume), Some(btrfs)) => btrfs.usage(subvolume).unwrap_or_else(|e| {
                tracing::warn!(path = %root.path().display(), error = %e, "reading a btrfs qgroup");
                Usage::default()
            }),
            _ => root.usage(),
        }
    }

    /// A root was removed: if it was a subvolume, its space is given back sooner.
    pub(super) fn removed_subvolume(&self) {
        if let Some(btrfs) = &self.btrfs {
            btrfs.commit();
        }
    }

    /// Makes the btrfs subvolume `local` (a directory of local's btrfs) a kernel-enforced
    /// root of `limit`: its subvolume id, once the limit is in force.
    pub(super) fn limit_subvolume(
        &self,
        local: BorrowedFd<'_>,
        limit: Limit,
        shown: &str,
    ) -> Result<u64, QuotaError> {
        let sys = |source| QuotaError::Sys {
            path: shown.to_owned(),
            source,
        };
        let btrfs = self.btrfs.as_ref().ok_or_else(|| sys(Errno::EOPNOTSUPP))?;
        let fd = store::reopen(local, OFlag::O_RDONLY | OFlag::O_DIRECTORY).map_err(sys)?;
        let subvolume = btrfs::subvolume_id(fd.as_fd()).map_err(sys)?;
        btrfs.limit(subvolume, Some(limit.bytes)).map_err(sys)?;
        Ok(subvolume)
    }
}

pub(super) fn no_inode_limits(shown: &str) -> QuotaError {
    QuotaError::Backend {
        path: shown.to_owned(),
        reason: "btrfs quotas cannot limit inodes (quota_backend=fuse can)".into(),
    }
}
