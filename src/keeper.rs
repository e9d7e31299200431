//! The keeper: the process that holds a mount's FUSE connection for the life of the mount,
//! so that the mount, and every container whose overlay stands on it, outlive the daemon
//! that serves it (DESIGN §13).
//!
//! The kernel keeps a FUSE connection for as long as any process holds its `/dev/fuse`
//! descriptor. The keeper makes the mount, holds that descriptor, a state file the daemon
//! writes (see [`State`]) and the lock on local, and does no FUSE I/O: it forks the daemon
//! and waits. A daemon that dies (a crash, `kill -9`, the OOM killer) is forked again on the
//! same descriptor; meanwhile callers wait, as on an NFS hard mount, instead of getting
//! `ENOTCONN`. The new daemon resumes the connection without an INIT (the kernel sends one
//! per connection), restores what the first one negotiated, and asks the kernel to send
//! again the requests the dead one had read but not answered (`FUSE_NOTIFY_RESEND`).
//!
//! A daemon that died while serving is replaced at once, however often that happens. One
//! that dies before it serves (a bad state, a binary that cannot start) is replaced after a
//! wait that grows to [`MAX_BACKOFF`]; after [`CRASHES`] such deaths within
//! [`CRASH_WINDOW`] none is started again: the keeper aborts the connection, so that
//! callers get an error instead of waiting forever, and detaches the mount.
//!
//! The keeper starts no thread, and only ever waits on one descriptor (a `signalfd` for the
//! child's end and the signals it passes on), so starting a daemon from it is always safe.
//! Termination signals are passed on to the daemon, which unmounts, and so is `SIGUSR1`
//! (a refresh round); the keeper ends when the daemon ends with the mount. A daemon dies
//! with its keeper (`PR_SET_PDEATHSIG`): a keeper killed leaves a dead mount, as a daemon
//! without one does, which the next mount at that path takes back.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::memfd::{memfd_create, MFdFlags};
use nix::sys::signal::{kill, SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use parking_lot::Mutex;
use tracing::{error, info, warn};

use crate::config::MountConfig;
use crate::daemon::Readiness;
use crate::error::{Error, Result};
use crate::fs::{kernel_mount, Negotiated};
use crate::view::keep::Journal;

/// Daemons dying before they serve, within [`CRASH_WINDOW`], after which none is started
/// again.
const CRASHES: usize = 5;
const CRASH_WINDOW: Duration = Duration::from_secs(60);
/// The longest wait before a restart.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// The environment variable that tells a daemon it was started by a keeper, and where its
/// descriptors are.
pub const KEPT_ENV: &str = "LAYERFS_KEPT";

/// What a daemon that exits with this code asks: to be replaced by the binary now on disk
/// (`layerfs upgrade`), not to end the mount.
pub const HAND_OVER: i32 = 75;

/// What a daemon started by the keeper is given.
pub struct Kept {
    /// The connection, as the keeper holds it (the same open file).
    pub device: OwnedFd,
    /// What the daemon keeps across its own death.
    pub state: State,
    /// How many daemons served this mount before this one: 0 for the first, which reads
    /// the INIT; any other resumes.
    pub restarts: u32,
    /// The keeper's process id, for `status`.
    pub keeper: u32,
    /// When the daemon before this one stopped serving (`CLOCK_REALTIME`, ns; 0 for the
    /// first): the gap callers waited through is measured from it.
    pub stopped_ns: u64,
}

impl Kept {
    /// The descriptors this process was handed: the connection, the state file and the
    /// readiness pipe `ready`.
    pub fn descriptors(&self, ready: &File) -> [std::os::fd::RawFd; 3] {
        [
            self.device.as_raw_fd(),
            self.state.file.as_raw_fd(),
            ready.as_raw_fd(),
        ]
    }

    /// What the keeper handed to this process, taken out of the environment: the
    /// descriptors, and the pipe to say `ok` on. `None` for a process a keeper did not
    /// start.
    pub fn inherited() -> Option<std::io::Result<(Kept, File)>> {
        let spec = std::env::var(KEPT_ENV).ok()?;
        // Read once, at start: nothing this process starts is a kept daemon.
        std::env::remove_var(KEPT_ENV);
        Some(Self::parse(&spec))
    }

    fn parse(spec: &str) -> std::io::Result<(Kept, File)> {
        let bad =
            || std::io::Error::other(format!("{KEPT_ENV}={spec:?} is not what a keeper sets"));
        let field = |key: &str| -> std::io::Result<u64> {
            spec.split(',')
                .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
                .and_then(|v| v.parse().ok())
                .ok_or_else(bad)
        };
        // Every field is read, and every descriptor checked, before any is taken: one
        // taken and then dropped over a later field's fault would close a descriptor this
        // process may be using for something else.
        let open_fd = |key: &str| -> std::io::Result<i32> {
            let raw = i32::try_from(field(key)?).map_err(|_| bad())?;
            nix::fcntl::fcntl(
                unsafe { std::os::fd::BorrowedFd::borrow_raw(raw) },
                nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
            )
            .map_err(|_| bad())?;
            Ok(raw)
        };
        let (device, state, ready) = (open_fd("device")?, open_fd("state")?, open_fd("ready")?);
        let restarts = u32::try_from(field("restarts")?).map_err(|_| bad())?;
        let keeper = u32::try_from(field("keeper")?).map_err(|_| bad())?;
        let stopped_ns = field("stopped")?;
        // SAFETY: descriptors the keeper left open for this process, which owns them now
        // (fcntl just showed they are open).
        let own = |raw: i32| unsafe { OwnedFd::from_raw_fd(raw) };
        let kept = Kept {
            device: own(device),
            state: State {
                file: File::from(own(state)),
            },
            restarts,
            keeper,
            stopped_ns,
        };
        Ok((kept, File::from(own(ready))))
    }
}

/// What a daemon leaves to the next one: a memory file the keeper holds, so it lasts as
/// long as the mount. It holds the settings the kernel agreed to at INIT, written once the
/// first daemon has them, then a [`Log`] of what the daemons did that the kernel may still
/// refer to.
pub struct State {
    file: File,
}

/// How the settings INIT agreed are kept: a tag, then one byte for each.
const NEGOTIATED_TAG: &[u8; 8] = b"lfsinit1";

fn encode(negotiated: Negotiated) -> [u8; 10] {
    let mut bytes = [0u8; 10];
    bytes[..8].copy_from_slice(NEGOTIATED_TAG);
    bytes[8] = u8::from(negotiated.passthrough);
    bytes[9] = u8::from(negotiated.expire_only);
    bytes
}

fn decode(bytes: &[u8; 10]) -> Option<Negotiated> {
    (&bytes[..8] == NEGOTIATED_TAG).then_some(Negotiated {
        passthrough: bytes[8] == 1,
        expire_only: bytes[9] == 1,
    })
}

impl State {
    fn create() -> std::io::Result<State> {
        let fd = memfd_create("layerfs-state", MFdFlags::MFD_CLOEXEC)?;
        Ok(State {
            file: File::from(fd),
        })
    }

    fn try_clone(&self) -> std::io::Result<State> {
        Ok(State {
            file: self.file.try_clone()?,
        })
    }

    /// Records what INIT settled, before the first request is served.
    pub fn save_negotiated(&self, negotiated: Negotiated) -> std::io::Result<()> {
        self.file.write_all_at(&encode(negotiated), 0)
    }

    /// What the first daemon recorded; `None` if it died before INIT was over.
    pub fn negotiated(&self) -> Option<Negotiated> {
        let mut bytes = [0u8; 10];
        self.file.read_exact_at(&mut bytes, 0).ok()?;
        decode(&bytes)
    }

    /// The log of records earlier daemons appended, whole ones only, and the log to append
    /// to after them (a record a dying daemon left cut is written over).
    pub fn log(&self) -> std::io::Result<(Arc<Log>, Vec<Vec<u8>>)> {
        let mut bytes = Vec::new();
        (&self.file).seek(SeekFrom::Start(LOG_START))?;
        (&self.file).read_to_end(&mut bytes)?;
        let mut records = Vec::new();
        let mut at = 0;
        while let Some(record) = Log::record_at(&bytes[at..]) {
            at += Log::HEADER + record.len();
            records.push(record.to_vec());
        }
        let log = Log {
            file: self.file.try_clone()?,
            end: Mutex::new(LOG_START + at as u64),
            failed: AtomicBool::new(false),
        };
        Ok((Arc::new(log), records))
    }
}

/// Where the log starts in the state file: after the INIT settings.
const LOG_START: u64 = 16;

/// An append-only log of records in the state file, each behind its length and a checksum,
/// so that a record cut by the daemon's death is told from a whole one.
#[derive(Debug)]
pub struct Log {
    file: File,
    /// Where the next record goes. A leaf lock: held only to write one record to memory.
    end: Mutex<u64>,
    /// An append failed: said once.
    failed: AtomicBool,
}

impl Log {
    const HEADER: usize = 8;

    /// The whole record at the start of `bytes`, if there is one.
    fn record_at(bytes: &[u8]) -> Option<&[u8]> {
        let len = u32::from_le_bytes(bytes.get(..4)?.try_into().ok()?) as usize;
        let sum = u32::from_le_bytes(bytes.get(4..8)?.try_into().ok()?);
        let record = bytes.get(Self::HEADER..Self::HEADER + len)?;
        (len > 0 && checksum(record) == sum).then_some(record)
    }
}

impl Journal for Log {
    fn append(&self, record: &[u8]) {
        let mut header = [0u8; Self::HEADER];
        header[..4].copy_from_slice(&(record.len() as u32).to_le_bytes());
        header[4..].copy_from_slice(&checksum(record).to_le_bytes());
        let parts = [
            std::io::IoSlice::new(&header),
            std::io::IoSlice::new(record),
        ];
        let len = Self::HEADER + record.len();
        let mut end = self.end.lock();
        // One call, header and record together: a request's journaling costs one syscall.
        let written = nix::sys::uio::pwritev(&self.file, &parts, *end as libc::off_t);
        match written {
            Ok(n) if n == len => *end += len as u64,
            Ok(_) => self.failed_once(&std::io::Error::other("a short write")),
            Err(e) => self.failed_once(&e.into()),
        }
    }
}

impl Log {
    fn failed_once(&self, e: &std::io::Error) {
        if !self.failed.swap(true, Ordering::Relaxed) {
            error!(error = %e, "the state a restarted daemon resumes from cannot be written; a restart may now answer ESTALE for what it misses");
        }
    }
}

/// FNV-1a over a record: enough to tell a cut record from a whole one.
fn checksum(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5_u32, |h, b| {
        (h ^ u32::from(*b)).wrapping_mul(0x0100_0193)
    })
}

