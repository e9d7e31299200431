//! Running the external tools the driver relies on (`qemu-img`, `losetup`, `mount`, `mkfs.ext4`,
//! `blkid`, `resize2fs`): arguments are passed as a list, never through a shell.

use std::ffi::OsStr;
use std::io;

use tokio::process::Command;

use super::error::{CsiError, Result};

/// A command for `program` that is killed when the driver dies, however it dies: a
/// SIGKILLed driver runs no cleanup, and a conversion left running would go on writing an
/// image nobody will use. The kernel signals the tool when the *thread* that started it
/// ends; the driver starts tools on the runtime's workers, which live as long as it does,
/// or on a thread that waits for the tool. Async callers wrap it
/// (`tokio::process::Command::from`).
pub fn tool(program: &str) -> std::process::Command {
    use std::os::unix::process::CommandExt;
    let mut cmd = std::process::Command::new(program);
    // SAFETY: the hook only makes async-signal-safe calls (prctl, getppid).
    unsafe { cmd.pre_exec(kill_when_orphaned(std::process::id())) };
    cmd
}

fn kill_when_orphaned(driver: u32) -> impl FnMut() -> io::Result<()> + Send + Sync + 'static {
    move || {
        // SAFETY: prctl(PR_SET_PDEATHSIG) and getppid have no memory-safety preconditions.
        if unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // The driver may have died between the fork and the prctl.
        if u32::try_from(unsafe { libc::getppid() }).ok() != Some(driver) {
            return Err(io::Error::from_raw_os_error(libc::ESRCH));
        }
        Ok(())
    }
}

/// Runs `program args…` and returns its stdout; a failure carries the tool's stderr.
pub async fn run<I, S>(program: &str, args: I) -> Result<String>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    run_accepting(program, args, &[0]).await
}

/// Like [`run`], with the exit codes that count as success (`e2fsck` exits 1 after fixing).
pub async fn run_accepting<I, S>(program: &str, args: I, ok: &[i32]) -> Result<String>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let args: Vec<_> = args.into_iter().map(|a| a.as_ref().to_owned()).collect();
    tracing::debug!(program, ?args, "running");
    let output = Command::from(tool(program))
        .args(&args)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output()
        .await
        .map_err(|e| CsiError::Internal(format!("cannot run {program}: {e}")))?;
    if output.status.code().is_some_and(|c| ok.contains(&c)) {
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    } else {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let shown: Vec<String> = args
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        Err(CsiError::Internal(format!(
            "{program} {} failed ({}): {}",
            shown.join(" "),
            output.status,
            stderr.trim()
        )))
    }
}
