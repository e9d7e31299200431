//! Telling the kernel what a round changed, and nothing else.
//!
//! The kernel caches names (negative ones too), attributes and file data for long (see
//! `fs`), so after a round it must forget exactly what the round changed:
//!
//! - every added, removed or re-pointed name in a layout directory (`inval_entry` on each
//!   number the directory is known by): an added name may sit in the cache as a negative
//!   entry from an earlier failed lookup;
//! - for an object whose directory stayed but whose files changed (a re-tag rewrites
//!   `images.json` through a rename): the names of its metadata files in its directory, and
//!   the attributes and data of the directory and every file of it the kernel holds
//!   (`inval_inode`);
//! - the attributes of every layout directory whose entries changed.
//!
//! Synthesized symlinks that disappear or change target lose their number first, so the
//! kernel, asking again, gets a new node rather than its cached target.
//!
//! The notices are sent by `notice`, after those of earlier rounds.

use std::collections::HashSet;
use std::ffi::{OsStr, OsString};

use super::diff::{Diff, ZoneKey};
use crate::layout::isulad_config_file_name;
use crate::notice::Notice;
use crate::view::View;

/// The notices for `diff`, in the order to send them. Call after the new index is in place:
/// synthesized symlinks that changed lose their numbers here.
pub fn apply(view: &View, diff: &Diff) -> Vec<Notice> {
    for (zone, name) in &diff.relinked {
        for parent in view.layout_dir_inos(zone.zone()) {
            view.unbind_virtual(parent, OsStr::new(name));
        }
    }

    let mut notices = Vec::new();
    let mut dirs_changed: HashSet<u64> = HashSet::new();
    for (zone, name) in &diff.names {
        for parent in view.layout_dir_inos(zone.zone()) {
            notices.push(Notice::Entry(parent, OsString::from(name)));
            dirs_changed.insert(parent);
        }
    }

    if !diff.touched.is_empty() {
        // The directories of touched objects the kernel holds, then their files.
        let mut parents: HashSet<u64> = HashSet::new();
        for (zone, _) in &diff.touched {
            parents.extend(view.layout_dir_inos(zone.zone()));
        }
        let wanted: HashSet<(u64, OsString)> = diff
            .touched
            .iter()
            .flat_map(|(zone, id)| {
                view.layout_dir_inos(zone.zone())
                    .into_iter()
                    .map(move |p| (p, OsString::from(id)))
            })
            .collect();
        let mut object_dirs: Vec<(u64, ZoneKey, String)> = Vec::new();
        for child in view.live_children(&parents) {
            if wanted.contains(&(child.parent, child.name.clone())) {
                let zone = diff
                    .touched
                    .iter()
                    .find(|(z, id)| {
                        view.layout_dir_inos(z.zone()).contains(&child.parent)
                            && OsStr::new(id) == child.name
                    })
                    .map(|(z, _)| *z);
                if let (Some(zone), Some(id)) = (zone, child.name.to_str()) {
                    object_dirs.push((child.ino, zone, id.to_owned()));
                }
            }
        }
        for (dir, zone, id) in &object_dirs {
            for file in metadata_files(*zone, id) {
                notices.push(Notice::Entry(*dir, OsString::from(file)));
            }
            notices.push(Notice::Inode(*dir));
        }
        let dirs: HashSet<u64> = object_dirs.iter().map(|(ino, _, _)| *ino).collect();
        for child in view.live_children(&dirs) {
            notices.push(Notice::Inode(child.ino));
        }
    }

    notices.extend(dirs_changed.into_iter().map(Notice::Inode));
    notices
}

/// The metadata files of an object directory in a layout area: the ones whose change makes
/// the object "changed".
fn metadata_files(zone: ZoneKey, id: &str) -> Vec<String> {
    match zone {
        ZoneKey::DriverRo => vec!["link".into(), "lower".into()],
        ZoneKey::LayersRo => vec!["layer.json".into(), format!("{id}.tar-split.gz")],
        ZoneKey::Images => vec![
            "images.json".into(),
            "manifest".into(),
            isulad_config_file_name(id),
        ],
        _ => Vec::new(),
    }
}
