//! Mounting, the INIT handshake, the classic /dev/fuse loop, and the server's lifecycle.
//!
//! Every mount made here is recorded in a process-wide list so that a panic or a fatal signal
//! can detach it before the process dies: the probe must never leave a mount behind.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::fs::{Fs, Reply, Request};
use crate::proto::*;
use crate::ring;
pub use crate::served::{Stats, Threads};

/// Largest write the server accepts, and so (with `MAX_PAGES`) the request payload size.
pub const MAX_WRITE: u32 = 128 * 1024;
pub const MAX_PAGES: u16 = 32;
/// /dev/fuse read buffer: a full write plus its headers.
const DEV_BUF: usize = MAX_WRITE as usize + 4096;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// `threads` threads each doing read(/dev/fuse) -> handle -> write(/dev/fuse).
    Dev { threads: usize },
    /// One io_uring per possible CPU with `depth` registered ring entries each; the
    /// /dev/fuse thread, which then reads only FORGETs and INTERRUPTs, pauses
    /// `forget_pause` after each FORGET so that the next ones come together (as layerfs's do).
    Uring {
        depth: usize,
        defer_taskrun: bool,
        forget_pause: Duration,
    },
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Transport::Dev { threads } => write!(f, "dev x{threads}"),
            Transport::Uring {
                depth,
                defer_taskrun,
                forget_pause,
            } => write!(
                f,
                "uring (depth {depth}{}, FORGETs gathered for {} µs)",
                if *defer_taskrun {
                    ", defer-taskrun"
                } else {
                    ""
                },
                forget_pause.as_micros()
            ),
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Config {
    pub transport: Transport,
    pub entry_ttl: Duration,
    pub attr_ttl: Duration,
}

// ---------------------------------------------------------------------------------------
// Emergency cleanup: mounts to detach and the module parameter to restore.

struct Registry {
    mounts: Vec<CString>,
    /// Directories this process created for its mounts, removed once those are detached.
    temp_dirs: Vec<CString>,
    /// Previous value of the `enable_uring` module parameter, if this process changed it.
    uring_param: Option<String>,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
    mounts: Vec::new(),
    temp_dirs: Vec::new(),
    uring_param: None,
});

fn registry() -> std::sync::MutexGuard<'static, Registry> {
    REGISTRY.lock().unwrap_or_else(|p| p.into_inner())
}

const URING_PARAM: &str = "/sys/module/fuse/parameters/enable_uring";

/// Detaches every live mount and restores the module parameter. Safe to call from a panic
/// hook or the signal thread; the process is expected to exit right after.
pub fn emergency_cleanup() {
    let mut r = registry();
    for m in r.mounts.drain(..) {
        // SAFETY: plain syscall on a valid C string.
        unsafe { libc::umount2(m.as_ptr(), libc::MNT_DETACH) };
    }
    for d in r.temp_dirs.drain(..) {
        // SAFETY: rmdir(2) with a valid C string; it only removes an empty directory.
        unsafe { libc::rmdir(d.as_ptr()) };
    }
    if let Some(prev) = r.uring_param.take() {
        let _ = std::fs::write(URING_PARAM, prev);
    }
}

/// Records (`add`) or forgets a temporary directory for `emergency_cleanup` to remove.
pub fn track_temp_dir(dir: &CString, add: bool) {
    let mut r = registry();
    r.temp_dirs.retain(|d| d != dir);
    if add {
        r.temp_dirs.push(dir.clone());
    }
}

/// Makes SIGINT/SIGTERM/SIGHUP/SIGQUIT and panics clean up before the process ends. Must be
/// called before any other thread starts, so that every thread inherits the blocked mask and
/// only the dedicated thread receives these signals.
pub fn install_cleanup_handlers() {
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default_hook(info);
        // A panicking server thread could leave a request unanswered and the workload
        // blocked on it forever: detach, then end the whole process (which also closes
        // /dev/fuse and so aborts the connection).
        emergency_cleanup();
        std::process::exit(101);
    }));
    // SAFETY: sigset manipulation on a local set, then pthread_sigmask/sigwait.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT] {
            libc::sigaddset(&mut set, s);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        std::thread::Builder::new()
            .name("signals".into())
            .spawn(move || {
                let mut sig = 0;
                libc::sigwait(&set, &mut sig);
                eprintln!("uring-probe: signal {sig}: unmounting and exiting");
                emergency_cleanup();
                std::process::exit(128 + sig);
            })
            .expect("spawn signal thread");
    }
}