/// How one daemon ended.
enum Ended {
    /// It served until the mount ended, or failed to start: the keeper is done.
    Done(i32),
    /// It died while the mount stands.
    Crashed(String),
    /// It stopped to be replaced by the binary now on disk.
    HandedOver,
}

/// Makes the mount and keeps it, starting a daemon to serve it and another whenever one
/// dies or hands over, until the mount ends. A daemon is this program's binary as it is on
/// disk then, run with this process's arguments. `readiness` is told once the first daemon
/// has the mount live. Returns the last daemon's exit code.
pub fn keep(config: &MountConfig, readiness: &mut Readiness) -> Result<i32> {
    let mount_error = |source: std::io::Error| Error::Mount {
        path: config.mountpoint.clone(),
        source,
    };
    let fsname = config.fsname();
    let (device, mount) = kernel_mount::mount(&config.mount_spec(&fsname)).map_err(|e| {
        mount_error(std::io::Error::other(format!(
            "mount(2) of fuse.layerfs: {e}"
        )))
    })?;
    let state = State::create().map_err(mount_error)?;
    // The path, not the open binary: an upgrade replaces the file there.
    let exe = std::env::current_exe().map_err(mount_error)?;
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    // Blocked here, they wait in the signalfd; a daemon it starts unblocks them for itself.
    let mut stop = SigSet::empty();
    for signal in [
        Signal::SIGCHLD,
        Signal::SIGTERM,
        Signal::SIGINT,
        Signal::SIGHUP,
        Signal::SIGUSR1,
    ] {
        stop.add(signal);
    }
    let old_mask = stop.thread_swap_mask(nix::sys::signal::SigmaskHow::SIG_BLOCK);
    let signals = SignalFd::with_flags(&stop, SfdFlags::SFD_CLOEXEC);
    let (old_mask, mut signals) = match (old_mask, signals) {
        (Ok(mask), Ok(signals)) => (mask, signals),
        (Err(e), _) | (_, Err(e)) => {
            let _ = mount.unmount();
            return Err(mount_error(e.into()));
        }
    };

    let keeper = std::process::id();
    let mut crashes = Crashes::default();
    let mut restarts = 0u32;
    let mut stopped_ns = 0;
    let mut first = Some(readiness);
    loop {
        let kept = || -> std::io::Result<Kept> {
            Ok(Kept {
                device: device.try_clone()?,
                state: state.try_clone()?,
                restarts,
                keeper,
                stopped_ns,
            })
        };
        let kept = kept().map_err(mount_error)?;
        let (word, daemon) = match start(&exe, &args, kept, &old_mask) {
            Ok(started) => started,
            Err(e) if first.is_none() => {
                // The binary on disk cannot be run (an upgrade half installed): a daemon that
                // died before serving, as far as the crash loop goes.
                let how = format!("{} could not be started: {e}", exe.display());
                if !crashes.died(false, &how, &config.mountpoint) {
                    return Ok(1);
                }
                continue;
            }
            Err(e) => {
                let _ = mount.unmount();
                return Err(mount_error(e));
            }
        };
        // A daemon says `ok` once it serves.
        let word = read_word(word);
        let served = word.as_deref() == Some("ok");
        if let Some(readiness) = first.take() {
            // The first daemon's word on whether the mount is live goes to whoever waits.
            if served {
                readiness.ready();
            } else {
                let reason =
                    word.unwrap_or_else(|| "the daemon exited before the mount was live".into());
                readiness.failed(&reason);
                let _ = wait_for(daemon, &mut signals);
                let _ = mount.unmount();
                return Ok(1);
            }
        }
        let ended = wait_for(daemon, &mut signals);
        stopped_ns = realtime_ns();
        match ended {
            Ended::Done(code) => return Ok(code),
            Ended::HandedOver => {
                info!(
                    restarts = restarts + 1,
                    "the daemon handed over; starting the binary on disk"
                );
                restarts += 1;
            }
            Ended::Crashed(how) => {
                if !crashes.died(served, &how, &config.mountpoint) {
                    return Ok(1);
                }
                restarts += 1;
            }
        }
    }
}

