//! The quota roots of one mount: limits, usage, and the reservations that keep concurrent
//! allocations from overshooting a limit.
//!
//! A call that allocates takes a [`Reservation`] for its estimate, which fits only while
//! `used + reserved + estimate` stays within the limit, and [`QuotaRoot::charge`]s what
//! it measured before dropping it (the whole story is in [`super::seam`]).
//!
//! Roots are found by the local directory's `(dev, ino)`, which survives renames.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use nix::errno::Errno;
use parking_lot::{Mutex, RwLock};

use super::backend::Backend;
use crate::report::QuotaInfo;

/// No inode limit.
const UNLIMITED: u64 = u64::MAX;

/// What a root may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    /// Bytes of allocated space.
    pub bytes: u64,
    /// Inodes, when limited.
    pub inodes: Option<u64>,
}

/// What a root holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub bytes: u64,
    pub inodes: u64,
}

/// One quota root.
#[derive(Debug)]
pub struct QuotaRoot {
    /// The local directory's identity.
    pub dev: u64,
    pub ino: u64,
    /// Relative to the local root (and the mountpoint); kept current across renames.
    path: Mutex<PathBuf>,
    limit: AtomicU64,
    inode_limit: AtomicU64,
    used: AtomicU64,
    reserved: AtomicU64,
    inodes: AtomicU64,
    reserved_inodes: AtomicU64,
    errno: Errno,
    /// Whether the registry lists it: not while it is being set (until its usage is
    /// counted and saved) or cleared (until the registry without it is saved). It is
    /// enforced either way; see `Ledger::save_change`.
    listed: AtomicBool,
    /// For a root the kernel enforces (see `super::kernel`): the btrfs subvolume it is.
    subvolume: Option<u64>,
}

impl QuotaRoot {
    pub fn new(
        dev: u64,
        ino: u64,
        path: PathBuf,
        limit: Limit,
        usage: Usage,
        errno: Errno,
    ) -> Self {
        QuotaRoot {
            dev,
            ino,
            path: Mutex::new(path),
            limit: AtomicU64::new(limit.bytes),
            inode_limit: AtomicU64::new(limit.inodes.unwrap_or(UNLIMITED)),
            used: AtomicU64::new(usage.bytes),
            reserved: AtomicU64::new(0),
            inodes: AtomicU64::new(usage.inodes),
            reserved_inodes: AtomicU64::new(0),
            errno,
            listed: AtomicBool::new(true),
            subvolume: None,
        }
    }

    /// The root is the btrfs subvolume `id`, whose qgroup the kernel enforces its limit
    /// with: the data path leaves it alone.
    pub fn enforced_by_btrfs(mut self, id: u64) -> Self {
        self.subvolume = Some(id);
        self
    }

    /// The btrfs subvolume of a root the kernel enforces.
    pub fn subvolume(&self) -> Option<u64> {
        self.subvolume
    }

    /// Whether the kernel enforces this root's limit, not the daemon.
    pub fn by_kernel(&self) -> bool {
        self.subvolume.is_some()
    }

    pub fn backend(&self) -> Backend {
        match self.subvolume {
            Some(_) => Backend::Btrfs,
            None => Backend::Fuse,
        }
    }

    pub fn is_listed(&self) -> bool {
        self.listed.load(Ordering::Relaxed)
    }

    pub fn set_listed(&self, listed: bool) {
        self.listed.store(listed, Ordering::Relaxed);
    }

    pub fn path(&self) -> PathBuf {
        self.path.lock().clone()
    }

    pub fn set_path(&self, path: PathBuf) {
        *self.path.lock() = path;
    }

    pub fn limit(&self) -> Limit {
        let inodes = self.inode_limit.load(Ordering::Relaxed);
        Limit {
            bytes: self.limit.load(Ordering::Relaxed),
            inodes: (inodes != UNLIMITED).then_some(inodes),
        }
    }

