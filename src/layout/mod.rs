//! The remote tree as iSulad's remote-layer store lays it out, reduced to what is *ready*.
//!
//! A writer host running iSulad with `storage-enable-remote-layer` puts every image layer in
//! two shared directories, `<driver>/RO/<id>/` (the overlay dir: `diff/`, `link`, `lower`) and
//! `<driver>-layers/RO/<id>/` (`layer.json`, the tar-split), and every image in
//! `<driver>-images/<id>/` (`images.json`, `manifest`, the config). [`LayoutIndex::scan`] reads
//! those three areas, and nothing else in the remote root, and keeps the objects that are
//! *ready*: complete and consistent enough that a runtime on this host can use them.
//!
//! The scan works in two stages:
//!
//! 1. Each object directory is checked on its own (`scan`): names must be ids, files are read
//!    without following symlinks and with size caps, JSON must parse and name the right id, an
//!    image layer's tar-split must be a complete gzip stream.
//! 2. Objects are then judged together (`readiness`): a layer needs both of its directories,
//!    agreeing with each other, and a ready parent, whose `lower` chain it must extend exactly;
//!    an image needs a ready top layer. Chains are walked iteratively with cycle detection, so
//!    no remote content can make the scan loop or recurse without bound.
//!
//! Objects with an id-like name that fail a rule are listed in [`LayoutIndex::not_ready`] with
//! a reason an operator can act on; garbage (temporary files, other names) is skipped.
//!
//! # Why stricter than iSulad
//!
//! iSulad trusts its own writes: it loads a layer whose `layer.json` parses and whose files
//! exist, and repairs or deletes what it finds broken. A reader cannot repair a shared tree it
//! does not own, and the writer may be mid-pull while we look. So we only show what a runtime
//! could use right now: a layer whose tar-split is still being written, whose parent is gone
//! or whose `lower` disagrees with its metadata stays hidden until the writer finishes. The
//! daemon runs as root, so a symlink anywhere in an object is refused rather than followed.
//!
//! The index is a plain immutable value. Every ready object carries a [`Fingerprint`] of its
//! directories and metadata files, so two indexes can be compared object by object.
//!
//! [`LayoutIndex::scan`] reads everything once. A mount that follows the remote uses a
//! [`Scanner`] instead, which remembers what it read and, on the next scan, reads only the
//! directories and objects whose stamps changed (see `incremental`).

mod area;
mod fingerprint;
mod incremental;
mod isulad;
mod nofollow;
mod readiness;
mod rejudge;
mod scan;
pub mod watch;

#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

pub use area::{ScanFailure, ScanStats};
pub use fingerprint::{Fingerprint, Part, Stamp};
pub use incremental::{Scanner, RACY_MARGIN};
pub(crate) use isulad::config_file_name as isulad_config_file_name;
pub(crate) use isulad::{is_object_id, is_short_id};
pub use nofollow::{note_shortage, ran_short};

/// The most parents a layer may have: overlayfs stacks at most this many lower dirs as
/// iSulad mounts them (`OVERLAY_LAYER_MAX_DEPTH`).
pub const MAX_LOWER_DEPTH: usize = 128;

/// A remote layer that passed every readiness rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layer {
    /// 64 lowercase hex: the directory name under both layer areas.
    pub id: String,
    /// The content of `link`, without a trailing newline: the name of `l/<short>`.
    pub short: String,
    /// The parent layer's id; `None` for a base layer.
    pub parent: Option<String>,
    /// Modification time of `<driver>/RO/<id>/`.
    pub mtime: SystemTime,
}

/// A remote image that passed every readiness rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Image {
    /// 64 lowercase hex: the image directory name and config digest.
    pub id: String,
    /// The `layer` field of `images.json`.
    pub top_layer: String,
    /// Repository tags and digests from `images.json`.
    pub names: Vec<String>,
    /// Modification time of `<driver>-images/<id>/`.
    pub mtime: SystemTime,
}

/// Where the directories of some objects are, by id, for [`LayoutIndex::judge`].
#[derive(Debug, Default, Clone)]
pub struct ObjectDirs {
    /// `<driver>/RO/<id>/` of each layer: `diff/`, `link`, `lower`.
    pub overlay: BTreeMap<String, PathBuf>,
    /// `<driver>-layers/RO/<id>/` of each layer: `layer.json` and the tar-split.
    pub layers: BTreeMap<String, PathBuf>,
    /// `<driver>-images/<id>/` of each image.
    pub images: BTreeMap<String, PathBuf>,
}

/// What a [`NotReady`] entry describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ObjectKind {
    Layer,
    Image,
}

/// An object that looks like a layer or image but is not ready, or an area that could not be
/// read (then `name` is the area's path relative to the remote root).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotReady {
    pub kind: ObjectKind,
    pub name: String,
    pub reason: String,
}

/// A ready object and the fingerprint of its files.
#[derive(Debug, Clone)]
struct Ready<T> {
    value: T,
    fingerprint: Fingerprint,
}

