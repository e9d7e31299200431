//! The FUSE entry points: each request is served on the FUSE thread that read it, unless it
//! may wait on the remote, in which case it goes to the remote pool with its reply, or is an
//! `fsync` of a local file, which goes to the sync pool (see [`super::pool`]). A request
//! that opens objects and runs out of descriptors here goes to the crowd pool, where it may
//! wait for them (see [`super::trim`] and [`LayerFs::opening`]). The `View` says which
//! requests may wait on the remote; [`Core`] serves them.

use std::borrow::Borrow;
use std::ffi::OsStr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use fuser::{
    AccessFlags, BsdFileFlags, CopyFileRangeFlags, FileHandle, Filesystem, ForgetOne, INodeNo,
    IoctlFlags, KernelConfig, LockOwner, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData,
    ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyIoctl, ReplyLseek, ReplyOpen, ReplyStatfs,
    ReplyWrite, ReplyXattr, Request, TimeOrNow, WriteFlags,
};

use super::pool::{Load, Pool};
use super::resent::resent;
use super::{creator, outcome, time, Core, Handed, Resume, Timeouts, Transport, Who};
use crate::metrics::{FsTables, Metrics};
use crate::notice::Notices;
use crate::view::attrs::SetAttr;
use crate::view::{Layer, View};

/// How many `fsync`s of local files may wait for the disk at once without holding a FUSE
/// thread.
pub(crate) const SYNC_THREADS: usize = 8;
/// How many requests may wait for descriptors at once without holding a FUSE thread.
pub(crate) const CROWD_THREADS: usize = 8;
/// How long a /dev/fuse reader pauses after a FORGET while the ring serves every other
/// request (see [`LayerFs::let_forgets_gather`]).
const FORGETS_GATHER: Duration = Duration::from_millis(1);

pub struct LayerFs {
    core: Arc<Core>,
    pool: Pool,
    sync: Pool,
    crowd: Pool,
    metrics: Option<Arc<Metrics>>,
}

impl LayerFs {
    /// Serves `view`, with `remote_threads` workers for requests that may wait on the
    /// remote; every request is counted in `metrics`, if given.
    pub fn new(
        view: Arc<View>,
        timeouts: Timeouts,
        transport: Transport,
        remote_threads: usize,
        metrics: Option<Arc<Metrics>>,
    ) -> std::io::Result<LayerFs> {
        let core = Arc::new(Core::new(view, timeouts, transport));
        if let Some(m) = &metrics {
            m.set_fs_tables(core.clone());
        }
        Ok(LayerFs {
            core,
            pool: Pool::start("remote", remote_threads, metrics.clone())?,
            sync: Pool::start("sync", SYNC_THREADS, None)?,
            crowd: Pool::start("crowd", CROWD_THREADS, None)?,
            metrics,
        })
    }

    /// When a request starts, if requests are counted.
    fn clock(&self) -> Option<Instant> {
        self.metrics.as_ref().map(|_| Instant::now())
    }

    /// Counts a request that started at `start` and has been replied to (on this thread).
    fn served(metrics: Option<&Metrics>, op: &'static str, start: Option<Instant>) {
        let failed = outcome::take();
        if let (Some(m), Some(start)) = (metrics, start) {
            m.request(op, start.elapsed(), failed);
        }
    }

    /// Serves a request on this thread and counts it.
    fn here(&self, op: &'static str, serve: impl FnOnce(&Core)) {
        let start = self.clock();
        let pass = self.core.view().gate().enter();
        serve(&self.core);
        drop(pass);
        Self::served(self.metrics.as_deref(), op, start);
    }

    pub fn view(&self) -> &Arc<View> {
        self.core.view()
    }

    /// Over the ring, /dev/fuse brings only FORGETs and INTERRUPTs. A reader waiting there
    /// is woken for every FORGET: each unlink wakes a thread on another CPU, from within the
    /// caller's system call, and that thread then runs beside the next unlink. A reader that
    /// pauses after a FORGET lets the kernel queue the next ones, and its next read takes
    /// them all as one BATCH_FORGET (`benches/README.md` has what it saves). Nothing waits
    /// for a FORGET; an INTERRUPT waits at most one pause. Until the queues have registered,
    /// the readers serve every request: a FORGET in that moment holds one of them back for
    /// one pause.
    fn let_forgets_gather(&self) {
        if self.core.ring.load(Ordering::Relaxed) {
            std::thread::sleep(FORGETS_GATHER);
        }
    }

    /// Set at `init` if the kernel took FUSE over io_uring.
    pub fn ring_negotiated(&self) -> Arc<AtomicBool> {
        self.core.ring.clone()
    }

