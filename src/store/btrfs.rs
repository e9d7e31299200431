//! What layerfs asks of btrfs for kernel-enforced quotas (DESIGN §6): subvolumes, their
//! qgroups and limits, through the filesystem's ioctls (no `btrfs-progs` at run time).
//!
//! A subvolume is btrfs's unit of quota: its level-0 qgroup (`0/<subvolume id>`) counts
//! every extent the subvolume references, and a limit on it makes the kernel refuse
//! allocations past it with `EDQUOT`. The qgroup of a deleted subvolume is removed by the
//! kernel once the subvolume is cleaned up.
//!
//! Counts are those of the last committed transaction: writes show in usage within one
//! commit interval (30 s by default), and [`commit`] makes them show now.

use std::ffi::CStr;
use std::os::fd::{AsRawFd, BorrowedFd};

use nix::errno::Errno;

/// `f_type` of btrfs in `statfs`.
const SUPER_MAGIC: i64 = 0x9123_683e;
/// The inode number of every subvolume's root directory.
const FIRST_FREE_OBJECTID: u64 = 256;
/// The tree that holds the qgroups.
const QUOTA_TREE: u64 = 8;
const QGROUP_STATUS_KEY: u32 = 240;
const QGROUP_INFO_KEY: u32 = 242;
const QGROUP_LIMIT_KEY: u32 = 244;
/// Status flags of the quota tree.
const STATUS_ON: u64 = 1;
const STATUS_INCONSISTENT: u64 = 1 << 2;
const STATUS_SIMPLE: u64 = 1 << 3;
const QUOTA_CTL_ENABLE: u64 = 1;
const LIMIT_MAX_RFER: u64 = 1;
/// The value that takes a limit away.
const CLEAR_LIMIT: u64 = u64::MAX;

const IOCTL_MAGIC: u8 = 0x94;
const PATH_NAME_MAX: usize = 4087;

#[repr(C)]
struct VolArgs {
    fd: i64,
    name: [u8; PATH_NAME_MAX + 1],
}

#[repr(C)]
struct InoLookupArgs {
    treeid: u64,
    objectid: u64,
    name: [u8; 4080],
}

#[repr(C)]
struct QuotaCtlArgs {
    cmd: u64,
    status: u64,
}

#[repr(C)]
#[derive(Default)]
struct QgroupLimit {
    flags: u64,
    max_rfer: u64,
    max_excl: u64,
    rsv_rfer: u64,
    rsv_excl: u64,
}

#[repr(C)]
struct QgroupLimitArgs {
    qgroupid: u64,
    lim: QgroupLimit,
}

#[repr(C)]
struct QgroupCreateArgs {
    create: u64,
    qgroupid: u64,
}

#[repr(C)]
#[derive(Default, Clone, Copy)]
struct SearchKey {
    tree_id: u64,
    min_objectid: u64,
    max_objectid: u64,
    min_offset: u64,
    max_offset: u64,
    min_transid: u64,
    max_transid: u64,
    min_type: u32,
    max_type: u32,
    nr_items: u32,
    unused: u32,
    unused1: u64,
    unused2: u64,
    unused3: u64,
    unused4: u64,
}

const SEARCH_BUF: usize = 4096 - std::mem::size_of::<SearchKey>();

#[repr(C)]
struct SearchArgs {
    key: SearchKey,
    buf: [u8; SEARCH_BUF],
}

/// The header of each item a tree search returns, followed by `len` bytes of item.
const SEARCH_HEADER: usize = 32;

nix::ioctl_write_ptr!(subvol_create, IOCTL_MAGIC, 14, VolArgs);
nix::ioctl_readwrite!(ino_lookup, IOCTL_MAGIC, 18, InoLookupArgs);
nix::ioctl_readwrite!(tree_search, IOCTL_MAGIC, 17, SearchArgs);
nix::ioctl_readwrite!(quota_ctl, IOCTL_MAGIC, 40, QuotaCtlArgs);
// Declared `_IOR` by the kernel, though it only reads what it is given.
nix::ioctl_read!(qgroup_limit, IOCTL_MAGIC, 43, QgroupLimitArgs);
nix::ioctl_write_ptr!(qgroup_create, IOCTL_MAGIC, 42, QgroupCreateArgs);
nix::ioctl_none!(quota_rescan_wait, IOCTL_MAGIC, 46);
nix::ioctl_none!(sync, IOCTL_MAGIC, 8);

/// Whether `fd` is on btrfs.
pub fn is_btrfs(fd: BorrowedFd<'_>) -> bool {
    nix::sys::statfs::fstatfs(fd).is_ok_and(|st| st.filesystem_type().0 == SUPER_MAGIC)
}

