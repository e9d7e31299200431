//! Serving a mount: open the trees, scan the remote, build the view, mount, run until
//! unmounted.

use std::sync::Arc;

use fuser::{Config, MountOption, Session, SessionACL};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use tracing::{info, warn};

use crate::config::MountConfig;
use crate::daemon::Readiness;
use crate::error::{Error, Result};
use crate::fs::{LayerFs, Timeouts};
use crate::layout::LayoutIndex;
use crate::view::{open_root, Layout, View};

/// Mounts and serves until the filesystem is unmounted (by `umount`, `fusermount3 -u`, or
/// a SIGTERM/SIGINT/SIGHUP to the daemon). `readiness` is told once the mount is live.
pub fn serve(config: &MountConfig, readiness: &mut Readiness) -> Result<()> {
    // Modes arrive from the kernel with the caller's umask already applied.
    nix::sys::stat::umask(nix::sys::stat::Mode::empty());
    raise_fd_limit();

    let open = |path: &std::path::Path| {
        open_root(path).map_err(|source| Error::Open {
            path: path.to_owned(),
            source,
        })
    };
    let remote = open(&config.remote)?;
    let local = open(&config.local)?;
    let index = LayoutIndex::scan(&config.remote, &config.driver);
    info!(
        remote = %config.remote.display(),
        layers = index.layers().count(),
        images = index.images().count(),
        not_ready = index.not_ready().len(),
        "remote tree scanned"
    );
    let layout = Layout::new(&config.driver, &config.mountpoint, config.link_style);
    let view = View::new(layout, local, remote, index).map_err(|source| Error::Open {
        path: config.local.clone(),
        source,
    })?;
    let timeouts = Timeouts {
        entry: config.entry_timeout,
        attr: config.attr_timeout,
    };
    let fs = LayerFs::new(Arc::new(view), timeouts, config.passthrough);

    let mut session =
        Session::new(fs, &config.mountpoint, &fuse_config(config)).map_err(|source| {
            Error::Mount {
                path: config.mountpoint.clone(),
                source,
            }
        })?;
    let mut unmounter = session.unmount_callable();
    let mountpoint = config.mountpoint.clone();
    match signal_hook::iterator::Signals::new([SIGTERM, SIGINT, SIGHUP]) {
        Ok(mut signals) => {
            std::thread::Builder::new()
                .name("signals".into())
                .spawn(move || {
                    if let Some(sig) = signals.forever().next() {
                        info!(signal = sig, "unmounting on signal");
                        if let Err(e) = unmounter.unmount() {
                            warn!(error = %e, mountpoint = %mountpoint.display(), "unmount on signal failed");
                        }
                    }
                })
                .map_err(|source| Error::Mount {
                    path: config.mountpoint.clone(),
                    source,
                })?;
        }
        Err(e) => warn!(error = %e, "signals will not unmount the filesystem"),
    }
    info!(mountpoint = %config.mountpoint.display(), "mounted");
    readiness.ready();
    session.run().map_err(|source| Error::Mount {
        path: config.mountpoint.clone(),
        source,
    })?;
    info!(mountpoint = %config.mountpoint.display(), "unmounted");
    Ok(())
}

fn fuse_config(config: &MountConfig) -> Config {
    let mut options = vec![
        MountOption::FSName(
            config
                .fsname
                .clone()
                .unwrap_or_else(|| config.remote.display().to_string()),
        ),
        MountOption::Subtype("layerfs".into()),
        MountOption::DefaultPermissions,
    ];
    if config.read_only {
        options.push(MountOption::RO);
    }
    // Like any FUSE mount, set-ID bits and device nodes are inert unless asked for. A
    // container rootfs that overlayfs stacks on the view follows its own mount's flags.
    options.push(if config.suid {
        MountOption::Suid
    } else {
        MountOption::NoSuid
    });
    options.push(if config.dev {
        MountOption::Dev
    } else {
        MountOption::NoDev
    });
    let mut fuse = Config::default();
    fuse.mount_options = options;
    fuse.acl = if config.allow_other {
        SessionACL::All
    } else if config.allow_root {
        SessionACL::RootAndOwner
    } else {
        SessionACL::Owner
    };
    fuse.n_threads = Some(config.threads);
    fuse.clone_fd = true;
    fuse
}

/// Directories stay open as `O_PATH` handles while the kernel knows them: allow many.
fn raise_fd_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    if let Ok((_, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    }
}
