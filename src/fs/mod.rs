//! The FUSE glue: each request becomes one call on the [`View`], each `Errno` a reply.
//! Requests that may wait on the remote are served on the remote pool ([`remote`]), the
//! rest on the FUSE thread that read them ([`dispatch`]).
//!
//! Caching is deliberate. Every change to local goes through this daemon, and the kernel
//! updates its own caches for the changes it asks for; the remote is read-only between
//! refreshes, and a refresh invalidates exactly what it changes. So entries and attributes
//! are cached for long (`Timeouts`), file data is kept across opens (`FOPEN_KEEP_CACHE`) or
//! not touched by the daemon at all (passthrough), and symlink targets are cached.

pub mod attr;
pub mod backing;
mod dispatch;

pub use dispatch::LayerFs;
pub mod handles;
pub mod kernel_mount;
pub mod notify;
pub mod pool;
pub mod trim;

use std::ffi::OsStr;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use fuser::{
    FileHandle, FopenFlags, Generation, INodeNo, InitFlags, KernelConfig, OpenFlags, RenameFlags,
    ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyLseek,
    ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr, Request, TimeOrNow, WriteFlags,
};
use nix::errno::Errno;
use parking_lot::Mutex;
use tracing::{debug, info};

use crate::store::creds;
use crate::view::attrs::{SetAttr, Time};
use crate::view::quota::Held;
use crate::view::{Caller, Entry, Layer, Node, View};
use attr::{file_attr, file_type};
use backing::{BackingTable, Grant};
use handles::{DirHandle, FileHandle as OpenFile, Handle, HandleTable};
use notify::Notices;

/// How long the kernel trusts the attributes of a file open for writing through
/// passthrough, which a shared mapping may change unseen. Not zero: the kernel checks
/// permissions against its cached attributes, and a zero lifetime made it ask again for
/// every open of such a file (one more round trip per create); a stat more than this after
/// an `msync` sees its times.
const MAPPED_WRITER_TTL: Duration = Duration::from_millis(1);

/// How long the kernel may trust what it was told.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    pub entry: Duration,
    pub attr: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        // Safe to make long: see the module documentation.
        Timeouts {
            entry: Duration::from_secs(3600),
            attr: Duration::from_secs(3600),
        }
    }
}

/// What serves requests: shared by the FUSE threads and the remote pool (see [`dispatch`]).
pub struct Core {
    view: Arc<View>,
    handles: HandleTable,
    backing: BackingTable,
    timeouts: Timeouts,
    want_passthrough: bool,
    passthrough: AtomicBool,
    notices: Arc<Notices>,
}

impl Core {
    fn new(view: Arc<View>, timeouts: Timeouts, passthrough: bool) -> Core {
        Core {
            view,
            handles: HandleTable::new(),
            backing: BackingTable::default(),
            timeouts,
            want_passthrough: passthrough,
            passthrough: AtomicBool::new(false),
            notices: Arc::new(Notices::default()),
        }
    }

    pub fn view(&self) -> &Arc<View> {
        &self.view
    }

    /// Where handlers send their notices to the kernel; started once the session exists.
    pub fn notices(&self) -> Arc<Notices> {
        self.notices.clone()
    }

    fn reply_entry(&self, reply: ReplyEntry, entry: &Entry) {
        reply.entry_with_ttls(
            &self.attr_ttl(&entry.node),
            &self.timeouts.entry,
            &file_attr(&entry.stat),
            Generation(0),
        );
    }

    /// How long the kernel may keep a node's attributes: a moment only while it may be
    /// written through a shared mapping of its backing file, which the daemon never hears
    /// of (see [`MAPPED_WRITER_TTL`]).
    fn attr_ttl(&self, node: &Node) -> Duration {
        if node.state().mapped_writers > 0 {
            MAPPED_WRITER_TTL
        } else {
            self.timeouts.attr
        }
    }

    fn file(&self, fh: FileHandle) -> Result<Arc<Handle>, Errno> {
        self.handles.file(fh.0).ok_or(Errno::EBADF)
    }

