//! The CSI Node service: publishing volumes on this node through loop devices.
//!
//! `Block` access bind-mounts the volume's loop device onto the target file; `Mount` access
//! formats the device as ext4 the first time (a device that already holds a filesystem, e.g. a
//! volume restored from a BackingImage, is never formatted again), mounts it at the target
//! directory and grows the filesystem to the volume's size. Every publication of a volume
//! shares one loop device, which is detached when the last one goes.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tonic::{Request, Response, Status};

use super::controller::check_capability;
use super::error::{CsiError, Result};
use super::mounts;
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
        if req.target_path.is_empty() {
            return Err(CsiError::InvalidArgument("target_path is required".into()));
        }
        let target = PathBuf::from(&req.target_path);
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
        if let Some(i) = pubs.iter().position(|p| p.target == target) {
            let p = &pubs[i];
            if mounts::is_mounted(&target) {
                if p.block == block && p.readonly == readonly {
                    return Ok(());
                }
                return Err(CsiError::AlreadyExists(format!(
                    "volume {id} is already published at {} with other options",
                    target.display()
                )));
            }
            pubs.remove(i);
        }
        let device = self.attach(&disk).await?;
        let result = self
            .mount_device(&disk, &device, &target, block, readonly, &flags)
            .await;
        if let Err(e) = result {
            if pubs.is_empty() {
                let _ = self.detach(&disk).await;
            }
            return Err(e);
        }
        pubs.push(Publication {
            target: target.clone(),
            block,
            readonly,
            device,
        });
        self.0.volumes.set_publications(id, &pubs)?;
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
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent)
                .map_err(|e| CsiError::io(format!("creating {}", parent.display()), e))?;
        }
        if block {
            std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(target)
                .map_err(|e| CsiError::io(format!("creating {}", target.display()), e))?;
            let mut options = vec!["bind".to_owned()];
            if readonly {
                options.push("ro".into());
            }
            return mounts::mount(device, target, None, &options).await;
        }
        std::fs::create_dir_all(target)
            .map_err(|e| CsiError::io(format!("creating {}", target.display()), e))?;
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
        if req.target_path.is_empty() {
            return Err(CsiError::InvalidArgument("target_path is required".into()));
        }
        let disk = self.disk(&req.volume_id)?;
        let target = PathBuf::from(&req.target_path);
        let id = &req.volume_id;
        let _guard = self.0.volume_locks.lock(id).await;
        if mounts::is_mounted(&target) {
            mounts::umount(&target).await?;
        }
        match std::fs::symlink_metadata(&target) {
            Ok(m) if m.is_dir() => {
                let _ = std::fs::remove_dir(&target);
            }
            Ok(_) => {
                let _ = std::fs::remove_file(&target);
            }
            Err(_) => {}
        }
        let mut pubs = self.0.volumes.publications(id)?;
        pubs.retain(|p| p.target != target);
        if pubs.is_empty() {
            self.detach(&disk).await?;
        }
        self.0.volumes.set_publications(id, &pubs)?;
        tracing::info!(volume = %id, target = %target.display(), "unpublished volume");
        Ok(())
    }

    fn publication(&self, id: &str, path: &str) -> Result<Publication> {
        require_volume_id(id)?;
        if path.is_empty() {
            return Err(CsiError::InvalidArgument("volume_path is required".into()));
        }
        self.disk(id)?;
        self.0
            .volumes
            .publications(id)?
            .into_iter()
            .find(|p| p.target == Path::new(path))
            .ok_or_else(|| CsiError::NotFound(format!("volume {id} is not published at {path}")))
    }

    fn stats(&self, req: &NodeGetVolumeStatsRequest) -> Result<Vec<VolumeUsage>> {
        let p = self.publication(&req.volume_id, &req.volume_path)?;
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
        let p = self.publication(&req.volume_id, &req.volume_path)?;
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
