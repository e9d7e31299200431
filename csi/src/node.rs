//! The CSI Node service: publishing volumes on this node through loop devices.
//!
//! `Block` access bind-mounts the volume's loop device onto the target file; `Mount` access
//! formats the device as ext4 the first time (a device that already holds a filesystem, e.g. a
//! volume restored from a BackingImage, is never formatted again), mounts it at the target
//! directory and grows the filesystem to the volume's size. Every publication of a volume
//! shares one loop device, which is detached when the last one goes.
//!
//! What the driver made at a target path is known two ways: its record of publications
//! (`publish.json`, written before anything is mounted) and the kernel's mount table (a mount
//! of the volume's loop device, or a bind mount of the device node, at that path). Unpublish
//! unmounts only the volume's own mount, and removes only the empty file or directory a
//! publication of the volume stood on; anything else at the path is left alone and reported
//! (`FAILED_PRECONDITION`), since it is someone else's data. Paths must be absolute and
//! clean: a relative path would be resolved against the driver's working directory, and
//! `..` would let one pod's request reach another's directory.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tonic::{Request, Response, Status};

use super::controller::check_capability;
use super::error::{CsiError, Result};
use super::mounts::{self, Occupant};
use super::proto::node_server::Node;
use super::proto::node_service_capability::{rpc, Rpc, Type as CapType};
use super::proto::volume_capability::access_mode::Mode;
use super::proto::volume_capability::AccessType;
use super::proto::*;
use super::volumes::Publication;
use super::Driver;

pub struct NodeService(pub Arc<Driver>);

impl NodeService {
    fn disk(&self, id: &str) -> Result<PathBuf> {
        require_volume_id(id)?;
        match (self.0.volumes.get(id)?, self.0.volumes.disk(id)) {
            (Some(_), Some(disk)) => Ok(disk),
            _ => Err(CsiError::NotFound(format!(
                "volume {id:?} does not exist on this node"
            ))),
        }
    }

    async fn publish(&self, req: NodePublishVolumeRequest) -> Result<()> {
        // Arguments first: a request that is malformed is INVALID_ARGUMENT whether or not the
        // volume exists (the spec's order; csi-sanity checks it with unknown volume ids).
        require_volume_id(&req.volume_id)?;
        let target = check_path("target_path", &req.target_path)?;
        if !req.staging_target_path.is_empty() {
            check_path("staging_target_path", &req.staging_target_path)?;
        }
        let cap = req
            .volume_capability
            .as_ref()
            .ok_or_else(|| CsiError::InvalidArgument("volume_capability is required".into()))?;
        check_capability(cap).map_err(CsiError::InvalidArgument)?;
        let disk = self.disk(&req.volume_id)?;
        let block = matches!(cap.access_type, Some(AccessType::Block(_)));
        let mode = cap.access_mode.as_ref().map(|m| m.mode).unwrap_or_default();
        let readonly = req.readonly || mode == Mode::SingleNodeReaderOnly as i32;
        let flags: Vec<String> = match &cap.access_type {
            Some(AccessType::Mount(m)) => m.mount_flags.clone(),
            _ => Vec::new(),
        };

        let id = &req.volume_id;
        let _guard = self.0.volume_locks.lock(id).await;
        let mut pubs = self.0.volumes.publications(id)?;
        let recorded = pubs.iter().position(|p| p.target == target);
        refuse_symlink(&target)?;
        let current = mounts::find_loop(&disk).await?;
        match mounts::occupant(&target, current.as_deref())? {
            Occupant::Volume => {
                let device = current.unwrap_or_default();
                match recorded.map(|i| &pubs[i]) {
                    Some(p) if p.block == block && p.readonly == readonly => return Ok(()),
                    Some(_) => {
                        return Err(CsiError::AlreadyExists(format!(
                            "volume {id} is already published at {} with other options",
                            target.display()
                        )))
                    }
                    // Mounted by this driver, its record lost: record it again, so that
                    // unpublish and DeleteVolume see it.
                    None => {
                        pubs.push(Publication {
                            target,
                            block,
                            readonly,
                            device,
                        });
                        return self.0.volumes.set_publications(id, &pubs);
                    }
                }
            }
            Occupant::Other(what) => {
                return Err(CsiError::FailedPrecondition(format!(
                    "{what} is mounted at {}, not volume {id}; not publishing over it",
                    target.display()
                )))
            }
            Occupant::Nothing => {}
        }
        if let Some(i) = recorded {
            pubs.remove(i);
        }
        let created = prepare_target(&target, block)?;
        let device = self.attach(&disk).await?;
        // Recorded before the mount: a driver killed in between still knows, after its
        // restart, that the file or directory at the target is its own.
        pubs.push(Publication {
            target: target.clone(),
            block,
            readonly,
            device: device.clone(),
        });
        let result = match self.0.volumes.set_publications(id, &pubs) {
            Ok(()) => {
                self.mount_device(&disk, &device, &target, block, readonly, &flags)
                    .await
            }
            Err(e) => Err(e),
        };
        if let Err(e) = result {
            pubs.pop();
            let _ = self.0.volumes.set_publications(id, &pubs);
            if created {
                let _ = remove_made(&target);
            }
            if pubs.is_empty() {
                let _ = self.detach(&disk).await;
            }
            return Err(e);
        }
        tracing::info!(volume = %id, target = %target.display(), block, readonly, "published volume");
        Ok(())
    }

