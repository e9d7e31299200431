//! The CSI Controller service: volumes, and snapshots that are BackingImages. This module
//! holds the RPC surface and what the RPCs share; CreateVolume's work is in [`provision`],
//! the snapshots' in [`snapshots`].

mod provision;
mod snapshots;

use std::collections::BTreeMap;
use std::sync::Arc;

use tonic::{Request, Response, Status};

use super::backing_image::ExportFrom;
use super::backing_image::{ImageState, Wait};
use super::cut::Quiesce;
use super::error::{CsiError, Result};
use super::export::{self, check_checksum, check_export_type};
use super::handle::{
    BiHandle, KEY_EXPORT_TYPE, KEY_URL, KEY_VOLUME_NAME, SOURCE_DOWNLOAD, SOURCE_EXPORT,
};
use super::jobs::JobWait;
use super::names::disk_name;
use super::proto::controller_server::Controller;
use super::proto::controller_service_capability::{rpc, Rpc, Type as CapType};
use super::proto::volume_capability::access_mode::Mode;
use super::proto::volume_capability::AccessType;
use super::proto::volume_content_source::{SnapshotSource, Type as SourceType};
use super::proto::*;
use super::volumes::VolumeMeta;
use super::{download, files, Driver};

/// Capacities are rounded up to this.
const ALIGN: u64 = 1 << 20;
/// The capacity of a new empty volume when none is asked for.
const DEFAULT_CAPACITY: u64 = 1 << 30;
/// The largest capacity: CSI sizes and file sizes are both signed 64-bit.
const MAX_CAPACITY: u64 = i64::MAX as u64;

pub struct ControllerService(pub Arc<Driver>);

/// Whether the driver can serve `cap`; `Err` says why not.
pub fn check_capability(cap: &VolumeCapability) -> std::result::Result<(), String> {
    match &cap.access_type {
        Some(AccessType::Block(_)) => {}
        Some(AccessType::Mount(m)) => {
            if !(m.fs_type.is_empty() || m.fs_type == "ext4") {
                return Err(format!(
                    "filesystem {:?} is not supported; use ext4",
                    m.fs_type
                ));
            }
        }
        None => return Err("the capability has neither block nor mount access".into()),
    }
    let mode = cap
        .access_mode
        .as_ref()
        .map(|m| m.mode)
        .unwrap_or(Mode::Unknown as i32);
    match Mode::try_from(mode) {
        Ok(Mode::SingleNodeWriter)
        | Ok(Mode::SingleNodeReaderOnly)
        | Ok(Mode::SingleNodeSingleWriter) => Ok(()),
        _ => Err(format!(
            "access mode {} is not supported: volumes live on one node",
            Mode::try_from(mode)
                .map(|m| m.as_str_name().to_owned())
                .unwrap_or_else(|_| mode.to_string())
        )),
    }
}

/// Keys the Kubernetes sidecars add on their own (with `--extra-create-metadata`: the names of
/// the PVC, PV or VolumeSnapshot) or read themselves (secrets, fstype). Always accepted.
const SIDECAR_PREFIX: &str = "csi.storage.k8s.io/";

/// The VolumeSnapshotClass parameters CreateSnapshot reads.
const SNAPSHOT_PARAMETERS: [&str; 3] = ["type", "export-type", "exportType"];

/// The StorageClass parameters CreateVolume reads: none.
const VOLUME_PARAMETERS: [&str; 0] = [];

/// Refuses keys of `params` that are neither `known` nor the sidecars': a misspelt key (say
/// `exporttype: qcow2`) would otherwise be ignored, and the user get what they did not ask
/// for without a word. `class` names where the parameters come from, for the message.
fn check_parameters(
    class: &str,
    params: &std::collections::HashMap<String, String>,
    known: &[&str],
) -> Result<()> {
    let mut unknown: Vec<&str> = params
        .keys()
        .map(String::as_str)
        .filter(|k| !known.contains(k) && !k.starts_with(SIDECAR_PREFIX))
        .collect();
    if unknown.is_empty() {
        return Ok(());
    }
    unknown.sort_unstable();
    let accepted = if known.is_empty() {
        "none".to_owned()
    } else {
        known.join(", ")
    };
    Err(CsiError::InvalidArgument(format!(
        "unknown {class} parameter{} {}; accepted: {accepted} (and keys starting with \
         {SIDECAR_PREFIX})",
        if unknown.len() > 1 { "s" } else { "" },
        unknown
            .iter()
            .map(|k| format!("{k:?}"))
            .collect::<Vec<_>>()
            .join(", ")
    )))
}

