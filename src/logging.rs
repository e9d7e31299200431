//! The daemon's log: where it goes, at what level, and changing that level while mounted.
//!
//! In the foreground it goes to stderr. Detached, it goes to `log_file` when one is given,
//! else to the journal when there is one, else to [`default_file`]: a detached daemon never
//! throws its log away. `layerfs status` says which ([`destination`]).

use std::fmt;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

use crate::config::MountConfig;

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

/// Lets `log` records (fuser's) through only up to what `filter` can show: the bridge
/// into `tracing` otherwise lets every one through to be judged, and fuser logs each
/// request it dispatches at debug level.
fn follow_level(filter: &EnvFilter) {
    use tracing::level_filters::LevelFilter as L;
    log::set_max_level(match filter.max_level_hint() {
        Some(L::OFF) => log::LevelFilter::Off,
        Some(L::ERROR) => log::LevelFilter::Error,
        Some(L::WARN) => log::LevelFilter::Warn,
        Some(L::INFO) => log::LevelFilter::Info,
        Some(L::DEBUG) => log::LevelFilter::Debug,
        _ => log::LevelFilter::Trace,
    });
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
        let filter = level_filter(level);
        follow_level(&filter);
        handle.reload(filter).map_err(|e| e.to_string())
    }));
    layer
}

/// Where the daemon's log goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Destination {
    Stderr,
    Journal,
    File(PathBuf),
}

impl fmt::Display for Destination {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Destination::Stderr => f.write_str("stderr"),
            Destination::Journal => f.write_str("the journal (journalctl -t layerfs)"),
            Destination::File(path) => write!(f, "{}", path.display()),
        }
    }
}

static DESTINATION: std::sync::OnceLock<Destination> = std::sync::OnceLock::new();

/// Where this daemon's log goes, once logging is up.
pub fn destination() -> Option<&'static Destination> {
    DESTINATION.get()
}

/// The log file of a detached daemon that has neither `log_file` nor a journal: under
/// `/var/log/layerfs` for root, else under the user's state directory, named after the
/// mountpoint as systemd names mount units (`/mnt/layers` → `mnt-layers.log`).
pub fn default_file(mountpoint: &Path) -> PathBuf {
    let name = mountpoint
        .to_string_lossy()
        .trim_matches('/')
        .replace('-', "\\x2d")
        .replace('/', "-");
    let name = if name.is_empty() {
        "-".to_owned()
    } else {
        name
    };
    let dir = if nix::unistd::geteuid().is_root() {
        PathBuf::from("/var/log/layerfs")
    } else {
        std::env::var_os("XDG_STATE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".local/state")))
            .unwrap_or_else(std::env::temp_dir)
            .join("layerfs")
    };
    dir.join(format!("{name}.log"))
}

/// Starts the daemon's log where the configuration says (step 3 of starting a mount, in `launch`).
pub fn init(config: &MountConfig) {
    let mut handles = Vec::new();
    let destination = init_layers(config, &mut handles);
    follow_level(&filter(config, "info"));
    let _ = RELOAD.set(handles);
    let _ = DESTINATION.set(destination);
}

/// Logs to stderr at `level` (or as `RUST_LOG` says): for commands that run in the
/// foreground without a mount, such as `publish --watch`.
pub fn init_stderr(level: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| level_filter(level));
    let layer = tracing_subscriber::fmt::layer()
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .with_filter(filter);
    let _ = tracing_subscriber::registry().with(layer).try_init();
}

/// The target of startup failures a detached daemon logs: the command that started it
/// prints them (from the readiness pipe), so they must not also reach its terminal here.
pub const STARTUP_FAILURE: &str = "layerfs::startup";

fn init_layers(config: &MountConfig, handles: &mut Vec<Reload>) -> Destination {
    let registry = tracing_subscriber::registry();
    let ansi = std::io::stderr().is_terminal();
    if config.foreground && config.log_file.is_none() {
        let layer = tracing_subscriber::fmt::layer()
            .with_ansi(ansi)
            .with_writer(std::io::stderr)
            .with_filter(reloadable(filter(config, "info"), handles));
        let _ = registry.with(layer).try_init();
        return Destination::Stderr;
    }
    // Detached: only warnings reach the terminal the command returns to, until the daemon
    // lets go of it; startup failures not even those (see STARTUP_FAILURE).
    let stderr = (!config.foreground).then(|| {
        tracing_subscriber::fmt::layer()
            .with_ansi(ansi)
            .with_writer(std::io::stderr)
            .with_filter(filter(config, "warn"))
            .with_filter(tracing_subscriber::filter::filter_fn(|meta| {
                meta.target() != STARTUP_FAILURE
            }))
    });
    let journal = if config.log_file.is_none() {
        tracing_journald::layer().ok()
    } else {
        None
    };
    if let Some(journal) = journal {
        let journal = journal
            .with_syslog_identifier("layerfs".into())
            .with_filter(reloadable(filter(config, "info"), handles));
        let _ = registry.with(stderr).with(journal).try_init();
        return Destination::Journal;
    }
    let path = config
        .log_file
        .clone()
        .unwrap_or_else(|| default_file(&config.mountpoint));
    let opened = path
        .parent()
        .map_or(Ok(()), std::fs::create_dir_all)
        .and_then(|()| {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
        });
    match opened {
        Ok(file) => {
            let layer = tracing_subscriber::fmt::layer()
                .with_ansi(false)
                .with_writer(std::sync::Mutex::new(file))
                .with_filter(reloadable(filter(config, "info"), handles));
            let _ = registry.with(stderr).with(layer).try_init();
            Destination::File(path)
        }
        Err(e) => {
            eprintln!(
                "layerfs: log file {}: {e}; logging to stderr",
                path.display()
            );
            let layer = tracing_subscriber::fmt::layer()
                .with_ansi(ansi)
                .with_writer(std::io::stderr)
                .with_filter(reloadable(filter(config, "info"), handles));
            let _ = registry.with(layer).try_init();
            Destination::Stderr
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_file_is_named_after_the_mountpoint_as_systemd_names_units() {
        let name = |m: &str| {
            default_file(Path::new(m))
                .file_name()
                .unwrap()
                .to_string_lossy()
                .into_owned()
        };
        assert_eq!(name("/mnt/layers"), "mnt-layers.log");
        assert_eq!(name("/var/lib/my-store/"), "var-lib-my\\x2dstore.log");
        assert_eq!(name("/"), "-.log");
    }
}
