//! Snapshots that are BackingImages: making sure an image exists or is being prepared,
//! CreateSnapshot, DeleteSnapshot and ListSnapshots.

use super::*;

impl ControllerService {
    /// Makes sure the BackingImage a handle names exists or is being prepared, and matches the
    /// handle.
    pub(super) fn ensure_image(
        &self,
        image: &str,
        handle: &BiHandle,
        checksum: Option<&str>,
    ) -> Result<()> {
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
    pub(super) fn start_export(
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

    pub(super) async fn create_snapshot(&self, req: CreateSnapshotRequest) -> Result<Snapshot> {
        let params = &req.parameters;
        check_parameters("VolumeSnapshotClass", params, &SNAPSHOT_PARAMETERS)?;
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

    pub(super) async fn delete_snapshot(&self, id: &str) -> Result<()> {
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
        let Some(state) = images.store.recorded(&image)? else {
            // A snapshot whose state file was corrupt left only quarantined files: free them.
            let freed = images.store.remove_quarantined(&image)?;
            if freed > 0 {
                tracing::info!(image = %image, files = freed,
                    "deleted the quarantined files of a backing image");
            }
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

    pub(super) async fn list_snapshots(
        &self,
        req: &ListSnapshotsRequest,
    ) -> Result<ListSnapshotsResponse> {
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
    pub(super) async fn resolve_snapshot(&self, id: &str) -> Result<Option<Snapshot>> {
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
    pub(super) fn listed(&self, state: &ImageState, snapshot_id: String) -> Option<Snapshot> {
        if state.source_type == SOURCE_EXPORT && !state.cut && !state.ready {
            return None;
        }
        let mut snap = snapshot_of(state, snapshot_id);
        snap.ready_to_use = self.checks_out(state);
        Some(snap)
    }

    /// Whether a ready image's file is there, as it was when it was verified: the size its
    /// checksum was computed over. The checksum itself is not recomputed on every call.
    pub(super) fn checks_out(&self, state: &ImageState) -> bool {
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

/// Checks that an existing image is the one a handle describes.
pub(super) fn check_matches(
    state: &ImageState,
    handle: &BiHandle,
    checksum: Option<&str>,
) -> Result<()> {
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

pub(super) fn snapshot_of(state: &ImageState, snapshot_id: String) -> Snapshot {
    Snapshot {
        size_bytes: i64::try_from(state.virtual_size).unwrap_or(i64::MAX),
        snapshot_id,
        source_volume_id: state.source_volume().unwrap_or_default().to_owned(),
        creation_time: Some(timestamp(state.created)),
        ready_to_use: state.ready,
        group_snapshot_id: String::new(),
    }
}

pub(super) fn timestamp(secs: i64) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: secs,
        nanos: 0,
    }
}
