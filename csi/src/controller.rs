//! The CSI Controller service: volumes, and snapshots that are BackingImages.

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
    if limit == 0 || rounded <= limit {
        Ok(rounded)
    } else if wanted <= limit {
        Ok(limit)
    } else {
        Err(CsiError::OutOfRange(format!(
            "a volume of {wanted} bytes does not fit limit_bytes {limit}"
        )))
    }
}

fn timestamp(secs: i64) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: secs,
        nanos: 0,
    }
}

fn snapshot_of(state: &ImageState, snapshot_id: String) -> Snapshot {
    Snapshot {
        size_bytes: i64::try_from(state.virtual_size).unwrap_or(i64::MAX),
        snapshot_id,
        source_volume_id: state.source_volume().unwrap_or_default().to_owned(),
        creation_time: Some(timestamp(state.created)),
        ready_to_use: state.ready,
        group_snapshot_id: String::new(),
    }
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

impl ControllerService {
    fn volume_response(&self, meta: &VolumeMeta, capacity: u64) -> Volume {
        let mut context: std::collections::HashMap<String, String> =
            meta.parameters.clone().into_iter().collect();
        if let Some(image) = &meta.backing_image {
            context.insert("backingImage".into(), image.clone());
        }
        Volume {
            capacity_bytes: i64::try_from(capacity).unwrap_or(i64::MAX),
            volume_id: meta.id.clone(),
            volume_context: context,
            content_source: meta.content_source.as_ref().map(|id| VolumeContentSource {
                r#type: Some(SourceType::Snapshot(SnapshotSource {
                    snapshot_id: id.clone(),
                })),
            }),
            accessible_topology: vec![self.0.topology()],
        }
    }

    async fn create_volume(&self, req: CreateVolumeRequest) -> Result<Volume> {
        let id = disk_name("volume", &req.name)?;
        if req.volume_capabilities.is_empty() {
            return Err(CsiError::InvalidArgument(
                "volume_capabilities are required".into(),
            ));
        }
        for cap in &req.volume_capabilities {
            check_capability(cap).map_err(CsiError::InvalidArgument)?;
        }
        let (required, limit) = capacity_range(req.capacity_range.as_ref())?;
        let snapshot_id =
            match req
                .volume_content_source
                .as_ref()
                .and_then(|s| s.r#type.as_ref())
            {
                None => None,
                Some(SourceType::Snapshot(s)) => Some(s.snapshot_id.clone()),
                Some(SourceType::Volume(_)) => return Err(CsiError::InvalidArgument(
                    "cloning from a volume is not supported; snapshot it (type bi) and restore \
                     from the snapshot"
                        .into(),
                )),
            };
        let parameters: BTreeMap<String, String> = req.parameters.clone().into_iter().collect();
        let meta = VolumeMeta {
            id: id.clone(),
            name: req.name.clone(),
            requested: required,
            parameters,
            content_source: snapshot_id.clone(),
            backing_image: None,
            created: files::now_secs(),
        };
        {
            let _guard = self.0.controller_lock.lock().await;
            if let Some(existing) = self.existing_volume(&meta, limit)? {
                return Ok(existing);
            }
            if snapshot_id.is_none() {
                // With no size asked for, the default must still respect a small limit.
                let wanted = match (required, limit) {
                    (0, 0) => DEFAULT_CAPACITY,
                    (0, limit) => DEFAULT_CAPACITY.min(limit),
                    (required, _) => required,
                };
                let capacity = fit(wanted, limit)?;
                let staging = self.0.volumes.stage(&id)?;
                self.0.volumes.commit(staging, &meta, capacity)?;
                tracing::info!(volume = %id, capacity, "created volume");
                return Ok(self.volume_response(&meta, capacity));
            }
        }
        let snapshot_id = snapshot_id.unwrap_or_default();
        self.restore_volume(meta, &snapshot_id, required, limit)
            .await
    }

    /// The response for a volume that already exists under this name, or `ALREADY_EXISTS`
    /// when it differs from what is asked.
    fn existing_volume(&self, meta: &VolumeMeta, limit: u64) -> Result<Option<Volume>> {
        let Some(existing) = self.0.volumes.get(&meta.id)? else {
            return Ok(None);
        };
        let capacity = self.0.volumes.capacity(&meta.id)?;
        let same = same_request(&existing, meta) && (limit == 0 || capacity <= limit);
        if !same {
            return Err(CsiError::AlreadyExists(format!(
                "volume {:?} already exists with a different capacity ({capacity} bytes), content \
                 source or parameters",
                meta.name
            )));
        }
        Ok(Some(self.volume_response(&existing, capacity)))
    }

    /// CreateVolume from a `bi://` snapshot: prepares the BackingImage if needed, then copies it
    /// into a new raw volume grown to the requested capacity. The copy is a job of its own,
    /// keyed by the volume id: a call that times out leaves it running, and the retry waits
    /// for it (answering `ABORTED` while it runs) instead of starting over.
    async fn restore_volume(
        &self,
        mut meta: VolumeMeta,
        snapshot_id: &str,
        required: u64,
        limit: u64,
    ) -> Result<Volume> {
        let handle = BiHandle::decode(snapshot_id)?;
        let image = disk_name("backing image", &handle.image)?;
        let checksum = handle.checksum.as_deref().map(check_checksum).transpose()?;
        if let Some(volume) = self.follow_restore(&meta, limit).await? {
            return Ok(volume);
        }
        let use_guard = {
            let _guard = self.0.controller_lock.lock().await;
            self.ensure_image(&image, &handle, checksum.as_deref())?;
            self.0.images.acquire(&image)
        };
        let state = match self.0.images.wait(&image, self.0.config.image_wait).await? {
            // The image may have been deleted and made again from another source while this
            // call waited: check it against the handle once more.
            Wait::Ready(state) => {
                check_matches(&state, &handle, checksum.as_deref())?;
                state
            }
            Wait::Pending(p) => {
                return Err(CsiError::Aborted(format!(
                    "backing image {image} is still being prepared ({} of {} bytes); retry later",
                    p.done, p.total
                )))
            }
        };
        {
            let _guard = self.0.controller_lock.lock().await;
            if let Some(existing) = self.existing_volume(&meta, limit)? {
                return Ok(existing);
            }
            if self.0.restores.running(&meta.id) {
                // Another call started the restore meanwhile: follow it (below).
            } else {
                let capacity = fit(
                    if required == 0 {
                        state.virtual_size
                    } else {
                        required
                    },
                    limit,
                )?;
                if capacity < state.virtual_size {
                    return Err(CsiError::OutOfRange(format!(
                        "requested capacity {capacity} bytes is smaller than backing image \
                         {image} ({} bytes)",
                        state.virtual_size
                    )));
                }
                let data = self.0.images.store.data_path(&image).ok_or_else(|| {
                    CsiError::NotFound(format!("backing image {image} does not exist"))
                })?;
                let format = state
                    .format
                    .clone()
                    .unwrap_or_else(|| export::RAW.to_owned());
                let staging = self.0.volumes.stage(&meta.id)?;
                meta.backing_image = Some(image.clone());
                let driver = Arc::clone(&self.0);
                let job_meta = meta.clone();
                self.0.restores.start(&meta.id, meta.clone(), async move {
                    // Held until the copy is done: the image cannot be deleted under it.
                    let _use = use_guard;
                    let id = job_meta.id.clone();
                    tracing::info!(volume = %id, image = %image, "restoring volume");
                    let mut last = std::time::Instant::now();
                    export::convert_with_progress(
                        &data,
                        &format,
                        &staging.disk(),
                        export::RAW,
                        |pct| {
                            if last.elapsed() >= std::time::Duration::from_secs(10) {
                                tracing::info!(volume = %id, percent = pct, "restoring");
                                last = std::time::Instant::now();
                            }
                        },
                    )
                    .await?;
                    let _guard = driver.controller_lock.lock().await;
                    driver.volumes.commit(staging, &job_meta, capacity)?;
                    tracing::info!(volume = %id, image = %image, capacity, "restored volume");
                    Ok(())
                });
            }
        }
        self.follow_restore(&meta, limit)
            .await?
            .ok_or_else(|| CsiError::Aborted(format!("volume {} is changing; retry", meta.id)))
    }

    /// Waits (up to `--image-wait`) for a restore of `meta.id` that is running, and returns
    /// the volume it made. `None` when no restore runs; `ABORTED` while it still does; the
    /// restore's error if it failed; `ALREADY_EXISTS` if it restores something else.
    async fn follow_restore(&self, meta: &VolumeMeta, limit: u64) -> Result<Option<Volume>> {
        let restores = &self.0.restores;
        if let Some(running) = restores.data(&meta.id) {
            if !same_request(&running, meta) {
                return Err(CsiError::AlreadyExists(format!(
                    "volume {:?} is being created with a different capacity, content source or \
                     parameters",
                    meta.name
                )));
            }
        }
        let deadline = tokio::time::Instant::now() + self.0.config.image_wait;
        match restores.wait(&meta.id, deadline).await {
            JobWait::NotRunning => Ok(None),
            JobWait::Done(Err(e)) => Err(e),
            JobWait::Done(Ok(())) => {
                let _guard = self.0.controller_lock.lock().await;
                self.existing_volume(meta, limit)
            }
            JobWait::Pending => Err(CsiError::Aborted(format!(
                "volume {} is still being restored from its snapshot; retry later",
                meta.id
            ))),
        }
    }

    /// Makes sure the BackingImage a handle names exists or is being prepared, and matches the
    /// handle.
    fn ensure_image(&self, image: &str, handle: &BiHandle, checksum: Option<&str>) -> Result<()> {
        let images = &self.0.images;
        if let Some(state) = images.store.get(image)? {
            if images.is_orphan(&state) {
                images.store.remove(image)?;
            } else {
                return check_matches(&state, handle, checksum);
            }
        }
        if let Some(failure) = images.take_failure(image) {
            return Err(failure);
        }
        // A job that is failing has removed its state but not yet said why: never start a
        // second one under the same name meanwhile.
        if images.job_running(image) {
            return Err(CsiError::Aborted(format!(
                "backing image {image} is still being prepared; retry"
            )));
        }
        match handle.source_type.as_str() {
            SOURCE_DOWNLOAD => {
                let raw = handle.params.get(KEY_URL).cloned().unwrap_or_default();
                if raw.is_empty() {
                    return Err(CsiError::InvalidArgument(format!(
                        "bi:// handle for a download of {image} has no url"
                    )));
                }
                let policy = self.0.config.download_policy();
                let url = download::check_url(&raw, &policy)?;
                let mut state = images.new_state(image, SOURCE_DOWNLOAD, handle.params.clone());
                state.expected_checksum = checksum.map(str::to_owned);
                if images.store.claim(&state)? {
                    images.start_download(state, url, policy);
                }
                Ok(())
            }
            SOURCE_EXPORT => {
                let export_type = handle
                    .params
                    .get(KEY_EXPORT_TYPE)
                    .cloned()
                    .unwrap_or_default();
                let volume = handle
                    .params
                    .get(KEY_VOLUME_NAME)
                    .cloned()
                    .unwrap_or_default();
                if export_type.is_empty() || volume.is_empty() {
                    return Err(CsiError::InvalidArgument(format!(
                        "bi:// handle for an export of {image} needs export-type and volume-name"
                    )));
                }
                check_export_type(&export_type)?;
                let mut state = images.new_state(image, SOURCE_EXPORT, handle.params.clone());
                state.expected_checksum = checksum.map(str::to_owned);
                self.start_export(state, &volume, &export_type).map(|_| ())
            }
            "upload" => Err(CsiError::InvalidArgument(
                "backing image data source type upload is not supported via CSI".into(),
            )),
            other => Err(CsiError::InvalidArgument(format!(
                "backing image data source type {other:?} is not supported; use download or \
                 export-from-volume"
            ))),
        }
    }

    /// Starts the job that cuts the volume and exports it into the image `state.name`. The
    /// state is claimed first; if another one exists already, that one is returned instead.
    /// Called under the controller lock; returns at once (the copy is the job's).
    fn start_export(
        &self,
        mut state: ImageState,
        volume: &str,
        export_type: &str,
    ) -> Result<ImageState> {
        let volume_id = disk_name("volume", volume)
            .map_err(|_| CsiError::NotFound(format!("source volume {volume:?} does not exist")))?;
        if self.0.volumes.get(&volume_id)?.is_none() {
            return Err(CsiError::NotFound(format!(
                "source volume {volume:?} does not exist"
            )));
        }
        let disk = self.0.volumes.disk(&volume_id).ok_or_else(|| {
            CsiError::NotFound(format!("source volume {volume:?} does not exist"))
        })?;
        state.virtual_size = self.0.volumes.capacity(&volume_id)?;
        state.progress.total = state.virtual_size;
        let mut quiesce = Quiesce::default();
        for p in self.0.volumes.publications(&volume_id)? {
            if p.block {
                quiesce.devices.push(p.device);
            } else {
                quiesce.mounts.push((p.target, p.device.clone()));
                quiesce.devices.push(p.device);
            }
        }
        quiesce.devices.sort();
        quiesce.devices.dedup();
        let images = &self.0.images;
        if !images.store.claim(&state)? {
            return images.store.get(&state.name)?.ok_or_else(|| {
                CsiError::Aborted(format!("backing image {} is changing; retry", state.name))
            });
        }
        images.start_export(
            state.clone(),
            ExportFrom::Volume { disk, quiesce },
            export_type.to_owned(),
        );
        Ok(state)
    }

    async fn create_snapshot(&self, req: CreateSnapshotRequest) -> Result<Snapshot> {
        let params = &req.parameters;
        match params.get("type").map(String::as_str).unwrap_or("bi") {
            "bi" | "" => {}
            kind @ ("snap" | "bak" | "bs") => {
                return Err(CsiError::InvalidArgument(format!(
                    "snapshot type {kind:?} is Longhorn's; layerfs makes only type bi \
                     (BackingImage) snapshots"
                )))
            }
            other => {
                return Err(CsiError::InvalidArgument(format!(
                    "unknown snapshot type {other:?}; layerfs supports type bi"
                )))
            }
        }
        let export_type = params
            .get("exportType")
            .or_else(|| params.get("export-type"))
            .map(String::as_str)
            .unwrap_or(export::RAW)
            .to_owned();
        check_export_type(&export_type)?;
        if req.source_volume_id.is_empty() {
            return Err(CsiError::InvalidArgument(
                "source_volume_id is required".into(),
            ));
        }
        let image = disk_name("snapshot", &req.name)?;
        let missing = || {
            CsiError::NotFound(format!(
                "source volume {:?} does not exist",
                req.source_volume_id
            ))
        };
        let volume_id = disk_name("volume", &req.source_volume_id).map_err(|_| missing())?;
        {
            let _guard = self.0.controller_lock.lock().await;
            let images = &self.0.images;
            if let Some(failure) = images.take_failure(&image) {
                return Err(failure);
            }
            // An existing image first: a snapshot already cut is answered even when its
            // source volume is gone since.
            let state = match images.store.get(&image)? {
                Some(state) if images.is_orphan(&state) => {
                    images.store.remove(&image)?;
                    None
                }
                other => other,
            };
            let state = match state {
                Some(state) => state,
                None => {
                    if self.0.volumes.get(&volume_id)?.is_none() {
                        return Err(missing());
                    }
                    let mut params = BTreeMap::new();
                    params.insert(KEY_EXPORT_TYPE.to_owned(), export_type.clone());
                    params.insert(KEY_VOLUME_NAME.to_owned(), volume_id.clone());
                    let mut new = images.new_state(&image, SOURCE_EXPORT, params);
                    new.csi_name = Some(req.name.clone());
                    self.start_export(new, &volume_id, &export_type)?
                }
            };
            let same = state.source_type == SOURCE_EXPORT
                && state.csi_name.as_deref() == Some(req.name.as_str())
                && state.parameters.get(KEY_VOLUME_NAME) == Some(&volume_id)
                && state.parameters.get(KEY_EXPORT_TYPE) == Some(&export_type);
            if !same {
                return Err(CsiError::AlreadyExists(format!(
                    "snapshot {:?} already exists as backing image {image} from another source \
                     ({} {:?})",
                    req.name, state.source_type, state.parameters
                )));
            }
        }
        // CreateSnapshot returns once the snapshot is cut (the volume's content is fixed);
        // the export goes on in the background with ready_to_use false until it is done.
        let state = match self
            .0
            .images
            .wait_cut(&image, self.0.config.image_wait)
            .await?
        {
            Wait::Ready(state) => state,
            Wait::Pending(_) => {
                return Err(CsiError::Aborted(format!(
                    "snapshot {:?} is still being cut from volume {volume_id}; retry later",
                    req.name
                )))
            }
        };
        let id = BiHandle::export(&image, &export_type, &volume_id).encode();
        Ok(snapshot_of(&state, id))
    }

    async fn delete_snapshot(&self, id: &str) -> Result<()> {
        if id.is_empty() {
            return Err(CsiError::InvalidArgument("snapshot_id is required".into()));
        }
        let Ok(handle) = BiHandle::decode(id) else {
            tracing::info!(snapshot = %id, "deleting a snapshot id that is not ours: nothing to do");
            return Ok(());
        };
        let Ok(image) = disk_name("backing image", &handle.image) else {
            return Ok(());
        };
        let _guard = self.0.controller_lock.lock().await;
        let images = &self.0.images;
        let Some(state) = images.store.get(&image)? else {
            return Ok(());
        };
        // Only the image this handle describes is deleted: another handle that happens to name
        // the same image (e.g. a download handle reusing a snapshot's name) must not remove it.
        let checksum = handle.checksum.as_deref().map(check_checksum).transpose();
        let matches = checksum.and_then(|c| check_matches(&state, &handle, c.as_deref()));
        if let Err(e) = matches {
            tracing::warn!(snapshot = %id, image = %image, reason = %e,
                "DeleteSnapshot: the handle does not describe the existing image; not deleting it");
            return Ok(());
        }
        if images.in_use(&image) {
            return Err(CsiError::FailedPrecondition(format!(
                "backing image {image} is in use: a volume is being created from it; retry when \
                 that finishes"
            )));
        }
        // This node's own work on it is cancelled by the delete; another node's cannot be.
        if !state.ready && state.node != images.node() {
            return Err(CsiError::Aborted(format!(
                "backing image {image} is still being prepared by node {} ({} of {} bytes); \
                 retry later",
                state.node, state.progress.done, state.progress.total
            )));
        }
        images.delete(&image).await?;
        tracing::info!(image = %image, "deleted backing image");
        Ok(())
    }

    async fn list_snapshots(&self, req: &ListSnapshotsRequest) -> Result<ListSnapshotsResponse> {
        let mut found: Vec<Snapshot> = Vec::new();
        if !req.snapshot_id.is_empty() {
            if let Some(snap) = self.resolve_snapshot(&req.snapshot_id).await? {
                if req.source_volume_id.is_empty() || snap.source_volume_id == req.source_volume_id
                {
                    found.push(snap);
                }
            }
        } else {
            for state in self.0.images.store.list()? {
                if !req.source_volume_id.is_empty()
                    && state.source_volume() != Some(req.source_volume_id.as_str())
                {
                    continue;
                }
                let id = state.handle();
                found.extend(self.listed(&state, id));
            }
        }
        let (entries, next_token) = page(found, req.max_entries, &req.starting_token)?;
        Ok(ListSnapshotsResponse {
            entries: entries
                .into_iter()
                .map(|s| list_snapshots_response::Entry { snapshot: Some(s) })
                .collect(),
            next_token,
        })
    }

    /// The snapshot a `bi://` id stands for: its image, when one exists and matches the
    /// handle. A download handle whose image does not exist yet (a pre-provisioned content)
    /// has its download started, and is listed not ready until the image is fetched and
    /// verified: the CO restores only from a ready snapshot, so waiting for a restore to fetch
    /// it would wait forever. Any other handle whose image does not exist (never made,
    /// deleted, or a download that failed) names no snapshot: the list is empty, as the spec
    /// wants for an unknown id.
    async fn resolve_snapshot(&self, id: &str) -> Result<Option<Snapshot>> {
        let Ok(handle) = BiHandle::decode(id) else {
            return Ok(None);
        };
        let Ok(image) = disk_name("backing image", &handle.image) else {
            return Ok(None);
        };
        let checksum = match handle.checksum.as_deref().map(check_checksum).transpose() {
            Ok(c) => c,
            Err(_) => return Ok(None),
        };
        let mut state = self.0.images.store.get(&image)?;
        if state.is_none() && handle.source_type == SOURCE_DOWNLOAD {
            let _guard = self.0.controller_lock.lock().await;
            match self.ensure_image(&image, &handle, checksum.as_deref()) {
                Ok(()) => state = self.0.images.store.get(&image)?,
                // A refused URL, or the failure of the last attempt (said once; the next
                // call tries again): no snapshot, and the log says why.
                Err(e) => {
                    tracing::info!(image = %image, error = %e, "listed snapshot cannot be prepared")
                }
            }
        }
        let Some(state) = state else {
            return Ok(None);
        };
        if check_matches(&state, &handle, checksum.as_deref()).is_err() {
            return Ok(None);
        }
        Ok(self.listed(&state, id.to_owned()))
    }

    /// How an image is listed: not at all while its export is still being cut (it is no
    /// snapshot yet); ready only when its file is complete, checksummed and still there.
    fn listed(&self, state: &ImageState, snapshot_id: String) -> Option<Snapshot> {
        if state.source_type == SOURCE_EXPORT && !state.cut && !state.ready {
            return None;
        }
        let mut snap = snapshot_of(state, snapshot_id);
        snap.ready_to_use = self.checks_out(state);
        Some(snap)
    }

    /// Whether a ready image's file is there, as it was when it was verified: the size its
    /// checksum was computed over. The checksum itself is not recomputed on every call.
    fn checks_out(&self, state: &ImageState) -> bool {
        if !state.ready || state.current_checksum.is_none() {
            return false;
        }
        let Some(path) = self.0.images.store.data_path(&state.name) else {
            return false;
        };
        match std::fs::metadata(&path) {
            Ok(meta) if meta.is_file() && meta.len() == state.size => true,
            Ok(meta) => {
                tracing::warn!(image = %state.name, size = meta.len(), expected = state.size,
                    "backing image file changed since it was verified; listed as not ready");
                false
            }
            Err(e) => {
                tracing::warn!(image = %state.name, error = %e,
                    "backing image file is missing; listed as not ready");
                false
            }
        }
    }
}

