//! `layerfs-snapshotter`: serves containerd's Snapshots API on a unix socket, with
//! snapshots under a directory of a layerfs mount. See `docs/snapshotter.md`.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Parser;
use layerfs::control::quota_backend;
use layerfs_snapshotter::api::snapshots::snapshots_server::SnapshotsServer;
use layerfs_snapshotter::service::Service;
use layerfs_snapshotter::{Config, Snapshots};
use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;

/// A containerd proxy snapshotter that stores snapshots in a layerfs mount, adopts layers
/// the shared tree already holds, and enforces snapshot quotas.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// The unix socket to serve on (`address` of `[proxy_plugins.layerfs]`).
    #[arg(long, default_value = "/run/layerfs/snapshotter.sock")]
    address: PathBuf,
    /// Where snapshots are kept: a directory inside a layerfs mount for quotas and shared
    /// layers (created if missing).
    #[arg(long)]
    root: PathBuf,
    /// The layerfs view whose shared layers are adopted; by default the layerfs mount
    /// `--root` is in, if any.
    #[arg(long)]
    view: Option<PathBuf>,
    /// The storage driver's directory names in the view (`overlay` for `overlay/RO/…`).
    #[arg(long, default_value = "overlay")]
    driver: String,
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("LAYERFS_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let args = Args::parse();
    let view = args
        .view
        .clone()
        .or_else(|| quota_backend::layerfs_mount_of(&args.root));
    let config = Config {
        root: args.root.clone(),
        view: view.clone(),
        driver: args.driver.clone(),
        ..Config::new(&args.root)
    };
    let snapshots = Snapshots::open(&config)
        .with_context(|| format!("opening the snapshotter at {}", args.root.display()))?;
    tracing::info!(
        root = %snapshots.root().display(),
        view = ?view,
        supported_quota = snapshots.supported_quota(),
        address = %args.address.display(),
        "serving"
    );
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(serve(&args.address, Arc::new(snapshots)))
}

/// In-flight calls get this long to finish once asked to stop. containerd keeps its
/// connection open, so the stop waits for calls, not for connections to close.
const GRACE: Duration = Duration::from_secs(10);

async fn serve(address: &Path, snapshots: Arc<Snapshots>) -> Result<()> {
    let listener = listen(address)?;
    let (stopping, stopped) = tokio::sync::oneshot::channel::<()>();
    let service = Service::new(snapshots);
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