    /// Sets the limit; returns the one it replaces.
    pub fn set_limit(&self, limit: Limit) -> Limit {
        let old = self.limit();
        self.limit.store(limit.bytes, Ordering::Relaxed);
        self.inode_limit
            .store(limit.inodes.unwrap_or(UNLIMITED), Ordering::Relaxed);
        old
    }

    pub fn usage(&self) -> Usage {
        Usage {
            bytes: self.used.load(Ordering::Relaxed),
            inodes: self.inodes.load(Ordering::Relaxed),
        }
    }

    /// The error an allocation over the limit fails with.
    pub fn exceeded(&self) -> Errno {
        self.errno
    }

    /// Bytes that may still be reserved.
    pub fn room(&self) -> u64 {
        let taken = self.used.load(Ordering::Acquire) + self.reserved.load(Ordering::Acquire);
        self.limit.load(Ordering::Relaxed).saturating_sub(taken)
    }

    /// Sets `bytes` aside for a call about to allocate, or fails with the quota's errno if
    /// they do not fit. Nothing always fits: overwriting allocated data, shrinking and
    /// punching holes work even over the limit (after the limit was lowered).
    pub fn reserve(self: &Arc<Self>, bytes: u64) -> Result<Reservation, Errno> {
        self.reserve_with_inodes(bytes, 0)
    }

    /// Like [`QuotaRoot::reserve`], with `inodes` new inodes set aside too (when there is
    /// an inode limit).
    pub fn reserve_with_inodes(
        self: &Arc<Self>,
        bytes: u64,
        inodes: u64,
    ) -> Result<Reservation, Errno> {
        let inode_limit = self.inode_limit.load(Ordering::Relaxed);
        set_aside(&self.reserved_inodes, &self.inodes, inodes, inode_limit).ok_or(self.errno)?;
        let mut reservation = Reservation {
            root: self.clone(),
            bytes: 0,
            inodes,
        };
        let limit = self.limit.load(Ordering::Relaxed);
        set_aside(&self.reserved, &self.used, bytes, limit).ok_or(self.errno)?;
        reservation.bytes = bytes;
        Ok(reservation)
    }

    /// Records a change of allocated bytes (negative: freed).
    pub fn charge(&self, delta: i64) {
        add_signed(&self.used, delta);
    }

    /// Records a change of the inode count.
    pub fn charge_inodes(&self, delta: i64) {
        add_signed(&self.inodes, delta);
    }

    /// Described with `usage` (see `Ledger::describe`).
    pub fn info(&self, usage: Usage) -> QuotaInfo {
        let limit = self.limit();
        QuotaInfo {
            backend: self.backend().name().to_owned(),
            path: self.path().to_string_lossy().into_owned(),
            limit: limit.bytes,
            used: usage.bytes,
            available: limit.bytes.saturating_sub(usage.bytes),
            inode_limit: limit.inodes,
            inodes_used: usage.inodes,
        }
    }
}

/// Adds `amount` to `reserved` if `used + reserved + amount` stays within `limit`; an
/// amount of zero always fits.
fn set_aside(reserved: &AtomicU64, used: &AtomicU64, amount: u64, limit: u64) -> Option<()> {
    if amount == 0 {
        return Some(());
    }
    let mut now = reserved.load(Ordering::Acquire);
    loop {
        let taken = used.load(Ordering::Acquire).saturating_add(now);
        if taken.saturating_add(amount) > limit {
            return None;
        }
        match reserved.compare_exchange_weak(now, now + amount, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => return Some(()),
            Err(seen) => now = seen,
        }
    }
}

/// Adds a signed delta to a counter, never going below zero (a credit for space that was
/// allocated before the count began must not wrap around).
fn add_signed(counter: &AtomicU64, delta: i64) {
    let _ = counter.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
        Some(if delta >= 0 {
            v.saturating_add(delta as u64)
        } else {
            v.saturating_sub(delta.unsigned_abs())
        })
    });
}

