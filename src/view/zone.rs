//! Where in the view a directory sits, and what the remote tree and the synthesized
//! layout may contribute there (DESIGN §4).
//!
//! Only three areas of the remote root are shared: `<driver>/RO/<id>/`,
//! `<driver>-layers/RO/<id>/` and `<driver>-images/<id>/`, and only for ready ids. The
//! directories above them form a fixed skeleton that always exists in the view; the
//! `<driver>/<id>`, `<driver>-layers/<id>` and `<driver>/l/<short>` symlinks are
//! synthesized from the layout index. Everything else of the remote is invisible.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use crate::layout::LayoutIndex;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Zone {
    /// The mount's root.
    Root,
    /// `<driver>/`
    DriverHome,
    /// `<driver>/RO/`
    DriverRo,
    /// `<driver>/l/`
    Links,
    /// `<driver>-layers/`
    LayersHome,
    /// `<driver>-layers/RO/`
    LayersRo,
    /// `<driver>-images/`
    Images,
    /// Inside a ready remote layer or image: the remote content merges with local.
    Shared,
    /// Anywhere else: local only.
    Private,
}

/// How synthesized `<driver>/<id>` links point at their `RO/<id>` directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LinkStyle {
    /// `<mountpoint>/<driver>/RO/<id>`, as iSulad creates them.
    #[default]
    Absolute,
    /// `RO/<id>`: still valid if the view is bind-mounted elsewhere.
    Relative,
}

/// The names of the driver's directories, and where synthesized links point.
#[derive(Debug, Clone)]
pub struct Layout {
    pub driver: String,
    pub layers: String,
    pub images: String,
    pub mountpoint: PathBuf,
    pub link_style: LinkStyle,
}

impl Layout {
    pub fn new(driver: &str, mountpoint: &Path, link_style: LinkStyle) -> Layout {
        Layout {
            driver: driver.to_owned(),
            layers: format!("{driver}-layers"),
            images: format!("{driver}-images"),
            mountpoint: mountpoint.to_owned(),
            link_style,
        }
    }

    /// The zone of `name` inside a directory of zone `parent`.
    pub fn child_zone(&self, parent: Zone, name: &OsStr, index: &LayoutIndex) -> Zone {
        let name = name.as_bytes();
        match parent {
            Zone::Root if name == self.driver.as_bytes() => Zone::DriverHome,
            Zone::Root if name == self.layers.as_bytes() => Zone::LayersHome,
            Zone::Root if name == self.images.as_bytes() => Zone::Images,
            Zone::DriverHome if name == b"RO" => Zone::DriverRo,
            Zone::DriverHome if name == b"l" => Zone::Links,
            Zone::LayersHome if name == b"RO" => Zone::LayersRo,
            Zone::DriverRo | Zone::LayersRo if is_layer(index, name) => Zone::Shared,
            Zone::Images if is_image(index, name) => Zone::Shared,
            Zone::Shared => Zone::Shared,
            _ => Zone::Private,
        }
    }

    /// Whether the remote entry `name` of a directory of zone `parent` shows in the view.
    pub fn remote_visible(&self, parent: Zone, name: &OsStr, index: &LayoutIndex) -> bool {
        match self.child_zone(parent, name, index) {
            Zone::Private => false,
            // The writer's own `l/` links point into its own tree; ours are synthesized.
            Zone::Links => false,
            _ => parent.merges_remote(),
        }
    }

    /// Where in the remote tree the area a directory of `zone` lists lies, as path
    /// components from the remote root; empty for other zones.
    pub fn remote_area(&self, zone: Zone) -> Vec<&str> {
        match zone {
            Zone::DriverRo => vec![&self.driver, "RO"],
            Zone::LayersRo => vec![&self.layers, "RO"],
            Zone::Images => vec![&self.images],
            _ => Vec::new(),
        }
    }

    /// The ids of the shared objects an area directory of `zone` lists.
    pub fn shared_ids(&self, zone: Zone, index: &LayoutIndex) -> Vec<String> {
        match zone {
            Zone::DriverRo | Zone::LayersRo => index.layers().map(|l| l.id.clone()).collect(),
            Zone::Images => index.images().map(|i| i.id.clone()).collect(),
            _ => Vec::new(),
        }
    }

