//! The parts of the FUSE kernel protocol (`include/uapi/linux/fuse.h`) this probe speaks.
//!
//! Structs are encoded and decoded field by field at their C offsets instead of being
//! transmuted, so a short or odd message from the kernel becomes an error, never undefined
//! behaviour.

pub const FUSE_KERNEL_VERSION: u32 = 7;
/// Highest minor version whose layouts this file follows (7.45).
pub const FUSE_KERNEL_MINOR_VERSION: u32 = 45;
pub const FUSE_ROOT_ID: u64 = 1;

// Opcodes.
pub const FUSE_LOOKUP: u32 = 1;
pub const FUSE_FORGET: u32 = 2;
pub const FUSE_GETATTR: u32 = 3;
pub const FUSE_SETATTR: u32 = 4;
pub const FUSE_MKNOD: u32 = 8;
pub const FUSE_MKDIR: u32 = 9;
pub const FUSE_UNLINK: u32 = 10;
pub const FUSE_OPEN: u32 = 14;
pub const FUSE_READ: u32 = 15;
pub const FUSE_WRITE: u32 = 16;
pub const FUSE_STATFS: u32 = 17;
pub const FUSE_RELEASE: u32 = 18;
pub const FUSE_FLUSH: u32 = 25;
pub const FUSE_INIT: u32 = 26;
pub const FUSE_OPENDIR: u32 = 27;
pub const FUSE_READDIR: u32 = 28;
pub const FUSE_RELEASEDIR: u32 = 29;
pub const FUSE_ACCESS: u32 = 34;
pub const FUSE_CREATE: u32 = 35;
pub const FUSE_INTERRUPT: u32 = 36;
pub const FUSE_DESTROY: u32 = 38;
pub const FUSE_BATCH_FORGET: u32 = 42;

// INIT flags. Bits 32..63 travel in `flags2`, and only when FUSE_INIT_EXT is set.
pub const FUSE_ASYNC_READ: u64 = 1 << 0;
pub const FUSE_BIG_WRITES: u64 = 1 << 5;
pub const FUSE_PARALLEL_DIROPS: u64 = 1 << 18;
pub const FUSE_MAX_PAGES: u64 = 1 << 22;
pub const FUSE_INIT_EXT: u64 = 1 << 30;
pub const FUSE_OVER_IO_URING: u64 = 1 << 41;

// SETATTR valid bits.
pub const FATTR_MODE: u32 = 1 << 0;
pub const FATTR_UID: u32 = 1 << 1;
pub const FATTR_GID: u32 = 1 << 2;
pub const FATTR_SIZE: u32 = 1 << 3;
pub const FATTR_ATIME: u32 = 1 << 4;
pub const FATTR_MTIME: u32 = 1 << 5;
pub const FATTR_ATIME_NOW: u32 = 1 << 7;
pub const FATTR_MTIME_NOW: u32 = 1 << 8;

// FUSE-over-io_uring (7.42).
pub const FUSE_IO_URING_CMD_REGISTER: u32 = 1;
pub const FUSE_IO_URING_CMD_COMMIT_AND_FETCH: u32 = 2;
/// `struct fuse_uring_req_header`: in_out[128], op_in[128], `fuse_uring_ent_in_out` (32).
pub const URING_IN_OUT_OFF: usize = 0;
pub const URING_OP_IN_OFF: usize = 128;
pub const URING_OP_IN_SIZE: usize = 128;
pub const URING_ENT_IN_OUT_OFF: usize = 256;
pub const URING_REQ_HEADER_SIZE: usize = 288;
/// Offsets inside `fuse_uring_ent_in_out`: flags u64, commit_id u64, payload_sz u32.
pub const URING_ENT_COMMIT_ID_OFF: usize = URING_ENT_IN_OUT_OFF + 8;
pub const URING_ENT_PAYLOAD_SZ_OFF: usize = URING_ENT_IN_OUT_OFF + 16;

// Fixed sizes of the structs used here.
pub const IN_HEADER_SIZE: usize = 40;
pub const OUT_HEADER_SIZE: usize = 16;
pub const ATTR_SIZE: usize = 88;
pub const ENTRY_OUT_SIZE: usize = 40 + ATTR_SIZE;
pub const ATTR_OUT_SIZE: usize = 16 + ATTR_SIZE;
pub const OPEN_OUT_SIZE: usize = 16;
pub const STATFS_OUT_SIZE: usize = 80;
pub const INIT_OUT_SIZE: usize = 64;
pub const DIRENT_HEADER_SIZE: usize = 24;

/// Size of the op's fixed argument (`in_args[0]`), which io_uring delivers in `op_in` while
/// /dev/fuse delivers it first in the body. Everything after it (names, forget lists) is the
/// "rest": the io_uring payload, or the remainder of the /dev/fuse body.
pub fn fixed_arg_size(opcode: u32) -> usize {
    match opcode {
        FUSE_FORGET | FUSE_OPEN | FUSE_OPENDIR | FUSE_ACCESS | FUSE_MKDIR | FUSE_INTERRUPT
        | FUSE_BATCH_FORGET => 8,
        FUSE_GETATTR | FUSE_CREATE | FUSE_MKNOD => 16,
        FUSE_RELEASE | FUSE_RELEASEDIR | FUSE_FLUSH => 24,
        FUSE_READDIR | FUSE_READ => 40,
        FUSE_WRITE => 40,
        FUSE_INIT => 64,
        FUSE_SETATTR => 88,
        _ => 0,
    }
}

