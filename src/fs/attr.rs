//! From on-disk attributes to what the FUSE protocol carries.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{FileAttr, FileType, INodeNo};

use crate::store::Kind;
use crate::view::Stat;

pub fn file_type(kind: Kind) -> FileType {
    match kind {
        Kind::File => FileType::RegularFile,
        Kind::Dir => FileType::Directory,
        Kind::Symlink => FileType::Symlink,
        Kind::Fifo => FileType::NamedPipe,
        Kind::Socket => FileType::Socket,
        Kind::CharDev => FileType::CharDevice,
        Kind::BlockDev => FileType::BlockDevice,
    }
}

fn time(sec: i64, nsec: i64) -> SystemTime {
    let nsec = nsec.clamp(0, 999_999_999) as u32;
    if sec >= 0 {
        UNIX_EPOCH + Duration::new(sec as u64, nsec)
    } else {
        UNIX_EPOCH - Duration::new(sec.unsigned_abs(), 0) + Duration::new(0, nsec)
    }
}

pub fn file_attr(st: &Stat) -> FileAttr {
    FileAttr {
        ino: INodeNo(st.st_ino),
        size: st.st_size as u64,
        blocks: st.st_blocks as u64,
        atime: time(st.st_atime, st.st_atime_nsec),
        mtime: time(st.st_mtime, st.st_mtime_nsec),
        ctime: time(st.st_ctime, st.st_ctime_nsec),
        crtime: UNIX_EPOCH,
        kind: file_type(Kind::from_mode(st.st_mode)),
        perm: (st.st_mode & 0o7777) as u16,
        nlink: st.st_nlink as u32,
        uid: st.st_uid,
        gid: st.st_gid,
        rdev: st.st_rdev as u32,
        blksize: st.st_blksize as u32,
        flags: 0,
    }
}

/// The attributes of a negative entry: node id 0 tells the kernel the name does not exist.
pub fn negative() -> FileAttr {
    // SAFETY: `stat` is plain integers; all-zero is a valid value.
    let st: Stat = unsafe { std::mem::zeroed() };
    file_attr(&st)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_before_the_epoch_survive() {
        assert_eq!(
            time(-1, 500),
            UNIX_EPOCH - Duration::from_secs(1) + Duration::from_nanos(500)
        );
        assert_eq!(time(2, 3), UNIX_EPOCH + Duration::new(2, 3));
    }

    #[test]
    fn mode_splits_into_kind_and_permissions() {
        let mut st: Stat = unsafe { std::mem::zeroed() };
        st.st_mode = libc::S_IFDIR | 0o4755;
        st.st_ino = 42;
        let a = file_attr(&st);
        assert_eq!(a.kind, FileType::Directory);
        assert_eq!(a.perm, 0o4755);
        assert_eq!(a.ino, INodeNo(42));
    }
}
