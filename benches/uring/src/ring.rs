//! FUSE over io_uring (kernel `fs/fuse/dev_uring.c`, protocol 7.42).
//!
//! The kernel keeps one queue per possible CPU and hands a request to the queue of the CPU the
//! requesting task runs on. Each queue here is one thread, pinned to that CPU, owning one
//! io_uring (SQE128: the 80-byte command area carries `struct fuse_uring_cmd_req`). The
//! thread registers `depth` ring entries with FUSE_IO_URING_CMD_REGISTER; each entry is a
//! header buffer (`struct fuse_uring_req_header`) and a payload buffer. A completion means the
//! kernel has written a request into an entry; the reply goes back into the same buffers and
//! FUSE_IO_URING_CMD_COMMIT_AND_FETCH both delivers it and re-arms the entry, so a round trip
//! costs one io_uring_enter instead of a write plus a read.
//!
//! The kernel switches the connection to the ring only once every queue has an entry
//! registered; until then (and for FORGET/INTERRUPT always) requests go through /dev/fuse.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use io_uring::{cqueue, opcode, squeue, types, IoUring};

use crate::fs::{Fs, Reply, Request};
use crate::proto::*;
use crate::served::{Stats, Threads};

pub struct Setup {
    pub dev_fd: Arc<OwnedFd>,
    pub fs: Arc<Fs>,
    pub stats: Arc<Stats>,
    pub depth: usize,
    pub payload: usize,
    pub defer_taskrun: bool,
}

/// The kernel requires each entry's payload buffer to hold its largest request:
/// max(FUSE_MIN_READ_BUFFER, max_write, max_pages * PAGE_SIZE).
pub fn payload_size(max_write: u32, max_pages: u16) -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
    8192.max(max_write as usize).max(max_pages as usize * page)
}

/// Number of queues the kernel creates: one per *possible* CPU (not online CPU), and it
/// switches to the ring only when every one of them has an entry.
fn possible_cpus() -> usize {
    // "0-1" or "0,2-5"
    let s = std::fs::read_to_string("/sys/devices/system/cpu/possible").unwrap_or_default();
    let n: usize = s
        .trim()
        .split(',')
        .filter_map(|r| {
            let mut it = r.split('-');
            let a: usize = it.next()?.parse().ok()?;
            let b: usize = it.next().map_or(Some(a), |b| b.parse().ok())?;
            Some(b.checked_sub(a)? + 1)
        })
        .sum();
    if n == 0 {
        // SAFETY: sysconf has no memory-safety preconditions.
        unsafe { libc::sysconf(libc::_SC_NPROCESSORS_CONF) }.max(1) as usize
    } else {
        n
    }
}

/// Starts one queue thread per possible CPU and waits until each has registered its entries
/// (or failed to). Returns the thread handles.
pub fn start_queues(setup: Setup, live: &Arc<AtomicUsize>) -> io::Result<Threads> {
    let nr = possible_cpus();
    let setup = Arc::new(setup);
    let (tx, rx) = mpsc::channel::<Result<(), String>>();
    let mut handles = Vec::new();
    for qid in 0..nr {
        let (setup, tx) = (setup.clone(), tx.clone());
        live.fetch_add(1, Ordering::AcqRel);
        let thread_live = live.clone();
        let name = format!("fuse-ring-{qid}");
        let h = std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || {
                let r = queue_thread(&setup, qid as u16, &tx);
                thread_live.fetch_sub(1, Ordering::AcqRel);
                r
            })
            .inspect_err(|_| {
                live.fetch_sub(1, Ordering::AcqRel);
            })?;
        handles.push((name, h));
    }
    drop(tx);
    for _ in 0..nr {
        match rx.recv_timeout(Duration::from_secs(10)) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(io::Error::other(e)),
            Err(_) => return Err(io::Error::other("ring queue did not start within 10 s")),
        }
    }
    Ok(handles)
}

/// One ring entry's buffers. They are shared with the kernel: while the entry's command is
/// in flight the kernel may write them at any time, so they are kept as raw allocations and
/// turned into slices only while the entry is ours (between its completion and its commit).
struct Entry {
    header: *mut u8,
    payload: *mut u8,
    payload_len: usize,
    iov: *mut [libc::iovec; 2],
}

impl Entry {
    fn new(payload_len: usize) -> Entry {
        let header = Box::into_raw(vec![0u8; URING_REQ_HEADER_SIZE].into_boxed_slice()) as *mut u8;
        let payload = Box::into_raw(vec![0u8; payload_len].into_boxed_slice()) as *mut u8;
        let iov = Box::into_raw(Box::new([
            libc::iovec {
                iov_base: header.cast(),
                iov_len: URING_REQ_HEADER_SIZE,
            },
            libc::iovec {
                iov_base: payload.cast(),
                iov_len: payload_len,
            },
        ]));
        Entry {
            header,
            payload,
            payload_len,
            iov,
        }
    }

