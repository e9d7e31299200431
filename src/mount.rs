//! Serving a mount: open the trees, scan the remote, build the view, mount, follow the
//! remote with refresh rounds, run until unmounted.

use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use fuser::{Config, MountOption, Session, SessionACL};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM, SIGUSR1};
use tracing::{info, warn};

use crate::config::{MountConfig, RingUse};
use crate::control::reconfigure::{Live, Reconfigure};
use crate::control::MountControl;
use crate::daemon::Readiness;
use crate::error::{Error, Result};
use crate::fs::kernel_mount::{self, KernelMount};
use crate::fs::HandleFact;
use crate::fs::{ring, LayerFs, Timeouts, Transport, CROWD_THREADS, SYNC_THREADS};
use crate::keeper::{Kept, Log};
use crate::layout::{LayoutIndex, Scanner};
use crate::metrics::{InodeCounts, Metrics, Sources};
use crate::notice::Wire;
use crate::refresh::{self, MountInfo, RefreshHandle, Refresher};
use crate::report::{
    ImageInfo, KeeperInfo, LayerInfo, QuotaAnswer, QuotaRequest, RoundReport, Status,
};
use crate::store::atime::{self, AccessTimes, Atime};
use crate::view::keep::Fact;
use crate::view::{open_root, Layout, View};

/// Mounts and serves until the filesystem is unmounted (by `umount`, `fusermount3 -u`, or
/// a SIGTERM/SIGINT/SIGHUP to the daemon). `readiness` is told once the mount is live.
pub fn serve(config: &MountConfig, readiness: &mut Readiness) -> Result<()> {
    serve_on(config, None, readiness)
}

/// Serves the mount a keeper made and holds (see [`crate::keeper`]): the first daemon
/// reads the INIT, a later one resumes the connection where the dead one left it.
pub fn serve_kept(config: &MountConfig, kept: Kept, readiness: &mut Readiness) -> Result<()> {
    let (log, records) = kept.state.log().map_err(|source| Error::Mount {
        path: config.mountpoint.clone(),
        source,
    })?;
    let kept = Inherited { kept, log, records };
    serve_on(config, Some(kept), readiness)
}

/// A kept connection, and the journal the daemons before this one left in its state.
pub struct Inherited {
    kept: Kept,
    log: Arc<Log>,
    records: Vec<Vec<u8>>,
}