/// Space set aside for one call in flight; given back when dropped (after the call has
/// charged what it really allocated).
#[derive(Debug)]
pub struct Reservation {
    root: Arc<QuotaRoot>,
    bytes: u64,
    inodes: u64,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.root.reserved.fetch_sub(self.bytes, Ordering::AcqRel);
        self.root
            .reserved_inodes
            .fetch_sub(self.inodes, Ordering::AcqRel);
    }
}

/// All quota roots of a mount.
#[derive(Debug)]
pub struct Quotas {
    roots: RwLock<HashMap<(u64, u64), Arc<QuotaRoot>>>,
    /// Lets the data path skip every quota question while there is no root.
    any: AtomicBool,
    /// Bumped whenever the answer to "which root is this node under" may change (a root
    /// set or cleared, a rename): nodes cache that answer with the generation it holds for.
    generation: AtomicU64,
    errno: Errno,
    /// Serializes changes to the set of roots; holds the number of the last snapshot of
    /// the registry taken, so that snapshots are numbered in the order of the changes.
    changes: Mutex<u64>,
}

impl Quotas {
    /// `errno` is what allocations over a limit fail with: `ENOSPC` or `EDQUOT`.
    pub fn new(errno: Errno) -> Quotas {
        Quotas {
            roots: RwLock::new(HashMap::new()),
            any: AtomicBool::new(false),
            generation: AtomicU64::new(1),
            errno,
            changes: Mutex::new(0),
        }
    }

    pub fn errno(&self) -> Errno {
        self.errno
    }

    pub fn is_empty(&self) -> bool {
        !self.any.load(Ordering::Acquire)
    }

    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Invalidates every node's cached root.
    pub fn bump(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// The root whose local directory is `(dev, ino)`.
    pub fn root(&self, dev: u64, ino: u64) -> Option<Arc<QuotaRoot>> {
        if self.is_empty() {
            return None;
        }
        self.roots.read().get(&(dev, ino)).cloned()
    }

    /// Every root, by path.
    pub fn list(&self) -> Vec<Arc<QuotaRoot>> {
        let mut roots: Vec<_> = self.roots.read().values().cloned().collect();
        roots.sort_by_key(|r| r.path());
        roots
    }

    pub fn insert(&self, root: Arc<QuotaRoot>) {
        self.roots.write().insert((root.dev, root.ino), root);
        self.any.store(true, Ordering::Release);
        self.bump();
    }

    pub fn remove(&self, dev: u64, ino: u64) -> Option<Arc<QuotaRoot>> {
        let mut roots = self.roots.write();
        let gone = roots.remove(&(dev, ino));
        self.any.store(!roots.is_empty(), Ordering::Release);
        drop(roots);
        self.bump();
        gone
    }

    /// Holds off other changes to the set of roots while held.
    pub fn lock_changes(&self) -> parking_lot::MutexGuard<'_, u64> {
        self.changes.lock()
    }

    /// The roots at or under `dir` (relative paths, component-wise).
    pub fn roots_under(&self, dir: &Path) -> Vec<Arc<QuotaRoot>> {
        self.roots
            .read()
            .values()
            .filter(|r| r.path().starts_with(dir))
            .cloned()
            .collect()
    }