    /// Frees the buffers. Only sound once the kernel can no longer reach them: the ring is
    /// closed and the connection has torn the entry down.
    unsafe fn free(self) {
        drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
            self.header,
            URING_REQ_HEADER_SIZE,
        )));
        drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
            self.payload,
            self.payload_len,
        )));
        drop(Box::from_raw(self.iov));
    }
}

/// `struct fuse_uring_cmd_req` in the SQE's 80-byte command area.
fn cmd_req(qid: u16, commit_id: u64) -> [u8; 80] {
    let mut c = [0u8; 80];
    let mut w = Wr(&mut c);
    w.u64(0, 0); // flags
    w.u64(8, commit_id);
    w.u16(16, qid);
    c
}

/// Sets `sqe->len`. FUSE's REGISTER wants the iovec count there, and the io-uring crate's
/// UringCmd80 builder has no setter for it. Entry128 is `repr(C)` over the 64-byte
/// `struct io_uring_sqe` (where `len` is the u32 at offset 24) plus the 64-byte extension.
fn with_sqe_len(mut e: squeue::Entry128, len: u32) -> squeue::Entry128 {
    const _: () = assert!(std::mem::size_of::<squeue::Entry128>() == 128);
    // SAFETY: in bounds of a 128-byte repr(C) value; unaligned write is allowed.
    unsafe {
        (&mut e as *mut squeue::Entry128)
            .cast::<u8>()
            .add(24)
            .cast::<u32>()
            .write_unaligned(len)
    };
    e
}

type Ring = IoUring<squeue::Entry128, cqueue::Entry>;

fn push(ring: &mut Ring, sqe: &squeue::Entry128) -> io::Result<()> {
    loop {
        // SAFETY: every buffer the SQE points at (iovecs, header, payload) outlives it.
        if unsafe { ring.submission().push(sqe) }.is_ok() {
            return Ok(());
        }
        // SQ full: flush it and retry. Cannot happen with depth <= SQ size, kept as a guard.
        ring.submit()?;
    }
}

