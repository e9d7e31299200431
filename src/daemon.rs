//! Detaching from the terminal so that the command returns only once the mount is live.
//!
//! The parent forks before any thread exists, then waits on a pipe. The child mounts and
//! writes one line: `ok`, or the error. The parent prints the error (or nothing) and exits
//! 0 only on `ok`, with the caller's failure code otherwise; if the child dies without a
//! word the parent says so and fails. A daemon run by systemd with `Type=notify` (in the
//! foreground) tells systemd the same moment with `READY=1`.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};

use nix::unistd::{fork, ForkResult};

/// The child's end of the readiness pipe.
pub struct Readiness {
    pipe: Option<File>,
    /// Whether `READY=1` goes to systemd from here: not from a daemon a keeper started,
    /// since systemd hears only its main process, the keeper.
    systemd: bool,
}

impl Readiness {
    /// For a foreground mount: there is nobody to tell.
    pub fn foreground() -> Readiness {
        Readiness {
            pipe: None,
            systemd: true,
        }
    }

    /// For a daemon a keeper started: its word goes to the keeper, which passes it on.
    pub fn to_keeper(pipe: File) -> Readiness {
        Readiness {
            pipe: Some(pipe),
            systemd: false,
        }
    }

    /// Tells the waiting parent (or systemd) the mount is live, and cuts a detached daemon
    /// off the terminal.
    pub fn ready(&mut self) {
        if let Some(mut pipe) = self.pipe.take() {
            let _ = pipe.write_all(b"ok\n");
            detach_stdio();
        }
        if self.systemd && std::env::var_os("NOTIFY_SOCKET").is_some() {
            if let Err(e) = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]) {
                tracing::warn!(error = %e, "could not tell systemd the mount is ready");
            }
        }
    }

    /// Tells the waiting parent why mounting failed; `false` when there is no parent
    /// waiting (in the foreground, or once the mount was live).
    pub fn failed(&mut self, reason: &str) -> bool {
        match self.pipe.take() {
            Some(mut pipe) => writeln!(pipe, "{reason}").is_ok(),
            None => false,
        }
    }
}

/// Forks. In the parent this never returns: it exits with 0 once the child says the mount
/// is live, with `failure_code` otherwise.
pub fn detach(failure_code: i32) -> std::io::Result<Readiness> {
    // Close-on-exec: a daemon a keeper runs must not hold the end the parent waits on.
    let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    // SAFETY: called before the process starts any thread.
    match unsafe { fork() }? {
        ForkResult::Parent { .. } => {
            drop(write);
            let live = wait_for_child(read);
            std::process::exit(if live { 0 } else { failure_code });
        }
        ForkResult::Child => {
            drop(read);
            let _ = nix::unistd::setsid();
            let _ = std::env::set_current_dir("/");
            Ok(Readiness {
                pipe: Some(File::from(write)),
                systemd: true,
            })
        }
    }
}

/// Waits for the child's word; prints why when it is not `ok`.
fn wait_for_child(read: OwnedFd) -> bool {
    let mut message = String::new();
    let _ = File::from(read).read_to_string(&mut message);
    match message.trim_end() {
        "ok" => true,
        "" => {
            eprintln!("layerfs: the daemon exited before the mount was live");
            false
        }
        reason => {
            eprintln!("layerfs: {reason}");
            false
        }
    }
}

/// Points stdin, stdout and stderr at /dev/null, so the daemon holds no terminal.
fn detach_stdio() {
    let Ok(null) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
    else {
        return;
    };
    for target in 0..=2 {
        // SAFETY: dup2 onto the standard descriptors, which this process owns.
        unsafe {
            libc::dup2(std::os::fd::AsRawFd::as_raw_fd(&null.as_fd()), target);
        }
    }
}
