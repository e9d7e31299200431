//! FUSE over io_uring (the kernel's `fs/fuse/dev_uring.c`): the request transport a mount uses
//! when asked to (`io_uring`) and the kernel offers it (the `fuse` module's `enable_uring`).
//!
//! Why: on a small VM a /dev/fuse round trip wakes a daemon thread on an idle CPU and then the
//! caller's CPU again, 12–13 µs; a ring queue thread runs on the caller's CPU, and one
//! `io_uring_enter` both answers a request and fetches the next, 6.5 µs (`benches/uring`).
//!
//! The kernel keeps one queue per possible CPU and hands a request to the queue of the CPU its
//! caller runs on. Each queue here is one thread pinned to that CPU with its own io_uring
//! (SQE128: the command area carries `struct fuse_uring_cmd_req`) and `depth` entries. An entry
//! is a header buffer (`struct fuse_uring_req_header`) and a payload buffer. Its completion
//! means the kernel wrote a request into it; the reply goes back into the same buffers and
//! FUSE_IO_URING_CMD_COMMIT_AND_FETCH delivers it and re-arms the entry. The kernel switches
//! to the ring once every queue has an entry; FORGET and INTERRUPT always come through
//! /dev/fuse, whose threads keep running.
//!
//! A request handed to a pool (one that may wait on the remote, an fsync) keeps its entry
//! until its reply, which is written into the entry from the pool's thread; the queue thread
//! is woken through an eventfd to commit it, since only a ring's own thread may submit
//! (IORING_SETUP_SINGLE_ISSUER). So an entry is held for as long as its caller waits, and a
//! queue with every entry held makes the next callers on its CPU wait in the kernel: `depth`
//! is sized above the pools' workers for that reason.
//!
//! Lock order: a queue's `answered` list is a leaf lock, taken for a push or a swap only.

use std::cell::Cell;
use std::io::{self, IoSlice};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Duration;

use fuser::{Dispatcher, Filesystem, ReplySink};
use io_uring::{cqueue, opcode, squeue, types, IoUring};
use parking_lot::Mutex;
use tracing::{info, warn};

/// `struct fuse_uring_req_header`: the request's `fuse_in_header` (the reply's
/// `fuse_out_header`), the operation's own header, then `struct fuse_uring_ent_in_out`.
const HEADER_SIZE: usize = 3 * 128;
const OP_IN: usize = 128;
const OP_IN_SIZE: usize = 128;
const COMMIT_ID: usize = 256 + 8;
const PAYLOAD_SIZE: usize = 256 + 16;
const IN_HEADER_SIZE: usize = 40;
const OUT_HEADER_SIZE: usize = 16;

const CMD_REGISTER: u32 = 1;
const CMD_COMMIT_AND_FETCH: u32 = 2;

/// The `user_data` of the eventfd read that wakes a queue for replies from other threads.
const WAKEUP: u64 = u64::MAX;

/// The `max_write` a ring mount asks for: the kernel's default limit of 256 pages, which caps
/// a request anyway, and which every entry's payload buffer must then hold.
pub const MAX_WRITE: u32 = 1 << 20;

/// How the queues are built.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    /// Entries per queue: requests a CPU can have outstanding at once.
    pub depth: usize,
    /// Bytes of an entry's payload buffer: the kernel wants the largest request or reply,
    /// `max(8 KiB, max_write, max_pages * page size)`.
    pub payload: usize,
}

impl Settings {
    /// Entries enough for every worker of the pools to hold one, with as many again for the
    /// requests served in place; payloads as large as `MAX_WRITE` allows a request to be.
    pub fn for_pools(workers: usize) -> Settings {
        // SAFETY: sysconf has no memory-safety preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
        Settings {
            depth: (2 * workers).clamp(8, 256),
            payload: (MAX_WRITE as usize).max(256 * page),
        }
    }
}

/// The number of queues the kernel makes: one per possible CPU, not per online one.
fn possible_cpus() -> usize {
    let list = std::fs::read_to_string("/sys/devices/system/cpu/possible").unwrap_or_default();
    let counted: usize = list
        .trim()
        .split(',')
        .filter_map(|range| {
            let (first, last) = range.split_once('-').unwrap_or((range, range));
            let (first, last): (usize, usize) = (first.parse().ok()?, last.parse().ok()?);
            Some(last.checked_sub(first)? + 1)
        })
        .sum();
    if counted > 0 {
        counted
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    }
}