/// Whether the btrfs directory stat'ed as `st` is the root of a subvolume.
pub fn is_subvolume(st: &libc::stat) -> bool {
    st.st_ino == FIRST_FREE_OBJECTID && st.st_mode & libc::S_IFMT == libc::S_IFDIR
}

/// Makes the subvolume `name` in the directory `dir` (mode 0755, owned by the caller).
pub fn create_subvolume(dir: BorrowedFd<'_>, name: &CStr) -> Result<(), Errno> {
    let bytes = name.to_bytes();
    if bytes.len() > PATH_NAME_MAX || bytes.contains(&b'/') {
        return Err(Errno::EINVAL);
    }
    let mut args = VolArgs {
        fd: 0,
        name: [0; PATH_NAME_MAX + 1],
    };
    args.name[..bytes.len()].copy_from_slice(bytes);
    // SAFETY: `args` is a valid, NUL-terminated `btrfs_ioctl_vol_args`.
    unsafe { subvol_create(dir.as_raw_fd(), &args) }.map(drop)
}

/// The id of the subvolume `fd` is in; its qgroup is `0/<id>`, which is the number itself.
pub fn subvolume_id(fd: BorrowedFd<'_>) -> Result<u64, Errno> {
    let mut args = InoLookupArgs {
        treeid: 0,
        objectid: FIRST_FREE_OBJECTID,
        name: [0; 4080],
    };
    // SAFETY: `args` is a valid `btrfs_ioctl_ino_lookup_args` the kernel fills in.
    unsafe { ino_lookup(fd.as_raw_fd(), &mut args) }?;
    Ok(args.treeid)
}

/// How the filesystem counts quotas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuotaMode {
    Off,
    /// Full qgroups: every extent counted for every subvolume that references it.
    Full,
    /// Simple quotas: an extent counted only for the subvolume that allocated it.
    Simple,
}

/// Whether quotas are on, and how. `inconsistent` counts need a rescan to be trusted.
pub fn quota_mode(fd: BorrowedFd<'_>) -> Result<(QuotaMode, bool), Errno> {
    let items = match search(fd, QGROUP_STATUS_KEY, 0, 0) {
        Ok(items) => items,
        // No quota tree: quotas were never enabled (or were disabled).
        Err(Errno::ENOENT) => return Ok((QuotaMode::Off, false)),
        Err(e) => return Err(e),
    };
    let Some(item) = items.first() else {
        return Ok((QuotaMode::Off, false));
    };
    // btrfs_qgroup_status_item: version, generation, flags, rescan (little-endian).
    let flags = le64(item, 16).ok_or(Errno::EIO)?;
    let mode = match (flags & STATUS_ON != 0, flags & STATUS_SIMPLE != 0) {
        (false, _) => QuotaMode::Off,
        (true, false) => QuotaMode::Full,
        (true, true) => QuotaMode::Simple,
    };
    Ok((mode, flags & STATUS_INCONSISTENT != 0))
}

/// Turns full qgroups on for the filesystem of `fd` and waits for the first count of what
/// it already holds.
pub fn enable_quota(fd: BorrowedFd<'_>) -> Result<(), Errno> {
    let mut args = QuotaCtlArgs {
        cmd: QUOTA_CTL_ENABLE,
        status: 0,
    };
    // SAFETY: `args` is a valid `btrfs_ioctl_quota_ctl_args`.
    unsafe { quota_ctl(fd.as_raw_fd(), &mut args) }?;
    // SAFETY: takes no argument.
    unsafe { quota_rescan_wait(fd.as_raw_fd()) }.map(drop)
}

/// Limits the referenced bytes of the qgroup `0/<subvolume>` to `bytes`, or takes its limit
/// away.
pub fn set_limit(fd: BorrowedFd<'_>, subvolume: u64, bytes: Option<u64>) -> Result<(), Errno> {
    let mut args = QgroupLimitArgs {
        qgroupid: subvolume,
        lim: QgroupLimit {
            flags: LIMIT_MAX_RFER,
            max_rfer: bytes.unwrap_or(CLEAR_LIMIT),
            ..Default::default()
        },
    };
    // SAFETY: `args` is a valid `btrfs_ioctl_qgroup_limit_args`.
    unsafe { qgroup_limit(fd.as_raw_fd(), &mut args) }.map(drop)
}

/// What a subvolume's qgroup counts, as of the last commit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Qgroup {
    /// Bytes of every extent the subvolume references.
    pub referenced: u64,
    /// Of them, the bytes no other subvolume references.
    pub exclusive: u64,
    /// The limit on referenced bytes, if any.
    pub limit: Option<u64>,
}

