//! CreateVolume: new empty volumes, and volumes restored from a BackingImage (whose image is
//! produced first when it does not exist yet).

use super::snapshots::check_matches;
use super::*;

impl ControllerService {
    pub(super) fn volume_response(&self, meta: &VolumeMeta, capacity: u64) -> Volume {
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

    pub(super) async fn create_volume(&self, req: CreateVolumeRequest) -> Result<Volume> {
        let id = disk_name("volume", &req.name)?;
        if req.volume_capabilities.is_empty() {
            return Err(CsiError::InvalidArgument(
                "volume_capabilities are required".into(),
            ));
        }
        for cap in &req.volume_capabilities {
            check_capability(cap).map_err(CsiError::InvalidArgument)?;
        }
        check_parameters("StorageClass", &req.parameters, &VOLUME_PARAMETERS)?;
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
                self.admit(capacity)?;
                let staging = self.0.volumes.stage(&id, capacity)?;
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
    pub(super) fn existing_volume(&self, meta: &VolumeMeta, limit: u64) -> Result<Option<Volume>> {
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
    pub(super) async fn restore_volume(
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
                self.admit(capacity)?;
                let staging = self.0.volumes.stage(&meta.id, capacity)?;
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
                        None,
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
    pub(super) async fn follow_restore(
        &self,
        meta: &VolumeMeta,
        limit: u64,
    ) -> Result<Option<Volume>> {
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
}

/// Whether two CreateVolume requests for one volume id ask for the same volume.
pub(super) fn same_request(a: &VolumeMeta, b: &VolumeMeta) -> bool {
    a.name == b.name
        && round_up(a.requested) == round_up(b.requested)
        && a.content_source == b.content_source
        && a.parameters == b.parameters
}
