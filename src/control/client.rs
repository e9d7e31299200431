//! The client side: [`Client`] finds a mount's control socket from its mountpoint and has one
//! method per operation, each with its typed answer. Requests are built here and nowhere
//! else.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde_json::Value;

use super::protocol::{self, Op, Request};
use super::reconfigure::Reconfigured;
use crate::report::{ImageInfo, LayerInfo, QuotaInfo, RoundReport, Status};

/// How long to wait for an answer. A refresh waits for a scan, which has its own, shorter
/// timeout on the daemon's side.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(120);
/// The longest answer read: room for listings of many thousands of layers.
const MAX_ANSWER: u64 = 256 * 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("no layerfs mount at {} (no control socket at {})", mountpoint.display(), socket.display())]
    NoSocket {
        mountpoint: PathBuf,
        socket: PathBuf,
    },
    #[error(
        "no layerfs mount at {} (nothing listens on the control socket {}; a mount that died left it)",
        mountpoint.display(),
        socket.display()
    )]
    NotListening {
        mountpoint: PathBuf,
        socket: PathBuf,
    },
    /// The caller is not root: the run dir, the socket or the server kept it out.
    #[error("{}: {}", mountpoint.display(), protocol::ROOT_ONLY)]
    Denied { mountpoint: PathBuf },
    #[error("control socket {}: {source}", socket.display())]
    Io {
        socket: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("control socket {}: unreadable answer: {reason}", socket.display())]
    BadAnswer { socket: PathBuf, reason: String },
    #[error("layerfs at {}: {message}", mountpoint.display())]
    Refused {
        mountpoint: PathBuf,
        message: String,
    },
    #[error("the refresh round could not scan the remote: {0}")]
    RoundFailed(String),
    /// The old daemon stopped for an upgrade and no new one answered in time.
    #[error("{0}")]
    NoSuccessor(String),
}

/// A running mount's control socket.
#[derive(Debug, Clone)]
pub struct Client {
    mountpoint: PathBuf,
    socket: PathBuf,
    timeout: Duration,
}

impl Client {
    /// The mount at `mountpoint`, as a user names it: resolved as the mount resolved its
    /// own (symlinks, a trailing slash, a relative path).
    pub fn new(mountpoint: &Path) -> Client {
        let mountpoint = crate::store::mountinfo::resolve_mountpoint(mountpoint);
        let socket = super::socket_path(&mountpoint);
        Client::at(&mountpoint, &socket)
    }

    /// The server on `socket`, on behalf of `mountpoint` (which messages name).
    pub fn at(mountpoint: &Path, socket: &Path) -> Client {
        Client {
            mountpoint: mountpoint.to_owned(),
            socket: socket.to_owned(),
            timeout: ANSWER_TIMEOUT,
        }
    }

    /// Gives up on an answer after `timeout`.
    pub fn with_timeout(mut self, timeout: Duration) -> Client {
        self.timeout = timeout;
        self
    }

    /// The mountpoint, resolved.
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// The mount's state now.
    pub fn status(&self) -> Result<Status, ClientError> {
        self.call(Request::new(Op::Status))
    }

    /// Runs a refresh round and reports it; `accept_empty` takes an empty remote as emptied
    /// on purpose. A round that could not scan is an answer too: see [`RoundReport::error`].
    pub fn refresh(&self, accept_empty: bool) -> Result<RoundReport, ClientError> {
        self.call(Request {
            accept_empty,
            ..Request::new(Op::Refresh)
        })
    }

    /// The ready layers, sorted by id.
    pub fn layers(&self) -> Result<Vec<LayerInfo>, ClientError> {
        self.call(Request::new(Op::Layers))
    }

    /// The ready images, sorted by id.
    pub fn images(&self) -> Result<Vec<ImageInfo>, ClientError> {
        self.call(Request::new(Op::Images))
    }

    /// Sets the quota of the directory `path` (relative to the mountpoint) to `limit`
    /// bytes and, optionally, `inodes` inodes; answers what the mount now enforces.
    pub fn quota_set(
        &self,
        path: &str,
        limit: u64,
        inodes: Option<u64>,
    ) -> Result<QuotaInfo, ClientError> {
        self.call(Request {
            path: Some(path.to_owned()),
            size: Some(limit.to_string()),
            inodes,
            ..Request::new(Op::QuotaSet)
        })
    }

    /// The quota of the directory `path` (relative to the mountpoint).
    pub fn quota_get(&self, path: &str) -> Result<QuotaInfo, ClientError> {
        self.call(Request {
            path: Some(path.to_owned()),
            ..Request::new(Op::QuotaGet)
        })
    }

    /// Every quota root of the mount.
    pub fn quota_list(&self) -> Result<Vec<QuotaInfo>, ClientError> {
        self.call(Request::new(Op::QuotaList))
    }

    /// Clears the quota of the directory `path`; answers the root as it was.
    pub fn quota_clear(&self, path: &str) -> Result<QuotaInfo, ClientError> {
        self.call(Request {
            path: Some(path.to_owned()),
            ..Request::new(Op::QuotaClear)
        })
    }

    /// Hands the mount over to the binary now on disk; the answer is the pid of the daemon
    /// that stops.
    pub fn hand_over(&self) -> Result<u32, ClientError> {
        self.call(Request::new(Op::Upgrade))
    }

    /// Applies mount `options` to the running mount (`mount -o remount,…`).
    pub fn reconfigure(&self, options: &[String]) -> Result<Reconfigured, ClientError> {
        self.call(Request {
            options: options.to_vec(),
            ..Request::new(Op::Reconfigure)
        })
    }

