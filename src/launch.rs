//! Starting a mount from a front end: the `layerfs mount` command and the `mount.layerfs`
//! helper do the same steps, in the same order, through this one function.
//!
//! 0. Close what the process inherited by accident (`inherited`): whatever it keeps open, the
//!    daemon keeps for the life of the mount.
//! 1. Take back a mountpoint that a killed daemon's dead mount still holds, then validate
//!    the configuration, so a bad one fails with one line and nothing started; lock the
//!    local tree against a second daemon.
//! 2. Detach (unless in the foreground): the command returns only once the mount is live,
//!    with `failure_code` if it never becomes so (mount(8) wants 32 from its helpers).
//! 3. Log: to stderr in the foreground; detached, to `log_file`, else the journal when there
//!    is one, else a default file (`logging`), and warnings to stderr until the daemon lets
//!    go of the terminal. A startup error is printed once, by whoever is on the terminal.
//! 4. Serve until unmounted, telling systemd (`Type=notify`) once the mount is live; for a
//!    kept mount (`MountConfig::kept`), through a keeper that starts the daemon and starts
//!    another when one dies (see `keeper`). A daemon a keeper starts comes back here, finds
//!    what it was handed in its environment, and only serves.

use crate::config::MountConfig;
use crate::daemon::{self, Readiness};
use crate::error::{Error, Result};
use crate::inherited::Closed;

/// Mounts `config` and serves it until it is unmounted. In the detaching parent this does
/// not return: the process exits with 0 or `failure_code`.
///
/// It takes the process over: call it from `main` before any thread or file exists. It
/// closes every descriptor the process holds but the standard three and what a keeper
/// handed it.
pub fn mount(mut config: MountConfig, failure_code: i32) -> Result<()> {
    let kept = crate::keeper::Kept::inherited();
    let handed = match &kept {
        Some(Ok((kept, ready))) => kept.descriptors(ready).to_vec(),
        _ => Vec::new(),
    };
    // SAFETY: the process has started no thread and opened nothing of its own yet; what it
    // was handed on purpose is in `handed`.
    let closed = unsafe { crate::inherited::close_all_but(&handed) };
    if let Some(kept) = kept {
        return serve_kept(config, kept, &closed);
    }
    crate::fs::kernel_mount::reclaim_dead(&config.mountpoint)?;
    config.validate()?;
    // Taken before detaching, so a refusal is a startup error like the others; the daemon
    // inherits the lock (it belongs to the open file, which the fork shares) and holds it
    // until it exits.
    let _local = crate::local_lock::take(&config.local, crate::control::client::mount_using)?;
    let mut readiness = if config.foreground {
        Readiness::foreground()
    } else {
        daemon::detach(failure_code).map_err(Error::Detach)?
    };
    crate::logging::init(&config);
    log_closed(&closed);
    if config.kept() {
        // The keeper tells whoever waits, and says why a start failed; a daemon it started
        // logs its own errors.
        return match crate::keeper::keep(&config, &mut readiness) {
            Ok(0) => Ok(()),
            Ok(_) => std::process::exit(failure_code),
            Err(e) if config.foreground => Err(e),
            Err(e) => {
                readiness.failed(&e.to_string());
                tracing::error!(target: crate::logging::STARTUP_FAILURE, error = %e, "mount failed");
                std::process::exit(failure_code)
            }
        };
    }
    let result = crate::mount::serve(&config, &mut readiness);
    if let Err(e) = &result {
        // Said once on the terminal: by the caller in the foreground, else by the waiting
        // parent; the log records it too.
        if config.foreground {
            if config.log_file.is_some() {
                tracing::error!(error = %e, "mount failed");
            }
            return result;
        }
        readiness.failed(&e.to_string());
        tracing::error!(target: crate::logging::STARTUP_FAILURE, error = %e, "mount failed");
        std::process::exit(failure_code);
    }
    result
}

/// A daemon a keeper started (see `keeper`): the keeper made the mount and holds the lock
/// on local; this process serves until the mount ends or it hands over. Its word on whether
/// it serves goes to the keeper, which says why a first start failed.
fn serve_kept(
    mut config: MountConfig,
    kept: std::io::Result<(crate::keeper::Kept, std::fs::File)>,
    closed: &std::io::Result<Vec<Closed>>,
) -> Result<()> {
    let (kept, ready) = kept.map_err(|source| Error::Mount {
        path: config.mountpoint.clone(),
        source,
    })?;
    let mut readiness = Readiness::to_keeper(ready);
    let result = config.validate_kept().and_then(|()| {
        crate::logging::init(&config);
        log_closed(closed);
        crate::mount::serve_kept(&config, kept, &mut readiness)
    });
    if let Err(e) = &result {
        if !readiness.failed(&e.to_string()) {
            tracing::error!(error = %e, "the daemon stopped");
        }
        std::process::exit(1);
    }
    result
}

/// Says which inherited descriptors were closed: a caller that leaks them into every child
/// is worth knowing about.
fn log_closed(closed: &std::io::Result<Vec<Closed>>) {
    match closed {
        Ok(closed) => {
            for Closed { fd, target } in closed {
                tracing::debug!(
                    fd,
                    target = %target.as_deref().map_or("?".into(), |t| t.display().to_string()),
                    "closed a descriptor inherited without close-on-exec"
                );
            }
        }
        Err(e) => tracing::warn!(
            error = %e,
            "could not list the descriptors this process inherited; they stay open"
        ),
    }
}