/// The deaths of daemons that died before they served, within [`CRASH_WINDOW`]: a crash
/// loop. One killed while serving (by the OOM killer, an operator, a bug a request hit) is
/// started again at once, however often.
#[derive(Default)]
struct Crashes(VecDeque<Instant>);

impl Crashes {
    /// Notes a daemon's death (`how`), waits as long as the next start should, and says
    /// whether to start another. When not, the connection is aborted and the mount at
    /// `mountpoint` detached: callers get an error instead of waiting for nobody.
    fn died(&mut self, served: bool, how: &str, mountpoint: &Path) -> bool {
        let now = Instant::now();
        if served {
            self.0.clear();
        } else {
            self.0.push_back(now);
        }
        while self
            .0
            .front()
            .is_some_and(|t| now.duration_since(*t) > CRASH_WINDOW)
        {
            self.0.pop_front();
        }
        if self.0.len() >= CRASHES {
            error!(
                daemon = how,
                crashes = self.0.len(),
                "the daemon keeps dying; aborting the connection so that callers get an error"
            );
            abort_connection(mountpoint);
            let _ = nix::mount::umount2(mountpoint, nix::mount::MntFlags::MNT_DETACH);
            return false;
        }
        let backoff = backoff(self.0.len());
        warn!(
            daemon = how,
            backoff_ms = backoff.as_millis() as u64,
            "the daemon died; starting another on the same connection"
        );
        std::thread::sleep(backoff);
        true
    }
}