/// Whether two CreateVolume requests for one volume id ask for the same volume.
fn same_request(a: &VolumeMeta, b: &VolumeMeta) -> bool {
    a.name == b.name
        && round_up(a.requested) == round_up(b.requested)
        && a.content_source == b.content_source
        && a.parameters == b.parameters
}

/// Checks that an existing image is the one a handle describes.
fn check_matches(state: &ImageState, handle: &BiHandle, checksum: Option<&str>) -> Result<()> {
    if state.source_type != handle.source_type {
        return Err(CsiError::InvalidArgument(format!(
            "backing image {} exists with data source type {}, but the handle says {}",
            state.name, state.source_type, handle.source_type
        )));
    }
    if !handle.params.is_empty() && handle.params != state.parameters {
        return Err(CsiError::InvalidArgument(format!(
            "backing image {} exists with different data source parameters ({:?}) than the \
             handle's ({:?})",
            state.name, state.parameters, handle.params
        )));
    }
    if let Some(sum) = checksum {
        for known in [&state.current_checksum, &state.expected_checksum]
            .into_iter()
            .flatten()
        {
            if known != sum {
                return Err(CsiError::InvalidArgument(format!(
                    "backing image {} has checksum {known}, but the handle asks for {sum}",
                    state.name
                )));
            }
        }
    }
    Ok(())
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
        let stat = nix::sys::statvfs::statvfs(self.0.volumes.root())
            .map_err(|e| Status::internal(format!("statvfs of the volume store: {e}")))?;
        let available =
            (stat.blocks_available() as u64).saturating_mul(stat.fragment_size() as u64);
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
            self.0.volumes.grow(&req.volume_id, target)?
        };
        tracing::info!(volume = %req.volume_id, capacity, "expanded volume");
        Ok(Response::new(ControllerExpandVolumeResponse {
            capacity_bytes: i64::try_from(capacity).unwrap_or(i64::MAX),
            node_expansion_required: true,
        }))
    }
}