fn serve_on(
    config: &MountConfig,
    kept: Option<Inherited>,
    readiness: &mut Readiness,
) -> Result<()> {
    // Modes arrive from the kernel with the caller's umask already applied.
    nix::sys::stat::umask(nix::sys::stat::Mode::empty());
    raise_fd_limit();
    crate::fs::trim::grow_descriptor_table();
    // Bound before anything is mounted: an address that cannot be had fails the mount.
    let (metrics, metrics_server) = match config.metrics {
        Some(addr) => {
            let metrics = Arc::new(Metrics::new());
            let server =
                crate::metrics::serve(addr, metrics.clone()).map_err(|e| Error::BadOption {
                    option: format!("metrics={addr}"),
                    reason: e.to_string(),
                })?;
            (Some(metrics), Some(server))
        }
        None => (None, None),
    };

    let open = |path: &std::path::Path| {
        open_root(path).map_err(|source| Error::Open {
            path: path.to_owned(),
            source,
        })
    };
    let remote = open(&config.remote)?;
    let local = match private_local(config) {
        Some(local) => local,
        None => open(&config.local)?,
    };
    // Exposed, the layout lives where the runtime sees it, and its absolute links say so.
    let link_base = config.expose_into.as_ref().unwrap_or(&config.mountpoint);
    let layout = Layout::new(&config.driver, link_base, config.link_style);
    let mut view =
        View::new(layout, local, remote, LayoutIndex::default()).map_err(|source| Error::Open {
            path: config.local.clone(),
            source,
        })?;
    // Refusing to mount beats serving without the limits an operator set.
    let roots = view
        .load_quotas(config.quota_errno, config.quota_backend)
        .map_err(|source| Error::Quota {
            local: config.local.clone(),
            source,
        })?;
    if roots > 0 {
        info!(roots, "quota roots loaded, usage counted from local");
    }
    let view = Arc::new(view);
    if let Some(kept) = &kept {
        keep_numbering(&view, kept);
    }

    // The first round gives the view its index before the kernel sees anything, through
    // the same scanner (and timeout) as every later round: a remote that does not answer
    // at mount time yields an empty, unhealthy view that fills in once it does.
    let mut refresher = Refresher::new(
        view.clone(),
        Box::new(Scanner::new(&config.remote, &config.driver)),
        MountInfo {
            mountpoint: config.mountpoint.clone(),
            remote: config.remote.clone(),
            local: config.local.clone(),
            driver: config.driver.clone(),
        },
        refresh::Options {
            interval: config.refresh,
            scan_timeout: config.scan_timeout,
            hide_unhealthy: config.hide_unhealthy,
            inotify: config.inotify,
            journal: config.journal,
            journal_poll: config.journal_poll,
        },
    );
    if let Some(m) = &metrics {
        refresher.set_metrics(m.clone());
    }
    let first = refresher.round();
    info!(
        remote = %config.remote.display(),
        layers = first.ready_layers,
        images = first.ready_images,
        not_ready = first.not_ready.len(),
        ms = first.duration.as_secs_f64() * 1000.0,
        error = first.error.as_deref().unwrap_or(""),
        "remote tree scanned"
    );
    let timeouts = Timeouts {
        entry: config.entry_timeout,
        attr: config.attr_timeout,
    };
    let want_ring = wants_ring(config, kept.is_some());
    let transport = Transport {
        passthrough: config.passthrough,
        io_uring: want_ring,
        keep_cache: config.atime.files != Atime::StrictAtime,
    };
    let fs = LayerFs::new(
        view.clone(),
        timeouts,
        transport,
        config.remote_threads,
        metrics.clone(),
    )
    .map_err(|source| Error::Mount {
        path: config.mountpoint.clone(),
        source,
    })?;
    let notices = fs.notices();
    let ring_negotiated = fs.ring_negotiated();
    let restarts = kept.as_ref().map(|k| k.kept.restarts);
    let mut keeper = kept.as_ref().map(|k| KeeperInfo {
        pid: k.kept.keeper,
        restarts: k.kept.restarts,
        gap_ms: None,
    });
    let stopped_ns = kept.as_ref().map_or(0, |k| k.kept.stopped_ns);

    let (session, mut unmounter, device) = match kept {
        Some(kept) => resume_session(fs, config, kept),
        None => open_session(fs, config),
    }
    .map_err(|source| Error::Mount {
        path: config.mountpoint.clone(),
        source,
    })?;
    // Only the requests a dead daemon had read are sent again; with none, nothing is.
    let resend = restarts
        .filter(|n| *n > 0)
        .and(device.as_ref())
        .map(|d| d.try_clone());
    notices
        .start(Arc::new(Wire::new(session.notifier(), device)))
        .and_then(|()| crate::fs::trim::spawn(&view, notices.clone(), &config.mountpoint))
        .map_err(|source| Error::Mount {
            path: config.mountpoint.clone(),
            source,
        })?;
    let handle: Arc<RefreshHandle> = refresher.handle();
    refresher.start(notices).map_err(|source| Error::Mount {
        path: config.mountpoint.clone(),
        source,
    })?;
    if let Some(keeper) = keeper.as_mut().filter(|_| stopped_ns > 0) {
        let gap = crate::keeper::realtime_ns().saturating_sub(stopped_ns) as f64 / 1e6;
        keeper.gap_ms = Some(gap);
        info!(gap_ms = gap, "serving again after the last daemon stopped");
    }
    let control = Arc::new(Control {
        refresh: handle.clone(),
        view: view.clone(),
        metrics: metrics_server.as_ref().map(|s| s.local_addr().to_string()),
        ring: ring_negotiated.clone(),
        keeper,
    });
    if let Some(metrics) = &metrics {
        metrics.set_sources(control.clone());
    }
    let control: Arc<dyn MountControl> = control;
    // Lives until the mount ends; dropping it removes the socket. A mount that cannot have
    // its socket (no writable run dir) still serves: the socket is for looking, not for use.
    let live: Arc<dyn Reconfigure> = Arc::new(Live::new(
        config.clone(),
        handle.clone(),
        Box::new(crate::logging::set_log_level),
    ));
    let socket = crate::control::socket_path(&config.mountpoint);
    let control_server = serve_control(control, live, &socket, &handle);
    on_sigusr1_refresh(&handle);

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
    let exposure = match &config.expose_into {
        Some(root) => Some(expose_when_served(
            root,
            config,
            std::mem::replace(readiness, Readiness::foreground()),
        )?),
        None => {
            readiness.ready();
            None
        }
    };
    let ring = ring_negotiated
        .load(Ordering::Relaxed)
        .then(|| session.as_fd().try_clone_to_owned())
        .transpose()
        .map_err(|source| Error::Mount {
            path: config.mountpoint.clone(),
            source,
        })?;
    if ring.is_none() && want_ring && config.io_uring == RingUse::Always {
        info!("the kernel offers no FUSE over io_uring (fuse module parameter enable_uring); requests stay on /dev/fuse");
    }
    let settings = ring::Settings::for_pools(config.remote_threads + SYNC_THREADS + CROWD_THREADS);
    let served = session
        .run_with(|dispatcher| {
            if let Some(device) = resend {
                // Once the threads read again: the requests come back to them.
                match device.and_then(|d| Wire::resend(&d)) {
                    Ok(()) => info!("asked the kernel to send again what the dead daemon had read"),
                    Err(e) => warn!(error = %e, "asking the kernel to send unanswered requests again failed; their callers wait until interrupted"),
                }
            }
            match ring {
                Some(device) => ring::start(dispatcher, device, settings, &ring_negotiated),
                None => Box::new(|| {}),
            }
        })
        .map_err(|source| Error::Mount {
            path: config.mountpoint.clone(),
            source,
        });
    if let Some(exposure) = exposure {
        exposure.finish()?;
    }
    served?;
    handle.stop();
    drop(control_server);
    drop(metrics_server);
    info!(mountpoint = %config.mountpoint.display(), "unmounted");
    Ok(())
}