/// Switches the fuse module's `enable_uring` parameter on for the guard's lifetime.
pub struct UringParam {
    prev: String,
}

impl UringParam {
    pub fn enable() -> io::Result<UringParam> {
        let prev = std::fs::read_to_string(URING_PARAM)
            .map_err(|e| io::Error::new(e.kind(), format!("{URING_PARAM}: {e}")))?
            .trim()
            .to_string();
        // The parameter reads back as Y/N; write it back in the 1/0 form it accepts.
        let prev = if prev == "Y" || prev == "1" { "1" } else { "0" }.to_string();
        registry().uring_param = Some(prev.clone());
        std::fs::write(URING_PARAM, "1")
            .map_err(|e| io::Error::new(e.kind(), format!("{URING_PARAM}: {e}")))?;
        Ok(UringParam { prev })
    }

    pub fn previous(&self) -> &str {
        &self.prev
    }
}

impl Drop for UringParam {
    fn drop(&mut self) {
        let _ = std::fs::write(URING_PARAM, &self.prev);
        registry().uring_param = None;
    }
}

// ---------------------------------------------------------------------------------------
// The server.

pub struct Server {
    mountpoint: CString,
    pub stats: Arc<Stats>,
    threads: Threads,
    live: Arc<AtomicUsize>,
    mounted: bool,
    _dev: Arc<OwnedFd>,
}

/// Decrements the live-thread count when a server thread ends, however it ends.
struct LiveGuard(Arc<AtomicUsize>);

impl Drop for LiveGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