    /// The loop device of `disk`, attached if it has none. The caller holds the volume's lock.
    async fn attach(&self, disk: &Path) -> Result<PathBuf> {
        let _loops = self.0.loop_lock.lock().await;
        mounts::attach(disk).await
    }

    /// Detaches the loop devices of `disk`. The caller holds the volume's lock.
    async fn detach(&self, disk: &Path) -> Result<()> {
        let _loops = self.0.loop_lock.lock().await;
        mounts::detach_all(disk).await
    }

    async fn mount_device(
        &self,
        disk: &Path,
        device: &Path,
        target: &Path,
        block: bool,
        readonly: bool,
        flags: &[String],
    ) -> Result<()> {
        if block {
            let mut options = vec!["bind".to_owned()];
            if readonly {
                options.push("ro".into());
            }
            return mounts::mount(device, target, None, &options).await;
        }
        let fs = mounts::fs_type(device).await?;
        if fs.is_empty() {
            if readonly {
                return Err(CsiError::FailedPrecondition(
                    "the volume has no filesystem yet and is published read-only".into(),
                ));
            }
            tracing::info!(device = %device.display(), "formatting ext4");
            mounts::mkfs_ext4(device).await?;
        } else if fs != "ext4" {
            return Err(CsiError::FailedPrecondition(format!(
                "the volume holds a {fs} filesystem, not ext4"
            )));
        }
        if !readonly && !mounts::is_device_mounted(device) {
            let size = std::fs::metadata(disk)
                .map_err(|e| CsiError::io(format!("volume disk {}", disk.display()), e))?
                .len();
            mounts::grow_offline(device, size).await?;
        }
        let mut options: Vec<String> = flags.to_vec();
        options.push(if readonly { "ro" } else { "rw" }.into());
        mounts::mount(device, target, Some("ext4"), &options).await
    }