    /// How an open is served, and what it holds of its quota. Reads never allocate, so a
    /// read-only open gets passthrough anywhere. One that may write gets it only outside
    /// quota roots; under one, its writes go through the daemon, uncached, naming the
    /// inode's backing file where readers gave it one (see `backing`, and
    /// [`crate::view::View::hold_holes`] for what such a writer holds). `None`: the
    /// kernel's inode has a backing file of another layer (see `backing`).
    fn grant(
        &self,
        node: &Arc<Node>,
        fd: &OwnedFd,
        layer: Layer,
        writes: bool,
        open: impl FnOnce(&OwnedFd) -> std::io::Result<fuser::BackingId>,
    ) -> Result<Option<Granted>, Errno> {
        let free = !writes || self.view.may_bypass(node);
        let grant = self.backing.acquire(
            node.ino,
            layer,
            self.passthrough.load(Ordering::Relaxed) && free,
            writes && !free,
            || open(fd),
        );
        if writes && free && !matches!(grant, Some(Grant::Passthrough(_))) {
            self.view.bypass_refused(node);
        }
        let Some(grant) = grant else {
            return Ok(None);
        };
        let held = match grant {
            Grant::Direct(_) => match self.view.hold_holes(node, fd.as_fd()) {
                Ok(held) => held,
                Err(e) => {
                    self.backing.release(node.ino);
                    return Err(e);
                }
            },
            _ => None,
        };
        Ok(Some(Granted { grant, held }))
    }

    /// The local copy of a remote file `file` opened before it was copied up, once it has
    /// one: reads through the daemon share the kernel's page cache with writers of the copy,
    /// so they must read the copy too (as kernel overlayfs redirects them).
    fn copy_of(&self, file: &OpenFile) -> Result<Option<Arc<OwnedFd>>, Errno> {
        if file.layer != Layer::Remote || file.node.layer() != Layer::Local {
            return Ok(None);
        }
        let mut copy = file.copy.lock();
        if copy.is_none() {
            *copy = Some(Arc::new(self.view.reopen(&file.node, libc::O_RDONLY)?));
        }
        Ok(copy.clone())
    }

    /// Records an open and what it was granted; returns its handle number and the grant,
    /// for the reply.
    fn opened(
        &self,
        node: &Arc<Node>,
        fd: OwnedFd,
        layer: Layer,
        writes: bool,
        created: bool,
        Granted { grant, held }: Granted,
    ) -> (u64, Grant) {
        // A shared writable mapping of this open changes the file where the daemon cannot
        // see it: from now on the kernel trusts its attributes for a tick only. A file just
        // created is new to the kernel, which takes its attributes from the reply.
        let maps_writes = writes && matches!(grant, Grant::Passthrough(_) | Grant::Direct(_));
        let bypasses = writes && matches!(grant, Grant::Passthrough(_));
        self.view.opened(node, maps_writes);
        if maps_writes && !created {
            self.notices.drop_attributes(node.ino);
        }
        let fh = self.handles.insert(Handle::File(OpenFile {
            node: node.clone(),
            bypasses,
            maps_writes,
            fd,
            layer,
            mode: grant.mode(),
            copy: Mutex::new(None),
            _held: held,
        }));
        (fh, grant)
    }
}

/// What an open was granted: its I/O mode, and the quota it holds while open.
struct Granted {
    grant: Grant,
    held: Option<Held>,
}

/// Who sent a request, kept beyond it: a request handed to the remote pool outlives the
/// `Request` it came with.
#[derive(Debug, Clone, Copy)]
pub struct Who {
    uid: u32,
    gid: u32,
    pid: u32,
}

impl Who {
    fn of(req: &Request) -> Who {
        Who {
            uid: req.uid(),
            gid: req.gid(),
            pid: req.pid(),
        }
    }
    fn uid(&self) -> u32 {
        self.uid
    }
    fn gid(&self) -> u32 {
        self.gid
    }
    fn pid(&self) -> u32 {
        self.pid
    }
}

fn caller(req: Who) -> Caller {
    Caller {
        uid: req.uid(),
        gid: req.gid(),
        pid: req.pid(),
        umask: None,
    }
}

/// The caller of a request that creates an object with `umask` (the kernel leaves applying
/// it to the daemon: `FUSE_DONT_MASK`).
fn creator(req: Who, umask: u32) -> Caller {
    Caller {
        umask: Some(umask),
        ..caller(req)
    }
}

