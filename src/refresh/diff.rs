//! What changed between two indexes, in the two vocabularies a round needs: objects (for the
//! report) and directory entries of the layout (for the kernel's caches).

use std::collections::{BTreeMap, BTreeSet};

use super::report::{Kind, ObjectRef};
use crate::layout::{Fingerprint, LayoutIndex, Part};
use crate::view::Zone;

/// The difference between the index the kernel was told about and the new one.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Diff {
    pub added: Vec<ObjectRef>,
    pub removed: Vec<ObjectRef>,
    /// Ready in both, but their metadata files (or their directory) are not the same.
    pub changed: Vec<ObjectRef>,
    /// Entries of layout directories that appeared, disappeared or now lead elsewhere: the
    /// kernel's dentry (positive or negative) for each must go.
    pub names: BTreeSet<(ZoneKey, String)>,
    /// Synthesized symlinks that disappeared or now point elsewhere: their numbers must not
    /// be reused for the new target.
    pub relinked: BTreeSet<(ZoneKey, String)>,
    /// Objects whose directory stayed but whose files changed: the directory and the files
    /// the kernel knows must be re-read.
    pub touched: BTreeSet<(ZoneKey, String)>,
}

/// A layout directory, orderable (for the sets above).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ZoneKey {
    DriverHome,
    DriverRo,
    Links,
    LayersHome,
    LayersRo,
    Images,
}

impl ZoneKey {
    pub fn zone(self) -> Zone {
        match self {
            ZoneKey::DriverHome => Zone::DriverHome,
            ZoneKey::DriverRo => Zone::DriverRo,
            ZoneKey::Links => Zone::Links,
            ZoneKey::LayersHome => Zone::LayersHome,
            ZoneKey::LayersRo => Zone::LayersRo,
            ZoneKey::Images => Zone::Images,
        }
    }
}

impl Diff {
    pub fn is_empty(&self) -> bool {
        self.added.is_empty()
            && self.removed.is_empty()
            && self.changed.is_empty()
            && self.names.is_empty()
    }

    /// Compares `old` (what the kernel may have cached) with `new`.
    pub fn between(old: &LayoutIndex, new: &LayoutIndex) -> Diff {
        let mut d = Diff::default();
        let old_layers: BTreeSet<&str> = old.layers().map(|l| l.id.as_str()).collect();
        let new_layers: BTreeSet<&str> = new.layers().map(|l| l.id.as_str()).collect();
        for id in old_layers.union(&new_layers) {
            let id = (*id).to_owned();
            match (old.layer_fingerprint(&id), new.layer_fingerprint(&id)) {
                (Some(_), None) => {
                    d.removed.push(layer(&id));
                    d.layer_names(&id);
                    d.relinked.insert((ZoneKey::DriverHome, id.clone()));
                    d.relinked.insert((ZoneKey::LayersHome, id.clone()));
                }
                (None, Some(_)) => {
                    d.added.push(layer(&id));
                    d.layer_names(&id);
                }
                (Some(a), Some(b)) if differ(a, b) => {
                    d.changed.push(layer(&id));
                    if recreated(a, b, &[Part::OverlayDir, Part::LayerDir]) {
                        d.names.insert((ZoneKey::DriverRo, id.clone()));
                        d.names.insert((ZoneKey::LayersRo, id.clone()));
                    } else {
                        d.touched.insert((ZoneKey::DriverRo, id.clone()));
                        d.touched.insert((ZoneKey::LayersRo, id.clone()));
                    }
                }
                _ => {}
            }
        }

        // `l/<short>` entries follow the short ids, which a changed `link` moves.
        let shorts = |index: &LayoutIndex| -> BTreeMap<String, String> {
            index
                .layers()
                .map(|l| (l.short.clone(), l.id.clone()))
                .collect()
        };
        let (old_shorts, new_shorts) = (shorts(old), shorts(new));
        for short in old_shorts.keys().chain(new_shorts.keys()) {
            let before = old_shorts.get(short);
            if before != new_shorts.get(short) {
                d.names.insert((ZoneKey::Links, short.clone()));
                if before.is_some() {
                    d.relinked.insert((ZoneKey::Links, short.clone()));
                }
            }
        }

        let old_images: BTreeSet<&str> = old.images().map(|i| i.id.as_str()).collect();
        let new_images: BTreeSet<&str> = new.images().map(|i| i.id.as_str()).collect();
        for id in old_images.union(&new_images) {
            let id = (*id).to_owned();
            match (old.image_fingerprint(&id), new.image_fingerprint(&id)) {
                (Some(_), None) => {
                    d.removed.push(image(&id));
                    d.names.insert((ZoneKey::Images, id));
                }
                (None, Some(_)) => {
                    d.added.push(image(&id));
                    d.names.insert((ZoneKey::Images, id));
                }
                (Some(a), Some(b)) if differ(a, b) => {
                    d.changed.push(image(&id));
                    if recreated(a, b, &[Part::ImageDir]) {
                        d.names.insert((ZoneKey::Images, id));
                    } else {
                        d.touched.insert((ZoneKey::Images, id));
                    }
                }
                _ => {}
            }
        }
        d
    }

    fn layer_names(&mut self, id: &str) {
        for zone in [
            ZoneKey::DriverHome,
            ZoneKey::DriverRo,
            ZoneKey::LayersHome,
            ZoneKey::LayersRo,
        ] {
            self.names.insert((zone, id.to_owned()));
        }
    }
}

fn layer(id: &str) -> ObjectRef {
    ObjectRef {
        kind: Kind::Layer,
        id: id.to_owned(),
    }
}

fn image(id: &str) -> ObjectRef {
    ObjectRef {
        kind: Kind::Image,
        id: id.to_owned(),
    }
}

/// "Changed": a metadata file differs, or a directory was replaced (deleted and created
/// again between two rounds, which a file comparison alone can miss when the new files
/// happen to get the old inode numbers).
fn differ(a: &Fingerprint, b: &Fingerprint) -> bool {
    a.files_differ(b) || recreated(a, b, &[Part::OverlayDir, Part::LayerDir, Part::ImageDir])
}

fn recreated(a: &Fingerprint, b: &Fingerprint, dirs: &[Part]) -> bool {
    dirs.iter()
        .any(|p| a.get(*p).map(|s| s.ino) != b.get(*p).map(|s| s.ino))
}
