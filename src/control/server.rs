//! The control server: accepts on the mount's socket and answers each connection on a
//! thread of its own, so that a slow question (a refresh) or a silent client holds up no one
//! else.

use std::fs;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use tracing::{debug, info, warn};

use super::protocol::MountControl;
use super::protocol::{self, MAX_REQUEST};
use super::reconfigure::Reconfigure;

/// How long a connection may sit without sending a byte before it is closed.
const IDLE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long an answer may wait for a client that does not read it.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections served at once; more are told the server is busy. Bounds the threads a
/// flood of clients can cost the daemon.
const MAX_CONNECTIONS: usize = 32;

/// A running control server. Dropping it stops accepting and removes the socket (answers
/// already being computed still go out).
pub struct ControlServer {
    path: PathBuf,
    /// The socket file's (dev, ino): removed on drop only if it is still this one.
    ident: (u64, u64),
    /// Dropping it wakes the accept loop to stop.
    stop: Option<UnixStream>,
    thread: Option<JoinHandle<()>>,
}

impl ControlServer {
    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        // A later mount on the same mountpoint may have put its own socket here.
        if let Ok(m) = fs::symlink_metadata(&self.path) {
            if (m.dev(), m.ino()) == self.ident {
                let _ = fs::remove_file(&self.path);
            }
        }
    }
}

/// Serves `handle` on a unix socket at `socket` (see [`socket_path`](super::socket_path)):
/// creates its dir (0700) if need be, removes a stale socket file left by a mount that died,
/// binds (0600) and accepts on a thread of its own until the returned server is dropped.
/// Fails if another process listens there, or if something other than a socket is in the way.
pub fn serve(handle: Arc<dyn MountControl>, socket: &Path) -> io::Result<ControlServer> {
    serve_with(handle, None, socket)
}

/// [`serve`], answering `reconfigure` through `live`.
pub fn serve_with(
    handle: Arc<dyn MountControl>,
    live: Option<Arc<dyn Reconfigure>>,
    socket: &Path,
) -> io::Result<ControlServer> {
    let context = |e: io::Error| {
        io::Error::new(
            e.kind(),
            format!("control socket {}: {e}", socket.display()),
        )
    };
    let dir = socket
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no directory"))
        .map_err(context)?;
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(context)?;
    clear_stale(socket).map_err(context)?;
    let listener = bind_private(dir, socket).map_err(context)?;
    let meta = fs::symlink_metadata(socket).map_err(context)?;
    let (stop, wake) = UnixStream::pair().map_err(context)?;
    listener.set_nonblocking(true).map_err(context)?;
    let thread = std::thread::Builder::new()
        .name("control".into())
        .spawn(move || accept_loop(listener, wake, handle, live))
        .map_err(context)?;
    info!(socket = %socket.display(), "control socket listening");
    Ok(ControlServer {
        path: socket.to_owned(),
        ident: (meta.dev(), meta.ino()),
        stop: Some(stop),
        thread: Some(thread),
    })
}

/// Removes a socket file nobody listens on; refuses to touch a live socket or a non-socket.
fn clear_stale(socket: &Path) -> io::Result<()> {
    match fs::symlink_metadata(socket) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
        Ok(m) if !m.file_type().is_socket() => Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            "exists and is not a socket",
        )),
        Ok(_) => match UnixStream::connect(socket) {
            Ok(_) => Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                "another process is serving it",
            )),
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                debug!(socket = %socket.display(), "removing a stale control socket");
                fs::remove_file(socket)
            }
            Err(e) => Err(e),
        },
    }
}