/// Registers a passthrough backing file. The kernel writes through it later with the
/// credentials it was registered with, so a local file is registered as the caller:
/// allocations by passthrough writes then meet local's reserved blocks as the caller's would.
/// Remote files keep the daemon's: a network filesystem checks every read against them.
fn backing_as<T>(who: Caller, layer: Layer, register: impl FnOnce() -> T) -> T {
    match layer {
        Layer::Local => creds::run_as(who.acting(), register),
        _ => register(),
    }
}

fn errno(e: Errno) -> fuser::Errno {
    match e {
        Errno::ENOENT | Errno::EEXIST | Errno::ENOTEMPTY | Errno::ENODATA | Errno::EXDEV => {}
        other => debug!(error = %other, "request failed"),
    }
    outcome::failed(e);
    fuser::Errno::from_i32(e as i32)
}

/// What the request being served on this thread ended with, for the metrics: handlers reply
/// themselves, and every error reply goes through [`errno`].
mod outcome {
    use std::cell::Cell;

    use nix::errno::Errno;

    thread_local! {
        static FAILED: Cell<Option<i32>> = const { Cell::new(None) };
    }

    pub fn failed(e: Errno) {
        FAILED.with(|f| f.set(Some(e as i32)));
    }

    /// The errno the last request on this thread failed with, if it did; forgets it.
    pub fn take() -> Option<i32> {
        FAILED.with(|f| f.take())
    }
}

fn open_flags(grant: &Grant) -> FopenFlags {
    match grant {
        Grant::Passthrough(_) => FopenFlags::empty(),
        Grant::Cached => FopenFlags::FOPEN_KEEP_CACHE,
        Grant::Direct(_) | Grant::Uncached => FopenFlags::FOPEN_DIRECT_IO,
    }
}

fn time(t: TimeOrNow) -> Time {
    match t {
        TimeOrNow::Now => Time::Now,
        TimeOrNow::SpecificTime(t) => Time::At(t),
    }
}

macro_rules! tri {
    ($reply:expr, $e:expr) => {
        match $e {
            Ok(v) => v,
            Err(e) => return $reply.error(errno(e)),
        }
    };
}

impl Core {
    fn init(&self, config: &mut KernelConfig) -> std::io::Result<()> {
        let offered = config.capabilities();
        let wanted = [
            // Lookups and readdirs of one directory may run in parallel: the view is
            // thread-safe and the kernel still serializes changes to a directory.
            InitFlags::FUSE_PARALLEL_DIROPS,
            // A symlink's target never changes: cache it.
            InitFlags::FUSE_CACHE_SYMLINKS,
            // O_TRUNC arrives with the open, so a truncating open copies up no data.
            InitFlags::FUSE_ATOMIC_O_TRUNC,
            // Direct-I/O opens (see backing.rs) can still be mmapped.
            InitFlags::FUSE_DIRECT_IO_ALLOW_MMAP,
            // The kernel enforces POSIX ACLs (read through getxattr) and leaves the umask
            // to the daemon, which creates as the caller so that local's filesystem
            // applies a directory's default ACL instead of the umask, as it would.
            InitFlags::FUSE_POSIX_ACL,
            InitFlags::FUSE_DONT_MASK,
            // Set-ID bits are the daemon's to clear: the kernel asks with an empty SETATTR
            // (before a write, passthrough ones included, fallocate or copy) or a write
            // flag, having decided with the caller's credentials, and the daemon applies
            // the whole rule, which the kernel's own fallback for FUSE only half applies
            // (it keeps a setgid bit without group-execute that a non-member must lose).
            InitFlags::FUSE_HANDLE_KILLPRIV_V2,
        ];
        for flag in wanted {
            if offered.contains(flag) {
                let _ = config.add_capabilities(flag);
            }
        }
        if self.want_passthrough && offered.contains(InitFlags::FUSE_PASSTHROUGH) {
            // Depth 1 leaves room for overlayfs on top of the view (the container rootfs
            // iSulad mounts from `<driver>/l/` links).
            if config.add_capabilities(InitFlags::FUSE_PASSTHROUGH).is_ok()
                && config.set_max_stack_depth(1).is_ok()
            {
                self.passthrough.store(true, Ordering::Relaxed);
            }
        }
        info!(
            passthrough = self.passthrough.load(Ordering::Relaxed),
            "FUSE session initialized"
        );
        Ok(())
    }