fn errno_err(what: &str) -> io::Error {
    let e = io::Error::last_os_error();
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

impl Server {
    /// Mounts a fresh filesystem at `mountpoint`, answers INIT and starts the transport.
    pub fn start(mountpoint: &Path, cfg: Config) -> io::Result<Server> {
        let mp = CString::new(mountpoint.as_os_str().as_encoded_bytes())
            .map_err(|_| io::Error::other("mount point contains NUL"))?;
        // SAFETY: open(2) with a valid C string; the fd is owned below.
        let fd = unsafe { libc::open(c"/dev/fuse".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(errno_err("open /dev/fuse"));
        }
        // SAFETY: fd was just opened and is owned by nobody else.
        let dev = Arc::new(unsafe { OwnedFd::from_raw_fd(fd) });
        let data = CString::new(format!(
            "fd={fd},rootmode=40000,user_id=0,group_id=0,allow_other,default_permissions"
        ))
        .expect("no NUL");
        {
            // Register under the same lock as the mount so a signal cannot slip between them.
            let mut r = registry();
            // SAFETY: mount(2) with valid C strings.
            let rc = unsafe {
                libc::mount(
                    c"uring-probe".as_ptr(),
                    mp.as_ptr(),
                    c"fuse".as_ptr(),
                    libc::MS_NOSUID | libc::MS_NODEV,
                    data.as_ptr().cast(),
                )
            };
            if rc != 0 {
                return Err(errno_err("mount"));
            }
            r.mounts.push(mp.clone());
        }
        let stats = Arc::new(Stats::default());
        let mut server = Server {
            mountpoint: mp,
            stats: stats.clone(),
            threads: Vec::new(),
            live: Arc::new(AtomicUsize::new(0)),
            mounted: true,
            _dev: dev.clone(),
        };
        // From here on, dropping `server` on an error unmounts.
        let uring = matches!(cfg.transport, Transport::Uring { .. });
        let offered = init_handshake(dev.as_raw_fd(), uring)?;
        if uring && offered & FUSE_OVER_IO_URING == 0 {
            return Err(io::Error::other(
                "the kernel did not offer FUSE_OVER_IO_URING in INIT \
                 (fuse module parameter enable_uring off, or kernel built without it)",
            ));
        }
        let fs = Arc::new(Fs::new(cfg.entry_ttl, cfg.attr_ttl));
        let (dev_threads, forget_pause) = match cfg.transport {
            Transport::Dev { threads } => (threads.max(1), Duration::ZERO),
            // FORGETs still come through /dev/fuse.
            Transport::Uring { forget_pause, .. } => (1, forget_pause),
        };
        for i in 0..dev_threads {
            let (dev, fs, stats) = (dev.clone(), fs.clone(), stats.clone());
            server.spawn(format!("fuse-dev-{i}"), move || {
                dev_loop(dev.as_raw_fd(), &fs, &stats, forget_pause)
            })?;
        }
        if let Transport::Uring {
            depth,
            defer_taskrun,
            ..
        } = cfg.transport
        {
            let payload = ring::payload_size(MAX_WRITE, MAX_PAGES);
            let setup = ring::Setup {
                dev_fd: dev.clone(),
                fs,
                stats,
                depth,
                payload,
                defer_taskrun,
            };
            for (name, handle) in ring::start_queues(setup, &server.live)? {
                server.threads.push((name, handle));
            }
        }
        Ok(server)
    }

    fn spawn(
        &mut self,
        name: String,
        f: impl FnOnce() -> Result<(), String> + Send + 'static,
    ) -> io::Result<()> {
        self.live.fetch_add(1, Ordering::AcqRel);
        let guard = LiveGuard(self.live.clone());
        let h = std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || {
                let _guard = guard;
                f()
            })?;
        self.threads.push((name, h));
        Ok(())
    }

    /// True while any server thread runs (they all end once the mount goes away).
    pub fn running(&self) -> bool {
        self.live.load(Ordering::Acquire) > 0
    }

    /// Unmounts and waits for the server threads, returning the first error any of them hit.
    pub fn stop(mut self) -> Result<(), String> {
        self.unmount();
        // Unmounting aborts the connection: /dev/fuse reads fail with ENODEV and every ring
        // entry completes with ENOTCONN, so the threads end by themselves.
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.live.load(Ordering::Acquire) > 0 {
            if Instant::now() > deadline {
                return Err(format!(
                    "{} server thread(s) still running 10 s after unmount",
                    self.live.load(Ordering::Acquire)
                ));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let mut first = Ok(());
        for (name, h) in self.threads.drain(..) {
            let r = match h.join() {
                Ok(r) => r,
                Err(_) => Err("panicked".to_string()),
            };
            if let (Err(e), Ok(())) = (r, &first) {
                first = Err(format!("{name}: {e}"));
            }
        }
        first
    }

    fn unmount(&mut self) {
        if !self.mounted {
            return;
        }
        self.mounted = false;
        let mut r = registry();
        // SAFETY: umount2(2) with a valid C string.
        unsafe { libc::umount2(self.mountpoint.as_ptr(), libc::MNT_DETACH) };
        r.mounts.retain(|m| m != &self.mountpoint);
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // Threads that are still running notice the unmount and end on their own.
        self.unmount();
    }
}

// ---------------------------------------------------------------------------------------
// INIT and the classic loop.

/// Reads INIT from /dev/fuse and answers it. Returns the kernel's offered flags (64-bit).
fn init_handshake(fd: RawFd, uring: bool) -> io::Result<u64> {
    let mut buf = vec![0u8; DEV_BUF];
    let n = loop {
        // SAFETY: read into an owned buffer of the given length.
        let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(io::Error::new(e.kind(), format!("read INIT: {e}")));
        }
    };
    let msg = &buf[..n];
    let h = InHeader::parse(msg).ok_or_else(|| io::Error::other("short INIT message"))?;
    if h.opcode != FUSE_INIT {
        return Err(io::Error::other(format!(
            "expected INIT, got opcode {}",
            h.opcode
        )));
    }
    let a = Rd(&msg[IN_HEADER_SIZE..]);
    let bad = || io::Error::other("short fuse_init_in");
    let (major, minor) = (a.u32(0).ok_or_else(bad)?, a.u32(4).ok_or_else(bad)?);
    let max_readahead = a.u32(8).ok_or_else(bad)?;
    let flags_lo = a.u32(12).ok_or_else(bad)? as u64;
    let flags_hi = if flags_lo & FUSE_INIT_EXT != 0 {
        a.u32(16).unwrap_or(0) as u64
    } else {
        0
    };
    let offered = flags_lo | (flags_hi << 32);
    let mut out = [0u8; OUT_HEADER_SIZE + INIT_OUT_SIZE];
    if major != FUSE_KERNEL_VERSION || minor < 36 {
        put_out_header(&mut out, OUT_HEADER_SIZE as u32, -libc::EPROTO, h.unique);
        dev_write(fd, &out[..OUT_HEADER_SIZE]).map_err(|e| io::Error::other(e.to_string()))?;
        return Err(io::Error::other(format!(
            "unsupported FUSE protocol {major}.{minor} (need 7.36 or later)"
        )));
    }
    // The same flags for both transports, so they are compared on equal terms; io_uring
    // adds only the transport bit.
    let mut want =
        FUSE_ASYNC_READ | FUSE_BIG_WRITES | FUSE_PARALLEL_DIROPS | FUSE_MAX_PAGES | FUSE_INIT_EXT;
    if uring {
        want |= FUSE_OVER_IO_URING;
    }
    let flags = want & offered;
    let b = &mut out[OUT_HEADER_SIZE..];
    let mut w = Wr(b);
    w.u32(0, FUSE_KERNEL_VERSION);
    w.u32(4, minor.min(FUSE_KERNEL_MINOR_VERSION));
    w.u32(8, max_readahead);
    w.u32(12, flags as u32);
    w.u16(16, 64); // max_background
    w.u16(18, 48); // congestion_threshold
    w.u32(20, MAX_WRITE);
    w.u32(24, 1); // time_gran
    w.u16(28, MAX_PAGES);
    w.u16(30, 0); // map_alignment
    w.u32(32, (flags >> 32) as u32);
    let len = out.len() as u32;
    put_out_header(&mut out, len, 0, h.unique);
    dev_write(fd, &out).map_err(|e| io::Error::other(format!("write INIT reply: {e}")))?;
    Ok(offered)
}

fn dev_write(fd: RawFd, b: &[u8]) -> io::Result<()> {
    // SAFETY: write from a valid buffer.
    let n = unsafe { libc::write(fd, b.as_ptr().cast(), b.len()) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// read(/dev/fuse) -> handle -> write(/dev/fuse) until the connection goes away; a pause of
/// `forget_pause` after each FORGET.
fn dev_loop(fd: RawFd, fs: &Fs, stats: &Stats, forget_pause: Duration) -> Result<(), String> {
    let mut buf = vec![0u8; DEV_BUF];
    let mut out = vec![0u8; DEV_BUF];
    loop {
        // SAFETY: read into an owned buffer of the given length.
        let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            match io::Error::last_os_error().raw_os_error() {
                // ENOENT: the request was interrupted before we read it.
                Some(libc::EINTR | libc::EAGAIN | libc::ENOENT) => continue,
                // ENODEV: unmounted or aborted; the normal way out.
                Some(libc::ENODEV) => return Ok(()),
                _ => return Err(format!("read /dev/fuse: {}", io::Error::last_os_error())),
            }
        }
        let msg = &buf[..n as usize];
        let Some(h) = InHeader::parse(msg) else {
            continue; // Too short to even answer; the kernel never sends this.
        };
        let body =
            &msg[IN_HEADER_SIZE.min(msg.len())..(h.len as usize).clamp(IN_HEADER_SIZE, msg.len())];
        let split = fixed_arg_size(h.opcode).min(body.len());
        let req = Request {
            h,
            arg: &body[..split],
            rest: &body[split..],
        };
        let reply = if h.opcode == FUSE_INIT {
            Reply::Err(libc::EPROTO) // INIT is answered once, in init_handshake.
        } else {
            fs.handle(&req, &mut out[OUT_HEADER_SIZE..])
        };
        let len = match reply {
            Reply::None => {
                stats.forgets.fetch_add(1, Ordering::Relaxed);
                if h.opcode != FUSE_INTERRUPT && !forget_pause.is_zero() {
                    std::thread::sleep(forget_pause);
                }
                continue;
            }
            Reply::Ok(len) => {
                put_out_header(&mut out, (OUT_HEADER_SIZE + len) as u32, 0, h.unique);
                OUT_HEADER_SIZE + len
            }
            Reply::Err(e) => {
                put_out_header(&mut out, OUT_HEADER_SIZE as u32, -e, h.unique);
                OUT_HEADER_SIZE
            }
        };
        stats.dev_requests.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = dev_write(fd, &out[..len]) {
            match e.raw_os_error() {
                // ENOENT: the request was interrupted meanwhile; nobody waits for the reply.
                Some(libc::ENOENT | libc::EINTR) => {}
                Some(libc::ENODEV) => return Ok(()),
                _ => return Err(format!("write /dev/fuse: {e}")),
            }
        }
    }
}