fn round_up(bytes: u64) -> u64 {
    bytes.div_ceil(ALIGN).saturating_mul(ALIGN)
}

/// `(required, limit)` of a capacity range, checked.
fn capacity_range(range: Option<&CapacityRange>) -> Result<(u64, u64)> {
    let Some(range) = range else {
        return Ok((0, 0));
    };
    let required = u64::try_from(range.required_bytes)
        .map_err(|_| CsiError::OutOfRange("required_bytes is negative".into()))?;
    let limit = u64::try_from(range.limit_bytes)
        .map_err(|_| CsiError::OutOfRange("limit_bytes is negative".into()))?;
    if limit != 0 && required > limit {
        return Err(CsiError::OutOfRange(format!(
            "required_bytes {required} is above limit_bytes {limit}"
        )));
    }
    Ok((required, limit))
}

/// Fits `wanted` bytes (rounded up) under `limit`.
fn fit(wanted: u64, limit: u64) -> Result<u64> {
    let rounded = round_up(wanted.max(1));
    let capacity = if limit == 0 || rounded <= limit {
        rounded
    } else if wanted <= limit {
        limit
    } else {
        return Err(CsiError::OutOfRange(format!(
            "a volume of {wanted} bytes does not fit limit_bytes {limit}"
        )));
    };
    // Rounding up near the top of the range goes past it.
    if capacity > MAX_CAPACITY {
        return Err(CsiError::OutOfRange(format!(
            "a volume of {wanted} bytes, rounded up to whole MiB, is larger than any volume \
             can be ({MAX_CAPACITY} bytes)"
        )));
    }
    Ok(capacity)
}

impl ControllerService {
    /// The capacity new volumes may still be promised: what the store can hold for volumes,
    /// scaled by `--over-provisioning`, less what is promised already.
    fn headroom(&self) -> Result<u64> {
        let space = self.0.volumes.space()?;
        Ok(promisable(space.usable(), self.0.config.over_provisioning)
            .saturating_sub(space.provisioned))
    }

    /// Refuses `more` bytes of capacity beyond what the store can promise: OUT_OF_RANGE for
    /// more than its filesystem could ever give, RESOURCE_EXHAUSTED for more than it has
    /// left now. Called under the controller lock, so two creations cannot both take the
    /// last of it.
    fn admit(&self, more: u64) -> Result<()> {
        let percent = self.0.config.over_provisioning;
        let space = self.0.volumes.space()?;
        let ever = promisable(space.total, percent);
        if more > ever {
            return Err(CsiError::OutOfRange(format!(
                "{more} bytes is more than the volume store can ever hold: its filesystem has \
                 {} bytes (over-provisioning {percent}%)",
                space.total
            )));
        }
        let left = promisable(space.usable(), percent).saturating_sub(space.provisioned);
        if more > left {
            return Err(CsiError::ResourceExhausted(format!(
                "the volume store has {left} bytes left for volumes, {more} were asked: volumes \
                 hold {} bytes and are promised {} bytes, {} bytes are free \
                 (over-provisioning {percent}%)",
                space.allocated, space.provisioned, space.free
            )));
        }
        Ok(())
    }
}

/// `percent` of `bytes`.
fn promisable(bytes: u64, percent: u32) -> u64 {
    u64::try_from(u128::from(bytes) * u128::from(percent) / 100).unwrap_or(u64::MAX)
}

/// The page of `items` that starts at `token` with at most `max` entries, and the next token.
fn page<T>(items: Vec<T>, max: i32, token: &str) -> Result<(Vec<T>, String)> {
    if max < 0 {
        return Err(CsiError::InvalidArgument("max_entries is negative".into()));
    }
    let start = if token.is_empty() {
        0
    } else {
        token
            .parse::<usize>()
            .ok()
            .filter(|&n| n <= items.len())
            .ok_or_else(|| CsiError::Aborted(format!("invalid starting_token {token:?}")))?
    };
    let max = if max == 0 { usize::MAX } else { max as usize };
    let total = items.len();
    let entries: Vec<T> = items.into_iter().skip(start).take(max).collect();
    let end = start + entries.len();
    let next = if end < total {
        end.to_string()
    } else {
        String::new()
    };
    Ok((entries, next))
}

fn rpc_cap(t: rpc::Type) -> ControllerServiceCapability {
    ControllerServiceCapability {
        r#type: Some(CapType::Rpc(Rpc { r#type: t as i32 })),
    }
}