/// Little-endian field reader over a byte slice; every read is bounds-checked.
pub struct Rd<'a>(pub &'a [u8]);

impl Rd<'_> {
    pub fn u32(&self, off: usize) -> Option<u32> {
        Some(u32::from_ne_bytes(
            self.0.get(off..off + 4)?.try_into().ok()?,
        ))
    }
    pub fn u64(&self, off: usize) -> Option<u64> {
        Some(u64::from_ne_bytes(
            self.0.get(off..off + 8)?.try_into().ok()?,
        ))
    }
}

/// Field writer; callers size the buffer first (`put_*` panics only on a logic error here,
/// never on kernel input).
pub struct Wr<'a>(pub &'a mut [u8]);

impl Wr<'_> {
    pub fn u16(&mut self, off: usize, v: u16) {
        self.0[off..off + 2].copy_from_slice(&v.to_ne_bytes());
    }
    pub fn u32(&mut self, off: usize, v: u32) {
        self.0[off..off + 4].copy_from_slice(&v.to_ne_bytes());
    }
    pub fn u64(&mut self, off: usize, v: u64) {
        self.0[off..off + 8].copy_from_slice(&v.to_ne_bytes());
    }
}

/// `struct fuse_in_header`.
#[derive(Clone, Copy, Debug)]
pub struct InHeader {
    pub len: u32,
    pub opcode: u32,
    pub unique: u64,
    pub nodeid: u64,
    pub uid: u32,
    pub gid: u32,
}

impl InHeader {
    pub fn parse(b: &[u8]) -> Option<InHeader> {
        let r = Rd(b);
        Some(InHeader {
            len: r.u32(0)?,
            opcode: r.u32(4)?,
            unique: r.u64(8)?,
            nodeid: r.u64(16)?,
            uid: r.u32(24)?,
            gid: r.u32(28)?,
        })
    }
}

/// `struct fuse_out_header`: len, error (negative errno), unique.
pub fn put_out_header(b: &mut [u8], len: u32, error: i32, unique: u64) {
    let mut w = Wr(b);
    w.u32(0, len);
    w.u32(4, error as u32);
    w.u64(8, unique);
}

/// `struct fuse_attr` as this probe fills it.
#[derive(Clone, Copy, Debug, Default)]
pub struct Attr {
    pub ino: u64,
    pub size: u64,
    pub atime: (u64, u32),
    pub mtime: (u64, u32),
    pub ctime: (u64, u32),
    pub mode: u32,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
}

pub fn put_attr(b: &mut [u8], a: &Attr) {
    let mut w = Wr(b);
    w.u64(0, a.ino);
    w.u64(8, a.size);
    w.u64(16, a.size.div_ceil(512));
    w.u64(24, a.atime.0);
    w.u64(32, a.mtime.0);
    w.u64(40, a.ctime.0);
    w.u32(48, a.atime.1);
    w.u32(52, a.mtime.1);
    w.u32(56, a.ctime.1);
    w.u32(60, a.mode);
    w.u32(64, a.nlink);
    w.u32(68, a.uid);
    w.u32(72, a.gid);
    w.u32(76, 0); // rdev
    w.u32(80, 4096); // blksize
    w.u32(84, 0); // flags
}

/// A cache lifetime as the (seconds, nanoseconds) pair FUSE replies carry.
#[derive(Clone, Copy, Debug)]
pub struct Ttl {
    pub secs: u64,
    pub nsecs: u32,
}

impl From<std::time::Duration> for Ttl {
    fn from(d: std::time::Duration) -> Ttl {
        Ttl {
            secs: d.as_secs(),
            nsecs: d.subsec_nanos(),
        }
    }
}

/// `struct fuse_entry_out`.
pub fn put_entry_out(b: &mut [u8], a: &Attr, entry: Ttl, attr: Ttl) {
    let mut w = Wr(b);
    w.u64(0, a.ino);
    w.u64(8, 0); // generation
    w.u64(16, entry.secs);
    w.u64(24, attr.secs);
    w.u32(32, entry.nsecs);
    w.u32(36, attr.nsecs);
    put_attr(&mut b[40..40 + ATTR_SIZE], a);
}

/// `struct fuse_attr_out`.
pub fn put_attr_out(b: &mut [u8], a: &Attr, attr: Ttl) {
    let mut w = Wr(b);
    w.u64(0, attr.secs);
    w.u32(8, attr.nsecs);
    w.u32(12, 0);
    put_attr(&mut b[16..16 + ATTR_SIZE], a);
}

/// `struct fuse_open_out`: fh, open_flags, backing_id.
pub fn put_open_out(b: &mut [u8], fh: u64, open_flags: u32) {
    let mut w = Wr(b);
    w.u64(0, fh);
    w.u32(8, open_flags);
    w.u32(12, 0);
}