/// The wait before the `n`th restart in a row: none for the first, then doubling.
fn backoff(n: usize) -> Duration {
    match n {
        0 | 1 => Duration::ZERO,
        n => (Duration::from_millis(100) * 2u32.pow((n - 2).min(6) as u32)).min(MAX_BACKOFF),
    }
}

/// Starts a daemon serving `kept`: `exe` run with `args`, told through [`KEPT_ENV`] where
/// its descriptors are. Returns the read end of its readiness pipe and its pid.
fn start(
    exe: &Path,
    args: &[std::ffi::OsString],
    kept: Kept,
    old_mask: &SigSet,
) -> std::io::Result<(OwnedFd, Pid)> {
    use std::os::unix::process::CommandExt;
    let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    let fds = [
        kept.device.as_raw_fd(),
        kept.state.file.as_raw_fd(),
        write.as_raw_fd(),
    ];
    let env = format!(
        "device={},state={},ready={},restarts={},keeper={},stopped={}",
        fds[0], fds[1], fds[2], kept.restarts, kept.keeper, kept.stopped_ns
    );
    let mask = *old_mask;
    let keeper = kept.keeper as libc::pid_t;
    let mut command = std::process::Command::new(exe);
    command.args(args).env(KEPT_ENV, env);
    // SAFETY: between fork and exec only async-signal-safe calls: fcntl, prctl, getppid,
    // pthread_sigmask.
    unsafe {
        command.pre_exec(move || {
            for fd in fds {
                if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            // The daemon goes with its keeper: a keeper killed takes the mount down as a
            // daemon without one does, rather than leave it served by nobody's child.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 || libc::getppid() != keeper
            {
                return Err(std::io::Error::other("the keeper is gone"));
            }
            mask.thread_set_mask().map_err(std::io::Error::from)
        });
    }
    let child = command.spawn()?;
    drop(write);
    drop(kept);
    Ok((read, Pid::from_raw(child.id() as i32)))
}

/// The time now as `CLOCK_REALTIME` counts it, in ns: comparable across processes.
pub fn realtime_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// The daemon's one line: `ok`, or why it failed; `None` if it died without a word.
fn read_word(pipe: OwnedFd) -> Option<String> {
    let mut said = String::new();
    let _ = File::from(pipe).read_to_string(&mut said);
    let said = said.trim_end();
    (!said.is_empty()).then(|| said.to_owned())
}

/// Waits until `daemon` ends, passing termination signals on to it.
fn wait_for(daemon: Pid, signals: &mut SignalFd) -> Ended {
    loop {
        match waitpid(daemon, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::Exited(_, 0)) => return Ended::Done(0),
            Ok(WaitStatus::Exited(_, HAND_OVER)) => return Ended::HandedOver,
            Ok(WaitStatus::Exited(_, code)) => {
                return Ended::Crashed(format!("exited with {code}"))
            }
            Ok(WaitStatus::Signaled(_, signal, _)) => {
                return Ended::Crashed(format!("killed by {signal}"))
            }
            Ok(_) => {}
            Err(e) => return Ended::Done(if e == nix::errno::Errno::ECHILD { 0 } else { 1 }),
        }
        match signals.read_signal() {
            Ok(Some(info)) => {
                let signal = Signal::try_from(info.ssi_signo as i32).ok();
                if let Some(
                    signal @ (Signal::SIGTERM | Signal::SIGINT | Signal::SIGHUP | Signal::SIGUSR1),
                ) = signal
                {
                    tracing::debug!(%signal, "passing the signal on to the daemon");
                    let _ = kill(daemon, signal);
                }
            }
            Ok(None) => {}
            Err(e) => {
                warn!(error = %e, "reading the keeper's signals failed");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// Ends the connection for good: every waiting caller gets `ECONNABORTED`, and later ones
/// `ENOTCONN`, instead of waiting for a daemon that will not come. The kernel names a
/// connection after its mount's (anonymous) device number, whose major is 0.
fn abort_connection(mountpoint: &Path) {
    let point = crate::store::mountinfo::resolve_mountpoint(mountpoint);
    let Some(minor) = crate::store::mountinfo::current()
        .into_iter()
        .rfind(|m| m.point == point && m.fstype == kernel_mount::FSTYPE)
        .and_then(|m| m.device.strip_prefix("0:").map(str::to_owned))
    else {
        warn!(mountpoint = %point.display(), "the mount's connection was not found to abort");
        return;
    };
    let connections = Path::new("/sys/fs/fuse/connections");
    if std::fs::read_dir(connections).map_or(true, |mut entries| entries.next().is_none()) {
        // The FUSE control filesystem is not mounted on every host.
        let _ = nix::mount::mount(
            Some("fusectl"),
            connections,
            Some("fusectl"),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        );
    }
    let path = connections.join(&minor).join("abort");
    if let Err(e) = std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .and_then(|mut f| f.write_all(b"1"))
    {
        warn!(error = %e, path = %path.display(), "aborting the connection failed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restarts_after_deaths_before_serving_wait_longer_and_longer() {
        let waits: Vec<Duration> = (0..10).map(backoff).collect();
        assert_eq!(waits[0], Duration::ZERO);
        assert_eq!(waits[1], Duration::ZERO);
        assert!(waits.windows(2).all(|w| w[0] <= w[1]), "{waits:?}");
        assert_eq!(waits[9], MAX_BACKOFF);
    }

    #[test]
    fn what_a_keeper_did_not_set_is_refused_not_trusted() {
        for spec in [
            "",
            "device=3",
            "device=x,state=4,ready=5,restarts=0,keeper=1,stopped=0",
            "device=999999,state=999998,ready=999997,restarts=0,keeper=1,stopped=0",
        ] {
            assert!(Kept::parse(spec).is_err(), "{spec:?}");
        }
    }

    #[test]
    fn a_cut_record_ends_the_log() {
        let state = State::create().unwrap();
        let (log, records) = state.log().unwrap();
        assert!(records.is_empty());
        log.append(b"first");
        log.append(b"second");
        // A third record the daemon died writing: its length and part of its bytes.
        let end = *log.end.lock();
        state
            .file
            .write_all_at(&[9, 0, 0, 0, 1, 2, 3, 4, b'x'], end)
            .unwrap();
        let (log, records) = state.log().unwrap();
        assert_eq!(records, vec![b"first".to_vec(), b"second".to_vec()]);
        assert_eq!(*log.end.lock(), end, "the cut record is written over");
    }
}