#[tonic::async_trait]
impl Controller for ControllerService {
    async fn create_volume(
        &self,
        request: Request<CreateVolumeRequest>,
    ) -> std::result::Result<Response<CreateVolumeResponse>, Status> {
        let volume = ControllerService::create_volume(self, request.into_inner()).await?;
        Ok(Response::new(CreateVolumeResponse {
            volume: Some(volume),
        }))
    }

    async fn delete_volume(
        &self,
        request: Request<DeleteVolumeRequest>,
    ) -> std::result::Result<Response<DeleteVolumeResponse>, Status> {
        let id = request.into_inner().volume_id;
        if id.is_empty() {
            return Err(Status::invalid_argument("volume_id is required"));
        }
        let _guard = self.0.controller_lock.lock().await;
        if self.0.restores.running(&id) {
            return Err(Status::aborted(format!(
                "volume {id} is still being restored from its snapshot; retry later"
            )));
        }
        if self.0.volumes.get(&id)?.is_none() {
            return Ok(Response::new(DeleteVolumeResponse {}));
        }
        let published = self.0.volumes.publications(&id)?;
        if let Some(p) = published.first() {
            return Err(Status::failed_precondition(format!(
                "volume {id} is still published at {}",
                p.target.display()
            )));
        }
        self.0.volumes.delete(&id)?;
        tracing::info!(volume = %id, "deleted volume");
        Ok(Response::new(DeleteVolumeResponse {}))
    }

    async fn validate_volume_capabilities(
        &self,
        request: Request<ValidateVolumeCapabilitiesRequest>,
    ) -> std::result::Result<Response<ValidateVolumeCapabilitiesResponse>, Status> {
        let req = request.into_inner();
        if req.volume_id.is_empty() {
            return Err(Status::invalid_argument("volume_id is required"));
        }
        if req.volume_capabilities.is_empty() {
            return Err(Status::invalid_argument("volume_capabilities are required"));
        }
        if self.0.volumes.get(&req.volume_id)?.is_none() {
            return Err(Status::not_found(format!(
                "volume {:?} does not exist",
                req.volume_id
            )));
        }
        let problems: Vec<String> = req
            .volume_capabilities
            .iter()
            .filter_map(|c| check_capability(c).err())
            .collect();
        let response = if problems.is_empty() {
            ValidateVolumeCapabilitiesResponse {
                confirmed: Some(validate_volume_capabilities_response::Confirmed {
                    volume_context: req.volume_context,
                    volume_capabilities: req.volume_capabilities,
                    parameters: req.parameters,
                    mutable_parameters: req.mutable_parameters,
                }),
                message: String::new(),
            }
        } else {
            ValidateVolumeCapabilitiesResponse {
                confirmed: None,
                message: problems.join("; "),
            }
        };
        Ok(Response::new(response))
    }

    async fn list_volumes(
        &self,
        request: Request<ListVolumesRequest>,
    ) -> std::result::Result<Response<ListVolumesResponse>, Status> {
        let req = request.into_inner();
        let mut all = Vec::new();
        for meta in self.0.volumes.list()? {
            let capacity = self.0.volumes.capacity(&meta.id).unwrap_or(0);
            all.push(self.volume_response(&meta, capacity));
        }
        let (entries, next_token) = page(all, req.max_entries, &req.starting_token)?;
        Ok(Response::new(ListVolumesResponse {
            entries: entries
                .into_iter()
                .map(|v| list_volumes_response::Entry {
                    volume: Some(v),
                    status: None,
                })
                .collect(),
            next_token,
        }))
    }

    async fn get_capacity(
        &self,
        _: Request<GetCapacityRequest>,
    ) -> std::result::Result<Response<GetCapacityResponse>, Status> {
        let available = self.headroom()?;
        Ok(Response::new(GetCapacityResponse {
            available_capacity: i64::try_from(available).unwrap_or(i64::MAX),
            maximum_volume_size: None,
            minimum_volume_size: None,
        }))
    }

    async fn controller_get_capabilities(
        &self,
        _: Request<ControllerGetCapabilitiesRequest>,
    ) -> std::result::Result<Response<ControllerGetCapabilitiesResponse>, Status> {
        Ok(Response::new(ControllerGetCapabilitiesResponse {
            capabilities: vec![
                rpc_cap(rpc::Type::CreateDeleteVolume),
                rpc_cap(rpc::Type::CreateDeleteSnapshot),
                rpc_cap(rpc::Type::ListSnapshots),
                rpc_cap(rpc::Type::ListVolumes),
                rpc_cap(rpc::Type::GetCapacity),
                // Not EXPAND_VOLUME: see the plugin capabilities (identity.rs).
            ],
        }))
    }