/// The ready layers and images of one remote tree, as of one scan.
///
/// Iteration is in id order, so two scans of an unchanged tree list the same objects in the
/// same order.
///
/// Objects are shared between indexes: a scanner derives each new index from the last one,
/// replacing only what changed, so a clone costs a reference count per object and two
/// indexes of one scanner hold the very same object where it did not change.
#[derive(Debug, Default, Clone)]
pub struct LayoutIndex {
    driver: String,
    layers: BTreeMap<Arc<str>, Arc<Ready<Layer>>>,
    by_short: BTreeMap<Arc<str>, Arc<str>>,
    images: BTreeMap<Arc<str>, Arc<Ready<Image>>>,
    not_ready: Arc<Vec<NotReady>>,
}

impl LayoutIndex {
    /// Scans the shared areas of `remote_root` for graph driver `driver` (normally
    /// `"overlay"`).
    ///
    /// Never fails and never panics: an area that cannot be read contributes nothing and is
    /// reported in [`not_ready`](Self::not_ready); a missing area is simply empty. Each
    /// not-ready object is logged at info level.
    pub fn scan(remote_root: &Path, driver: &str) -> LayoutIndex {
        let index = if is_driver_name(driver) {
            let facts = scan::collect(remote_root, driver);
            readiness::resolve(readiness::FactsRef::of(&facts), driver)
        } else {
            LayoutIndex::invalid_driver(driver)
        };
        for nr in index.not_ready.iter() {
            tracing::info!(kind = ?nr.kind, name = %nr.name, reason = %nr.reason, "remote object not ready");
        }
        index
    }

    /// Judges the objects whose directories `dirs` names, and only those, by the rules
    /// [`scan`](Self::scan) applies to a whole remote tree.
    ///
    /// For a tree that is not laid out as a remote, or for a few objects of one: a writer
    /// host's own storage root reaches its layers through `<driver>/<id>` symlinks, and a
    /// publisher checks the objects it has just placed without reading the rest. Each named
    /// directory is opened following symlinks (the caller chose the path); nothing below it
    /// is followed. A layer is judged with the objects `dirs` holds, so its parent chain
    /// must be in `dirs` too, or it is not ready.
    pub fn judge(dirs: &ObjectDirs, driver: &str) -> LayoutIndex {
        if !is_driver_name(driver) {
            return LayoutIndex::invalid_driver(driver);
        }
        let facts = scan::collect_dirs(dirs, driver);
        readiness::resolve(readiness::FactsRef::of(&facts), driver)
    }

    /// A driver name becomes a single path component of every area; anything that could
    /// climb out of the remote root yields an empty index.
    fn invalid_driver(driver: &str) -> LayoutIndex {
        LayoutIndex {
            driver: driver.to_owned(),
            not_ready: Arc::new(vec![NotReady {
                kind: ObjectKind::Layer,
                name: driver.escape_debug().to_string(),
                reason: "invalid graph driver name".to_owned(),
            }]),
            ..LayoutIndex::default()
        }
    }

    /// The graph driver this index was scanned for.
    pub fn driver(&self) -> &str {
        &self.driver
    }

    /// The ready layer `id`.
    pub fn layer(&self, id: &str) -> Option<&Layer> {
        self.layers.get(id).map(|r| &r.value)
    }

    /// The ready layer whose `link` holds `short`: the target of `<driver>/l/<short>`.
    pub fn layer_by_short(&self, short: &str) -> Option<&Layer> {
        self.by_short.get(short).and_then(|id| self.layer(id))
    }

    /// The ready image `id`.
    pub fn image(&self, id: &str) -> Option<&Image> {
        self.images.get(id).map(|r| &r.value)
    }

    /// Ready layers in id order.
    pub fn layers(&self) -> impl Iterator<Item = &Layer> {
        self.layers.values().map(|r| &r.value)
    }

    /// Ready images in id order.
    pub fn images(&self) -> impl Iterator<Item = &Image> {
        self.images.values().map(|r| &r.value)
    }

    /// Objects and areas that are not ready, sorted by kind then name.
    pub fn not_ready(&self) -> &[NotReady] {
        &self.not_ready
    }

    /// Ready layers in id order, each with its fingerprint: for walking two indexes side
    /// by side without a lookup per layer.
    pub fn layers_with_fingerprints(&self) -> impl Iterator<Item = (&Layer, &Fingerprint)> {
        self.layers.values().map(|r| (&r.value, &r.fingerprint))
    }

    /// Ready images in id order, each with its fingerprint.
    pub fn images_with_fingerprints(&self) -> impl Iterator<Item = (&Image, &Fingerprint)> {
        self.images.values().map(|r| (&r.value, &r.fingerprint))
    }

    /// The fingerprint of a ready layer's two directories and their files.
    pub fn layer_fingerprint(&self, id: &str) -> Option<&Fingerprint> {
        self.layers.get(id).map(|r| &r.fingerprint)
    }

    /// The fingerprint of a ready image's directory and files.
    pub fn image_fingerprint(&self, id: &str) -> Option<&Fingerprint> {
        self.images.get(id).map(|r| &r.fingerprint)
    }
}

fn is_driver_name(driver: &str) -> bool {
    !driver.is_empty() && driver != "." && driver != ".." && !driver.contains(['/', '\0'])
}