/// The binds of `--expose-into`, made by a thread of their own: they look the view up,
/// which only answers once the session runs.
struct Exposure {
    exposed: Arc<parking_lot::Mutex<Option<Arc<crate::expose::Exposed>>>>,
    failed: Arc<parking_lot::Mutex<Option<crate::expose::ExposeError>>>,
}

impl Exposure {
    /// After the session: the binds go (lazily, if something still uses them), and a
    /// failure to make them is the mount's failure.
    fn finish(self) -> Result<()> {
        if let Some(exposed) = self.exposed.lock().take() {
            exposed.withdraw();
        }
        match self.failed.lock().take() {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }
}

/// Exposes the view in `root` once it is served, then tells `readiness`: the mount is live
/// only when the runtime can see it. Failing, it takes the view down again. Then it waits
/// for the view's unmount to withdraw the binds, which would keep the session alive.
fn expose_when_served(
    root: &std::path::Path,
    config: &MountConfig,
    mut readiness: Readiness,
) -> Result<Exposure> {
    let exposure = Exposure {
        exposed: Arc::default(),
        failed: Arc::default(),
    };
    let (exposed, failed) = (exposure.exposed.clone(), exposure.failed.clone());
    let (root, mountpoint, driver) = (
        root.to_owned(),
        config.mountpoint.clone(),
        config.driver.clone(),
    );
    let view = crate::expose::view_mount_id(&mountpoint);
    std::thread::Builder::new()
        .name("expose".into())
        .spawn(move || match crate::expose::expose(&root, &mountpoint, &driver) {
            Ok(made) => {
                let made = Arc::new(made);
                *exposed.lock() = Some(made.clone());
                readiness.ready();
                match view {
                    Some(view) => made.withdraw_when_unmounted(view),
                    None => warn!("the view's mount is not in the mount table; its binds stay until the daemon exits"),
                }
            }
            Err(e) => {
                if readiness.failed(&e.to_string()) {
                    tracing::error!(target: crate::logging::STARTUP_FAILURE, error = %e,
                        "exposing the view failed; unmounting");
                } else {
                    tracing::error!(error = %e, "exposing the view failed; unmounting");
                }
                *failed.lock() = Some(e);
                if let Err(e) = nix::mount::umount2(&mountpoint, nix::mount::MntFlags::MNT_DETACH)
                {
                    warn!(error = %e, "unmounting after the failed exposure failed");
                }
            }
        })
        .map_err(|source| Error::Mount {
            path: config.mountpoint.clone(),
            source,
        })?;
    Ok(exposure)
}

/// The control socket's view of the mount: the refresh engine answers for the remote, the
/// view for quotas. Metrics scrapes read the mount through it too.
struct Control {
    refresh: Arc<RefreshHandle>,
    view: Arc<View>,
    /// Where metrics are served, if they are.
    metrics: Option<String>,
    /// Whether requests come through FUSE over io_uring: the kernel took it at `init` and
    /// every queue registered.
    ring: Arc<AtomicBool>,
    keeper: Option<KeeperInfo>,
}

impl Sources for Control {
    fn status(&self) -> Status {
        MountControl::status(self)
    }
    fn inodes(&self) -> InodeCounts {
        InodeCounts {
            nodes: self.view.inodes.len(),
            identities: self.view.inodes.identities(),
        }
    }
}

impl MountControl for Control {
    fn status(&self) -> Status {
        let mut status = self.refresh.status();
        status.quotas = self.view.quota_list();
        let ring = self.ring.load(Ordering::Relaxed);
        status.transport = Some(if ring { "io_uring" } else { "/dev/fuse" }.to_owned());
        status.log = crate::logging::destination().map(|d| d.to_string());
        status.keeper = self.keeper.clone();
        status
    }
    fn refresh(&self) -> RoundReport {
        self.refresh.refresh()
    }
    fn hand_over(&self) -> std::result::Result<u32, String> {
        if self.keeper.is_none() {
            return Err(
                "this mount has no keeper to hand over to (mount it with -o keeper)".into(),
            );
        }
        info!("handing the mount over to the binary on disk");
        // After the answer has gone out: what this daemon had read and not answered by then
        // is sent again to the next one (see `fs::resent`).
        std::thread::spawn(|| {
            std::thread::sleep(std::time::Duration::from_millis(50));
            std::process::exit(crate::keeper::HAND_OVER);
        });
        Ok(std::process::id())
    }
    fn refresh_accepting_empty(&self) -> RoundReport {
        self.refresh.accept_empty()
    }
    fn layers(&self) -> Vec<LayerInfo> {
        self.refresh.layers()
    }
    fn images(&self) -> Vec<ImageInfo> {
        self.refresh.images()
    }
    fn quota(&self, request: QuotaRequest) -> std::result::Result<QuotaAnswer, String> {
        self.view.quota_request(request)
    }
    fn metrics(&self) -> Option<String> {
        self.metrics.clone()
    }
}

/// How long a new mount waits for the daemon of the previous mount at the same mountpoint
/// to finish shutting down and let go of the control socket.
const SOCKET_HANDOVER: std::time::Duration = std::time::Duration::from_secs(60);

/// The control socket, once it is served; dropping the last reference removes it.
type ControlSlot = Arc<parking_lot::Mutex<Option<crate::control::ControlServer>>>;

/// Serves the control socket. A live socket at our path can only be the previous daemon's
/// (the mountpoint was free, so its mount is gone, and that daemon is finishing): it is
/// not taken over but waited for, on a thread of its own, so the mount serves meanwhile.
fn serve_control(
    control: Arc<dyn MountControl>,
    live: Arc<dyn Reconfigure>,
    socket: &std::path::Path,
    handle: &Arc<RefreshHandle>,
) -> ControlSlot {
    let slot: ControlSlot = Arc::default();
    // Holds the slot weakly: a server made after the mount ended is dropped at once.
    let install = {
        let (slot, handle, socket) = (Arc::downgrade(&slot), handle.clone(), socket.to_owned());
        move |server| {
            if let Some(slot) = slot.upgrade() {
                handle.set_socket(&socket);
                *slot.lock() = Some(server);
            }
        }
    };
    let unavailable = |e: &std::io::Error| {
        warn!(error = %e, "no control socket: `layerfs status` cannot reach this mount");
    };
    let serve = move |socket: &std::path::Path| {
        crate::control::serve_with(control.clone(), Some(live.clone()), socket)
    };
    match serve(socket) {
        Ok(server) => install(server),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
            info!("the previous daemon of this mountpoint still holds the control socket; waiting for it");
            let socket = socket.to_owned();
            let weak = Arc::downgrade(&slot);
            let spawned = std::thread::Builder::new()
                .name("control-handover".into())
                .spawn(move || {
                    let deadline = std::time::Instant::now() + SOCKET_HANDOVER;
                    loop {
                        std::thread::sleep(std::time::Duration::from_millis(50));
                        // The mount ended meanwhile.
                        if weak.strong_count() == 0 {
                            return;
                        }
                        match serve(&socket) {
                            Ok(server) => return install(server),
                            Err(e)
                                if e.kind() == std::io::ErrorKind::AddrInUse
                                    && std::time::Instant::now() < deadline => {}
                            Err(e) => return unavailable(&e),
                        }
                    }
                });
            if let Err(e) = spawned {
                unavailable(&e);
            }
        }
        Err(e) => unavailable(&e),
    }
    slot
}

