//! The control socket: how `layerfs status`, `refresh`, `layers` and `images` talk to a
//! running mount (DESIGN §9).
//!
//! Each mount serves one unix socket. The mount's engine answers through
//! [`MountControl`](crate::refresh::report::MountControl); this module only carries
//! questions and answers:
//!
//! 1. The mount calls [`serve`] with its engine handle and [`socket_path`] of its (canonical)
//!    mountpoint. A socket file left by a mount that died is removed first; a live one is
//!    never taken over. The returned [`ControlServer`] serves on its own thread until it is
//!    dropped, which removes the socket.
//! 2. A client ([`client::query`]) resolves the MOUNTPOINT it was given the same way,
//!    connects, sends one request line and reads one answer line.
//!
//! **Where the socket lives.** `<run dir>/mounts/<escaped mountpoint>.sock`, so that a
//! client needs nothing but the mountpoint. The run dir is `/run/layerfs`, or
//! `$LAYERFS_RUN_DIR` when set. The mountpoint is escaped like `systemd-escape --path`:
//! slashes become `-`, and bytes other than ASCII letters, digits, `:`, `_` and `.` (and a
//! leading `.`) become `\xNN`; `/var/lib/isulad/storage` gives `var-lib-isulad-storage.sock`.
//! The `mounts/` subdir keeps these names apart from other sockets in the run dir (the CSI
//! driver's `csi.sock` would otherwise be the socket of a mount at `/csi`). A path too long
//! for a unix socket address (107 bytes) uses a digest of the mountpoint instead of its
//! escaped form.
//!
//! **Who may talk.** Root only, by default: the dirs are created 0700, the socket is 0600,
//! and the server also checks each peer's credentials (uid 0, or the uid the mount runs as),
//! so a loose mode on a pre-existing run dir does not open it up.
//!
//! **Protocol** ([`protocol`]): one JSON object per line each way. `{"op":"status"}` is
//! answered `{"ok":true,"status":{…}}`; the other ops are `refresh` (→ `round`), `layers`
//! (→ `layers`) and `images` (→ `images`). A request the server cannot serve is answered
//! `{"ok":false,"error":"…"}` and the connection stays usable, except after a request longer
//! than [`protocol::MAX_REQUEST`], which also closes it.

pub mod client;
mod path;
pub mod protocol;
pub mod render;
mod server;
pub mod umount;

pub use client::{query, ClientError};
pub use path::{escape_path, run_dir, socket_path, socket_path_in, DEFAULT_RUN_DIR, RUN_DIR_ENV};
pub use protocol::Op;
pub use server::{serve, ControlServer};

use std::path::Path;

/// What a control command prints, and whether it succeeded.
pub struct Reply {
    /// For stdout: the rendered answer, or its JSON with `--json`.
    pub text: String,
    /// An error to report after printing the text (a refresh round that failed to scan).
    pub outcome: Result<(), ClientError>,
}

/// Runs `layerfs status|refresh|layers|images MOUNTPOINT [--json]`: asks the mount and
/// renders its answer. An error here means there is nothing to print.
pub fn command(mountpoint: &Path, op: Op, json: bool) -> Result<Reply, ClientError> {
    let mountpoint = client::resolve_mountpoint(mountpoint);
    let socket = socket_path(&mountpoint);
    let payload = client::query_at(&mountpoint, &socket, op)?;
    let decode = |e: serde_json::Error| ClientError::BadAnswer {
        socket: socket.clone(),
        reason: e.to_string(),
    };
    let mut outcome = Ok(());
    let text = match op {
        Op::Refresh => {
            let round: protocol::RoundView =
                serde_json::from_value(payload.clone()).map_err(decode)?;
            if let Some(e) = round.error.clone() {
                outcome = Err(ClientError::RoundFailed(e));
            }
            if json {
                render::json(&payload)
            } else {
                render::round(&round)
            }
        }
        _ if json => render::json(&payload),
        Op::Status => render::status(&serde_json::from_value(payload).map_err(decode)?, now()),
        Op::Layers => render::layers(&serde_json::from_value::<Vec<_>>(payload).map_err(decode)?),
        Op::Images => render::images(&serde_json::from_value::<Vec<_>>(payload).map_err(decode)?),
    };
    Ok(Reply { text, outcome })
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}
