//! The filesystem both transports serve: one in-memory flat directory (the root) holding empty
//! regular files. It does just enough for the metadata workloads, so that what the benchmark
//! measures is the transport, not the filesystem.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::proto::*;

/// Outcome of one request. Reply bodies are written into the caller's buffer.
#[derive(Debug, PartialEq, Eq)]
pub enum Reply {
    /// FORGET, BATCH_FORGET and INTERRUPT get no reply.
    None,
    /// Success with a body of this many bytes (possibly 0).
    Ok(usize),
    /// Failure with this (positive) errno.
    Err(i32),
}

/// One decoded request. `arg` is the op's fixed argument (`in_args[0]`), `rest` what follows it.
pub struct Request<'a> {
    pub h: InHeader,
    pub arg: &'a [u8],
    pub rest: &'a [u8],
}

struct Node {
    attr: Attr,
    /// Kernel references (LOOKUP/CREATE replies minus FORGETs).
    nlookup: u64,
    /// Position in the directory listing; None once unlinked.
    dir_pos: Option<u64>,
}

struct Inner {
    nodes: HashMap<u64, Node>,
    /// name -> inode
    names: HashMap<Vec<u8>, u64>,
    /// Directory listing order. READDIR offsets are these positions, so they stay valid while
    /// files come and go. Positions 0 and 1 are "." and "..".
    listing: BTreeMap<u64, (Vec<u8>, u64)>,
    next_ino: u64,
    next_pos: u64,
}

pub struct Fs {
    inner: Mutex<Inner>,
    entry_ttl: Ttl,
    attr_ttl: Ttl,
    next_fh: AtomicU64,
}

fn now() -> (u64, u32) {
    let d = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    (d.as_secs(), d.subsec_nanos())
}

/// A name argument is NUL-terminated; anything else is a protocol error.
fn name_arg(rest: &[u8]) -> Result<&[u8], i32> {
    let end = rest.iter().position(|&c| c == 0).ok_or(libc::EINVAL)?;
    match &rest[..end] {
        b"" => Err(libc::EINVAL),
        n if n.len() > 255 => Err(libc::ENAMETOOLONG),
        n => Ok(n),
    }
}

