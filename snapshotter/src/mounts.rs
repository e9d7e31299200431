//! The mounts containerd performs for a snapshot, as its own overlay snapshotter makes
//! them: a bind mount for a snapshot alone, a kernel overlay over its parents otherwise.
//! Where the directories are is [`Dirs`]'s to say.

use std::path::{Path, PathBuf};

use crate::api::types::Mount;
use crate::dirs::Dirs;
use crate::error::Error;
use crate::meta::{Kind, Meta};

/// The mounts of the snapshot `name`.
pub fn mounts(dirs: &Dirs, meta: &Meta, name: &str) -> Result<Vec<Mount>, Error> {
    let record = meta.get(name)?;
    let parents = meta
        .ancestors(name)?
        .into_iter()
        .map(|p| meta.get(p).map(|r| dirs.files(r)))
        .collect::<Result<Vec<_>, _>>()?;
    let bind = |source: PathBuf, mode: &str| Mount {
        r#type: "bind".into(),
        source: text(&source),
        target: String::new(),
        options: vec![mode.into(), "rbind".into()],
    };
    let lowerdir = || {
        let lowers: Vec<String> = parents.iter().map(|p| text(p)).collect();
        format!("lowerdir={}", lowers.join(":"))
    };
    let overlay = |options: Vec<String>| Mount {
        r#type: "overlay".into(),
        source: "overlay".into(),
        target: String::new(),
        options,
    };
    Ok(vec![match record.kind {
        Kind::Committed => {
            return Err(Error::FailedPrecondition(format!(
                "snapshot {name} is committed: only active snapshots and views have mounts"
            )))
        }
        Kind::Active if parents.is_empty() => bind(dirs.files(record), "rw"),
        Kind::Active => overlay(vec![
            "index=off".into(),
            format!("workdir={}", text(&dirs.work(record))),
            format!("upperdir={}", text(&dirs.files(record))),
            lowerdir(),
        ]),
        Kind::View if parents.is_empty() => bind(dirs.files(record), "ro"),
        Kind::View if parents.len() == 1 => bind(parents[0].clone(), "ro"),
        Kind::View => overlay(vec!["index=off".into(), lowerdir()]),
    }])
}

fn text(path: &Path) -> String {
    path.to_string_lossy().into_owned()
}

/// Whether overlay's option syntax can carry `path` (it splits on `,` and `:`).
pub fn fits_overlay_options(path: &Path) -> bool {
    let s = path.to_string_lossy();
    !s.contains([',', ':', '='])
}
