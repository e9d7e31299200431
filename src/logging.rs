//! The daemon's log: where it goes, at what level, and changing that level while mounted.

use std::io::IsTerminal;

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

/// Starts the daemon's log where the configuration says (step 3 of starting a mount, in `launch`).
pub fn init(config: &MountConfig) {
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