    fn destroy(&self) {
        // The last request of an unmount: what was written through the view reaches the
        // disk before the daemon says it is done.
        match self.view.sync_local() {
            Ok(()) => info!("local tree synced"),
            Err(e) => tracing::warn!(error = %e, "syncing the local tree at unmount failed"),
        }
    }

    fn lookup(&self, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        match self.view.lookup(parent.0, name) {
            Ok(entry) => self.reply_entry(reply, &entry),
            // A negative entry: the kernel remembers the name is absent. Names appear only
            // through this daemon (which the kernel sees) or a refresh (which invalidates).
            Err(Errno::ENOENT) if !self.timeouts.entry.is_zero() => {
                outcome::failed(Errno::ENOENT);
                reply.entry_with_ttls(
                    &self.timeouts.attr,
                    &self.timeouts.entry,
                    &attr::negative(),
                    Generation(0),
                )
            }
            Err(e) => reply.error(errno(e)),
        }
    }

    fn forget(&self, ino: INodeNo, nlookup: u64) {
        self.view.inodes.forget(ino.0, nlookup);
    }

    fn getattr(&self, ino: INodeNo, reply: ReplyAttr) {
        let node = tri!(reply, self.view.node(ino.0));
        // A node holds its object: attributes stay readable when its name is gone, and
        // are the copy's once a remote file open through `fh` was copied up.
        let st = tri!(reply, self.view.getattr(&node));
        reply.attr(&self.attr_ttl(&node), &file_attr(&st));
    }

    fn setattr(
        &self,
        req: Who,
        ino: INodeNo,
        set: SetAttr,
        ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        reply: ReplyAttr,
    ) {
        let node = tri!(reply, self.view.node(ino.0));
        let who = caller(req);
        // A SETATTR that changes nothing is the kernel asking for the set-ID bits to go (see
        // `init`: a write, fallocate or copy by a caller without CAP_FSETID, or a chown).
        let kill = set.is_empty() && ctime.is_none();
        // A truncate by an unprivileged caller clears them as a write does (the kernel's
        // flag for it is not passed on by the FUSE library).
        if kill || (set.size.is_some() && who.uid != 0) {
            tri!(reply, self.view.drop_privileges(&node, who));
        }
        let handle = fh.and_then(|fh| self.handles.file(fh.0));
        let open = handle
            .as_ref()
            .and_then(|h| h.as_file())
            .filter(|f| f.layer == crate::view::Layer::Local)
            .map(|f| f.fd.as_fd());
        let st = tri!(reply, self.view.setattr(&node, &set, open));
        reply.attr(&self.attr_ttl(&node), &file_attr(&st));
    }

    fn readlink(&self, ino: INodeNo, reply: ReplyData) {
        let node = tri!(reply, self.view.node(ino.0));
        let target = tri!(reply, self.view.readlink(&node));
        reply.data(&target);
    }

    fn mknod(
        &self,
        who: Caller,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        let entry = tri!(reply, self.view.mknod(parent.0, name, mode, rdev, who));
        self.reply_entry(reply, &entry);
    }

    fn mkdir(&self, who: Caller, parent: INodeNo, name: &OsStr, mode: u32, reply: ReplyEntry) {
        let entry = tri!(reply, self.view.mkdir(parent.0, name, mode, who));
        self.reply_entry(reply, &entry);
    }

    fn unlink(&self, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        tri!(reply, self.view.unlink(parent.0, name));
        reply.ok();
    }

    fn rmdir(&self, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        tri!(reply, self.view.rmdir(parent.0, name));
        reply.ok();
    }

    fn symlink(
        &self,
        req: Who,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let entry = tri!(
            reply,
            self.view
                .symlink(parent.0, link_name, target.as_os_str(), caller(req))
        );
        self.reply_entry(reply, &entry);
    }

    fn rename(
        &self,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        tri!(
            reply,
            self.view
                .rename(parent.0, name, newparent.0, newname, flags.bits())
        );
        reply.ok();
    }