/// `kill -USR1 <daemon>` runs a refresh round now and logs it: handy where the control
/// socket is not reachable, and in benchmarks.
fn on_sigusr1_refresh(handle: &Arc<RefreshHandle>) {
    let handle = Arc::downgrade(handle);
    let spawned = signal_hook::iterator::Signals::new([SIGUSR1]).and_then(|mut signals| {
        std::thread::Builder::new()
            .name("sigusr1".into())
            .spawn(move || {
                for _ in signals.forever() {
                    let Some(handle) = handle.upgrade() else {
                        return;
                    };
                    let report = handle.refresh();
                    info!(
                        added = report.added.len(),
                        removed = report.removed.len(),
                        changed = report.changed.len(),
                        layers = report.ready_layers,
                        images = report.ready_images,
                        ms = report.duration.as_secs_f64() * 1000.0,
                        error = report.error.as_deref().unwrap_or(""),
                        "refresh round on SIGUSR1"
                    );
                }
            })
    });
    if let Err(e) = spawned {
        warn!(error = %e, "SIGUSR1 will not trigger refresh rounds");
    }
}

/// Who removes the mount: layerfs itself when it mounted as root (see
/// [`crate::fs::kernel_mount`]), fuser (through `fusermount3`) otherwise.
/// Only the signal thread unmounts: when the kernel ends the session, nothing is left to do.
enum Unmounter {
    Ours(KernelMount),
    Fuser(fuser::SessionUnmounter),
}