/// Starts one queue per possible CPU, serving requests through `dispatcher`. Returns what
/// stops them, to be called once the connection is gone (the /dev/fuse threads have ended).
/// A queue that cannot start is logged and leaves the connection on /dev/fuse, where the
/// kernel keeps sending requests until every queue has registered; `serving` then says no.
pub fn start<FS: Filesystem>(
    dispatcher: Dispatcher<FS>,
    device: OwnedFd,
    settings: Settings,
    serving: &AtomicBool,
) -> Box<dyn FnOnce() + Send> {
    let device = Arc::new(device);
    let (ready_tx, ready_rx) = mpsc::channel();
    let mut queues = Vec::new();
    let cpus = possible_cpus();
    for qid in 0..cpus {
        let shared = match Queue::new() {
            Ok(q) => Arc::new(q),
            Err(e) => {
                warn!(error = %e, "FUSE over io_uring: no eventfd for a queue");
                break;
            }
        };
        let (dispatcher, device, ready) = (dispatcher.clone(), device.clone(), ready_tx.clone());
        let thread_shared = shared.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("fuse-ring-{qid}"))
            .spawn(move || {
                let served = serve_queue(
                    &thread_shared,
                    qid as u16,
                    &device,
                    &dispatcher,
                    settings,
                    &ready,
                );
                if let Err(e) = &served {
                    warn!(queue = qid, error = %e, "FUSE io_uring queue ended");
                }
            });
        match spawned {
            Ok(thread) => queues.push((shared, thread)),
            Err(e) => {
                warn!(error = %e, "FUSE over io_uring: a queue thread did not start");
                break;
            }
        }
    }
    drop((ready_tx, dispatcher));
    let mut registered = 0;
    for _ in 0..queues.len() {
        match ready_rx.recv_timeout(Duration::from_secs(10)) {
            Ok(Ok(())) => registered += 1,
            Ok(Err(e)) => warn!(error = %e, "FUSE over io_uring: a queue did not register"),
            Err(_) => warn!("FUSE over io_uring: a queue did not register within 10 s"),
        }
    }
    let all = registered > 0 && registered == cpus;
    serving.store(all, Ordering::Relaxed);
    if all {
        info!(
            queues = registered,
            depth = settings.depth,
            "FUSE requests go through io_uring"
        );
    } else {
        warn!(
            registered,
            "FUSE over io_uring needs a queue on every possible CPU; requests stay on /dev/fuse"
        );
    }
    Box::new(move || stop(queues))
}

fn stop(queues: Vec<(Arc<Queue>, JoinHandle<()>)>) {
    for (queue, _) in &queues {
        queue.stopping.store(true, Ordering::Release);
        queue.wake();
    }
    for (_, thread) in queues {
        let _ = thread.join();
    }
}

/// What a queue's thread shares with the threads that answer its requests.
struct Queue {
    /// Entries whose replies are written and wait to be committed.
    answered: Mutex<Vec<u32>>,
    /// Wakes the queue's thread for replies sent from other threads, and to stop.
    wakeup: OwnedFd,
    stopping: AtomicBool,
}

thread_local! {
    /// The queue whose thread this is, if any: its own replies need no wakeup.
    static SERVING: Cell<*const Queue> = const { Cell::new(std::ptr::null()) };
}

impl Queue {
    fn new() -> io::Result<Queue> {
        // SAFETY: eventfd has no memory-safety preconditions; the descriptor is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Queue {
            answered: Mutex::new(Vec::new()),
            // SAFETY: a descriptor just created and owned by nobody else.
            wakeup: unsafe { OwnedFd::from_raw_fd(fd) },
            stopping: AtomicBool::new(false),
        })
    }

    fn answer(&self, entry: u32) {
        self.answered.lock().push(entry);
        if !SERVING.with(|s| std::ptr::eq(s.get(), self)) {
            self.wake();
        }
    }

    fn wake(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live buffer. An eventfd write fails only when its
        // counter would overflow, and then the thread is already due to wake.
        unsafe { libc::write(self.wakeup.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    }
}

/// One ring entry: its buffers, which the kernel writes while the entry's command is in
/// flight, and the queue its replies go to. Kept as raw allocations, turned into slices only
/// while the entry is the daemon's (between its completion and its commit).
#[derive(Debug)]
struct Entry {
    index: u32,
    header: *mut u8,
    payload: *mut u8,
    payload_len: usize,
    iov: *mut [libc::iovec; 2],
    queue: Arc<Queue>,
}

// SAFETY: the buffers are only touched by whoever holds the entry at the time (the kernel,
// the queue thread, or the reply of the request in it); hand-overs go through the ring or
// the queue's lock.
unsafe impl Send for Entry {}
// SAFETY: as above.
unsafe impl Sync for Entry {}

impl std::fmt::Debug for Queue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queue").finish_non_exhaustive()
    }
}

