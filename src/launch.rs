//! Starting a mount from a front end: the `layerfs mount` command and the `mount.layerfs`
//! helper do the same steps, in the same order, through this one function.
//!
//! 1. Take back a mountpoint that a killed daemon's dead mount still holds, then validate
//!    the configuration, so a bad one fails with one line and nothing started; lock the
//!    local tree against a second daemon.
//! 2. Detach (unless in the foreground): the command returns only once the mount is live,
//!    with `failure_code` if it never becomes so (mount(8) wants 32 from its helpers).
//! 3. Log: to stderr in the foreground; detached, to the journal when there is one (and
//!    warnings to stderr until the daemon lets go of the terminal), or to `log_file`.
//! 4. Serve until unmounted, telling systemd (`Type=notify`) once the mount is live.

use std::io::IsTerminal;

use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

use crate::config::MountConfig;
use crate::daemon::{self, Readiness};
use crate::error::{Error, Result};

/// Mounts `config` and serves it until it is unmounted. In the detaching parent this does
/// not return: the process exits with 0 or `failure_code`.
pub fn mount(mut config: MountConfig, failure_code: i32) -> Result<()> {
    crate::fs::kernel_mount::reclaim_dead(&config.mountpoint)?;
    config.validate()?;
    // Taken before detaching, so a refusal is a startup error like the others; the daemon
    // inherits the lock (it belongs to the open file, which the fork shares) and holds it
    // until it exits.
    let _local = crate::local_lock::take(&config.local)?;
    let mut readiness = if config.foreground {
        Readiness::foreground()
    } else {
        daemon::detach(failure_code).map_err(Error::Detach)?
    };
    init_logging(&config);
    let result = crate::mount::serve(&config, &mut readiness);
    if let Err(e) = &result {
        readiness.failed(&e.to_string());
        tracing::error!(error = %e, "mount failed");
    }
    result
}

/// `RUST_LOG` if set, else `-o log=`, else `level`.
fn filter(config: &MountConfig, level: &str) -> EnvFilter {
    if let Ok(filter) = EnvFilter::try_from_default_env() {
        return filter;
    }
    level_filter(config.log_level.as_deref().unwrap_or(level))
}

fn level_filter(level: &str) -> EnvFilter {
    // fuser warns that its own unmount-on-drop failed after every external umount: the
    // filesystem is already gone then, so that line says nothing.
    EnvFilter::new(format!("{level},fuser::session=error"))
}

/// Sets a new filter on the daemon's log (`-o remount,log=…`).
type Reload = Box<dyn Fn(&str) -> std::result::Result<(), String> + Send + Sync>;

/// The log's reload handles, set once logging is up.
static RELOAD: std::sync::OnceLock<Vec<Reload>> = std::sync::OnceLock::new();

/// Replaces the filter of the daemon's log with `level` (a level or a `RUST_LOG`-style
/// filter), where the log goes: the journal, the log file, or stderr in the foreground.
pub fn set_log_level(level: &str) -> std::result::Result<(), String> {
    let handles = RELOAD
        .get()
        .filter(|h| !h.is_empty())
        .ok_or("this daemon's log cannot change level")?;
    EnvFilter::try_new(level).map_err(|e| format!("log={level}: {e}"))?;
    handles.iter().try_for_each(|reload| reload(level))
}

/// `filter`, behind a reload handle kept in [`RELOAD`]'s list.
fn reloadable<S>(
    filter: EnvFilter,
    handles: &mut Vec<Reload>,
) -> tracing_subscriber::reload::Layer<EnvFilter, S>
where
    S: tracing::Subscriber + Send + Sync + 'static,
{
    let (layer, handle) = tracing_subscriber::reload::Layer::new(filter);
    handles.push(Box::new(move |level| {
        handle
            .reload(level_filter(level))
            .map_err(|e| e.to_string())
    }));
    layer
}

fn init_logging(config: &MountConfig) {
    let mut handles = Vec::new();
    init_layers(config, &mut handles);
    let _ = RELOAD.set(handles);
}

fn init_layers(config: &MountConfig, handles: &mut Vec<Reload>) {
    let registry = tracing_subscriber::registry();
    if let Some(path) = &config.log_file {
        match std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            Ok(file) => {
                let layer = tracing_subscriber::fmt::layer()
                    .with_ansi(false)
                    .with_writer(std::sync::Mutex::new(file))
                    .with_filter(reloadable(filter(config, "info"), handles));
                let _ = registry.with(layer).try_init();
                return;
            }
            Err(e) => eprintln!(
                "layerfs: log file {}: {e}; logging to stderr",
                path.display()
            ),
        }
    }
    let ansi = std::io::stderr().is_terminal();
    if config.foreground {
        let layer = tracing_subscriber::fmt::layer()
            .with_ansi(ansi)
            .with_writer(std::io::stderr)
            .with_filter(reloadable(filter(config, "info"), handles));
        let _ = registry.with(layer).try_init();
        return;
    }
    // Detached: only warnings reach the terminal the command returns to (and nothing once
    // stderr is /dev/null); the full log goes to the journal where there is one.
    let stderr = tracing_subscriber::fmt::layer()
        .with_ansi(ansi)
        .with_writer(std::io::stderr)
        .with_filter(filter(config, "warn"));
    let journal = tracing_journald::layer().ok().map(|j| {
        j.with_syslog_identifier("layerfs".into())
            .with_filter(reloadable(filter(config, "info"), handles))
    });
    let _ = registry.with(stderr).with(journal).try_init();
}