/// The counts of the qgroup `0/<subvolume>`; `ENOENT` if there is none.
pub fn qgroup(fd: BorrowedFd<'_>, subvolume: u64) -> Result<Qgroup, Errno> {
    let info = search(fd, QGROUP_INFO_KEY, subvolume, subvolume)?;
    let info = info.first().ok_or(Errno::ENOENT)?;
    // btrfs_qgroup_info_item: generation, rfer, rfer_cmpr, excl, excl_cmpr.
    let mut found = Qgroup {
        referenced: le64(info, 8).ok_or(Errno::EIO)?,
        exclusive: le64(info, 24).ok_or(Errno::EIO)?,
        limit: None,
    };
    // btrfs_qgroup_limit_item: flags, max_rfer, max_excl, rsv_rfer, rsv_excl.
    if let Some(limit) = search(fd, QGROUP_LIMIT_KEY, subvolume, subvolume)?.first() {
        let flags = le64(limit, 0).ok_or(Errno::EIO)?;
        if flags & LIMIT_MAX_RFER != 0 {
            found.limit = le64(limit, 8);
        }
    }
    Ok(found)
}

/// Removes the qgroup `0/<subvolume>` of a deleted subvolume: `EBUSY` while the
/// subvolume is still being cleaned up, `ENOENT` once there is none.
pub fn remove_qgroup(fd: BorrowedFd<'_>, subvolume: u64) -> Result<(), Errno> {
    let args = QgroupCreateArgs {
        create: 0,
        qgroupid: subvolume,
    };
    // SAFETY: `args` is a valid `btrfs_ioctl_qgroup_create_args`.
    unsafe { qgroup_create(fd.as_raw_fd(), &args) }.map(drop)
}

/// Commits the filesystem's transaction, so that qgroup counts include every write so far.
pub fn commit(fd: BorrowedFd<'_>) -> Result<(), Errno> {
    // SAFETY: takes no argument.
    unsafe { sync(fd.as_raw_fd()) }.map(drop)
}

/// The items of the quota tree of type `kind` keyed `(0, kind, offset)` with `offset` in
/// `from..=to`.
fn search(fd: BorrowedFd<'_>, kind: u32, from: u64, to: u64) -> Result<Vec<Vec<u8>>, Errno> {
    let mut args = SearchArgs {
        key: SearchKey {
            tree_id: QUOTA_TREE,
            min_objectid: 0,
            max_objectid: 0,
            min_offset: from,
            max_offset: to,
            min_transid: 0,
            max_transid: u64::MAX,
            min_type: kind,
            max_type: kind,
            nr_items: 16,
            ..Default::default()
        },
        buf: [0; SEARCH_BUF],
    };
    // SAFETY: `args` is a valid `btrfs_ioctl_search_args` the kernel fills in.
    unsafe { tree_search(fd.as_raw_fd(), &mut args) }?;
    let mut items = Vec::new();
    let mut at = 0;
    for _ in 0..args.key.nr_items {
        let header = args.buf.get(at..at + SEARCH_HEADER).ok_or(Errno::EIO)?;
        let kind_found = u32::from_ne_bytes(header[24..28].try_into().expect("4 bytes"));
        let len = u32::from_ne_bytes(header[28..32].try_into().expect("4 bytes")) as usize;
        let body = at + SEARCH_HEADER;
        let item = args.buf.get(body..body + len).ok_or(Errno::EIO)?;
        if kind_found == kind {
            items.push(item.to_vec());
        }
        at = body + len;
    }
    Ok(items)
}

fn le64(item: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(item.get(at..at + 8)?.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_arguments_have_the_kernel_sizes() {
        assert_eq!(std::mem::size_of::<VolArgs>(), 4096);
        assert_eq!(std::mem::size_of::<InoLookupArgs>(), 4096);
        assert_eq!(std::mem::size_of::<SearchArgs>(), 4096);
        assert_eq!(std::mem::size_of::<SearchKey>(), 104);
        assert_eq!(std::mem::size_of::<QgroupLimitArgs>(), 48);
    }

    #[test]
    fn other_filesystems_are_not_btrfs() {
        let dir = tempfile::tempdir().unwrap();
        let fd = std::fs::File::open(dir.path()).unwrap();
        if is_btrfs(std::os::fd::AsFd::as_fd(&fd)) {
            return;
        }
        assert!(subvolume_id(std::os::fd::AsFd::as_fd(&fd)).is_err());
    }
}