    async fn unpublish(&self, req: NodeUnpublishVolumeRequest) -> Result<()> {
        require_volume_id(&req.volume_id)?;
        let target = check_path("target_path", &req.target_path)?;
        let disk = self.disk(&req.volume_id)?;
        let id = &req.volume_id;
        let _guard = self.0.volume_locks.lock(id).await;
        let mut pubs = self.0.volumes.publications(id)?;
        let recorded = pubs.iter().position(|p| p.target == target);
        let mut ours = recorded.is_some();
        refuse_symlink(&target)?;
        // The volume's mounts only, each time the one on top: one publication may have been
        // made twice over by a driver that lost its record in between.
        let mut unmounted = 0;
        loop {
            let current = mounts::find_loop(&disk).await?;
            match mounts::occupant(&target, current.as_deref())? {
                Occupant::Nothing => break,
                Occupant::Volume if unmounted < MAX_STACKED => {
                    mounts::umount(&target).await?;
                    unmounted += 1;
                    ours = true;
                }
                Occupant::Volume => {
                    return Err(CsiError::FailedPrecondition(format!(
                        "volume {id} is still mounted at {} after {MAX_STACKED} unmounts",
                        target.display()
                    )))
                }
                Occupant::Other(what) => {
                    return Err(CsiError::FailedPrecondition(format!(
                        "{what} is mounted at {}, not volume {id}; it is left alone",
                        target.display()
                    )))
                }
            }
        }
        let leftover = match std::fs::symlink_metadata(&target) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(CsiError::io(format!("{}", target.display()), e)),
            Ok(meta) if ours && is_made_shape(&target, &meta) => {
                remove_made(&target)?;
                None
            }
            Ok(meta) => Some(CsiError::FailedPrecondition(format!(
                "{} is a {} that volume {id} is not published on; it is left alone",
                target.display(),
                kind_of(&meta)
            ))),
        };
        if let Some(i) = recorded {
            pubs.remove(i);
        } else if let Some(e) = leftover {
            // Not ours and never was: nothing of the volume changes.
            return Err(e);
        }
        if pubs.is_empty() {
            self.detach(&disk).await?;
        }
        self.0.volumes.set_publications(id, &pubs)?;
        if let Some(e) = leftover {
            return Err(e);
        }
        tracing::info!(volume = %id, target = %target.display(), "unpublished volume");
        Ok(())
    }

    fn publication(&self, id: &str, path: &str, staging: &str) -> Result<Publication> {
        require_volume_id(id)?;
        if path.is_empty() {
            return Err(CsiError::InvalidArgument("volume_path is required".into()));
        }
        if !staging.is_empty() {
            check_path("staging_target_path", staging)?;
        }
        self.disk(id)?;
        // NOT_FOUND rather than INVALID_ARGUMENT: the spec's answer for a volume that "is not
        // available at the specified volume_path", which csi-sanity checks with a relative one.
        // Nothing is ever published at such a path, so none is looked up or touched.
        if let Err(e) = check_path("volume_path", path) {
            return Err(CsiError::NotFound(format!(
                "volume {id} is not published at {path:?}: {e}"
            )));
        }
        self.0
            .volumes
            .publications(id)?
            .into_iter()
            .find(|p| p.target == Path::new(path))
            .ok_or_else(|| CsiError::NotFound(format!("volume {id} is not published at {path}")))
    }

    fn stats(&self, req: &NodeGetVolumeStatsRequest) -> Result<Vec<VolumeUsage>> {
        let p = self.publication(&req.volume_id, &req.volume_path, &req.staging_target_path)?;
        let bytes = volume_usage::Unit::Bytes as i32;
        if p.block {
            let total = self.0.volumes.capacity(&req.volume_id)?;
            let used = self.0.volumes.allocated(&req.volume_id)?.min(total);
            return Ok(vec![VolumeUsage {
                available: clamp(total - used),
                total: clamp(total),
                used: clamp(used),
                unit: bytes,
            }]);
        }
        let st = nix::sys::statvfs::statvfs(&p.target)
            .map_err(|e| CsiError::Internal(format!("statvfs {}: {e}", p.target.display())))?;
        let frag = st.fragment_size() as u64;
        let total = (st.blocks() as u64).saturating_mul(frag);
        let free = (st.blocks_free() as u64).saturating_mul(frag);
        let avail = (st.blocks_available() as u64).saturating_mul(frag);
        let inodes = st.files() as u64;
        let ifree = st.files_free() as u64;
        Ok(vec![
            VolumeUsage {
                available: clamp(avail),
                total: clamp(total),
                used: clamp(total.saturating_sub(free)),
                unit: bytes,
            },
            VolumeUsage {
                available: clamp(ifree),
                total: clamp(inodes),
                used: clamp(inodes.saturating_sub(ifree)),
                unit: volume_usage::Unit::Inodes as i32,
            },
        ])
    }

    async fn expand(&self, req: NodeExpandVolumeRequest) -> Result<u64> {
        require_volume_id(&req.volume_id)?;
        let _guard = self.0.volume_locks.lock(&req.volume_id).await;
        let p = self.publication(&req.volume_id, &req.volume_path, &req.staging_target_path)?;
        mounts::refresh_size(&p.device).await?;
        if !p.block {
            mounts::grow_fs(&p.device).await?;
        }
        self.0.volumes.capacity(&req.volume_id)
    }
}