    fn link(&self, ino: INodeNo, newparent: INodeNo, newname: &OsStr, reply: ReplyEntry) {
        let entry = tri!(reply, self.view.link(ino.0, newparent.0, newname));
        self.reply_entry(reply, &entry);
    }

    fn open(&self, req: Who, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let node = tri!(reply, self.view.node(ino.0));
        let (fd, layer) = tri!(reply, self.view.open(&node, flags.0));
        // `FUSE_ATOMIC_O_TRUNC`: the kernel leaves the set-ID bits of a truncating open to us.
        if flags.0 & libc::O_TRUNC != 0 && req.uid() != 0 {
            tri!(reply, self.view.drop_privileges(&node, caller(req)));
        }
        let writes = flags.0 & libc::O_ACCMODE != libc::O_RDONLY;
        let who = caller(req);
        let granted = self.grant(&node, &fd, layer, writes, |fd| {
            backing_as(who, layer, || reply.open_backing(fd))
        });
        let Some(granted) = tri!(reply, granted) else {
            // The kernel's inode is bound to the remote copy it had before a copy-up, and
            // would map it: the node goes, and the kernel, told the open is stale, looks
            // the name up again and gets a new node for the copy.
            for (parent, name) in self.view.detach(&node) {
                self.notices.drop_name(parent, name);
            }
            return reply.error(errno(Errno::ESTALE));
        };
        let (fh, grant) = self.opened(&node, fd, layer, writes, false, granted);
        let fopen = open_flags(&grant);
        match &grant {
            // The kernel wants every open of an inode with a backing file to name it.
            Grant::Passthrough(id) | Grant::Direct(id) => {
                reply.opened_passthrough(FileHandle(fh), fopen, id)
            }
            Grant::Cached | Grant::Uncached => reply.opened(FileHandle(fh), fopen),
        }
    }