fn leak_zeroed(len: usize) -> *mut u8 {
    Box::into_raw(vec![0u8; len].into_boxed_slice()).cast()
}

impl Entry {
    fn new(index: u32, payload_len: usize, queue: Arc<Queue>) -> Entry {
        let header = leak_zeroed(HEADER_SIZE);
        let payload = leak_zeroed(payload_len);
        let iov = Box::into_raw(Box::new([
            libc::iovec {
                iov_base: header.cast(),
                iov_len: HEADER_SIZE,
            },
            libc::iovec {
                iov_base: payload.cast(),
                iov_len: payload_len,
            },
        ]));
        Entry {
            index,
            header,
            payload,
            payload_len,
            iov,
            queue,
        }
    }

    /// The entry's buffers.
    ///
    /// # Safety
    /// The entry must be the caller's: its request completed and its commit not yet queued.
    #[allow(clippy::mut_from_ref)]
    unsafe fn buffers(&self) -> (&mut [u8], &mut [u8]) {
        unsafe {
            (
                std::slice::from_raw_parts_mut(self.header, HEADER_SIZE),
                std::slice::from_raw_parts_mut(self.payload, self.payload_len),
            )
        }
    }
}

impl Drop for Entry {
    /// Runs only once the kernel has let go of the entry: the queue thread leaks its entries
    /// on every path where one may still be in flight.
    fn drop(&mut self) {
        // SAFETY: allocated in `Entry::new` with these lengths; nobody else holds them now.
        unsafe {
            drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.header,
                HEADER_SIZE,
            )));
            drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.payload,
                self.payload_len,
            )));
            drop(Box::from_raw(self.iov));
        }
    }
}

