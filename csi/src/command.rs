//! Running the external tools the driver relies on (`qemu-img`, `losetup`, `mount`, `mkfs.ext4`,
//! `blkid`, `resize2fs`): arguments are passed as a list, never through a shell.

use std::ffi::OsStr;

use tokio::process::Command;

use super::error::{CsiError, Result};

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
    let output = Command::new(program)
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
