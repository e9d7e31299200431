//! Quotas on read-write directories of the view (DESIGN §6), after containerd's universal
//! snapshot-quota design.
//!
//! The view reaches quotas through one trait, [`Accounting`] (see [`seam`] for the story
//! of a call), implemented by [`Ledger`]; everything else here is behind it:
//!
//! - [`seam`]: the trait, [`Object`] (what it needs of the view's objects, which the view
//!   implements) and the values they exchange.
//! - `ledger`: the accounting of one mount.
//! - `charge`: which root an object is under, and what is charged and credited to it.
//! - `io`: what a call may allocate, estimated before it runs.
//! - `table`: the live quota roots of a mount, their limits and usage, and the
//!   reservations calls take against them.
//! - `roots`: setting and clearing roots, and their registry saved and loaded.
//! - `backend`, `kernel`, `qgroups`: roots the kernel enforces (btrfs subvolumes with a qgroup limit), which
//!   the data path leaves alone.
//! - `persist`: the registry of quota roots kept in local.
//! - `scan`: usage recomputed from local at mount (and when a quota is set), so that a
//!   crash never leaves it wrong.
//! - [`size`]: the size strings users and containerd labels give.
//! - [`storage`]: the one place that decides what happens to a `storage {size,
//!   ignore_failed}` request, over snapshotter backends that do or do not support quotas.
//!
//! Usage is allocated space (`st_blocks`), so sparse holes are free until written, as with
//! XFS project quotas. Quota roots do not nest: a quota cannot be set inside, or above,
//! another quota root.
//!
//! ## Locks
//! Taken in the view's lock order (see `view`): the change lock
//! (`table::Quotas::lock_changes`) serializes setting, clearing and moving roots and numbers
//! the snapshots of the registry taken under it, and is taken with no object's state
//! locked; under it, objects' states are locked ([`Object::tally`]) for reading and
//! updating alone. Snapshots are written to local under a lock of their own
//! (`Ledger::written`), never under the change lock: a write waits for the disk, and
//! every directory rename takes the change lock while any root exists. Setting and
//! clearing a root run one at a time (`Ledger::settling`, taken first and held to the
//! end, the usage scan of a new root included: no request but another setting or clearing
//! waits for it); they take `written` before the change lock, and hold it until their
//! change is saved (or taken back, when it cannot be). The table of roots
//! and each root's path are leaves; limits, usage and reservations are atomics. A file's
//! measuring lock ([`Object::measuring`]) is taken before its state, never while the change
//! lock is held.

mod backend;
mod charge;
mod error;
mod io;
mod kernel;
mod ledger;
mod persist;
mod qgroups;
mod restore;
mod roots;
mod scan;
pub mod seam;
pub mod size;
pub mod storage;
mod table;

pub use backend::{Backend, Choice};
pub use error::QuotaError;
pub use ledger::Ledger;
pub use roots::QUOTA_XATTR;
pub use seam::{
    Accounting, Allocated, Charge, Charged, Gone, Move, Need, Object, Opens, Reserved, Tally, Under,
};
pub use table::{Limit, Usage};

/// What the tree under `dir` uses, counted as a quota root's usage is (allocated bytes and
/// inodes, hard links once, never leaving its filesystem): for tools that measure a
/// directory the way a quota would, such as the containerd snapshotter's Usage.
pub fn measure(dir: std::os::fd::BorrowedFd<'_>) -> Result<Usage, nix::errno::Errno> {
    scan::usage(dir)
}