impl Fs {
    pub fn new(entry_ttl: Duration, attr_ttl: Duration) -> Fs {
        let t = now();
        let root = Node {
            attr: Attr {
                ino: FUSE_ROOT_ID,
                size: 0,
                atime: t,
                mtime: t,
                ctime: t,
                mode: libc::S_IFDIR | 0o755,
                nlink: 2,
                uid: 0,
                gid: 0,
            },
            nlookup: 1,
            dir_pos: None,
        };
        Fs {
            inner: Mutex::new(Inner {
                nodes: HashMap::from([(FUSE_ROOT_ID, root)]),
                names: HashMap::new(),
                listing: BTreeMap::new(),
                next_ino: FUSE_ROOT_ID + 1,
                next_pos: 2,
            }),
            entry_ttl: entry_ttl.into(),
            attr_ttl: attr_ttl.into(),
            next_fh: AtomicU64::new(1),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock ends the process (see the panic hook), so a
        // poisoned lock is never observed in practice; recover rather than panic again.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Handles one request, writing any reply body into `out`.
    pub fn handle(&self, req: &Request, out: &mut [u8]) -> Reply {
        let r = match req.h.opcode {
            FUSE_LOOKUP => self.lookup(req, out),
            FUSE_GETATTR => self.getattr(req, out),
            FUSE_SETATTR => self.setattr(req, out),
            FUSE_CREATE => self.create(req, out),
            FUSE_OPEN | FUSE_OPENDIR => self.open(req, out),
            FUSE_RELEASE | FUSE_RELEASEDIR | FUSE_ACCESS | FUSE_DESTROY => Ok(0),
            // As layerfs answers it: the kernel then never sends FLUSH again, and a close
            // costs no round trip.
            FUSE_FLUSH => Err(libc::ENOSYS),
            FUSE_UNLINK => self.unlink(req),
            FUSE_READDIR => self.readdir(req, out),
            FUSE_STATFS => Ok(self.statfs(out)),
            FUSE_FORGET => {
                if let Some(n) = Rd(req.arg).u64(0) {
                    self.forget(req.h.nodeid, n);
                }
                return Reply::None;
            }
            FUSE_BATCH_FORGET => {
                self.batch_forget(req);
                return Reply::None;
            }
            FUSE_INTERRUPT => return Reply::None,
            _ => Err(libc::ENOSYS),
        };
        match r {
            Ok(n) => Reply::Ok(n),
            Err(e) => Reply::Err(e),
        }
    }

    fn lookup(&self, req: &Request, out: &mut [u8]) -> Result<usize, i32> {
        let name = name_arg(req.rest)?;
        let mut g = self.lock();
        if req.h.nodeid != FUSE_ROOT_ID {
            return Err(if g.nodes.contains_key(&req.h.nodeid) {
                libc::ENOTDIR
            } else {
                libc::ENOENT
            });
        }
        let ino = *g.names.get(name).ok_or(libc::ENOENT)?;
        let node = g.nodes.get_mut(&ino).ok_or(libc::ENOENT)?;
        node.nlookup += 1;
        put_entry_out(
            out.get_mut(..ENTRY_OUT_SIZE).ok_or(libc::EIO)?,
            &node.attr,
            self.entry_ttl,
            self.attr_ttl,
        );
        Ok(ENTRY_OUT_SIZE)
    }

    fn getattr(&self, req: &Request, out: &mut [u8]) -> Result<usize, i32> {
        let g = self.lock();
        let node = g.nodes.get(&req.h.nodeid).ok_or(libc::ENOENT)?;
        put_attr_out(
            out.get_mut(..ATTR_OUT_SIZE).ok_or(libc::EIO)?,
            &node.attr,
            self.attr_ttl,
        );
        Ok(ATTR_OUT_SIZE)
    }

    fn setattr(&self, req: &Request, out: &mut [u8]) -> Result<usize, i32> {
        let a = Rd(req.arg);
        let valid = a.u32(0).ok_or(libc::EINVAL)?;
        let field = |off| a.u64(off).ok_or(libc::EINVAL);
        let field32 = |off| a.u32(off).ok_or(libc::EINVAL);
        let mut g = self.lock();
        let node = g.nodes.get_mut(&req.h.nodeid).ok_or(libc::ENOENT)?;
        let t = now();
        let at = &mut node.attr;
        if valid & FATTR_MODE != 0 {
            // The file type never changes; the kernel would reject a reply that changed it.
            at.mode = (at.mode & libc::S_IFMT) | (field32(68)? & 0o7777);
        }
        if valid & FATTR_UID != 0 {
            at.uid = field32(76)?;
        }
        if valid & FATTR_GID != 0 {
            at.gid = field32(80)?;
        }
        if valid & FATTR_SIZE != 0 {
            if at.mode & libc::S_IFMT == libc::S_IFDIR {
                return Err(libc::EISDIR);
            }
            at.size = field(16)?;
            at.mtime = t;
        }
        if valid & FATTR_ATIME_NOW != 0 {
            at.atime = t;
        } else if valid & FATTR_ATIME != 0 {
            at.atime = (field(32)?, field32(56)?);
        }
        if valid & FATTR_MTIME_NOW != 0 {
            at.mtime = t;
        } else if valid & FATTR_MTIME != 0 {
            at.mtime = (field(40)?, field32(60)?);
        }
        at.ctime = t;
        put_attr_out(
            out.get_mut(..ATTR_OUT_SIZE).ok_or(libc::EIO)?,
            at,
            self.attr_ttl,
        );
        Ok(ATTR_OUT_SIZE)
    }

    fn create(&self, req: &Request, out: &mut [u8]) -> Result<usize, i32> {
        let a = Rd(req.arg);
        let flags = a.u32(0).ok_or(libc::EINVAL)?;
        let mode = a.u32(4).ok_or(libc::EINVAL)?;
        let name = name_arg(req.rest)?;
        if req.h.nodeid != FUSE_ROOT_ID {
            return Err(libc::ENOTDIR);
        }
        if mode & libc::S_IFMT != libc::S_IFREG && mode & libc::S_IFMT != 0 {
            return Err(libc::EINVAL);
        }
        let out = out
            .get_mut(..ENTRY_OUT_SIZE + OPEN_OUT_SIZE)
            .ok_or(libc::EIO)?;
        let mut guard = self.lock();
        let g = &mut *guard;
        let ino = match g.names.get(name) {
            Some(_) if flags as i32 & libc::O_EXCL != 0 => return Err(libc::EEXIST),
            Some(&ino) => ino,
            None => {
                let ino = g.next_ino;
                let pos = g.next_pos;
                g.next_ino += 1;
                g.next_pos += 1;
                let t = now();
                let attr = Attr {
                    ino,
                    size: 0,
                    atime: t,
                    mtime: t,
                    ctime: t,
                    // The kernel has already applied the umask (no FUSE_DONT_MASK).
                    mode: libc::S_IFREG | (mode & 0o7777),
                    nlink: 1,
                    uid: req.h.uid,
                    gid: req.h.gid,
                };
                g.nodes.insert(
                    ino,
                    Node {
                        attr,
                        nlookup: 0,
                        dir_pos: Some(pos),
                    },
                );
                g.names.insert(name.to_vec(), ino);
                g.listing.insert(pos, (name.to_vec(), ino));
                if let Some(root) = g.nodes.get_mut(&FUSE_ROOT_ID) {
                    root.attr.mtime = t;
                    root.attr.ctime = t;
                }
                ino
            }
        };
        let node = g.nodes.get_mut(&ino).ok_or(libc::EIO)?;
        node.nlookup += 1;
        put_entry_out(out, &node.attr, self.entry_ttl, self.attr_ttl);
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        put_open_out(&mut out[ENTRY_OUT_SIZE..], fh, 0);
        Ok(ENTRY_OUT_SIZE + OPEN_OUT_SIZE)
    }

    fn open(&self, req: &Request, out: &mut [u8]) -> Result<usize, i32> {
        if !self.lock().nodes.contains_key(&req.h.nodeid) {
            return Err(libc::ENOENT);
        }
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        put_open_out(out.get_mut(..OPEN_OUT_SIZE).ok_or(libc::EIO)?, fh, 0);
        Ok(OPEN_OUT_SIZE)
    }

    fn unlink(&self, req: &Request) -> Result<usize, i32> {
        let name = name_arg(req.rest)?;
        if req.h.nodeid != FUSE_ROOT_ID {
            return Err(libc::ENOTDIR);
        }
        let mut guard = self.lock();
        let g = &mut *guard;
        let ino = g.names.remove(name).ok_or(libc::ENOENT)?;
        let t = now();
        if let Some(node) = g.nodes.get_mut(&ino) {
            if let Some(pos) = node.dir_pos.take() {
                g.listing.remove(&pos);
            }
            node.attr.nlink = 0;
            node.attr.ctime = t;
            // Kept until the kernel forgets it, if it still holds references.
            if node.nlookup == 0 {
                g.nodes.remove(&ino);
            }
        }
        if let Some(root) = g.nodes.get_mut(&FUSE_ROOT_ID) {
            root.attr.mtime = t;
            root.attr.ctime = t;
        }
        Ok(0)
    }

    fn forget_locked(g: &mut Inner, ino: u64, n: u64) {
        if ino == FUSE_ROOT_ID {
            return;
        }
        if let Some(node) = g.nodes.get_mut(&ino) {
            node.nlookup = node.nlookup.saturating_sub(n);
            if node.nlookup == 0 && node.dir_pos.is_none() {
                g.nodes.remove(&ino);
            }
        }
    }

    fn forget(&self, ino: u64, n: u64) {
        Self::forget_locked(&mut self.lock(), ino, n);
    }

    fn batch_forget(&self, req: &Request) {
        let count = Rd(req.arg).u32(0).unwrap_or(0) as usize;
        let list = Rd(req.rest);
        let mut g = self.lock();
        for i in 0..count {
            match (list.u64(i * 16), list.u64(i * 16 + 8)) {
                (Some(ino), Some(n)) => Self::forget_locked(&mut g, ino, n),
                _ => break,
            }
        }
    }

    fn readdir(&self, req: &Request, out: &mut [u8]) -> Result<usize, i32> {
        let a = Rd(req.arg);
        let offset = a.u64(8).ok_or(libc::EINVAL)?;
        let size = a.u32(16).ok_or(libc::EINVAL)? as usize;
        if req.h.nodeid != FUSE_ROOT_ID {
            return Err(libc::ENOTDIR);
        }
        let out_len = size.min(out.len());
        let out = &mut out[..out_len];
        let g = self.lock();
        let dots: [(u64, &[u8], u64); 2] = [(0, b".", FUSE_ROOT_ID), (1, b"..", FUSE_ROOT_ID)];
        let dots = dots.into_iter().filter(|d| d.0 >= offset);
        let files = g
            .listing
            .range(offset.max(2)..)
            .map(|(&pos, (name, ino))| (pos, name.as_slice(), *ino));
        let mut used = 0;
        for (pos, name, ino) in dots.chain(files) {
            let len = DIRENT_HEADER_SIZE + name.len();
            let padded = len.next_multiple_of(8);
            if used + padded > out.len() {
                break;
            }
            let dtype = if ino == FUSE_ROOT_ID {
                libc::DT_DIR
            } else {
                libc::DT_REG
            };
            let b = &mut out[used..used + padded];
            let mut w = Wr(b);
            w.u64(0, ino);
            // The offset of an entry is the position to resume from after it.
            w.u64(8, pos + 1);
            w.u32(16, name.len() as u32);
            w.u32(20, dtype as u32);
            b[DIRENT_HEADER_SIZE..len].copy_from_slice(name);
            b[len..].fill(0);
            used += padded;
        }
        Ok(used)
    }

    fn statfs(&self, out: &mut [u8]) -> usize {
        let files = self.lock().nodes.len() as u64;
        let Some(b) = out.get_mut(..STATFS_OUT_SIZE) else {
            return 0;
        };
        b.fill(0);
        let mut w = Wr(b);
        w.u64(0, 1 << 20); // blocks
        w.u64(8, 1 << 20); // bfree
        w.u64(16, 1 << 20); // bavail
        w.u64(24, files); // files
        w.u64(32, 1 << 20); // ffree
        w.u32(40, 4096); // bsize
        w.u32(44, 255); // namelen
        w.u32(48, 4096); // frsize
        STATFS_OUT_SIZE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req<'a>(opcode: u32, nodeid: u64, arg: &'a [u8], rest: &'a [u8]) -> Request<'a> {
        Request {
            h: InHeader {
                len: 0,
                opcode,
                unique: 2,
                nodeid,
                uid: 0,
                gid: 0,
            },
            arg,
            rest,
        }
    }

    #[test]
    fn create_lookup_readdir_unlink() {
        let fs = Fs::new(Duration::from_secs(1), Duration::from_secs(1));
        let mut out = vec![0u8; 4096];
        let mut create_in = [0u8; 16];
        Wr(&mut create_in).u32(0, (libc::O_CREAT | libc::O_EXCL) as u32);
        Wr(&mut create_in).u32(4, libc::S_IFREG | 0o644);
        let r = fs.handle(&req(FUSE_CREATE, 1, &create_in, b"a\0"), &mut out);
        assert_eq!(r, Reply::Ok(ENTRY_OUT_SIZE + OPEN_OUT_SIZE));
        let r = fs.handle(&req(FUSE_CREATE, 1, &create_in, b"a\0"), &mut out);
        assert_eq!(r, Reply::Err(libc::EEXIST));
        let r = fs.handle(&req(FUSE_LOOKUP, 1, &[], b"a\0"), &mut out);
        assert_eq!(r, Reply::Ok(ENTRY_OUT_SIZE));
        assert_eq!(Rd(&out).u64(0), Some(2));
        let mut read_in = [0u8; 40];
        Wr(&mut read_in).u32(16, 4096);
        let r = fs.handle(&req(FUSE_READDIR, 1, &read_in, &[]), &mut out);
        assert_eq!(r, Reply::Ok(32 + 32 + 32));
        let r = fs.handle(&req(FUSE_UNLINK, 1, &[], b"a\0"), &mut out);
        assert_eq!(r, Reply::Ok(0));
        let r = fs.handle(&req(FUSE_LOOKUP, 1, &[], b"a\0"), &mut out);
        assert_eq!(r, Reply::Err(libc::ENOENT));
        // Still referenced by the kernel until FORGET.
        assert!(fs.lock().nodes.contains_key(&2));
        let forget = 2u64.to_ne_bytes();
        assert_eq!(
            fs.handle(&req(FUSE_FORGET, 2, &forget, &[]), &mut out),
            Reply::None
        );
        assert!(!fs.lock().nodes.contains_key(&2));
    }

    #[test]
    fn malformed_input_is_an_error() {
        let fs = Fs::new(Duration::ZERO, Duration::ZERO);
        let mut out = vec![0u8; 4096];
        assert_eq!(
            fs.handle(&req(FUSE_LOOKUP, 1, &[], b"no-nul"), &mut out),
            Reply::Err(libc::EINVAL)
        );
        assert_eq!(
            fs.handle(&req(FUSE_CREATE, 1, &[1, 2], b"x\0"), &mut out),
            Reply::Err(libc::EINVAL)
        );
        assert_eq!(
            fs.handle(&req(9999, 1, &[], &[]), &mut out),
            Reply::Err(libc::ENOSYS)
        );
    }
}