fn require_volume_id(id: &str) -> Result<()> {
    if id.is_empty() {
        return Err(CsiError::InvalidArgument("volume_id is required".into()));
    }
    Ok(())
}

/// More mounts of one volume stacked at one path than a driver could have made by mistake.
const MAX_STACKED: usize = 8;

/// `path`, checked to be absolute and clean; `field` names it in the error. A clean path is
/// the only spelling of itself, so that it matches the record of a publication exactly.
pub fn check_path(field: &str, path: &str) -> Result<PathBuf> {
    if path.is_empty() {
        return Err(CsiError::InvalidArgument(format!("{field} is required")));
    }
    let problem = if path.contains('\0') {
        "contains NUL"
    } else if !path.starts_with('/') {
        "is not an absolute path"
    } else if path.contains("//") {
        "contains \"//\""
    } else if path.len() > 1 && path.ends_with('/') {
        "ends with \"/\""
    } else if path.split('/').any(|c| c == "." || c == "..") {
        "contains a \".\" or \"..\" component"
    } else {
        return Ok(PathBuf::from(path));
    };
    Err(CsiError::InvalidArgument(format!(
        "{field} {path:?} {problem}; it must be an absolute, clean path"
    )))
}

/// Refuses a symlink at `target`: mount and umount would act on where it points.
fn refuse_symlink(target: &Path) -> Result<()> {
    match std::fs::symlink_metadata(target) {
        Ok(m) if m.file_type().is_symlink() => Err(CsiError::FailedPrecondition(format!(
            "{} is a symlink, which the driver never makes; it is left alone",
            target.display()
        ))),
        _ => Ok(()),
    }
}

/// Makes sure `target` is something a publication can stand on: an empty file (block) or an
/// empty directory (mount), made if missing, with its parent. Anything else is refused: a
/// publication would hide it, and unpublish would not know whose it is. Returns whether
/// it made the target.
fn prepare_target(target: &Path, block: bool) -> Result<bool> {
    match std::fs::symlink_metadata(target) {
        Ok(meta) => {
            let fits = if block {
                meta.is_file() && meta.len() == 0
            } else {
                meta.is_dir() && is_empty_dir(target)
            };
            if !fits {
                return Err(CsiError::FailedPrecondition(format!(
                    "{} is a {}, not an empty {}; not publishing over it",
                    target.display(),
                    kind_of(&meta),
                    if block { "file" } else { "directory" }
                )));
            }
            Ok(false)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if let Some(parent) = target.parent() {
                std::fs::create_dir_all(parent)
                    .map_err(|e| CsiError::io(format!("creating {}", parent.display()), e))?;
            }
            let made = if block {
                std::fs::OpenOptions::new()
                    .create_new(true)
                    .write(true)
                    .open(target)
                    .map(|_| ())
            } else {
                std::fs::create_dir(target)
            };
            made.map_err(|e| CsiError::io(format!("creating {}", target.display()), e))?;
            Ok(true)
        }
        Err(e) => Err(CsiError::io(format!("{}", target.display()), e)),
    }
}