fn pin_to_cpu(cpu: usize) {
    // SAFETY: cpu_set_t is plain data; sched_setaffinity only reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        // Best effort: an unpinned queue still works, the kernel only uses the qid.
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

fn queue_thread(
    s: &Setup,
    qid: u16,
    ready: &mpsc::Sender<Result<(), String>>,
) -> Result<(), String> {
    // The kernel picks the queue by the requester's CPU; running the queue's thread on that
    // CPU keeps the hand-off local (what libfuse does too).
    pin_to_cpu(qid as usize);
    let fail = |e: String| {
        let _ = ready.send(Err(e.clone()));
        Err(e)
    };
    // Created on this thread: with SINGLE_ISSUER the creating task is the only submitter.
    let mut b = IoUring::<squeue::Entry128, cqueue::Entry>::builder();
    b.setup_single_issuer();
    if s.defer_taskrun {
        b.setup_defer_taskrun();
    } else {
        b.setup_coop_taskrun().setup_taskrun_flag();
    }
    let mut ring: Ring = match b.build(s.depth.max(1) as u32) {
        Ok(r) => r,
        Err(e) => return fail(format!("qid {qid}: io_uring_setup(SQE128): {e}")),
    };
    let fd = types::Fd(s.dev_fd.as_raw_fd());
    let entries: Vec<Entry> = (0..s.depth).map(|_| Entry::new(s.payload)).collect();

    // Register every entry. A REGISTER completes only when a request arrives, or at once
    // with an error, so errors are checked right after submission.
    for (i, e) in entries.iter().enumerate() {
        let sqe = opcode::UringCmd80::new(fd, FUSE_IO_URING_CMD_REGISTER)
            .cmd(cmd_req(qid, 0))
            .addr(Some(e.iov as u64))
            .build();
        let sqe = with_sqe_len(sqe, 2).user_data(i as u64);
        if let Err(err) = push(&mut ring, &sqe) {
            return fail(format!("qid {qid}: queue REGISTER: {err}"));
        }
    }
    if let Err(err) = ring.submit() {
        return fail(format!("qid {qid}: submit REGISTER: {err}"));
    }
    let mut pending: Vec<(u64, i32)> = ring
        .completion()
        .map(|c| (c.user_data(), c.result()))
        .collect();
    if let Some(&(i, res)) = pending.iter().find(|c| c.1 < 0) {
        // The entries are leaked on purpose on error paths: the kernel may still hold them.
        std::mem::forget(entries);
        return fail(format!(
            "qid {qid}: FUSE_IO_URING_CMD_REGISTER of entry {i} failed: {}",
            io::Error::from_raw_os_error(-res)
        ));
    }
    let _ = ready.send(Ok(()));

    let mut live = entries.len();
    let mut arg = [0u8; URING_OP_IN_SIZE];
    let mut rest = vec![0u8; s.payload];
    let mut first_error: Option<String> = None;
    while live > 0 {
        if pending.is_empty() {
            // Submits the commits queued by the previous pass and sleeps until a request
            // (or a teardown completion) arrives.
            match ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EBUSY)) => {}
                Err(e) => {
                    std::mem::forget(entries);
                    return Err(format!("qid {qid}: io_uring_enter: {e}"));
                }
            }
            pending.extend(ring.completion().map(|c| (c.user_data(), c.result())));
        }
        for (i, res) in pending.drain(..) {
            let Some(e) = entries.get(i as usize) else {
                continue;
            };
            if res < 0 {
                // ENOTCONN/ECONNABORTED/ECANCELED: the connection is being torn down
                // (unmount); the entry is gone. Anything else is a real error.
                live -= 1;
                if !matches!(-res, libc::ENOTCONN | libc::ECONNABORTED | libc::ECANCELED)
                    && first_error.is_none()
                {
                    first_error = Some(format!(
                        "qid {qid}: entry {i} completed with {}",
                        io::Error::from_raw_os_error(-res)
                    ));
                }
                continue;
            }
            // SAFETY: the completion hands the entry's buffers back to us until we commit.
            let (header, payload) = unsafe {
                (
                    std::slice::from_raw_parts_mut(e.header, URING_REQ_HEADER_SIZE),
                    std::slice::from_raw_parts_mut(e.payload, e.payload_len),
                )
            };
            let commit_id = match serve_entry(s, header, payload, &mut arg, &mut rest) {
                Some(id) => id,
                None => {
                    // Unparseable: without a commit id the entry cannot be re-armed.
                    live -= 1;
                    first_error.get_or_insert(format!("qid {qid}: entry {i}: bad request header"));
                    continue;
                }
            };
            let sqe = opcode::UringCmd80::new(fd, FUSE_IO_URING_CMD_COMMIT_AND_FETCH)
                .cmd(cmd_req(qid, commit_id))
                .build()
                .user_data(i);
            if let Err(err) = push(&mut ring, &sqe) {
                std::mem::forget(entries);
                return Err(format!("qid {qid}: queue COMMIT_AND_FETCH: {err}"));
            }
        }
    }
    // Every entry came back from the kernel: close the ring first, then free the buffers.
    drop(ring);
    for e in entries {
        // SAFETY: the ring is closed and every entry was torn down by the connection.
        unsafe { e.free() };
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Serves the request in one entry and writes the reply into it. Returns the commit id.
fn serve_entry(
    s: &Setup,
    header: &mut [u8],
    payload: &mut [u8],
    arg: &mut [u8; URING_OP_IN_SIZE],
    rest: &mut [u8],
) -> Option<u64> {
    let h = InHeader::parse(&header[URING_IN_OUT_OFF..])?;
    let hr = Rd(header);
    let commit_id = hr.u64(URING_ENT_COMMIT_ID_OFF)?;
    if commit_id == 0 {
        return None;
    }
    let payload_sz = (hr.u32(URING_ENT_PAYLOAD_SZ_OFF)? as usize).min(payload.len());
    // The reply is written into the payload buffer the request arrived in, so the request's
    // arguments are copied out first (a few bytes for metadata ops).
    let arg_len = fixed_arg_size(h.opcode).min(URING_OP_IN_SIZE);
    arg[..arg_len].copy_from_slice(&header[URING_OP_IN_OFF..URING_OP_IN_OFF + arg_len]);
    rest[..payload_sz].copy_from_slice(&payload[..payload_sz]);
    let req = Request {
        h,
        arg: &arg[..arg_len],
        rest: &rest[..payload_sz],
    };
    let (error, len) = match s.fs.handle(&req, payload) {
        Reply::Ok(n) => (0, n),
        Reply::Err(e) => (-e, 0),
        // Requests without replies (FORGET, INTERRUPT) never come through the ring, but an
        // entry must always be committed, so answer rather than drop it.
        Reply::None => (-libc::ENOSYS, 0),
    };
    put_out_header(
        &mut header[URING_IN_OUT_OFF..],
        (OUT_HEADER_SIZE + len) as u32,
        error,
        h.unique,
    );
    // Reply arguments go in the payload; their total size in ent_in_out.payload_sz.
    Wr(header).u32(URING_ENT_PAYLOAD_SZ_OFF, len as u32);
    s.stats
        .ring_requests
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    Some(commit_id)
}