    /// The skeleton directories that always exist inside a directory of this zone.
    pub fn skeleton(&self, zone: Zone) -> &'static [&'static str] {
        match zone {
            Zone::DriverHome => &["RO", "l"],
            Zone::LayersHome => &["RO"],
            _ => &[],
        }
    }

    /// Like [`Layout::skeleton`], for the root, whose names depend on the driver.
    pub fn root_skeleton(&self) -> [&str; 3] {
        [&self.driver, &self.layers, &self.images]
    }

    pub fn is_skeleton(&self, parent: Zone, name: &OsStr) -> bool {
        match parent {
            Zone::Root => self
                .root_skeleton()
                .iter()
                .any(|s| s.as_bytes() == name.as_bytes()),
            _ => self
                .skeleton(parent)
                .iter()
                .any(|s| s.as_bytes() == name.as_bytes()),
        }
    }

    /// The target of the synthesized symlink `name` in a directory of zone `parent`.
    pub fn virtual_link(&self, parent: Zone, name: &OsStr, index: &LayoutIndex) -> Option<Vec<u8>> {
        let name = name.to_str()?;
        match parent {
            Zone::DriverHome => index
                .layer(name)
                .map(|l| self.ro_target(&self.driver, &l.id)),
            Zone::LayersHome => index
                .layer(name)
                .map(|l| self.ro_target(&self.layers, &l.id)),
            Zone::Links => index
                .layer_by_short(name)
                .map(|l| format!("../{}/diff", l.id).into_bytes()),
            _ => None,
        }
    }

    /// Names of all synthesized symlinks in a directory of zone `zone`.
    pub fn virtual_links(&self, zone: Zone, index: &LayoutIndex) -> Vec<String> {
        match zone {
            Zone::DriverHome | Zone::LayersHome => index.layers().map(|l| l.id.clone()).collect(),
            Zone::Links => index.layers().map(|l| l.short.clone()).collect(),
            _ => Vec::new(),
        }
    }

    fn ro_target(&self, home: &str, id: &str) -> Vec<u8> {
        match self.link_style {
            LinkStyle::Absolute => {
                let mut p = self.mountpoint.join(home);
                p.push("RO");
                p.push(id);
                p.into_os_string().into_vec()
            }
            LinkStyle::Relative => format!("RO/{id}").into_bytes(),
        }
    }
}

impl Zone {
    /// Whether anything can show below local in directories of this zone (remote entries
    /// or synthesized ones). Where nothing can, a 0/0 character device in local is not a
    /// whiteout but an ordinary device node: a runtime's own overlayfs upper directory
    /// (`<driver>/<container>/diff`) keeps its whiteouts there, visible, as it wrote them.
    pub fn has_below(self) -> bool {
        self != Zone::Private
    }

    /// Whether directories of this zone list shared objects (`<driver>/RO/`,
    /// `<driver>-layers/RO/`, `<driver>-images/`): their remote entries are known from the
    /// index.
    pub fn lists_shared(self) -> bool {
        matches!(self, Zone::DriverRo | Zone::LayersRo | Zone::Images)
    }

    /// Whether directories of this zone merge remote entries at all.
    pub fn merges_remote(self) -> bool {
        !matches!(self, Zone::Links | Zone::Private)
    }
}

fn is_layer(index: &LayoutIndex, name: &[u8]) -> bool {
    std::str::from_utf8(name).is_ok_and(|id| index.layer(id).is_some())
}

fn is_image(index: &LayoutIndex, name: &[u8]) -> bool {
    std::str::from_utf8(name).is_ok_and(|id| index.image(id).is_some())
}

use std::os::unix::ffi::OsStringExt;

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(style: LinkStyle) -> Layout {
        Layout::new("overlay", Path::new("/var/lib/isulad/storage"), style)
    }

    #[test]
    fn skeleton_zones_follow_the_driver_name() {
        let l = Layout::new("vfs", Path::new("/m"), LinkStyle::Absolute);
        let idx = LayoutIndex::default();
        assert_eq!(
            l.child_zone(Zone::Root, OsStr::new("vfs"), &idx),
            Zone::DriverHome
        );
        assert_eq!(
            l.child_zone(Zone::Root, OsStr::new("vfs-layers"), &idx),
            Zone::LayersHome
        );
        assert_eq!(
            l.child_zone(Zone::Root, OsStr::new("vfs-images"), &idx),
            Zone::Images
        );
        assert_eq!(
            l.child_zone(Zone::Root, OsStr::new("overlay"), &idx),
            Zone::Private
        );
        assert_eq!(
            l.child_zone(Zone::DriverHome, OsStr::new("RO"), &idx),
            Zone::DriverRo
        );
        assert_eq!(
            l.child_zone(Zone::DriverHome, OsStr::new("l"), &idx),
            Zone::Links
        );
        assert_eq!(
            l.child_zone(Zone::LayersHome, OsStr::new("l"), &idx),
            Zone::Private
        );
    }

    #[test]
    fn unknown_ids_are_private_and_remote_hidden() {
        let l = layout(LinkStyle::Absolute);
        let idx = LayoutIndex::default();
        let id = OsStr::new("9c27e219663c25e0f28493790cc0b88bc973ba3b1686355f221c38a36978ac63");
        assert_eq!(l.child_zone(Zone::DriverRo, id, &idx), Zone::Private);
        assert!(!l.remote_visible(Zone::DriverRo, id, &idx));
        assert!(!l.remote_visible(Zone::Root, OsStr::new("overlay-containers"), &idx));
        assert!(!l.remote_visible(Zone::DriverHome, OsStr::new("l"), &idx));
        assert!(l.remote_visible(Zone::DriverHome, OsStr::new("RO"), &idx));
        assert!(l.remote_visible(Zone::Shared, OsStr::new("anything"), &idx));
        assert!(!l.remote_visible(Zone::Private, OsStr::new("anything"), &idx));
    }

    #[test]
    fn no_links_without_ready_layers() {
        let l = layout(LinkStyle::Relative);
        let idx = LayoutIndex::default();
        assert_eq!(
            l.virtual_link(Zone::DriverHome, OsStr::new("abc"), &idx),
            None
        );
        assert!(l.virtual_links(Zone::Links, &idx).is_empty());
        assert!(l.is_skeleton(Zone::Root, OsStr::new("overlay-images")));
        assert!(l.is_skeleton(Zone::DriverHome, OsStr::new("l")));
        assert!(!l.is_skeleton(Zone::Images, OsStr::new("RO")));
    }
}