impl ReplySink for Entry {
    /// Writes the reply (`fuse_out_header` and arguments) into the entry: the header into the
    /// header buffer, the arguments into the payload. A reply larger than the payload, which
    /// the kernel's own limits rule out, becomes EIO rather than a lost request.
    fn send(&self, reply: &[IoSlice<'_>]) -> io::Result<()> {
        // SAFETY: the entry holds this reply's request; its commit waits for this call.
        let (header, payload) = unsafe { self.buffers() };
        let total: usize = reply.iter().map(|part| part.len()).sum();
        let fits = (OUT_HEADER_SIZE..=OUT_HEADER_SIZE + self.payload_len).contains(&total);
        let args = if fits {
            // The parts are cut anywhere: the first 16 bytes are the header, the rest payload.
            let mut written = 0;
            for part in reply {
                let mut part: &[u8] = part;
                if written < OUT_HEADER_SIZE {
                    let head = part.len().min(OUT_HEADER_SIZE - written);
                    header[written..written + head].copy_from_slice(&part[..head]);
                    (part, written) = (&part[head..], written + head);
                }
                if !part.is_empty() {
                    let at = written - OUT_HEADER_SIZE;
                    payload[at..at + part.len()].copy_from_slice(part);
                    written += part.len();
                }
            }
            total - OUT_HEADER_SIZE
        } else {
            put_u32(header, 0, OUT_HEADER_SIZE as u32);
            put_u32(header, 4, (-libc::EIO) as u32);
            0
        };
        put_u32(header, PAYLOAD_SIZE, args as u32);
        self.queue.answer(self.index);
        if fits {
            Ok(())
        } else {
            Err(io::Error::other(format!(
                "a reply of {total} bytes does not fit a ring entry"
            )))
        }
    }
}

fn put_u32(buf: &mut [u8], at: usize, value: u32) {
    buf[at..at + 4].copy_from_slice(&value.to_ne_bytes());
}

fn get_u32(buf: &[u8], at: usize) -> u32 {
    u32::from_ne_bytes(buf[at..at + 4].try_into().expect("4 bytes"))
}

fn get_u64(buf: &[u8], at: usize) -> u64 {
    u64::from_ne_bytes(buf[at..at + 8].try_into().expect("8 bytes"))
}

type Ring = IoUring<squeue::Entry128, cqueue::Entry>;

/// A FUSE ring command: `struct fuse_uring_cmd_req` in the SQE's 80-byte command area.
fn command(device: &OwnedFd, op: u32, qid: u16, commit_id: u64) -> opcode::UringCmd80 {
    let mut req = [0u8; 80];
    req[8..16].copy_from_slice(&commit_id.to_ne_bytes());
    req[16..18].copy_from_slice(&qid.to_ne_bytes());
    opcode::UringCmd80::new(types::Fd(device.as_raw_fd()), op).cmd(req)
}

/// Sets `sqe->len`, where REGISTER wants its iovec count; the io-uring crate's UringCmd80 has
/// no setter for it. `Entry128` is the 64-byte `struct io_uring_sqe` (with `len` the u32 at
/// offset 24) followed by the command area.
fn with_len(mut sqe: squeue::Entry128, len: u32) -> squeue::Entry128 {
    const _: () = assert!(std::mem::size_of::<squeue::Entry128>() == 128);
    // SAFETY: in bounds of a 128-byte value; an unaligned write is allowed.
    unsafe {
        (&mut sqe as *mut squeue::Entry128)
            .cast::<u8>()
            .add(24)
            .cast::<u32>()
            .write_unaligned(len)
    };
    sqe
}

fn push(ring: &mut Ring, sqe: &squeue::Entry128) -> io::Result<()> {
    loop {
        // SAFETY: every buffer the SQE points at outlives its command (see `Entry`).
        if unsafe { ring.submission().push(sqe) }.is_ok() {
            return Ok(());
        }
        ring.submit()?;
    }
}

/// One queue's thread: registers its entries, then serves until the connection is gone.
fn serve_queue<FS: Filesystem>(
    queue: &Arc<Queue>,
    qid: u16,
    device: &OwnedFd,
    dispatcher: &Dispatcher<FS>,
    settings: Settings,
    ready: &mpsc::Sender<io::Result<()>>,
) -> io::Result<()> {
    // An unpinned queue still works: the kernel picks a queue by its caller's CPU only.
    super::cpus::pin(usize::from(qid));
    SERVING.with(|s| s.set(Arc::as_ptr(queue)));
    let started = QueueRing::start(queue, qid, device, settings);
    let (mut ring, completions) = match started {
        Ok(started) => started,
        Err(e) => {
            let _ = ready.send(Err(io::Error::new(e.kind(), e.to_string())));
            return Err(e);
        }
    };
    // A REGISTER completes when a request arrives, or at once with an error.
    match completions
        .iter()
        .find(|&&(tag, res)| tag != WAKEUP && res < 0)
    {
        Some(&(_, res)) => {
            let e = io::Error::from_raw_os_error(-res);
            let _ = ready.send(Err(io::Error::new(
                e.kind(),
                format!("FUSE_IO_URING_CMD_REGISTER: {e}"),
            )));
        }
        None => {
            let _ = ready.send(Ok(()));
        }
    }
    ring.serve(dispatcher, completions, settings.payload)
}

/// A queue's ring and entries, owned by the queue's thread.
struct QueueRing<'a> {
    ring: Ring,
    entries: Vec<Arc<Entry>>,
    /// Entries whose command is in the kernel, which may write their buffers meanwhile.
    in_flight: usize,
    /// The connection is being torn down: what is answered now is not committed.
    gone: bool,
    /// The eventfd read's buffer. Leaked (8 bytes a queue): the read is still pending when
    /// the ring closes, and the kernel cancels it after the close, not before.
    wakeup_count: &'static mut [u8; 8],
    queue: &'a Arc<Queue>,
    qid: u16,
    device: &'a OwnedFd,
}

impl Drop for QueueRing<'_> {
    /// An entry still in the kernel is leaked rather than freed under it: the ring's close
    /// cancels the commands after the close, not before.
    fn drop(&mut self) {
        if self.in_flight > 0 {
            std::mem::forget(std::mem::take(&mut self.entries));
        }
    }
}

