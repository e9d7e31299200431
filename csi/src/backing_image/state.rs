//! The state file of a BackingImage: what the image is made from, its checksums and sizes,
//! and how far its preparation got. Every node that shares the images directory reads it, so
//! its fields are a format on disk (DESIGN §7): a field added later needs a default, or the
//! state files written before it no longer decode and are quarantined.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::handle::{BiHandle, KEY_EXPORT_TYPE, KEY_VOLUME_NAME, SOURCE_EXPORT};

/// Bytes done out of a total (0 when unknown).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Progress {
    pub done: u64,
    pub total: u64,
}

/// The state file of one BackingImage.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ImageState {
    pub name: String,
    /// The CSI snapshot name it was created for (CreateSnapshot), if any.
    #[serde(default)]
    pub csi_name: Option<String>,
    /// `export-from-volume` or `download`.
    pub source_type: String,
    /// The data-source parameters (`export-type` + `volume-name`, or `url`).
    pub parameters: BTreeMap<String, String>,
    #[serde(default)]
    pub expected_checksum: Option<String>,
    #[serde(default)]
    pub current_checksum: Option<String>,
    /// `raw` or `qcow2`, once known.
    #[serde(default)]
    pub format: Option<String>,
    /// Size of the image file in bytes, once ready.
    pub size: u64,
    /// Size of the disk the image holds; for an export, known from the start.
    pub virtual_size: u64,
    /// Seconds since the epoch; set once, returned on every call.
    pub created: i64,
    pub progress: Progress,
    /// For an export: the point-in-time copy of the volume is taken (the snapshot is cut).
    #[serde(default)]
    pub cut: bool,
    /// The preparation finished (the image was complete and verified then). Whether it still
    /// checks out is [`ImageState::quarantined`].
    pub ready: bool,
    /// The node preparing (or that prepared) the image.
    pub node: String,
    /// Why the image failed verification after it was made, and where its file went. Such an
    /// image is never restored from nor reported ready; deleting its snapshot frees it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quarantined: Option<String>,
}

impl ImageState {
    /// The snapshot handle that names this image.
    pub fn handle(&self) -> String {
        let mut params = self.parameters.clone();
        if self.source_type == SOURCE_EXPORT {
            params.retain(|k, _| k == KEY_EXPORT_TYPE || k == KEY_VOLUME_NAME);
        }
        BiHandle {
            image: self.name.clone(),
            source_type: self.source_type.clone(),
            checksum: self.expected_checksum.clone(),
            params,
        }
        .encode()
    }

    /// The volume an exported image came from.
    pub fn source_volume(&self) -> Option<&str> {
        (self.source_type == SOURCE_EXPORT)
            .then(|| self.parameters.get(KEY_VOLUME_NAME).map(String::as_str))
            .flatten()
    }
}