    fn call<T: DeserializeOwned>(&self, request: Request) -> Result<T, ClientError> {
        let ask = || ask_within(&self.mountpoint, &self.socket, &request, self.timeout);
        let payload = match ask() {
            // Nobody listens while a keeper starts the next daemon (DESIGN §13): a look at
            // the mount's root waits until it serves, and fails at once on a dead mount.
            Err(ClientError::NotListening { .. })
                if crate::fs::kernel_mount::ask_root(&self.mountpoint).is_ok() =>
            {
                ask()
            }
            asked => asked,
        }?;
        serde_json::from_value(payload).map_err(|e| ClientError::BadAnswer {
            socket: self.socket.clone(),
            reason: e.to_string(),
        })
    }
}

/// The live layerfs mount serving `local` (canonical) as its local tree, if any answers
/// on its control socket in time: asks each `fuse.layerfs` mount of this namespace.
pub fn mount_using(local: &Path) -> Option<PathBuf> {
    // A mount too busy to answer within this is not worth holding up an error for.
    const QUICK: Duration = Duration::from_secs(2);
    crate::store::mountinfo::current()
        .into_iter()
        .filter(|m| m.fstype == crate::fs::kernel_mount::FSTYPE)
        .find_map(|m| {
            let socket = super::socket_path(&m.point);
            let status = Client::at(&m.point, &socket)
                .with_timeout(QUICK)
                .status()
                .ok()?;
            (Path::new(&status.local) == local).then_some(m.point)
        })
}

fn ask_within(
    mountpoint: &Path,
    socket: &Path,
    request: &Request,
    timeout: Duration,
) -> Result<Value, ClientError> {
    let op = request.op;
    let io_err = |source: io::Error| ClientError::Io {
        socket: socket.to_owned(),
        source,
    };
    let mut stream = UnixStream::connect(socket).map_err(|e| match e.kind() {
        io::ErrorKind::NotFound => ClientError::NoSocket {
            mountpoint: mountpoint.to_owned(),
            socket: socket.to_owned(),
        },
        io::ErrorKind::ConnectionRefused => ClientError::NotListening {
            mountpoint: mountpoint.to_owned(),
            socket: socket.to_owned(),
        },
        io::ErrorKind::PermissionDenied => ClientError::Denied {
            mountpoint: mountpoint.to_owned(),
        },
        _ => io_err(e),
    })?;
    stream
        .set_read_timeout(Some(timeout))
        .and_then(|()| stream.set_write_timeout(Some(timeout)))
        .map_err(io_err)?;
    // A server that refuses the caller answers and hangs up at once, maybe before the
    // request is written: the answer is still there to read, so a failed write is only
    // reported when no answer comes.
    let sent = stream.write_all(&protocol::request_line_for(request));
    let mut line = Vec::new();
    BufReader::new(&stream)
        .take(MAX_ANSWER)
        .read_until(b'\n', &mut line)
        .map_err(|e| match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => ClientError::Io {
                socket: socket.to_owned(),
                source: io::Error::new(e.kind(), "no answer in time"),
            },
            _ => io_err(e),
        })?;
    let bad = |reason: String| ClientError::BadAnswer {
        socket: socket.to_owned(),
        reason,
    };
    if line.is_empty() {
        sent.map_err(io_err)?;
        return Err(bad("the connection closed without an answer".into()));
    }
    let mut answer: Value = serde_json::from_slice(&line).map_err(|e| bad(e.to_string()))?;
    match answer.get("ok").and_then(Value::as_bool) {
        Some(true) => answer
            .get_mut(op.key())
            .map(Value::take)
            .ok_or_else(|| bad(format!("no '{}' in it", op.key()))),
        Some(false) => {
            let message = answer
                .get("error")
                .and_then(Value::as_str)
                .unwrap_or("unspecified error");
            Err(refused(mountpoint, message))
        }
        None => Err(bad("no 'ok' in it".into())),
    }
}

/// A server's refusal; one that keeps out a caller who is not root reads like every other
/// command's (older daemons said it in their own words).
fn refused(mountpoint: &Path, message: &str) -> ClientError {
    if message == protocol::ROOT_ONLY || message.starts_with("permission denied: only root") {
        return ClientError::Denied {
            mountpoint: mountpoint.to_owned(),
        };
    }
    ClientError::Refused {
        mountpoint: mountpoint.to_owned(),
        message: message.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolves_missing_and_relative_paths() {
        let tmp = tempfile::tempdir().unwrap();
        let real = std::fs::canonicalize(tmp.path()).unwrap();
        assert_eq!(
            crate::store::mountinfo::resolve_mountpoint(&tmp.path().join("gone")),
            real.join("gone")
        );
        std::fs::create_dir(real.join("d")).unwrap();
        std::os::unix::fs::symlink(real.join("d"), real.join("link")).unwrap();
        assert_eq!(
            crate::store::mountinfo::resolve_mountpoint(&real.join("link")),
            real.join("d")
        );
        assert_eq!(
            crate::store::mountinfo::resolve_mountpoint(&real.join("d/")),
            real.join("d")
        );
    }

    #[test]
    fn missing_and_dead_sockets_say_so() {
        let tmp = tempfile::tempdir().unwrap();
        let mnt = Path::new("/nowhere");
        let socket = tmp.path().join("x.sock");
        let e = Client::at(mnt, &socket).status().unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "no layerfs mount at /nowhere (no control socket at {})",
                socket.display()
            )
        );
        drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
        let e = Client::at(mnt, &socket).status().unwrap_err();
        assert!(matches!(e, ClientError::NotListening { .. }), "{e}");
    }
}