    fn read(&self, fh: FileHandle, offset: u64, size: u32, reply: ReplyData) {
        let handle = tri!(reply, self.file(fh));
        let Some(file) = handle.as_file() else {
            return reply.error(errno(Errno::EBADF));
        };
        let copy = tri!(reply, self.copy_of(file));
        let fd = copy.as_deref().unwrap_or(&file.fd).as_fd();
        let mut buf = vec![0u8; size as usize];
        let mut done = 0;
        while done < buf.len() {
            match nix::sys::uio::pread(
                fd,
                &mut buf[done..],
                (offset as usize + done) as libc::off_t,
            ) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(Errno::EINTR) => continue,
                Err(e) => return reply.error(errno(e)),
            }
        }
        reply.data(&buf[..done]);
    }

    fn write(
        &self,
        req: Who,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        reply: ReplyWrite,
    ) {
        let handle = tri!(reply, self.file(fh));
        let Some(file) = handle.as_file() else {
            return reply.error(errno(Errno::EBADF));
        };
        let who = caller(req);
        // Direct-I/O writes by a caller without CAP_FSETID come with this instead of a
        // SETATTR.
        if write_flags.contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID) {
            tri!(reply, self.view.drop_privileges(&file.node, who));
        }
        let done = tri!(
            reply,
            self.view
                .write_at(&file.node, file.fd.as_fd(), offset, data, who)
        );
        reply.written(done as u32);
    }

    fn release(&self, fh: FileHandle, reply: ReplyEmpty) {
        if let Some(handle) = self.handles.remove(fh.0) {
            if let Some(file) = handle.as_file() {
                self.backing.release(file.node.ino);
                // What the kernel holds of a file written through a mapping lives a tick
                // (`MAPPED_WRITER_TTL`), so it is read again anyway: nothing to drop here.
                self.view
                    .released(&file.node, file.fd.as_fd(), file.bypasses, file.maps_writes);
            }
        }
        reply.ok();
    }

    fn fsync(&self, fh: FileHandle, datasync: bool, reply: ReplyEmpty) {
        let handle = tri!(reply, self.file(fh));
        let Some(file) = handle.as_file() else {
            return reply.error(errno(Errno::EBADF));
        };
        let res = if datasync {
            nix::unistd::fdatasync(file.fd.as_fd())
        } else {
            nix::unistd::fsync(file.fd.as_fd())
        };
        tri!(reply, res);
        self.view.resettle(&file.node, file.fd.as_fd());
        reply.ok();
    }

    fn opendir(&self, ino: INodeNo, reply: ReplyOpen) {
        let node = tri!(reply, self.view.node(ino.0));
        if !node.is_dir() {
            return reply.error(errno(Errno::ENOTDIR));
        }
        let fh = self.handles.insert(Handle::Dir(DirHandle {
            ino: ino.0,
            entries: Mutex::new(Arc::new(Vec::new())),
        }));
        // The kernel may keep a listing across opens, as it keeps names: a directory's
        // entries change only through this mount (which bumps the directory's version, and
        // that drops the cached listing) or through a refresh, which invalidates the
        // directories whose entries it changes (see `refresh::invalidate`).
        let cache = if self.timeouts.entry.is_zero() {
            FopenFlags::empty()
        } else {
            FopenFlags::FOPEN_CACHE_DIR | FopenFlags::FOPEN_KEEP_CACHE
        };
        reply.opened(FileHandle(fh), cache);
    }

    fn readdir(&self, ino: INodeNo, fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        let Some(handle) = self.handles.get(fh.0) else {
            return reply.error(errno(Errno::EBADF));
        };
        let Some(dir) = handle.as_dir() else {
            return reply.error(errno(Errno::EBADF));
        };
        // Offset 0 is an opendir or a rewind: take a fresh listing.
        let entries = if offset == 0 {
            let node = tri!(reply, self.view.node(ino.0));
            let listing = Arc::new(tri!(reply, self.view.list(&node)));
            *dir.entries.lock() = listing.clone();
            listing
        } else {
            dir.entries.lock().clone()
        };
        let parent = self
            .view
            .node(ino.0)
            .ok()
            .and_then(|n| n.primary())
            .map_or(ino.0, |(p, _)| p.ino);
        // Offsets: 1 is after ".", 2 after "..", 3 + i after entries[i].
        let dots = [(".", ino.0), ("..", parent)];
        for (i, (name, dot_ino)) in dots.iter().enumerate().skip(offset as usize) {
            if reply.add(
                INodeNo(*dot_ino),
                i as u64 + 1,
                fuser::FileType::Directory,
                name,
            ) {
                return reply.ok();
            }
        }
        let skip = (offset as usize).saturating_sub(2);
        for (i, e) in entries.iter().enumerate().skip(skip) {
            if reply.add(INodeNo(e.ino), (i + 3) as u64, file_type(e.kind), &e.name) {
                break;
            }
        }
        reply.ok();
    }

    fn releasedir(&self, fh: FileHandle, reply: ReplyEmpty) {
        self.handles.remove(fh.0);
        reply.ok();
    }

    fn fsyncdir(&self, ino: INodeNo, datasync: bool, reply: ReplyEmpty) {
        let node = tri!(reply, self.view.node(ino.0));
        if let Some(local) = node.dir_fds().local {
            let dir = tri!(
                reply,
                crate::store::reopen(
                    local.as_fd(),
                    nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_DIRECTORY
                )
            );
            let res = if datasync {
                nix::unistd::fdatasync(dir.as_fd())
            } else {
                nix::unistd::fsync(dir.as_fd())
            };
            tri!(reply, res);
        }
        reply.ok();
    }

    fn statfs(&self, ino: INodeNo, reply: ReplyStatfs) {
        let node = tri!(reply, self.view.node(ino.0));
        let s = tri!(reply, self.view.statfs_at(&node));
        reply.statfs(
            s.f_blocks,
            s.f_bfree,
            s.f_bavail,
            s.f_files,
            s.f_ffree,
            s.f_bsize as u32,
            s.f_namemax as u32,
            s.f_frsize as u32,
        );
    }

    fn setxattr(
        &self,
        req: Who,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        reply: ReplyEmpty,
    ) {
        let node = tri!(reply, self.view.node(ino.0));
        tri!(
            reply,
            self.view.setxattr(&node, name, value, flags, caller(req))
        );
        reply.ok();
    }

    fn getxattr(&self, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        let node = tri!(reply, self.view.node(ino.0));
        let value = tri!(reply, self.view.getxattr(&node, name));
        reply_sized(reply, &value, size);
    }

    fn listxattr(&self, ino: INodeNo, size: u32, reply: ReplyXattr) {
        let node = tri!(reply, self.view.node(ino.0));
        let names = tri!(reply, self.view.listxattr(&node));
        reply_sized(reply, &names, size);
    }

    fn removexattr(&self, req: Who, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let node = tri!(reply, self.view.node(ino.0));
        tri!(reply, self.view.removexattr(&node, name, caller(req)));
        reply.ok();
    }

    fn access(&self, ino: INodeNo, reply: ReplyEmpty) {
        // default_permissions: the kernel checks permissions itself.
        tri!(reply, self.view.node(ino.0));
        reply.ok();
    }

    fn create(
        &self,
        who: Caller,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let (entry, fd) = tri!(reply, self.view.create(parent.0, name, mode, flags, who));
        let layer = crate::view::Layer::Local;
        let writes = flags & libc::O_ACCMODE != libc::O_RDONLY;
        let granted = self.grant(&entry.node, &fd, layer, writes, |fd| {
            backing_as(who, layer, || reply.open_backing(fd))
        });
        // A new object has no other open to be bound to.
        let granted = tri!(reply, granted).unwrap_or(Granted {
            grant: Grant::Uncached,
            held: None,
        });
        let (fh, grant) = self.opened(&entry.node, fd, layer, writes, true, granted);
        let fopen = open_flags(&grant);
        let attr = file_attr(&entry.stat);
        let ttl = self.attr_ttl(&entry.node);
        match &grant {
            Grant::Passthrough(id) | Grant::Direct(id) => {
                reply.created_passthrough(&ttl, &attr, Generation(0), FileHandle(fh), fopen, id)
            }
            Grant::Cached | Grant::Uncached => {
                reply.created(&ttl, &attr, Generation(0), FileHandle(fh), fopen)
            }
        }
    }

    fn fallocate(
        &self,
        req: Who,
        fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let handle = tri!(reply, self.file(fh));
        let Some(file) = handle.as_file() else {
            return reply.error(errno(Errno::EBADF));
        };
        tri!(
            reply,
            self.view.fallocate_at(
                &file.node,
                file.fd.as_fd(),
                mode,
                offset,
                length,
                caller(req)
            )
        );
        reply.ok();
    }

    fn lseek(&self, fh: FileHandle, offset: i64, whence: i32, reply: ReplyLseek) {
        let handle = tri!(reply, self.file(fh));
        let Some(file) = handle.as_file() else {
            return reply.error(errno(Errno::EBADF));
        };
        let copy = tri!(reply, self.copy_of(file));
        let fd = copy.as_deref().unwrap_or(&file.fd);
        let res = unsafe { libc::lseek(fd.as_raw_fd(), offset as libc::off_t, whence) };
        let pos = tri!(reply, Errno::result(res));
        reply.offset(pos);
    }

    /// `from` and `to`: an open file and an offset in it.
    fn copy_file_range(
        &self,
        req: Who,
        from: (FileHandle, u64),
        to: (FileHandle, u64),
        len: u64,
        reply: ReplyWrite,
    ) {
        let ((fh_in, offset_in), (fh_out, offset_out)) = (from, to);
        let (src, dst) = (
            tri!(reply, self.file(fh_in)),
            tri!(reply, self.file(fh_out)),
        );
        let (Some(src), Some(dst)) = (src.as_file(), dst.as_file()) else {
            return reply.error(errno(Errno::EBADF));
        };
        let n = tri!(
            reply,
            self.view.copy_range_at(
                &dst.node,
                (src.fd.as_fd(), offset_in),
                (dst.fd.as_fd(), offset_out),
                len,
                caller(req),
            )
        );
        reply.written(n as u32);
    }
}

fn reply_sized(reply: ReplyXattr, value: &[u8], size: u32) {
    if size == 0 {
        reply.size(value.len() as u32);
    } else if (size as usize) < value.len() {
        reply.error(errno(Errno::ERANGE));
    } else {
        reply.data(value);
    }
}