impl<'a> QueueRing<'a> {
    /// Sets up the ring and registers `depth` entries and the wakeup read. Returns the
    /// completions already there.
    fn start(
        queue: &'a Arc<Queue>,
        qid: u16,
        device: &'a OwnedFd,
        settings: Settings,
    ) -> io::Result<(QueueRing<'a>, Vec<(u64, i32)>)> {
        let depth = settings.depth.max(1);
        let mut builder = IoUring::<squeue::Entry128, cqueue::Entry>::builder();
        builder
            .setup_single_issuer()
            .setup_coop_taskrun()
            .setup_taskrun_flag();
        let ring = builder
            .build((depth + 1) as u32)
            .map_err(|e| io::Error::new(e.kind(), format!("io_uring_setup: {e}")))?;
        let mut this = QueueRing {
            ring,
            entries: (0..depth)
                .map(|i| Arc::new(Entry::new(i as u32, settings.payload, queue.clone())))
                .collect(),
            in_flight: 0,
            gone: false,
            wakeup_count: Box::leak(Box::new([0u8; 8])),
            queue,
            qid,
            device,
        };
        for i in 0..depth {
            let entry = &this.entries[i];
            let sqe = command(device, CMD_REGISTER, qid, 0)
                .addr(Some(entry.iov as u64))
                .build();
            let sqe = with_len(sqe, 2).user_data(u64::from(entry.index));
            // Counted before the push: once pushed, the kernel may hold the entry.
            this.in_flight += 1;
            push(&mut this.ring, &sqe)
                .map_err(|e| io::Error::new(e.kind(), format!("registering: {e}")))?;
        }
        this.arm_wakeup()?;
        this.ring.submit()?;
        // Room for every entry and the wakeup: the serving loop never grows it.
        let mut completions = Vec::with_capacity(depth + 1);
        this.take_completions(&mut completions);
        Ok((this, completions))
    }

    fn take_completions(&mut self, into: &mut Vec<(u64, i32)>) {
        into.extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
    }

    fn arm_wakeup(&mut self) -> io::Result<()> {
        let count = self.wakeup_count.as_mut_ptr();
        let read = opcode::Read::new(types::Fd(self.queue.wakeup.as_raw_fd()), count, 8)
            .build()
            .user_data(WAKEUP);
        push(&mut self.ring, &read.into())
    }

    /// Serves requests until the connection is gone, or the queue is stopped, and the kernel
    /// holds none of the entries.
    fn serve<FS: Filesystem>(
        &mut self,
        dispatcher: &Dispatcher<FS>,
        mut completions: Vec<(u64, i32)>,
        payload: usize,
    ) -> io::Result<()> {
        let mut request = vec![0u8; IN_HEADER_SIZE + OP_IN_SIZE + payload];
        let mut answered = Vec::new();
        loop {
            for (tag, res) in completions.drain(..) {
                self.completed(tag, res, dispatcher, &mut request)?;
            }
            std::mem::swap(&mut answered, &mut *self.queue.answered.lock());
            for index in answered.drain(..) {
                self.commit(index)?;
            }
            if self.in_flight == 0 && (self.gone || self.queue.stopping.load(Ordering::Acquire)) {
                return Ok(());
            }
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EBUSY)) => {}
                Err(e) => return Err(e),
            }
            self.take_completions(&mut completions);
        }
    }

    /// One completion: a request in an entry (served now), an entry the kernel let go of, or
    /// the wakeup.
    fn completed<FS: Filesystem>(
        &mut self,
        tag: u64,
        res: i32,
        dispatcher: &Dispatcher<FS>,
        request: &mut [u8],
    ) -> io::Result<()> {
        if tag == WAKEUP {
            if !self.queue.stopping.load(Ordering::Acquire) {
                self.arm_wakeup()?;
            }
            return Ok(());
        }
        let Some(entry) = self.entries.get(tag as usize) else {
            return Ok(());
        };
        self.in_flight -= 1;
        if res >= 0 {
            serve_entry(entry, dispatcher, request);
        } else if matches!(-res, libc::ENOTCONN | libc::ECONNABORTED | libc::ECANCELED) {
            self.gone = true;
        } else {
            let error = io::Error::from_raw_os_error(-res);
            warn!(queue = self.qid, %error, "a FUSE io_uring entry was refused");
        }
        Ok(())
    }

    /// Delivers the reply written into entry `index` and re-arms the entry.
    fn commit(&mut self, index: u32) -> io::Result<()> {
        if self.gone {
            return Ok(());
        }
        let entry = &self.entries[index as usize];
        // SAFETY: answered, so the entry is still ours until this commit is queued.
        let commit_id = get_u64(unsafe { entry.buffers() }.0, COMMIT_ID);
        let sqe = command(self.device, CMD_COMMIT_AND_FETCH, self.qid, commit_id)
            .build()
            .user_data(u64::from(entry.index));
        self.in_flight += 1;
        push(&mut self.ring, &sqe)
    }
}

