//! Serving the driver on a unix socket until SIGTERM or SIGINT.

use std::path::{Path, PathBuf};

use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;
use tokio_stream::StreamExt;

use super::authority;
use super::controller::ControllerService;
use super::error::{CsiError, Result};
use super::identity::IdentityService;
use super::node::NodeService;
use super::proto::controller_server::ControllerServer;
use super::proto::identity_server::IdentityServer;
use super::proto::node_server::NodeServer;
use super::{Config, Driver};

/// The socket path of an endpoint: `unix:///path`, `unix:/path` or a plain path.
pub fn socket_path(endpoint: &str) -> Result<PathBuf> {
    let path = endpoint
        .strip_prefix("unix://")
        .or_else(|| endpoint.strip_prefix("unix:"))
        .unwrap_or(endpoint);
    if path.is_empty() || endpoint.contains("://") && !endpoint.starts_with("unix://") {
        return Err(CsiError::InvalidArgument(format!(
            "endpoint {endpoint:?} is not a unix socket (unix:///path/csi.sock)"
        )));
    }
    Ok(PathBuf::from(path))
}

/// Serves the CSI driver described by `config` until the process is told to stop.
pub async fn serve(config: Config) -> Result<()> {
    let path = socket_path(&config.endpoint)?;
    let driver = Driver::new(config)?;
    // Before serving: a CreateSnapshot retry must find the export of its cut running again.
    driver.recover()?;
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)
            .map_err(|e| CsiError::io(format!("creating {}", parent.display()), e))?;
    }
    {
        // A socket left by an earlier run is replaced (by the rename in `listen_at`); anything
        // else at the path is someone's file.
        use std::os::unix::fs::FileTypeExt;
        if let Ok(m) = std::fs::symlink_metadata(&path) {
            if !m.file_type().is_socket() {
                return Err(CsiError::FailedPrecondition(format!(
                    "{} exists and is not a socket; not replacing it",
                    path.display()
                )));
            }
        }
    }
    let listener = listen_at(&path)?;
    tracing::info!(
        endpoint = %path.display(),
        node = %driver.config.node_id,
        name = %driver.config.driver_name,
        "CSI driver serving"
    );
    let shutdown = async {
        let term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate());
        match term {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
        tracing::info!("stopping");
    };
    let result = tonic::transport::Server::builder()
        // What the shim lets through, so that both refuse the same frames.
        .max_frame_size(authority::MAX_FRAME as u32)
        .add_service(IdentityServer::new(IdentityService(driver.clone())))
        .add_service(ControllerServer::new(ControllerService(driver.clone())))
        .add_service(NodeServer::new(NodeService(driver)))
        .serve_with_incoming_shutdown(
            UnixListenerStream::new(listener).map(|accepted| accepted.map(authority::shim)),
            shutdown,
        )
        .await;
    let _ = std::fs::remove_file(&path);
    result.map_err(|e| CsiError::Internal(format!("gRPC server: {e}")))
}

/// Listens on a unix socket at `path`. The socket is bound under a temp name and renamed into
/// place once it listens: whoever waits for `path` to appear (the kubelet's registrar, a
/// test) never finds a socket that refuses connections.
fn listen_at(path: &Path) -> Result<UnixListener> {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let temp = path.with_file_name(format!(".{name}.{}", std::process::id()));
    let _ = std::fs::remove_file(&temp);
    let listener = UnixListener::bind(&temp)
        .map_err(|e| CsiError::io(format!("listening on {}", temp.display()), e))?;
    if let Err(e) = std::fs::rename(&temp, path) {
        let _ = std::fs::remove_file(&temp);
        return Err(CsiError::io(format!("listening on {}", path.display()), e));
    }
    Ok(listener)
}