impl Unmounter {
    fn unmount(&mut self) -> std::io::Result<()> {
        match self {
            Unmounter::Ours(m) => m.unmount().map_err(std::io::Error::from),
            Unmounter::Fuser(u) => u.unmount(),
        }
    }
}

/// Mounts and opens the FUSE session: ourselves as root, through fuser otherwise. Our own
/// mount also gives a second descriptor of the device, for the notices fuser cannot send.
fn open_session(
    fs: LayerFs,
    config: &MountConfig,
) -> std::io::Result<(Session<LayerFs>, Unmounter, Option<std::os::fd::OwnedFd>)> {
    let fuse = fuse_config(config);
    if !nix::unistd::geteuid().is_root() {
        let mut session = Session::new(fs, &config.mountpoint, &fuse)?;
        let unmounter = Unmounter::Fuser(session.unmount_callable());
        return Ok((session, unmounter, None));
    }
    let fsname = config.fsname();
    let (device, mount) = kernel_mount::mount(&config.mount_spec(&fsname))
        .map_err(|e| std::io::Error::other(format!("mount(2) of fuse.layerfs: {e}")))?;
    let acl = fuse.acl;
    let notices = device.try_clone().ok();
    match Session::from_fd(fs, device, acl, fuse) {
        Ok(session) => Ok((session, Unmounter::Ours(mount), notices)),
        Err(e) => {
            let _ = mount.unmount();
            Err(e)
        }
    }
}

/// Gives the view the numbering earlier daemons of this mount kept, before it gives any
/// number itself, and keeps its own from now on (see `view::keep`).
fn keep_numbering(view: &View, inherited: &Inherited) {
    if inherited.kept.restarts > 0 {
        view.restore_numbering(inherited.records.iter().filter_map(|r| Fact::decode(r)));
        view.resume();
    }
    view.keep_numbering_in(inherited.log.clone());
}