/// Hands the request in `entry` to the filesystem. The kernel split it: its `fuse_in_header`
/// and the operation's own header sit in the header buffer, everything after in the payload;
/// fuser wants them in one piece, as a read of /dev/fuse returns them.
fn serve_entry<FS: Filesystem>(
    entry: &Arc<Entry>,
    dispatcher: &Dispatcher<FS>,
    request: &mut [u8],
) {
    // SAFETY: the completion handed the entry to us until its commit.
    let (header, payload) = unsafe { entry.buffers() };
    let len = get_u32(header, 0) as usize;
    let payload_len = get_u32(header, PAYLOAD_SIZE) as usize;
    let op_len = len.checked_sub(IN_HEADER_SIZE + payload_len);
    let assembled = match op_len {
        Some(op_len) if op_len <= OP_IN_SIZE && payload_len <= payload.len() => {
            request[..IN_HEADER_SIZE].copy_from_slice(&header[..IN_HEADER_SIZE]);
            request[IN_HEADER_SIZE..IN_HEADER_SIZE + op_len]
                .copy_from_slice(&header[OP_IN..OP_IN + op_len]);
            request[IN_HEADER_SIZE + op_len..len].copy_from_slice(&payload[..payload_len]);
            Some(&request[..len])
        }
        _ => None,
    };
    let sink: Arc<dyn ReplySink> = entry.clone();
    let dispatched = match assembled {
        Some(bytes) => dispatcher.dispatch(bytes, sink),
        None => Err(io::Error::from(io::ErrorKind::InvalidData)),
    };
    if let Err(e) = dispatched {
        warn!(error = %e, len, payload_len, "a malformed FUSE request from the ring was refused");
        let mut out = [0u8; OUT_HEADER_SIZE];
        out[..4].copy_from_slice(&(OUT_HEADER_SIZE as u32).to_ne_bytes());
        out[4..8].copy_from_slice(&(-libc::EIO).to_ne_bytes());
        out[8..].copy_from_slice(&header[8..16]);
        let _ = entry.send(&[IoSlice::new(&out)]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// fuser cuts a reply into parts anywhere; the first 16 bytes must land in the header
    /// buffer and the rest, in order, at the start of the payload.
    #[test]
    fn a_reply_cut_anywhere_lands_in_header_and_payload() {
        let queue = Arc::new(Queue::new().unwrap());
        let entry = Entry::new(0, 64, queue.clone());
        let reply: Vec<u8> = (0..40).collect();
        let parts = [&reply[..10], &reply[10..10], &reply[10..17], &reply[17..]];
        let slices: Vec<IoSlice<'_>> = parts.iter().map(|p| IoSlice::new(p)).collect();
        entry.send(&slices).unwrap();
        // SAFETY: the entry was never registered: nobody else holds it.
        let (header, payload) = unsafe { entry.buffers() };
        assert_eq!(header[..16], reply[..16]);
        assert_eq!(payload[..24], reply[16..]);
        assert_eq!(get_u32(header, PAYLOAD_SIZE), 24);
        assert_eq!(*queue.answered.lock(), vec![0]);
    }

    #[test]
    fn a_reply_larger_than_the_payload_becomes_eio() {
        let queue = Arc::new(Queue::new().unwrap());
        let entry = Entry::new(3, 8, queue);
        let reply = [7u8; 16 + 9];
        assert!(entry.send(&[IoSlice::new(&reply)]).is_err());
        // SAFETY: as above.
        let (header, _) = unsafe { entry.buffers() };
        assert_eq!(get_u32(header, 4) as i32, -libc::EIO);
        assert_eq!(get_u32(header, PAYLOAD_SIZE), 0);
    }
}
