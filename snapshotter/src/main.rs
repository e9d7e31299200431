//! `layerfs-snapshotter`: serves containerd's Snapshots API on a unix socket, with
//! snapshots under a directory of a layerfs mount. Settings come from the command line over
//! a TOML file ([`layerfs_snapshotter::config`]). See `docs/snapshotter.md` and
//! `docs/snapshotter-operations.md`.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Parser;
use layerfs::control::quota_backend;
use layerfs_snapshotter::api::snapshots::snapshots_server::SnapshotsServer;
use layerfs_snapshotter::config::{Args, Settings};
use layerfs_snapshotter::service::Service;
use layerfs_snapshotter::Snapshots;
use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;

fn main() -> Result<()> {
    let settings = Settings::load(Args::parse())?;
    // As with layerfs itself, the environment wins over the configuration, so that a
    // one-off debug run needs no edit of the file.
    let filter = match tracing_subscriber::EnvFilter::try_from_env("LAYERFS_LOG") {
        Ok(filter) => filter,
        Err(_) => {
            tracing_subscriber::EnvFilter::try_new(&settings.log_level).with_context(|| {
                format!(
                    "log_level: {:?} is not a level or filter",
                    settings.log_level
                )
            })?
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let view = settings
        .view
        .clone()
        .or_else(|| quota_backend::layerfs_mount_of(&settings.root));
    let snapshots = Snapshots::open(&settings.snapshots(view.clone()))
        .with_context(|| format!("opening the snapshotter at {}", settings.root.display()))?;
    tracing::info!(
        config = ?settings.config_file,
        root = %snapshots.root().display(),
        view = ?view,
        supported_quota = snapshots.supported_quota(),
        fast_path = settings.fast_path,
        address = %settings.address.display(),
        metrics = ?settings.metrics_address,
        "serving"
    );
    let service = Service::new(Arc::new(snapshots));
    // Bound before the socket, so that an address that cannot be had fails the start
    // instead of leaving the snapshotter silently unobservable.
    let _metrics_server = match settings.metrics_address {
        Some(addr) => {
            let metrics = service.metrics();
            Some(layerfs::metrics::serve_with(
                addr,
                Arc::new(move || metrics.encode()),
            )?)
        }
        None => None,
    };
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(serve(&settings.address, service))
}

/// In-flight calls get this long to finish once asked to stop. containerd keeps its
/// connection open, so the stop waits for calls, not for connections to close.
const GRACE: Duration = Duration::from_secs(10);

async fn serve(address: &Path, service: Service) -> Result<()> {
    let listener = listen(address)?;
    // Under systemd (`Type=notify`), containerd is started only once the socket takes
    // connections.
    if std::env::var_os("NOTIFY_SOCKET").is_some() {
        if let Err(e) = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]) {
            tracing::warn!(error = %e, "could not tell systemd the snapshotter is ready");
        }
    }
    let (stopping, stopped) = tokio::sync::oneshot::channel::<()>();
    let in_flight = service.in_flight();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(SnapshotsServer::new(service))
            .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
                let _ = stopped.await;
            }),
    );
    stop().await;
    let _ = stopping.send(());
    let deadline = tokio::time::Instant::now() + GRACE;
    while in_flight.load(Ordering::SeqCst) > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let result = match server.is_finished() {
        true => server.await.context("the server task")?.context("serving"),
        false => Ok(()),
    };
    let _ = fs::remove_file(address);
    result
}

/// Binds `address`, taking over a socket file only when nothing answers on it.
fn listen(address: &Path) -> Result<UnixListener> {
    if address.exists() {
        if UnixStream::connect(address).is_ok() {
            bail!("{} is in use by a running server", address.display());
        }
        fs::remove_file(address)
            .with_context(|| format!("removing the stale socket {}", address.display()))?;
    }
    if let Some(dir) = address.parent() {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let listener =
        UnixListener::bind(address).with_context(|| format!("binding {}", address.display()))?;
    fs::set_permissions(address, fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

async fn stop() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    tracing::info!("stopping");
}