/// The session on the connection a keeper holds: read the INIT on the first start, and
/// record what it settled; on a later one, resume without it, as that record says.
fn resume_session(
    fs: LayerFs,
    config: &MountConfig,
    inherited: Inherited,
) -> std::io::Result<(Session<LayerFs>, Unmounter, Option<std::os::fd::OwnedFd>)> {
    let Inherited { kept, log, records } = inherited;
    let mut fuse = fuse_config(config);
    // A request read on a cloned descriptor dies with the daemon that read it, and is not
    // sent again: every thread reads the descriptor the keeper holds.
    fuse.clone_fd = false;
    let acl = fuse.acl;
    let notices = Some(kept.device.try_clone()?);
    let unmounter = Unmounter::Ours(KernelMount::at(&config.mountpoint));
    let resume = fs.resume();
    let session = if kept.restarts == 0 {
        let session = Session::from_fd(fs, kept.device, acl, fuse)?;
        kept.state.save_negotiated(resume.negotiated())?;
        session
    } else {
        let negotiated = kept.state.negotiated().ok_or_else(|| {
            std::io::Error::other("the first daemon died before INIT was over; nothing to resume")
        })?;
        resume.restore_negotiated(negotiated);
        let session = Session::resume(fs, kept.device, acl, fuse);
        let opens = resume.restore_opens(
            records.iter().filter_map(|r| HandleFact::decode(r)),
            // SAFETY: ids the dead daemon registered on this connection, journaled while it
            // owned them and not released since; nothing else owns them now.
            |raw| unsafe { session.adopt_backing(raw) },
        );
        info!(
            restarts = kept.restarts,
            keeper = kept.keeper,
            records = records.len(),
            opens,
            "resuming the connection the keeper holds"
        );
        session
    };
    resume.keep_in(log);
    Ok((session, unmounter, notices))
}

/// Whether the daemon asks the kernel for FUSE over io_uring. Never under a keeper: the
/// ring's registrations die with the daemon that made them, and the requests on them are not
/// sent again, so a kept mount takes its requests through `/dev/fuse`.
fn wants_ring(config: &MountConfig, kept: bool) -> bool {
    match config.io_uring {
        RingUse::Never => false,
        RingUse::Auto => !kept,
        RingUse::Always if kept => {
            warn!("io_uring is not used under a keeper: requests go through /dev/fuse, which a restarted daemon resumes");
            false
        }
        RingUse::Always => true,
    }
}

/// Local, reached through a private clone of its mount on which reads move access times as
/// the view's mode says (see `store::atime`); a read-only view moves none, as the kernel
/// moves none on a read-only mount. `None` where no clone can be made (not root): local is
/// then opened as it is, and reads follow its own mount.
fn private_local(config: &MountConfig) -> Option<std::os::fd::OwnedFd> {
    let times = match config.read_only {
        true => AccessTimes {
            files: Atime::NoAtime,
            dirs: false,
        },
        false => config.atime,
    };
    let opened =
        atime::open_clone(&config.local, times).and_then(|fd| {
            match crate::store::stat_fd(fd.as_fd())?.st_mode & libc::S_IFMT {
                libc::S_IFDIR => Ok(fd),
                _ => Err(nix::errno::Errno::ENOTDIR),
            }
        });
    if let (Err(e), true) = (&opened, times != AccessTimes::default()) {
        warn!(error = %e, local = %config.local.display(),
              "no private mount of local for the access-time mode; reads move access times as local's own mount says");
    }
    opened.ok()
}

fn fuse_config(config: &MountConfig) -> Config {
    let mut options = vec![
        MountOption::FSName(config.fsname()),
        // fuser passes its Subtype option to fusermount only; the kernel takes it as data,
        // and /proc/mounts then says `fuse.layerfs`, which umount(8) and findmnt use.
        MountOption::CUSTOM("subtype=layerfs".into()),
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
    if config.atime.files == Atime::NoAtime {
        options.push(MountOption::NoAtime);
    }
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

/// Every object the kernel knows stays open as an `O_PATH` handle (two for a merged
/// directory): allow as many as the system does. Root may go up to `fs.nr_open`.
fn raise_fd_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let Ok((_, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else {
        return;
    };
    let most = std::fs::read_to_string("/proc/sys/fs/nr_open")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or(hard)
        .max(hard);
    if setrlimit(Resource::RLIMIT_NOFILE, most, most).is_err() {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    }
    if let Ok((soft, _)) = getrlimit(Resource::RLIMIT_NOFILE) {
        tracing::debug!(open_files = soft, "open file limit");
    }
}