/// Binds under a temporary name, makes the socket 0600, then renames it into place: the
/// socket appears at `socket` with its final mode, whatever the umask.
fn bind_private(dir: &Path, socket: &Path) -> io::Result<UnixListener> {
    let tmp = dir.join(format!(".{}.tmp", std::process::id()));
    let _ = fs::remove_file(&tmp);
    let listener = UnixListener::bind(&tmp)?;
    let placed = fs::set_permissions(&tmp, fs::Permissions::from_mode(0o600))
        .and_then(|()| fs::rename(&tmp, socket));
    if let Err(e) = placed {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(listener)
}

fn accept_loop(
    listener: UnixListener,
    wake: UnixStream,
    handle: Arc<dyn MountControl>,
    live: Option<Arc<dyn Reconfigure>>,
) {
    let active = Arc::new(AtomicUsize::new(0));
    let own_uid = nix::unistd::geteuid().as_raw();
    loop {
        match wait_readable(&listener, &wake) {
            Ok(Wake::Stop) => return,
            Ok(Wake::Accept) => {}
            Err(e) => {
                warn!(error = %e, "control socket: poll failed; no longer serving");
                return;
            }
        }
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => {
                // Out of fds and the like: back off rather than spin.
                warn!(error = %e, "control socket: accept failed");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let guard = ConnectionGuard::enter(&active);
        let (handle, live) = (Arc::clone(&handle), live.clone());
        let spawned = std::thread::Builder::new()
            .name("control-conn".into())
            .spawn(move || serve_connection(stream, guard, handle, live, own_uid));
        if let Err(e) = spawned {
            warn!(error = %e, "control socket: cannot start a connection thread");
        }
    }
}

enum Wake {
    Accept,
    Stop,
}

/// Waits until a client connects or the stop end is closed.
fn wait_readable(listener: &UnixListener, wake: &UnixStream) -> io::Result<Wake> {
    let mut fds = [
        libc::pollfd {
            fd: listener.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: wake.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    loop {
        // SAFETY: `fds` is a valid array of two pollfds for the duration of the call, and
        // both descriptors stay open while borrowed here.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if fds[1].revents != 0 {
            return Ok(Wake::Stop);
        }
        if fds[0].revents != 0 {
            return Ok(Wake::Accept);
        }
    }
}

/// Counts a connection while it lives.
struct ConnectionGuard {
    active: Arc<AtomicUsize>,
    over_limit: bool,
}

impl ConnectionGuard {
    fn enter(active: &Arc<AtomicUsize>) -> ConnectionGuard {
        let before = active.fetch_add(1, Ordering::SeqCst);
        ConnectionGuard {
            active: Arc::clone(active),
            over_limit: before >= MAX_CONNECTIONS,
        }
    }
}

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        self.active.fetch_sub(1, Ordering::SeqCst);
    }
}

fn serve_connection(
    stream: UnixStream,
    guard: ConnectionGuard,
    handle: Arc<dyn MountControl>,
    live: Option<Arc<dyn Reconfigure>>,
    own_uid: u32,
) {
    let mut writer = &stream;
    // The listener is non-blocking; an accepted socket must not be, for the timeouts to
    // mean what they say.
    if stream.set_nonblocking(false).is_err()
        || stream.set_read_timeout(Some(IDLE_TIMEOUT)).is_err()
        || stream.set_write_timeout(Some(WRITE_TIMEOUT)).is_err()
    {
        return;
    }
    if guard.over_limit {
        let _ = writer.write_all(&protocol::encode(&protocol::error(
            "busy: too many control connections",
        )));
        return;
    }
    let admin = match peer(&stream) {
        // Quotas are changed only by a client with CAP_SYS_ADMIN, as on XFS: uid 0
        // alone (a container's root) is not enough.
        Ok(cred) if cred.uid == 0 || cred.uid == own_uid => {
            crate::store::creds::is_admin(cred.pid as u32)
        }
        Ok(libc::ucred { uid, .. }) => {
            debug!(uid, "control socket: refused a client");
            let _ = writer.write_all(&protocol::encode(&protocol::error(protocol::ROOT_ONLY)));
            return;
        }
        Err(_) => return,
    };
    let mut reader = BufReader::new(&stream);
    loop {
        let mut line = Vec::new();
        // One byte over the limit tells a full-size request from a longer one.
        match (&mut reader)
            .take(MAX_REQUEST as u64 + 1)
            .read_until(b'\n', &mut line)
        {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let complete = line.last() == Some(&b'\n');
        if complete {
            line.pop();
        } else if line.len() > MAX_REQUEST {
            let _ = writer.write_all(&protocol::encode(&protocol::error(&format!(
                "bad request: longer than {MAX_REQUEST} bytes"
            ))));
            return;
        }
        if line.iter().all(u8::is_ascii_whitespace) && complete {
            continue;
        }
        if writer
            .write_all(&protocol::answer_with(
                &*handle,
                live.as_deref(),
                &line,
                admin,
            ))
            .is_err()
            || !complete
        {
            // Without a newline the request ended the stream: nothing more will come.
            return;
        }
    }
}

/// The process at the other end.
fn peer(stream: &UnixStream) -> io::Result<libc::ucred> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writes of the sizes passed, and the descriptor
    // is an open unix socket borrowed from `stream`.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cred)
}