    /// Directories moved, each `(from, to)`, all at once (an exchange swaps two): roots at
    /// or under one move with it. Returns whether any did.
    pub fn moved(&self, moves: &[(PathBuf, PathBuf)]) -> bool {
        let mut any = false;
        for root in self.roots.read().values() {
            let path = root.path();
            let new = moves.iter().find_map(|(from, to)| {
                let rest = path.strip_prefix(from).ok()?;
                Some(if rest.as_os_str().is_empty() {
                    to.clone()
                } else {
                    to.join(rest)
                })
            });
            if let Some(new) = new {
                root.set_path(new);
                any = true;
            }
        }
        any
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root(limit: u64, used: u64) -> Arc<QuotaRoot> {
        Arc::new(QuotaRoot::new(
            1,
            2,
            "overlay/c1".into(),
            Limit {
                bytes: limit,
                inodes: Some(3),
            },
            Usage {
                bytes: used,
                inodes: 1,
            },
            Errno::ENOSPC,
        ))
    }

    #[test]
    fn reservations_share_the_room_and_give_it_back() {
        let r = root(10_000, 4_096);
        let a = r.reserve(4_096).unwrap();
        assert_eq!(r.room(), 1_808);
        assert_eq!(r.reserve(4_096).unwrap_err(), Errno::ENOSPC);
        r.charge(4_096);
        drop(a);
        assert_eq!(r.usage().bytes, 8_192);
        assert_eq!(r.room(), 1_808);
        assert!(r.reserve(1_808).is_ok());
        assert!(r.reserve(0).is_ok());
    }

    #[test]
    fn a_root_over_its_limit_admits_nothing() {
        let r = root(0, 4_096);
        assert_eq!(r.reserve(1).unwrap_err(), Errno::ENOSPC);
        assert!(r.reserve(0).is_ok());
        assert_eq!(r.room(), 0);
        assert_eq!(r.info(r.usage()).available, 0);
    }

    #[test]
    fn credits_never_wrap() {
        let r = root(10_000, 100);
        r.charge(-4_096);
        assert_eq!(r.usage().bytes, 0);
        r.charge_inodes(-5);
        assert_eq!(r.usage().inodes, 0);
    }

    #[test]
    fn inode_limit() {
        // Limit 3, one in use.
        let r = root(10_000, 0);
        let a = r.reserve_with_inodes(0, 1).unwrap();
        let b = r.reserve_with_inodes(0, 1).unwrap();
        assert_eq!(r.reserve_with_inodes(0, 1).unwrap_err(), Errno::ENOSPC);
        // A refused byte reservation gives its inodes back.
        drop(b);
        assert_eq!(r.reserve_with_inodes(20_000, 1).unwrap_err(), Errno::ENOSPC);
        assert!(r.reserve_with_inodes(0, 1).is_ok());
        drop(a);
        r.set_limit(Limit {
            bytes: 10_000,
            inodes: None,
        });
        assert!(r.reserve_with_inodes(0, 1_000_000).is_ok());
    }

    #[test]
    fn concurrent_reservations_never_exceed_the_limit() {
        let r = root(1 << 20, 0);
        let granted = AtomicU64::new(0);
        let held = Mutex::new(Vec::new());
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    while let Ok(res) = r.reserve(4_096) {
                        granted.fetch_add(4_096, Ordering::Relaxed);
                        held.lock().push(res);
                    }
                });
            }
        });
        assert_eq!(granted.load(Ordering::Relaxed), 1 << 20);
    }

    #[test]
    fn roots_move_with_their_directories() {
        let q = Quotas::new(Errno::EDQUOT);
        assert!(q.is_empty());
        let g = q.generation();
        q.insert(root(1, 0));
        assert!(!q.is_empty());
        assert!(q.generation() > g);
        let moving = |from: &str, to: &str| (PathBuf::from(from), PathBuf::from(to));
        assert!(q.moved(&[moving("overlay", "old/overlay")]));
        assert_eq!(q.root(1, 2).unwrap().path(), Path::new("old/overlay/c1"));
        assert!(!q.moved(&[moving("overlay/c", "x")]));
        // An exchange: both moves apply to the paths from before it.
        assert!(q.moved(&[moving("old/overlay/c1", "b"), moving("b", "old/overlay/c1")]));
        assert_eq!(q.root(1, 2).unwrap().path().as_os_str(), "b");
        assert_eq!(q.roots_under(Path::new("b")).len(), 1);
        assert!(q.roots_under(Path::new("old")).is_empty());
        q.remove(1, 2);
        assert!(q.is_empty());
    }
}
