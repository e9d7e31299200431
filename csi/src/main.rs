//! `layerfs-csi`: the CSI driver's binary. A crate of its own so the FUSE daemon and
//! `mount.layerfs` link none of the gRPC and HTTP stack.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;

fn main() -> ExitCode {
    let args = CsiArgs::parse();
    let deprecated = args.deny_private_urls;
    match run(args.into_config(), deprecated) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("layerfs-csi: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(config: layerfs_csi::Config, deny_private_urls: bool) -> anyhow::Result<()> {
    // Loop devices, mounts and a socket in root's run dir: nothing of it works otherwise.
    if !nix::unistd::geteuid().is_root() {
        anyhow::bail!("{}: permission denied (root only)", config.endpoint);
    }
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour codes are for a terminal; in a log file or a container log they are noise.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    if deny_private_urls {
        tracing::warn!("--deny-private-urls is the default now and is ignored; remove it");
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    Ok(runtime.block_on(layerfs_csi::serve(config))?)
}

#[derive(Debug, Parser)]
#[command(
    name = "layerfs-csi",
    version,
    about = "The layerfs CSI driver: node-local volumes, and BackingImages made from VolumeSnapshots of `type: bi`."
)]
pub struct CsiArgs {
    /// The gRPC endpoint: a unix socket, `unix:///path/csi.sock`.
    #[arg(
        long,
        value_name = "ENDPOINT",
        default_value = "unix:///run/layerfs/csi.sock"
    )]
    pub endpoint: String,
    /// This node's name (Kubernetes passes the node name).
    #[arg(long, value_name = "NAME")]
    pub node_id: String,
    /// The local store: volumes live in `<DIR>/volumes`.
    #[arg(long, value_name = "DIR", default_value = "/var/lib/layerfs/csi")]
    pub store: PathBuf,
    /// Where BackingImages live; a directory every node shares makes them visible to all.
    /// Default: `<store>/backing-images`.
    #[arg(long, value_name = "DIR")]
    pub backing_images: Option<PathBuf>,
    /// The driver name reported to Kubernetes.
    #[arg(long, value_name = "NAME", default_value = layerfs_csi::DRIVER_NAME)]
    pub driver_name: String,
    /// Seconds CreateVolume waits for a BackingImage being prepared before it answers ABORTED
    /// (and the caller retries).
    #[arg(long, value_name = "SECONDS", default_value_t = 60)]
    pub image_wait: u64,
    /// Allow `file://` download URLs, for regular files below DIR only. Without it they are
    /// refused: the driver runs as root and would read any host file.
    #[arg(long, value_name = "DIR")]
    pub file_root: Option<PathBuf>,
    /// Allow http(s) download URLs whose host is (or resolves to) a loopback, link-local or
    /// private address. Without it they are refused: the driver runs as root inside the
    /// cluster, and such a URL would reach the node's or the cluster's internal services.
    #[arg(long)]
    pub allow_private_urls: bool,
    /// Refusing private addresses is the default now; accepted so that older manifests keep
    /// working, and ignored.
    #[arg(long, hide = true, conflicts_with = "allow_private_urls")]
    pub deny_private_urls: bool,
    /// The largest image a download may produce, in bytes.
    #[arg(long, value_name = "BYTES", default_value_t = layerfs_csi::download::DEFAULT_MAX_SIZE)]
    pub max_image_size: u64,
    /// Seconds a download may receive nothing before it fails.
    #[arg(long, value_name = "SECONDS", default_value_t = 60)]
    pub download_idle_timeout: u64,
    /// The capacity volumes may be promised, in percent of what the store's filesystem can
    /// hold for them (what they occupy plus what is free). Volumes are sparse: at 100 every
    /// volume can be filled at once; above it they share free space, and a full store fails
    /// writes inside them.
    #[arg(long, value_name = "PERCENT", default_value_t = 100,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub over_provisioning: u32,
    /// The most bytes per second an export (a VolumeSnapshot of `type: bi`) reads from its
    /// volume, so that a large export leaves the node's disk to the pods using it.
    /// 0: no limit.
    #[arg(long, value_name = "BYTES", default_value_t = 0)]
    pub export_rate: u64,
}

impl CsiArgs {
    pub fn into_config(self) -> layerfs_csi::Config {
        let backing_images = self
            .backing_images
            .unwrap_or_else(|| self.store.join("backing-images"));
        layerfs_csi::Config {
            endpoint: self.endpoint,
            node_id: self.node_id,
            driver_name: self.driver_name,
            store: self.store,
            backing_images,
            image_wait: std::time::Duration::from_secs(self.image_wait),
            file_root: self.file_root,
            allow_private_urls: self.allow_private_urls,
            max_image_size: self.max_image_size,
            download_idle_timeout: std::time::Duration::from_secs(self.download_idle_timeout),
            over_provisioning: self.over_provisioning,
            export_rate: std::num::NonZeroU64::new(self.export_rate),
        }
    }
}