    /// What a daemon that resumes this session's connection will need, and the means to
    /// restore it (see `resume`).
    pub fn resume(&self) -> Resume {
        Resume(self.core.clone())
    }

    /// Where handlers send their notices to the kernel; started once the session exists.
    pub fn notices(&self) -> Arc<Notices> {
        self.core.notices()
    }

    /// How busy the remote pool is.
    pub fn remote_load(&self) -> Arc<Load> {
        self.pool.load()
    }

    /// Serves `job` on `pool` and counts it, from now until it is replied to.
    fn on(&self, pool: &Pool, op: &'static str, job: impl FnOnce(&Core) + Send + 'static) {
        let start = self.clock();
        let (core, metrics) = (self.core.clone(), self.metrics.clone());
        pool.run(move || {
            let pass = core.view().gate().enter();
            job(&core);
            drop(pass);
            Self::served(metrics.as_deref(), op, start);
        });
    }

    /// Serves a request that opens objects: on the remote pool if it may `wait` on the
    /// remote, else here. One served here that finds no descriptor free hands its reply
    /// back and is served again on the crowd pool, where it may wait for one: a FUSE thread
    /// must not wait (it reads the FORGETs and RELEASEs that free descriptors), and a
    /// `mkdir` must not fail because the daemon keeps handles. So `serve` may run twice;
    /// `args` (a name) is copied only for a pool. On the crowd pool, the directories the
    /// kernel holds for it (`dirs`) are marked held: names there wait as long as it does
    /// (see `View::held_for`).
    ///
    /// A request is tried here first even while trimming is under way: most find a
    /// descriptor, and a failed try costs one call that fails at once, where a hop to a
    /// pool costs two thread wakeups for every request of a walk that outgrows the table.
    fn opening<A, R>(
        &self,
        op: &'static str,
        wait: bool,
        dirs: &[u64],
        args: &A,
        reply: R,
        serve: impl Fn(&Core, &A, R) -> Handed<R> + Send + 'static,
    ) where
        A: ToOwned + ?Sized,
        A::Owned: Send + 'static,
        R: Send + 'static,
    {
        // On a worker, `serve` always replies.
        if wait {
            let args = args.to_owned();
            return self.on(&self.pool, op, move |core| {
                let _ = serve(core, args.borrow(), reply);
            });
        }
        let start = self.clock();
        let pass = self.core.view().gate().enter();
        let served = serve(&self.core, args, reply);
        drop(pass);
        let Err(reply) = served else {
            return Self::served(self.metrics.as_deref(), op, start);
        };
        let held = (!dirs.is_empty()).then(|| self.core.view().held_for(dirs));
        let (core, metrics, args) = (self.core.clone(), self.metrics.clone(), args.to_owned());
        self.crowd.run(move || {
            let _held = held;
            let _pass = core.view().gate().enter();
            let _ = serve(&core, args.borrow(), reply);
            Self::served(metrics.as_deref(), op, start);
        });
    }

    /// The node of the open file `fh` if it was opened on the remote.
    fn opened_on_remote(&self, fh: FileHandle) -> Option<Arc<crate::view::Node>> {
        let handle = self.core.handles.file(fh.0)?;
        let file = handle.as_file()?;
        (file.layer == Layer::Remote).then(|| file.node.clone())
    }

    /// Whether I/O on the open file `fh` may wait on the remote: it was opened there and
    /// the file has no local copy yet (a change through it makes one, reads go to it).
    fn handle_may_wait(&self, fh: FileHandle) -> bool {
        self.opened_on_remote(fh)
            .is_some_and(|node| node.layer() != Layer::Local)
    }

    /// Whether closing the open file `fh` may wait on the remote: it was opened there.
    fn handle_on_remote(&self, fh: FileHandle) -> bool {
        self.opened_on_remote(fh).is_some()
    }

    fn view_of(&self) -> &View {
        &self.core.view
    }
}

/// Serves a request on the calling FUSE thread, or with owned arguments on the remote pool
/// if it may wait there. Requests that open objects are served by [`LayerFs::opening`].
macro_rules! serve {
    ($fs:ident, $op:literal, $wait:expr, $core:ident => $call:expr, own { $($name:ident),* }) => {
        if $wait {
            $(let $name = $name.to_owned();)*
            $fs.on(&$fs.pool, $op, move |$core| {
                $(let $name = &*$name;)*
                $call
            });
        } else {
            $fs.here($op, |$core| $call)
        }
    };
}

