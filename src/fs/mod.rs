//! The FUSE glue: each request becomes one call on the [`View`], each `Errno` a reply.
//! Requests that may wait on the remote are served on the remote pool ([`pool`]), the
//! rest on the FUSE thread that read them ([`dispatch`]). The handlers live by family:
//! `session` (init), `entries` (names and attributes), `files` (opens and I/O), `dirs`
//! (listings) and `xattrs`; this module holds what they share.
//!
//! Caching is deliberate. Every change to local goes through this daemon, and the kernel
//! updates its own caches for the changes it asks for; the remote is read-only between
//! refreshes, and a refresh invalidates exactly what it changes. So entries and attributes
//! are cached for long (`Timeouts`), file data is kept across opens (`FOPEN_KEEP_CACHE`) or
//! not touched by the daemon at all (passthrough), and symlink targets are cached.

pub mod attr;
pub mod backing;
mod cpus;
mod dispatch;

pub use dispatch::LayerFs;
pub(crate) use dispatch::{CROWD_THREADS, SYNC_THREADS};
pub use resume::{HandleFact, Negotiated, Resume};
pub mod handles;
pub mod kernel_mount;
pub mod pool;
pub mod ring;
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

use crate::notice::Notices;
use crate::quota::Reserved;
use crate::store::creds;
use crate::view::attrs::{SetAttr, Time};
use crate::view::{Caller, Entry, Layer, Node, View};
use attr::{file_attr, file_type};
use backing::{BackingTable, Grant, Opening, Rights};
use handles::{DirHandle, FileHandle as OpenFile, Handle, HandleTable};

/// How long the kernel trusts the attributes a CREATE answers with, of a file it opens for
/// writing through passthrough, which a shared mapping may change unseen. Not zero: the
/// kernel checks permissions against its cached attributes, and a zero lifetime made it
/// ask again for every create. The kernel counts it in clock ticks: it lasts to the next
/// one, during which a write changes no timestamp local's filesystem keeps coarsely.
/// Every other answer about such a file is trusted not at all (see [`Core::attr_ttl`]).
const CREATED_WRITER_TTL: Duration = Duration::from_millis(1);

/// How long the kernel may trust what it was told.
/// What the daemon asks of the kernel's FUSE transport; the kernel may refuse either.
#[derive(Debug, Clone, Copy)]
pub struct Transport {
    /// File I/O goes straight to local's files (FUSE passthrough).
    pub passthrough: bool,
    /// Requests come through FUSE over io_uring (see [`ring`]).
    pub io_uring: bool,
    /// The kernel keeps the data and listings it cached from one open to the next. Off
    /// under `strictatime`: every open's reads then reach local, where they move the access
    /// time (see `store::atime`).
    pub keep_cache: bool,
}

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
    want_ring: bool,
    keep_cache: bool,
    /// Whether the kernel took FUSE_OVER_IO_URING at `init`: the ring's queues may register.
    ring: Arc<AtomicBool>,
    notices: Arc<Notices>,
    /// Where opens and releases are kept for a daemon that resumes (see [`resume`]).
    journal: std::sync::OnceLock<Arc<dyn crate::view::keep::Journal>>,
    /// Handles an earlier daemon handed out, not yet opened again (see [`resume`]).
    orphans: resume::Orphans,
    /// This daemon resumed a connection: handle numbers it never gave are an earlier
    /// daemon's.
    resumed: AtomicBool,
}

impl Core {
    fn new(view: Arc<View>, timeouts: Timeouts, transport: Transport) -> Core {
        Core {
            notices: Arc::new(Notices::new(&view)),
            view,
            handles: HandleTable::new(),
            backing: BackingTable::default(),
            timeouts,
            want_passthrough: transport.passthrough,
            passthrough: AtomicBool::new(false),
            want_ring: transport.io_uring,
            keep_cache: transport.keep_cache,
            ring: Arc::new(AtomicBool::new(false)),
            journal: std::sync::OnceLock::new(),
            orphans: Default::default(),
            resumed: AtomicBool::new(false),
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
            Generation(u64::from(entry.node.generation)),
        );
    }

    /// How long the kernel may keep a node's attributes: not at all while it may be
    /// written through a shared mapping of its backing file, which the daemon never hears
    /// of. A lifetime of even a millisecond lasts to the kernel's next clock tick, long
    /// enough for a writer to map, write, unmap and exit, and for a `stat` after that to
    /// see the times from before.
    fn attr_ttl(&self, node: &Node) -> Duration {
        self.ttl_unless_mapped(node, Duration::ZERO)
    }

    /// [`Core::attr_ttl`] for the answer to a CREATE (see [`CREATED_WRITER_TTL`]).
    fn created_ttl(&self, node: &Node) -> Duration {
        self.ttl_unless_mapped(node, CREATED_WRITER_TTL)
    }

    /// The attribute lifetime, or `mapped` while the file may be written through a mapping.
    fn ttl_unless_mapped(&self, node: &Node, mapped: Duration) -> Duration {
        match node.state().mapped_writers {
            0 => self.timeouts.attr,
            _ => mapped,
        }
    }

    /// Runs `call`, which opens descriptors, on the view; on a pool's worker it waits for
    /// descriptors to be freed if it runs out (see [`trim::patiently`]), elsewhere it fails
    /// at once and the handler hands its request back (see `opened!`).
    fn patiently<T>(&self, call: impl Fn(&View) -> Result<T, Errno>) -> Result<T, Errno> {
        trim::patiently(|| {
            let result = call(&self.view);
            if result.as_ref().is_err_and(|e| trim::out_of_descriptors(*e)) {
                // However few nodes the table holds, trimming has work to do.
                self.view.inodes.run_short();
            }
            result
        })
    }

    fn file(&self, fh: FileHandle) -> Result<Arc<Handle>, Errno> {
        match self.handles.file(fh.0) {
            Some(handle) => Ok(handle),
            None => self.adopt(fh.0).ok_or(Errno::EBADF),
        }
    }
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

fn time(t: TimeOrNow) -> Time {
    match t {
        TimeOrNow::Now => Time::Now,
        TimeOrNow::SpecificTime(t) => Time::At(t),
    }
}

/// What a handler that opens objects returns: `Err` with its reply, unanswered, when it
/// found no descriptor free on a thread that must not wait for one (see `opened!`).
type Handed<R> = Result<(), R>;

/// What a handler returns once it has replied.
trait Replied {
    fn replied() -> Self;
}

impl Replied for () {
    fn replied() {}
}

impl<R> Replied for Handed<R> {
    fn replied() -> Self {
        Ok(())
    }
}

macro_rules! tri {
    ($reply:expr, $e:expr) => {
        match $e {
            Ok(v) => v,
            Err(e) => {
                $reply.error(errno(e));
                return Replied::replied();
            }
        }
    };
}

/// `tri!` for the call that opens a request's objects ([`Core::patiently`]). Out of
/// descriptors on a thread that reads requests, the handler hands its reply back, to be
/// served again on a pool where it may wait for them (see `dispatch`).
macro_rules! opened {
    ($reply:expr, $e:expr) => {
        match $e {
            Err(e) if trim::out_of_descriptors(e) && !pool::on_worker() => return Err($reply),
            result => tri!($reply, result),
        }
    };
}

// The request families, each an `impl Core` of its own that `dispatch` calls.
mod dirs;
mod entries;
mod files;
mod resent;
mod resume;
mod session;
mod xattrs;