    async fn create_snapshot(
        &self,
        request: Request<CreateSnapshotRequest>,
    ) -> std::result::Result<Response<CreateSnapshotResponse>, Status> {
        let snapshot = ControllerService::create_snapshot(self, request.into_inner()).await?;
        Ok(Response::new(CreateSnapshotResponse {
            snapshot: Some(snapshot),
        }))
    }

    async fn delete_snapshot(
        &self,
        request: Request<DeleteSnapshotRequest>,
    ) -> std::result::Result<Response<DeleteSnapshotResponse>, Status> {
        ControllerService::delete_snapshot(self, &request.into_inner().snapshot_id).await?;
        Ok(Response::new(DeleteSnapshotResponse {}))
    }

    async fn list_snapshots(
        &self,
        request: Request<ListSnapshotsRequest>,
    ) -> std::result::Result<Response<ListSnapshotsResponse>, Status> {
        let response = ControllerService::list_snapshots(self, request.get_ref()).await?;
        Ok(Response::new(response))
    }

    async fn controller_expand_volume(
        &self,
        request: Request<ControllerExpandVolumeRequest>,
    ) -> std::result::Result<Response<ControllerExpandVolumeResponse>, Status> {
        let req = request.into_inner();
        if req.volume_id.is_empty() {
            return Err(Status::invalid_argument("volume_id is required"));
        }
        if req.capacity_range.is_none() {
            return Err(Status::invalid_argument("capacity_range is required"));
        }
        if let Some(cap) = &req.volume_capability {
            check_capability(cap).map_err(Status::invalid_argument)?;
        }
        let (required, limit) = capacity_range(req.capacity_range.as_ref())?;
        let _guard = self.0.controller_lock.lock().await;
        if self.0.volumes.get(&req.volume_id)?.is_none() {
            return Err(Status::not_found(format!(
                "volume {:?} does not exist",
                req.volume_id
            )));
        }
        let current = self.0.volumes.capacity(&req.volume_id)?;
        let capacity = if current >= required {
            current
        } else {
            let target = fit(required, limit)?;
            self.admit(target - current)?;
            self.0.volumes.grow(&req.volume_id, target)?
        };
        tracing::info!(volume = %req.volume_id, capacity, "expanded volume");
        Ok(Response::new(ControllerExpandVolumeResponse {
            capacity_bytes: i64::try_from(capacity).unwrap_or(i64::MAX),
            node_expansion_required: true,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_parameters_are_refused_by_name() {
        let params = |keys: &[&str]| {
            keys.iter()
                .map(|k| (k.to_string(), "x".to_string()))
                .collect::<std::collections::HashMap<_, _>>()
        };
        let known = &SNAPSHOT_PARAMETERS;
        let ok = params(&[
            "type",
            "export-type",
            "exportType",
            "csi.storage.k8s.io/volumesnapshot/name",
        ]);
        check_parameters("VolumeSnapshotClass", &ok, known).unwrap();
        let err = check_parameters(
            "VolumeSnapshotClass",
            &params(&["type", "exporttype"]),
            known,
        )
        .unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.to_string().contains("\"exporttype\""), "{err}");
        let err = check_parameters(
            "StorageClass",
            &params(&["backingImage"]),
            &VOLUME_PARAMETERS,
        )
        .unwrap_err();
        assert!(err.to_string().contains("\"backingImage\""), "{err}");
        check_parameters(
            "StorageClass",
            &params(&["csi.storage.k8s.io/pvc/name"]),
            &VOLUME_PARAMETERS,
        )
        .unwrap();
    }

    #[test]
    fn a_capacity_rounded_past_a_signed_size_is_out_of_range() {
        let err = fit(MAX_CAPACITY, 0).unwrap_err();
        assert_eq!(err.code(), tonic::Code::OutOfRange, "{err}");
        assert_eq!(fit(MAX_CAPACITY, MAX_CAPACITY).unwrap(), MAX_CAPACITY);
        assert_eq!(
            fit(MAX_CAPACITY - ALIGN, 0).unwrap(),
            MAX_CAPACITY + 1 - ALIGN
        );
    }
}
