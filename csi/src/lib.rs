//! The layerfs CSI driver: volumes as sparse raw images on this node, and BackingImages made
//! from VolumeSnapshots of `type: bi` (DESIGN §7).
//!
//! The story of a BackingImage: `CreateSnapshot` takes a point-in-time copy of a volume and
//! starts exporting it (raw or qcow2) into the images directory, answering `ready_to_use:
//! false` until the image is complete and checksummed. Its snapshot id is a `bi://` handle
//! ([`handle`]). `CreateVolume` with that handle as content source restores a new volume from
//! the image; a handle for an image that does not exist yet (a pre-provisioned
//! VolumeSnapshotContent) makes the driver produce it first, by download or export.
//! `DeleteSnapshot` removes the image.
//!
//! Point in time: the cut ([`cut::cut_volume`]) is the volume at one instant while writers
//! run (crash-consistent: not what applications still buffer themselves). It freezes the ext4
//! filesystem of every `Mount` publication (FIFREEZE), fsyncs the loop devices and the disk
//! file, then reflinks the file, or copies it with its writers held out ([`hold`]). CreateSnapshot returns once the cut is
//! taken and durable; the export then runs from it with `ready_to_use: false`, and resumes
//! from it after a restart. DeleteSnapshot of a snapshot still being cut or exported cancels
//! that work and removes everything it made.
//!
//! Copies never run inside a request: cuts, exports, downloads and restores are background
//! jobs keyed by name ([`jobs`]), so a CO deadline that drops a request does not stop or
//! restart them; the retry finds the job and waits for it again. The controller lock guards
//! only state changes.
//!
//! Modules: [`jobs`] runs the background copies; [`server`] serves the three gRPC services
//! ([`identity`], [`controller`], [`node`])
//! over a unix socket ([`authority`] lets any client in); [`volumes`] and [`backing_image`] are
//! the two stores; [`cut`] keeps the point-in-time copies snapshots are made from; [`export`]
//! and [`download`] produce image files, writing and checksumming them in one pass with
//! [`copy`]; [`mounts`] does loop devices and mounts, one call per volume at a time
//! ([`locks`]); [`names`] maps CSI names to safe on-disk names.

pub mod addresses;
pub mod authority;
pub mod backing_image;
pub mod command;
pub mod controller;
pub mod copy;
pub mod cut;
pub mod download;
pub mod error;
pub mod export;
pub mod files;
pub mod handle;
pub mod hold;
pub mod identity;
pub mod jobs;
pub mod locks;
pub mod mounts;
pub mod names;
pub mod node;
pub mod server;
pub mod sha512;
pub mod volumes;

/// The generated CSI v1 messages and services.
#[allow(clippy::all, missing_docs)]
pub mod proto {
    tonic::include_proto!("csi.v1");
}

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

pub use error::{CsiError, Result};
pub use server::serve;

use backing_image::{ImageStore, Images};
use jobs::JobSet;
use locks::KeyedLocks;
use volumes::{VolumeMeta, VolumeStore};

/// The default driver name.
pub const DRIVER_NAME: &str = "layerfs.csi.io";
/// The topology key whose value is the node a volume lives on.
pub const TOPOLOGY_KEY: &str = "topology.layerfs.csi.io/node";

/// How the driver is run.
#[derive(Debug, Clone)]
pub struct Config {
    /// `unix:///path/csi.sock` (or a plain path).
    pub endpoint: String,
    pub node_id: String,
    pub driver_name: String,
    /// The local volume store (`volumes/` is made in it).
    pub store: PathBuf,
    /// Where BackingImages live; may be a directory every node shares.
    pub backing_images: PathBuf,
    /// How long CreateVolume waits for a BackingImage being prepared before it answers
    /// `ABORTED` (the CO retries).
    pub image_wait: Duration,
    /// The directory `file://` download URLs may read from; `None` disables them.
    pub file_root: Option<PathBuf>,
    /// Allow http(s) download URLs whose host is (or resolves to) a loopback, link-local or
    /// private address; refused otherwise.
    pub allow_private_urls: bool,
    /// The largest image a download may produce, in bytes.
    pub max_image_size: u64,
    /// A download that receives nothing for this long fails.
    pub download_idle_timeout: Duration,
    /// The capacity volumes may be promised, in percent of what the store's filesystem can
    /// hold for them: 100 means every volume can be filled at once.
    pub over_provisioning: u32,
    /// The most bytes per second an export reads from a volume; `None`: no limit.
    pub export_rate: Option<std::num::NonZeroU64>,
}