impl Filesystem for LayerFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        self.core.init(config)
    }

    fn destroy(&mut self) {
        self.core.destroy();
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        // A file handle's `.` or `..` may walk a path through the shared areas.
        let by_handle = matches!(name.as_encoded_bytes(), b"." | b"..");
        let wait = by_handle || self.view_of().name_may_wait(parent.0, name);
        self.opening(
            "lookup",
            wait,
            &[parent.0],
            name,
            reply,
            move |core, name, reply| core.lookup(parent, name, reply),
        );
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        self.here("forget", |core| core.forget(ino, nlookup));
        self.let_forgets_gather();
    }

    fn batch_forget(&self, _req: &Request, nodes: &[ForgetOne]) {
        self.here("batch_forget", |core| {
            for node in nodes {
                core.forget(node.nodeid(), node.nlookup());
            }
        });
        self.let_forgets_gather();
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let wait = self.view_of().object_may_wait(ino.0);
        serve!(self, "getattr", wait, core => core.getattr(ino, reply), own {});
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let who = Who::of(req);
        let set = SetAttr {
            mode,
            uid,
            gid,
            size,
            atime: atime.map(time),
            mtime: mtime.map(time),
        };
        let wait = self.view_of().object_may_wait(ino.0);
        serve!(self, "setattr", wait, core => core.setattr(who, ino, set, ctime, fh, reply), own {});
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let wait = self.view_of().object_may_wait(ino.0);
        serve!(self, "readlink", wait, core => core.readlink(ino, reply), own {});
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        let (who, resent) = (creator(Who::of(req), umask), resent(req));
        let wait = self.view_of().name_may_wait(parent.0, name);
        self.opening(
            "mknod",
            wait,
            &[parent.0],
            name,
            reply,
            move |core, name, reply| core.mknod(who, parent, name, mode, rdev, resent, reply),
        );
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let (who, resent) = (creator(Who::of(req), umask), resent(req));
        let wait = self.view_of().name_may_wait(parent.0, name);
        self.opening(
            "mkdir",
            wait,
            &[parent.0],
            name,
            reply,
            move |core, name, reply| core.mkdir(who, parent, name, mode, resent, reply),
        );
    }

    fn unlink(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let (wait, resent) = (self.view_of().name_may_wait(parent.0, name), resent(req));
        serve!(self, "unlink", wait, core => core.unlink(parent, name, resent, reply), own { name });
    }

    fn rmdir(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let (wait, resent) = (self.view_of().name_may_wait(parent.0, name), resent(req));
        serve!(self, "rmdir", wait, core => core.rmdir(parent, name, resent, reply), own { name });
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let (who, resent) = (Who::of(req), resent(req));
        let wait = self.view_of().name_may_wait(parent.0, link_name);
        // The target is copied: symlinks are few, and `opening` copies one name only.
        let target = target.to_owned();
        self.opening(
            "symlink",
            wait,
            &[parent.0],
            link_name,
            reply,
            move |core, link_name, reply| {
                core.symlink(who, parent, link_name, &target, resent, reply)
            },
        );
    }

    fn rename(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let view = self.core.view();
        let wait = view.name_may_wait(parent.0, name) || view.name_may_wait(newparent.0, newname);
        // The kernel holds both directories while the rename waits.
        let held = wait.then(|| view.held_for(&[parent.0, newparent.0]));
        let resent = resent(req);
        serve!(self, "rename", wait, core => {
            let _held = held;
            core.rename(parent, name, newparent, newname, flags, resent, reply)
        }, own { name, newname });
    }

    fn link(
        &self,
        req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let view = self.core.view();
        let wait = view.object_may_wait(ino.0) || view.name_may_wait(newparent.0, newname);
        // The kernel holds the new name's directory, which may be local, while the link
        // copies the file up from the remote; the mark lasts as long as the request.
        let copying = wait.then(|| view.held_for(&[newparent.0]));
        let resent = resent(req);
        self.opening(
            "link",
            wait,
            &[newparent.0],
            newname,
            reply,
            move |core, newname, reply| {
                let _copying = &copying;
                core.link(ino, newparent, newname, resent, reply)
            },
        );
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let who = Who::of(req);
        let wait = self.view_of().object_may_wait(ino.0);
        self.opening("open", wait, &[], &(), reply, move |core, (), reply| {
            core.open(who, ino, flags, reply)
        });
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let wait = self.handle_may_wait(fh);
        serve!(self, "read", wait, core => core.read(fh, offset, size, reply), own {});
    }

    fn write(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        // The first write through an open of a remote file copies it up.
        let who = Who::of(req);
        let wait = self.handle_may_wait(fh);
        serve!(self, "write", wait, core => core.write(who, fh, offset, data, write_flags, reply), own { data });
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // Nothing is buffered here and POSIX locks stay in the kernel, so a close needs no
        // round trip: ENOSYS tells the kernel never to send FLUSH again.
        reply.error(fuser::Errno::ENOSYS);
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        // Closing a file of a network share can wait on it too.
        let wait = self.handle_on_remote(fh);
        serve!(self, "release", wait, core => core.release(fh, reply), own {});
    }

    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        let pool = if self.handle_may_wait(fh) {
            &self.pool
        } else {
            &self.sync
        };
        self.on(pool, "fsync", move |core| core.fsync(fh, datasync, reply));
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        self.here("opendir", |core| core.opendir(ino, reply));
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        reply: ReplyDirectory,
    ) {
        // Only the first call of a listing reads the directory; later ones page through it.
        let wait = offset == 0 && self.view_of().entries_may_wait(ino.0);
        self.opening("readdir", wait, &[], &(), reply, move |core, (), reply| {
            core.readdir(ino, fh, offset, reply)
        });
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        self.here("releasedir", |core| core.releasedir(fh, reply));
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        self.on(&self.sync, "fsyncdir", move |core| {
            core.fsyncdir(ino, datasync, reply)
        });
    }

    fn statfs(&self, _req: &Request, ino: INodeNo, reply: ReplyStatfs) {
        self.here("statfs", |core| core.statfs(ino, reply));
    }

    fn setxattr(
        &self,
        req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        let who = Who::of(req);
        let wait = self.view_of().object_may_wait(ino.0);
        serve!(self, "setxattr", wait, core => core.setxattr(who, ino, name, value, flags, reply), own { name, value });
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        let wait = self.view_of().object_may_wait(ino.0);
        serve!(self, "getxattr", wait, core => core.getxattr(ino, name, size, reply), own { name });
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        let wait = self.view_of().object_may_wait(ino.0);
        serve!(self, "listxattr", wait, core => core.listxattr(ino, size, reply), own {});
    }

    fn removexattr(&self, req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let who = Who::of(req);
        let wait = self.view_of().object_may_wait(ino.0);
        serve!(self, "removexattr", wait, core => core.removexattr(who, ino, name, reply), own { name });
    }

    fn access(&self, _req: &Request, ino: INodeNo, _mask: AccessFlags, reply: ReplyEmpty) {
        self.here("access", |core| core.access(ino, reply));
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let (who, resent) = (creator(Who::of(req), umask), resent(req));
        let wait = self.view_of().name_may_wait(parent.0, name);
        self.opening(
            "create",
            wait,
            &[parent.0],
            name,
            reply,
            move |core, name, reply| core.create(who, parent, name, mode, flags, resent, reply),
        );
    }

    fn fallocate(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let who = Who::of(req);
        let wait = self.handle_may_wait(fh);
        serve!(self, "fallocate", wait, core => core.fallocate(who, fh, offset, length, mode, reply), own {});
    }

    fn lseek(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: i64,
        whence: i32,
        reply: ReplyLseek,
    ) {
        let wait = self.handle_may_wait(fh);
        serve!(self, "lseek", wait, core => core.lseek(fh, offset, whence, reply), own {});
    }

    fn ioctl(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: IoctlFlags,
        _cmd: u32,
        _in_data: &[u8],
        _out_size: u32,
        reply: ReplyIoctl,
    ) {
        // No ioctls are served: "not a terminal/not supported" is what callers probing
        // for inode flags (overlayfs copy-up, chattr) expect to handle.
        reply.error(fuser::Errno::from_i32(libc::ENOTTY));
    }

    fn copy_file_range(
        &self,
        req: &Request,
        _ino_in: INodeNo,
        fh_in: FileHandle,
        offset_in: u64,
        _ino_out: INodeNo,
        fh_out: FileHandle,
        offset_out: u64,
        len: u64,
        _flags: CopyFileRangeFlags,
        reply: ReplyWrite,
    ) {
        let who = Who::of(req);
        let (from, to) = ((fh_in, offset_in), (fh_out, offset_out));
        let wait = self.handle_may_wait(fh_in) || self.handle_may_wait(fh_out);
        serve!(self, "copy_file_range", wait, core => core.copy_file_range(who, from, to, len, reply), own {});
    }
}

impl FsTables for Core {
    fn open_handles(&self) -> usize {
        self.handles.len()
    }

    fn backing_files(&self) -> usize {
        self.backing.len()
    }
}
