//! Changing a running mount's options: `mount.layerfs -o remount,…` sends the options over
//! the control socket (`reconfigure`), and the mount applies those that can change live:
//!
//! - `refresh=` — the time between refresh rounds (the next round follows the new one);
//! - `log=` — the log filter (it then wins over `RUST_LOG`).
//!
//! Every other option must say what the mount already has: `allow_other` on a mount made with
//! it is fine, `threads=8` on one serving with 4 is refused, naming the option, and nothing
//! is changed. Options mount(8) passes for the kernel's side of a remount (`rw`, `relatime`,
//! `user_id=`…) and those it keeps for itself are ignored.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::config::MountConfig;
use crate::refresh::RefreshHandle;

/// What a mount answers `reconfigure` with.
pub trait Reconfigure: Send + Sync {
    /// Applies `options` (one option each) or, if any cannot change live, nothing.
    fn reconfigure(&self, options: &[String]) -> Result<Reconfigured, String>;
}

/// What a `reconfigure` changed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Reconfigured {
    /// The options that took effect, as given (`refresh=2s`); empty when nothing changed.
    pub changed: Vec<String>,
}

/// What `options` would change in `current`, or the options that cannot change live.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Plan {
    pub refresh: Option<Duration>,
    pub log: Option<String>,
    pub changed: Vec<String>,
}

/// Options of a remount that are the kernel's or mount(8)'s business, not ours.
fn is_ignored(option: &str) -> bool {
    let key = option.split_once('=').map_or(option, |(k, _)| k);
    matches!(
        key,
        "remount"
            | "user_id"
            | "group_id"
            | "rootmode"
            | "fd"
            | "max_read"
            | "blksize"
            | "subtype"
            | "atime"
            | "noatime"
            | "relatime"
            | "norelatime"
            | "strictatime"
            | "nostrictatime"
            | "lazytime"
            | "nolazytime"
            | "diratime"
            | "nodiratime"
            | "exec"
            | "noexec"
            | "sync"
            | "async"
            | "dirsync"
    ) || crate::config::is_for_mount8(option)
}

/// Checks `options` against `current`: each option alone must change nothing but what can
/// change live. All refusals are reported together.
pub fn plan(current: &MountConfig, options: &[String]) -> Result<Plan, String> {
    let mut plan = Plan::default();
    let mut refused = Vec::new();
    for option in options
        .iter()
        .map(|o| o.trim())
        .filter(|o| !o.is_empty() && !is_ignored(o))
    {
        let mut next = current.clone();
        next.apply_option(option).map_err(|e| e.to_string())?;
        let live = MountConfig {
            refresh: current.refresh,
            log_level: current.log_level.clone(),
            ..next.clone()
        };
        if live != *current {
            refused.push(option.to_owned());
            continue;
        }
        if next.refresh != current.refresh {
            plan.refresh = Some(next.refresh);
            plan.changed.push(option.to_owned());
        }
        if next.log_level != current.log_level {
            plan.log = next.log_level;
            plan.changed.push(option.to_owned());
        }
    }
    if !refused.is_empty() {
        return Err(format!(
            "cannot change while mounted: {} (only refresh= and log= change live; unmount and mount again for the rest)",
            refused.join(", ")
        ));
    }
    Ok(plan)
}

/// Sets the daemon's log filter to a level or a `RUST_LOG`-style filter.
pub type SetLog = Box<dyn Fn(&str) -> Result<(), String> + Send + Sync>;

/// A mount's live options: checks each request against the configuration it runs with,
/// and applies it to the refresh engine and the log.
pub struct Live {
    config: Mutex<MountConfig>,
    refresh: Arc<RefreshHandle>,
    /// Sets the log filter; the daemon's log is set up outside the library's reach.
    set_log: SetLog,
}

impl Live {
    pub fn new(config: MountConfig, refresh: Arc<RefreshHandle>, set_log: SetLog) -> Live {
        Live {
            config: Mutex::new(config),
            refresh,
            set_log,
        }
    }
}

impl Reconfigure for Live {
    fn reconfigure(&self, options: &[String]) -> Result<Reconfigured, String> {
        let mut config = self.config.lock();
        let plan = plan(&config, options)?;
        // The log first: it is the one that can fail.
        if let Some(level) = &plan.log {
            (self.set_log)(level)?;
            config.log_level = Some(level.clone());
        }
        if let Some(refresh) = plan.refresh {
            self.refresh.set_interval(refresh);
            config.refresh = refresh;
        }
        if !plan.changed.is_empty() {
            tracing::info!(changed = %plan.changed.join(","), "mount options changed");
        }
        Ok(Reconfigured {
            changed: plan.changed,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(list: &str) -> Vec<String> {
        list.split(',').map(String::from).collect()
    }

    fn current() -> MountConfig {
        let mut c = MountConfig::default();
        c.apply_options("local=/l,remote=/r,allow_other,threads=4")
            .unwrap();
        c
    }

    #[test]
    fn refresh_and_log_change_live() {
        let p = plan(&current(), &opts("remount,refresh=2s,log=debug")).unwrap();
        assert_eq!(p.refresh, Some(Duration::from_secs(2)));
        assert_eq!(p.log.as_deref(), Some("debug"));
        assert_eq!(p.changed, ["refresh=2s", "log=debug"]);
    }

    #[test]
    fn what_the_mount_already_has_and_the_kernels_options_pass() {
        let p = plan(
            &current(),
            &opts("rw,allow_other,threads=4,local=/l,relatime,user_id=0,group_id=0,refresh=5,x-systemd.automount"),
        )
        .unwrap();
        assert_eq!(p, Plan::default());
    }

    #[test]
    fn the_rest_is_refused_by_name_and_nothing_applies() {
        let e = plan(&current(), &opts("refresh=1,threads=8,ro,local=/other")).unwrap_err();
        assert!(
            e.starts_with("cannot change while mounted: threads=8, ro, local=/other"),
            "{e}"
        );
        let e = plan(&current(), &opts("bogus")).unwrap_err();
        assert!(e.contains("bogus"), "{e}");
        let e = plan(&current(), &opts("refresh=soon")).unwrap_err();
        assert!(e.contains("refresh=soon"), "{e}");
    }
}
