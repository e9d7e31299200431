//! What changed between two indexes, in the two vocabularies a round needs: objects (for the
//! report) and directory entries of the layout (for the kernel's caches).

use std::collections::BTreeSet;

use crate::layout::{Fingerprint, LayoutIndex, Part};
use crate::report::{Kind, ObjectRef};
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
    ///
    /// Both indexes list their objects in id order, so they are walked side by side: the
    /// cost is one comparison per object, and allocations only for what differs.
    pub fn between(old: &LayoutIndex, new: &LayoutIndex) -> Diff {
        let mut d = Diff::default();
        // Short ids whose `l/<short>` entry may lead elsewhere now: those of layers added,
        // removed or changed (a changed `link` changes the fingerprint). A short whose
        // owner is ready and unchanged in both indexes keeps its entry.
        let mut shorts: BTreeSet<&str> = BTreeSet::new();
        for pair in side_by_side(
            old.layers_with_fingerprints(),
            new.layers_with_fingerprints(),
            |(l, _)| l.id.as_str(),
        ) {
            match pair {
                (Some((l, _)), None) => {
                    let id = &l.id;
                    d.removed.push(layer(id));
                    d.layer_names(id);
                    d.relinked.insert((ZoneKey::DriverHome, id.clone()));
                    d.relinked.insert((ZoneKey::LayersHome, id.clone()));
                    shorts.insert(&l.short);
                }
                (None, Some((l, _))) => {
                    d.added.push(layer(&l.id));
                    d.layer_names(&l.id);
                    shorts.insert(&l.short);
                }
                // The same object in both (a scanner shares what it did not judge again)
                // is unchanged without a look at its fingerprint.
                (Some((o, a)), Some((n, b))) if !std::ptr::eq(o, n) && differ(a, b) => {
                    let id = &n.id;
                    d.changed.push(layer(id));
                    if recreated(a, b, &[Part::OverlayDir, Part::LayerDir]) {
                        d.names.insert((ZoneKey::DriverRo, id.clone()));
                        d.names.insert((ZoneKey::LayersRo, id.clone()));
                    } else {
                        d.touched.insert((ZoneKey::DriverRo, id.clone()));
                        d.touched.insert((ZoneKey::LayersRo, id.clone()));
                    }
                    shorts.insert(&o.short);
                    shorts.insert(&n.short);
                }
                _ => {}
            }
        }

        // `l/<short>` entries follow the short ids, which a changed `link` moves.
        for short in shorts {
            let before = old.layer_by_short(short).map(|l| &l.id);
            if before != new.layer_by_short(short).map(|l| &l.id) {
                d.names.insert((ZoneKey::Links, short.to_owned()));
                if before.is_some() {
                    d.relinked.insert((ZoneKey::Links, short.to_owned()));
                }
            }
        }

        for pair in side_by_side(
            old.images_with_fingerprints(),
            new.images_with_fingerprints(),
            |(i, _)| i.id.as_str(),
        ) {
            match pair {
                (Some((i, _)), None) => {
                    d.removed.push(image(&i.id));
                    d.names.insert((ZoneKey::Images, i.id.clone()));
                }
                (None, Some((i, _))) => {
                    d.added.push(image(&i.id));
                    d.names.insert((ZoneKey::Images, i.id.clone()));
                }
                (Some((o, a)), Some((i, b))) if !std::ptr::eq(o, i) && differ(a, b) => {
                    d.changed.push(image(&i.id));
                    if recreated(a, b, &[Part::ImageDir]) {
                        d.names.insert((ZoneKey::Images, i.id.clone()));
                    } else {
                        d.touched.insert((ZoneKey::Images, i.id.clone()));
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

/// Pairs the items of two id-ordered sequences by id: `(Some, None)` for one only in `a`,
/// `(None, Some)` for one only in `b`, both for one in each.
fn side_by_side<'a, T: Copy + 'a>(
    a: impl Iterator<Item = T>,
    b: impl Iterator<Item = T>,
    key: impl Fn(&T) -> &'a str + Copy,
) -> impl Iterator<Item = (Option<T>, Option<T>)> {
    let mut a = a.peekable();
    let mut b = b.peekable();
    std::iter::from_fn(move || {
        let take_a = match (a.peek(), b.peek()) {
            (None, None) => return None,
            (Some(_), None) => true,
            (None, Some(_)) => false,
            (Some(x), Some(y)) => key(x) <= key(y),
        };
        let take_b = match (a.peek(), b.peek()) {
            (Some(x), Some(y)) => key(y) <= key(x),
            (None, Some(_)) => true,
            _ => false,
        };
        Some((
            if take_a { a.next() } else { None },
            if take_b { b.next() } else { None },
        ))
    })
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
