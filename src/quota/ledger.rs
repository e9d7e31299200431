//! [`Ledger`]: the quota accounting of one mount, behind [`Accounting`].

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use nix::errno::Errno;
use parking_lot::Mutex;

use super::backend::Choice;
use super::error::QuotaError;
use super::qgroups::Qgroups;
use super::restore;
use super::scan::block_size;
use super::seam::{Accounting, Charge, Charged, Gone, Move, Need, Object, Reserved, Under};
use super::table::{Limit, QuotaRoot, Quotas};
use crate::report::QuotaInfo;

/// The quota roots of a mount over the local tree, with their registry in it.
#[derive(Debug)]
pub struct Ledger {
    pub(super) quotas: Quotas,
    /// Local's root, where the registry is kept.
    pub(super) local: Arc<OwnedFd>,
    /// The block size of local's filesystem: what a new directory costs at least.
    pub(super) block: u64,
    /// The number of the newest snapshot of the registry on disk; held while one is
    /// written (see `roots::Snapshot`).
    pub(super) written: Mutex<u64>,
    /// Held by each setting or clearing of a root from start to end, so that one sees a
    /// root as the last left it: two clears at once would both succeed, and a limit
    /// changed on a root another call is still setting (or clearing) could be lost.
    pub(super) settling: Mutex<()>,
    /// Which backend new roots get.
    pub(super) choice: Choice,
    /// btrfs's quotas, when local is on btrfs.
    pub(super) btrfs: Option<Qgroups>,
}

impl Ledger {
    /// No roots yet, over the local root `local` (stat'ed as `local_st`); allocations over
    /// a limit will fail with `ENOSPC`.
    pub fn new(local: Arc<OwnedFd>, local_st: &libc::stat) -> Ledger {
        Ledger {
            quotas: Quotas::new(Errno::ENOSPC),
            block: block_size(local_st),
            written: Mutex::new(0),
            settling: Mutex::new(()),
            choice: Choice::Auto,
            btrfs: Qgroups::of(local.as_fd()),
            local,
        }
    }

    /// Loads the roots from the registry in local and recounts their usage from disk, so
    /// that a crash (whose last counts were never saved) leaves nothing wrong; before the
    /// mount is served. `errno` is what allocations over a limit fail with, `ENOSPC` or
    /// `EDQUOT` (with the FUSE backend); `choice` the backend new roots get. Returns how
    /// many roots there are.
    pub fn load(&mut self, errno: Errno, choice: Choice) -> Result<usize, QuotaError> {
        self.quotas = Quotas::new(errno);
        self.choice = choice;
        restore::load(&self.quotas, self.local.as_fd(), self.btrfs.as_ref())
    }

    /// The btrfs subvolumes of the roots the kernel enforces: device and subvolume id.
    pub fn subvolumes(&self) -> Vec<(u64, u64)> {
        self.quotas
            .list()
            .iter()
            .filter_map(|r| Some((r.dev, r.subvolume()?)))
            .collect()
    }

    /// A root as users see it, with its usage as its backend counts it.
    pub(super) fn describe(&self, root: &QuotaRoot) -> QuotaInfo {
        root.info(self.usage_of(root))
    }
}

impl<O: Object> Accounting<O> for Ledger {
    fn under(&self, obj: &Arc<O>) -> Under {
        Under(self.root_of(obj))
    }

    fn reserve(&self, under: &Under, need: Need<'_>) -> Result<Reserved, Errno> {
        self.set_aside(under, need)
    }

    fn charge(&self, under: &Under, change: Charge<'_, O>) -> Charged {
        let Some(root) = under.0.as_ref().filter(|r| !r.by_kernel()) else {
            if let Charge::Moved { plan, .. } = change {
                plan.commit();
            }
            return Charged::default();
        };
        let bytes = self.charge_to(root, change);
        let (limit, usage) = (root.limit(), root.usage());
        Charged {
            bytes,
            over: (usage.bytes > limit.bytes).then(|| root.exceeded()),
        }
    }

    fn credit(&self, gone: Gone<'_, O>) {
        match gone {
            Gone::Name { from, obj, st } => self.credit_name(from, obj, st),
            Gone::Open { obj, fd } => self.credit_close(obj, fd),
        }
    }

    fn statfs(&self, under: &Under, mut st: libc::statvfs) -> libc::statvfs {
        let Some(root) = &under.0 else {
            return st;
        };
        let (limit, usage) = (root.limit(), self.usage_of(root));
        // statvfs counts are 64-bit on every target layerfs builds for.
        let unit = st.f_frsize.max(1);
        let free = (limit.bytes.saturating_sub(usage.bytes) / unit).min(st.f_bavail);
        st.f_blocks = limit.bytes / unit;
        st.f_bfree = free;
        st.f_bavail = free;
        if let Some(inodes) = limit.inodes {
            let free = inodes.saturating_sub(usage.inodes).min(st.f_ffree);
            st.f_files = inodes;
            st.f_ffree = free;
            st.f_favail = free;
        }
        st
    }

    fn may_passthrough(&self, obj: &Arc<O>) -> bool {
        // The kernel counts what passthrough writes, for a root it enforces.
        self.root_of(obj).is_none_or(|root| root.by_kernel())
    }

    fn plan_move(
        &self,
        obj: &Arc<O>,
        from: &Arc<O>,
        to: &Arc<O>,
        exchanged: Option<&Arc<O>>,
    ) -> Result<Move<O>, Errno> {
        self.plan(obj, from, to, exchanged)
    }

    fn renamed(&self, plan: Move<O>) {
        self.moved(plan)
    }

    fn root(&self, dir: &O) -> Option<QuotaInfo> {
        self.own_root(dir).map(|r| self.describe(&r))
    }

    fn set(
        &self,
        dir: &Arc<O>,
        local: impl FnOnce() -> Result<Arc<OwnedFd>, Errno>,
        subvolume: impl FnOnce() -> Result<Arc<OwnedFd>, QuotaError>,
        limit: Limit,
        live: impl FnOnce() -> Vec<Arc<O>>,
    ) -> Result<QuotaInfo, QuotaError> {
        self.set_root(dir, local, subvolume, limit, live)
    }

    fn clear(&self, dir: &O) -> Result<QuotaInfo, QuotaError> {
        self.clear_root(dir)
    }

    fn list(&self) -> Vec<QuotaInfo> {
        self.quotas
            .list()
            .iter()
            .map(|r| self.describe(r))
            .collect()
    }
}