impl Config {
    /// What downloads may do.
    pub fn download_policy(&self) -> download::Policy {
        download::Policy {
            file_root: self.file_root.clone(),
            allow_private: self.allow_private_urls,
            max_size: self.max_image_size,
            idle_timeout: self.download_idle_timeout,
        }
    }
}

/// State shared by the three services.
pub struct Driver {
    pub config: Config,
    pub volumes: VolumeStore,
    pub images: Arc<Images>,
    /// Volumes being restored from a BackingImage, with what their CreateVolume asked.
    pub restores: Arc<JobSet<VolumeMeta>>,
    /// Serializes controller state changes (claiming, creating and deleting volumes and
    /// images). Never held across a copy: copies run as jobs ([`jobs`]). Lock order: this
    /// lock, then the job sets' own mutexes, which are only held to read or change their maps.
    /// DeleteSnapshot waits under it for a cancelled image job to end; image jobs never take
    /// it, so that wait cannot deadlock, and a cancelled job ends within milliseconds.
    pub controller_lock: tokio::sync::Mutex<()>,
    /// Serializes publish, unpublish and expansion of one volume on this node. Other volumes
    /// go on meanwhile: a publish may format, check and grow a filesystem, which takes
    /// minutes on a big volume. Lock order: a volume's lock, then `loop_lock`; nobody holds
    /// two volumes' locks at once, and nobody takes a volume's lock while holding `loop_lock`.
    pub volume_locks: KeyedLocks,
    /// Serializes attaching and detaching loop devices, which come from one pool that all
    /// volumes share. Held only around `losetup`, never across formatting or mounting.
    pub loop_lock: tokio::sync::Mutex<()>,
}

impl Driver {
    pub fn new(config: Config) -> Result<Arc<Driver>> {
        if config.node_id.is_empty() {
            return Err(CsiError::InvalidArgument("a node id is required".into()));
        }
        // The node id is part of temp file names in a directory nodes may share.
        if config
            .node_id
            .contains(['/', '\0', backing_image::NODE_END])
        {
            return Err(CsiError::InvalidArgument(format!(
                "node id {:?} contains '/', NUL or '{}', which are not allowed",
                config.node_id,
                backing_image::NODE_END
            )));
        }
        let volumes = VolumeStore::open(config.store.join("volumes"))?;
        let store = ImageStore::open(config.backing_images.clone(), &config.node_id)?;
        let cuts = cut::Cuts::open(config.store.join("cuts"))?;
        let images = Arc::new(Images::new(
            store,
            cuts,
            config.node_id.clone(),
            config.export_rate,
        ));
        Ok(Arc::new(Driver {
            config,
            volumes,
            images,
            restores: Arc::default(),
            controller_lock: tokio::sync::Mutex::new(()),
            volume_locks: KeyedLocks::default(),
            loop_lock: tokio::sync::Mutex::new(()),
        }))
    }

    /// Start-up, before serving: thaws what a killed cut left frozen, then resumes or removes
    /// what an earlier run left in the BackingImage directory ([`Images::recover`]).
    pub fn recover(&self) -> Result<()> {
        for volume in self.volumes.list()? {
            for p in self.volumes.publications(&volume.id)? {
                if !p.block {
                    cut::thaw_leftover(&p.target, &p.device);
                }
            }
        }
        self.images.recover()
    }

    /// The topology segment of this node.
    pub fn topology(&self) -> proto::Topology {
        proto::Topology {
            segments: [(TOPOLOGY_KEY.to_owned(), self.config.node_id.clone())].into(),
        }
    }
}
