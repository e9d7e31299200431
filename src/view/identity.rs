//! What a node is, before it has a number: its identity in local, in the remote or in the
//! synthesized layout, and the bits that keep the numbers of each kind apart.

use std::ffi::OsString;

/// The root's number, fixed by the FUSE protocol.
pub const ROOT_INO: u64 = 1;
/// Set in the numbers of remote objects.
pub const REMOTE_BIT: u64 = 1 << 62;
/// Set in numbers handed out from the counter.
pub const COUNTER_BIT: u64 = 1 << 63;
/// Set in the numbers of objects in the btrfs subvolumes of quota roots (see
/// `quota::kernel`), with the subvolume's id above [`SUBVOLUME_INO_BITS`] bits of inode
/// number: each subvolume numbers its inodes from 256 again.
pub const SUBVOLUME_BIT: u64 = 1 << 61;
pub const SUBVOLUME_INO_BITS: u32 = 40;

/// Whether a number is an inode number of local's own filesystem, whose object the file
/// handle records find again (see `exports`).
pub fn is_local_number(ino: u64) -> bool {
    ino & (REMOTE_BIT | COUNTER_BIT | SUBVOLUME_BIT) == 0
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Identity {
    Local {
        dev: u64,
        ino: u64,
    },
    Remote {
        dev: u64,
        ino: u64,
    },
    /// One name of a remote non-directory with several links. Copy-up gives each name its
    /// own local file (overlayfs without `index` does the same), so each name must be its
    /// own node from the start: a shared node would show one name's copy through the other
    /// for as long as the kernel happens to cache it.
    RemoteName {
        parent: u64,
        name: OsString,
    },
    Virtual {
        parent: u64,
        name: OsString,
    },
}

pub fn local_identity(st: &libc::stat) -> Identity {
    Identity::Local {
        dev: st.st_dev,
        ino: st.st_ino,
    }
}