/// Whether what is at `target` is what a publication stands on once unmounted: an empty
/// regular file or an empty directory.
fn is_made_shape(target: &Path, meta: &std::fs::Metadata) -> bool {
    (meta.is_file() && meta.len() == 0) || (meta.is_dir() && is_empty_dir(target))
}

fn is_empty_dir(path: &Path) -> bool {
    std::fs::read_dir(path)
        .map(|mut d| d.next().is_none())
        .unwrap_or(false)
}

/// Removes the empty file or directory a publication stood on. A directory that is no longer
/// empty is not removed (remove_dir refuses it).
fn remove_made(target: &Path) -> Result<()> {
    let meta = std::fs::symlink_metadata(target)
        .map_err(|e| CsiError::io(format!("{}", target.display()), e))?;
    let removed = if meta.is_dir() {
        std::fs::remove_dir(target)
    } else {
        std::fs::remove_file(target)
    };
    match removed {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(CsiError::io(format!("removing {}", target.display()), e)),
    }
}

fn kind_of(meta: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = meta.file_type();
    if t.is_dir() {
        "directory"
    } else if t.is_file() {
        "regular file"
    } else if t.is_symlink() {
        "symlink"
    } else if t.is_block_device() {
        "block device"
    } else {
        "special file"
    }
}

fn clamp(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn rpc_cap(t: rpc::Type) -> NodeServiceCapability {
    NodeServiceCapability {
        r#type: Some(CapType::Rpc(Rpc { r#type: t as i32 })),
    }
}

#[tonic::async_trait]
impl Node for NodeService {
    async fn node_publish_volume(
        &self,
        request: Request<NodePublishVolumeRequest>,
    ) -> std::result::Result<Response<NodePublishVolumeResponse>, Status> {
        self.publish(request.into_inner()).await?;
        Ok(Response::new(NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        request: Request<NodeUnpublishVolumeRequest>,
    ) -> std::result::Result<Response<NodeUnpublishVolumeResponse>, Status> {
        self.unpublish(request.into_inner()).await?;
        Ok(Response::new(NodeUnpublishVolumeResponse {}))
    }

    async fn node_get_volume_stats(
        &self,
        request: Request<NodeGetVolumeStatsRequest>,
    ) -> std::result::Result<Response<NodeGetVolumeStatsResponse>, Status> {
        let usage = self.stats(request.get_ref())?;
        Ok(Response::new(NodeGetVolumeStatsResponse {
            usage,
            volume_condition: None,
        }))
    }

    async fn node_expand_volume(
        &self,
        request: Request<NodeExpandVolumeRequest>,
    ) -> std::result::Result<Response<NodeExpandVolumeResponse>, Status> {
        let capacity = self.expand(request.into_inner()).await?;
        Ok(Response::new(NodeExpandVolumeResponse {
            capacity_bytes: clamp(capacity),
        }))
    }

    /// Volume stats and online expansion. No staging: a loop device needs no per-node attach
    /// step shared between pods, so NodePublish does all the work.
    async fn node_get_capabilities(
        &self,
        _: Request<NodeGetCapabilitiesRequest>,
    ) -> std::result::Result<Response<NodeGetCapabilitiesResponse>, Status> {
        Ok(Response::new(NodeGetCapabilitiesResponse {
            capabilities: vec![
                rpc_cap(rpc::Type::GetVolumeStats),
                rpc_cap(rpc::Type::ExpandVolume),
            ],
        }))
    }

    async fn node_get_info(
        &self,
        _: Request<NodeGetInfoRequest>,
    ) -> std::result::Result<Response<NodeGetInfoResponse>, Status> {
        Ok(Response::new(NodeGetInfoResponse {
            node_id: self.0.config.node_id.clone(),
            max_volumes_per_node: 0,
            accessible_topology: Some(self.0.topology()),
        }))
    }
}
