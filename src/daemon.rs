//! Detaching from the terminal so that the command returns only once the mount is live.
//!
//! The parent forks before any thread exists, then waits on a pipe. The child mounts and
//! writes one line: `ok`, or the error. The parent prints the error (or nothing) and exits
//! 0 only on `ok`; if the child dies without a word the parent says so and fails.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};

use nix::unistd::{fork, ForkResult};

/// The child's end of the readiness pipe.
pub struct Readiness {
    pipe: Option<File>,
}

impl Readiness {
    /// For a foreground mount: there is nobody to tell.
    pub fn foreground() -> Readiness {
        Readiness { pipe: None }
    }

    /// Tells the waiting parent the mount is live, and cuts the daemon off the terminal.
    pub fn ready(&mut self) {
        if let Some(mut pipe) = self.pipe.take() {
            let _ = pipe.write_all(b"ok\n");
            detach_stdio();
        }
    }

    /// Tells the waiting parent why mounting failed.
    pub fn failed(&mut self, reason: &str) {
        if let Some(mut pipe) = self.pipe.take() {
            let _ = writeln!(pipe, "{reason}");
        }
    }
}

/// Forks. In the parent this never returns: it exits with the child's verdict.
pub fn detach() -> std::io::Result<Readiness> {
    let (read, write) = nix::unistd::pipe()?;
    // SAFETY: called before the process starts any thread.
    match unsafe { fork() }? {
        ForkResult::Parent { .. } => {
            drop(write);
            std::process::exit(wait_for_child(read));
        }
        ForkResult::Child => {
            drop(read);
            let _ = nix::unistd::setsid();
            let _ = std::env::set_current_dir("/");
            Ok(Readiness {
                pipe: Some(File::from(write)),
            })
        }
    }
}

fn wait_for_child(read: OwnedFd) -> i32 {
    let mut message = String::new();
    let _ = File::from(read).read_to_string(&mut message);
    match message.trim_end() {
        "ok" => 0,
        "" => {
            eprintln!("layerfs: the daemon exited before the mount was live");
            1
        }
        reason => {
            eprintln!("layerfs: {reason}");
            1
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
