//! The view checked against a worker's model: after each operation, in the worker, and for
//! the final state, in the parent (as left, after dropping the kernel's caches and after a
//! remount). A difference is reported with what the name is on disk in local and remote at
//! that moment, and content by its length, hash and tag, short enough to read in a report.

use std::collections::{BTreeSet, HashMap};
use std::fs;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::common::{is_whiteout, xattr_get, Mount};
use crate::model::Ent;
use crate::protocol::{ENV_LOCAL, ENV_MNT, ENV_REMOTE, XATTR};
use crate::worker::Worker;

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn sha(data: &[u8]) -> String {
    hex(&Sha256::digest(data))
}

/// A short description of some content, to tell objects apart in a report: every content a
/// worker writes starts with a tag naming the worker and the write.
pub fn describe(data: &[u8]) -> String {
    let head: String = String::from_utf8_lossy(&data[..data.len().min(24)])
        .chars()
        .map(|c| if c.is_ascii_graphic() { c } else { '.' })
        .collect();
    format!(
        "{} bytes, sha256 {}…, starts {head:?}",
        data.len(),
        &sha(data)[..12]
    )
}

pub fn kind_of(ft: &fs::FileType) -> &'static str {
    if ft.is_file() {
        "file"
    } else if ft.is_dir() {
        "dir"
    } else if ft.is_symlink() {
        "symlink"
    } else if ft.is_char_device() {
        "chardev"
    } else {
        "other"
    }
}

impl Worker {
    /// Reads `name` back (a file in the model) and compares it with the model.
    pub fn verify_file(&mut self, op: &str, a: usize, name: &str) -> bool {
        let Some(Ent::File(o)) = self.ent(a, name) else {
            return true;
        };
        let path = self.path(a, name);
        match fs::read(&path) {
            Err(e) => {
                self.error(op, &path, "the file reads", &e);
                self.resync(a, name);
                false
            }
            Ok(got) if got != self.objs[&o].data => {
                let expected = describe(&self.objs[&o].data);
                self.mismatch(op, &path, &expected, &describe(&got));
                self.resync(a, name);
                false
            }
            Ok(_) => true,
        }
    }

    /// `name` must be gone.
    pub fn verify_absent(&mut self, op: &str, a: usize, name: &str) {
        let path = self.path(a, name);
        match fs::symlink_metadata(&path) {
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => self.error(op, &path, "ENOENT", &e),
            Ok(m) => {
                self.mismatch(op, &path, "ENOENT", &format!("exists: {:?}", m.file_type()));
                self.resync(a, name);
            }
        }
    }

    /// `lstat` of `name` agrees with the model (kind; size and link count of files; size of
    /// symlinks).
    pub fn verify_stat(&mut self, op: &str, a: usize, name: &str) {
        let Some(ent) = self.ent(a, name) else {
            return self.verify_absent(op, a, name);
        };
        let path = self.path(a, name);
        let m = match fs::symlink_metadata(&path) {
            Ok(m) => m,
            Err(e) => {
                self.error(op, &path, &format!("{ent:?}"), &e);
                return self.resync(a, name);
            }
        };
        let ft = m.file_type();
        let wrong = match &ent {
            Ent::File(o) => {
                let obj = &self.objs[o];
                (!ft.is_file() || m.len() != obj.data.len() as u64 || m.nlink() != obj.links as u64)
                    .then(|| format!("file of {} bytes, {} links", obj.data.len(), obj.links))
            }
            Ent::Link(t) => {
                (!ft.is_symlink() || m.len() != t.len() as u64).then(|| format!("symlink to {t:?}"))
            }
            Ent::Dir => (!ft.is_dir()).then(|| "directory".to_owned()),
        };
        if let Some(expected) = wrong {
            let got = format!(
                "{ft:?} size {} nlink {} ino {}",
                m.len(),
                m.nlink(),
                m.ino()
            );
            self.mismatch(op, &path, &expected, &got);
            self.resync(a, name);
        }
    }

    pub fn verify_link(&mut self, op: &str, a: usize, name: &str) {
        let Some(Ent::Link(target)) = self.ent(a, name) else {
            return;
        };
        let path = self.path(a, name);
        match fs::read_link(&path) {
            Err(e) => {
                self.error(op, &path, &format!("readlink {target:?}"), &e);
                self.resync(a, name);
            }
            Ok(t) if t.as_os_str() != target.as_str() => {
                self.mismatch(op, &path, &target, &t.to_string_lossy());
                self.resync(a, name);
            }
            Ok(_) => {}
        }
    }
}

/// Compares one worker's final model with what the view shows.
pub fn verify_model(model: &Value, stage: &str, backing: Option<&Backing>, out: &mut Vec<String>) {
    let mut fail = |path: &Path, what: String| {
        let on_disk = backing.map(|b| b.of(path)).unwrap_or_default();
        out.push(format!("{stage}: {}: {what}{on_disk}", path.display()));
    };
    // One inode per object, across both directories.
    let mut inos: HashMap<u64, (u64, String)> = HashMap::new();
    for area in model["areas"].as_array().into_iter().flatten() {
        let dir = PathBuf::from(area["dir"].as_str().unwrap());
        let entries = area["entries"].as_object().unwrap();
        let unknown = |n: &str| entries.get(n).is_some_and(|e| e["kind"] == "unknown");
        let want: BTreeSet<&str> = entries
            .keys()
            .map(|k| k.as_str())
            .filter(|k| !unknown(k))
            .collect();
        let listed = match fs::read_dir(&dir).and_then(|it| it.collect::<io::Result<Vec<_>>>()) {
            Ok(v) => v,
            Err(e) => {
                fail(&dir, format!("cannot list: {e}"));
                continue;
            }
        };
        let listed: BTreeSet<String> = listed
            .iter()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        let listed_ref: BTreeSet<&str> = listed
            .iter()
            .map(|s| s.as_str())
            .filter(|k| !unknown(k))
            .collect();
        for n in want.difference(&listed_ref) {
            fail(&dir.join(n), "in the model, not listed".to_owned());
        }
        for n in listed_ref.difference(&want) {
            let path = dir.join(n);
            let lstat = match fs::symlink_metadata(&path) {
                Ok(m) => kind_of(&m.file_type()).to_owned(),
                Err(e) => e.to_string(),
            };
            fail(&path, format!("listed, not in the model (lstat: {lstat})"));
        }
        for (name, e) in entries.iter().filter(|(n, _)| !unknown(n)) {
            let path = dir.join(name);
            let m = match fs::symlink_metadata(&path) {
                Ok(m) => m,
                Err(err) => {
                    fail(&path, format!("lstat: {err}"));
                    continue;
                }
            };
            let kind = kind_of(&m.file_type());
            let want_kind = e["kind"].as_str().unwrap();
            if kind != want_kind {
                fail(&path, format!("a {kind}, not a {want_kind}"));
                continue;
            }
            match want_kind {
                "file" => {
                    match fs::read(&path) {
                        Ok(data) if sha(&data) == e["sha256"].as_str().unwrap() => {}
                        Ok(data) => fail(
                            &path,
                            format!(
                                "holds {}, not {} bytes sha256 {}…",
                                describe(&data),
                                e["len"],
                                &e["sha256"].as_str().unwrap()[..12]
                            ),
                        ),
                        Err(err) => fail(&path, format!("read: {err}")),
                    }
                    let want_x = e["xattr"].as_str();
                    match (xattr_get(&path, XATTR), want_x) {
                        (Ok(v), Some(w)) if hex(&v) == w => {}
                        (Err(err), None) if err.raw_os_error() == Some(libc::ENODATA) => {}
                        (got, w) => fail(
                            &path,
                            format!(
                                "xattr {XATTR}: expected {}, got {:?}",
                                w.unwrap_or("ENODATA"),
                                got.map(|v| hex(&v))
                            ),
                        ),
                    }
                    let links = e["links"].as_u64().unwrap();
                    if m.nlink() != links {
                        fail(&path, format!("{} links, not {links}", m.nlink()));
                    }
                    let obj = e["obj"].as_u64().unwrap();
                    match inos.get(&obj) {
                        Some((ino, other)) if *ino != m.ino() => fail(
                            &path,
                            format!("ino {}, its hard link {other} ino {ino}", m.ino()),
                        ),
                        Some(_) => {}
                        None => {
                            inos.insert(obj, (m.ino(), path.display().to_string()));
                        }
                    }
                }
                "symlink" => match fs::read_link(&path) {
                    Ok(t) if t.as_os_str() == e["target"].as_str().unwrap() => {}
                    got => fail(
                        &path,
                        format!("readlink: expected {}, got {got:?}", e["target"]),
                    ),
                },
                _ => {}
            }
        }
    }
}

/// Where a view path is on disk, to describe it in a report.
pub struct Backing {
    mnt: PathBuf,
    local: PathBuf,
    remote: PathBuf,
}

impl Backing {
    pub fn from_env() -> Option<Backing> {
        let var = |k: &str| std::env::var_os(k).map(PathBuf::from);
        Some(Backing {
            mnt: var(ENV_MNT)?,
            local: var(ENV_LOCAL)?,
            remote: var(ENV_REMOTE)?,
        })
    }

    pub fn of_mount(m: &Mount) -> Backing {
        Backing {
            mnt: m.mnt.clone(),
            local: m.local.clone(),
            remote: m.remote.clone(),
        }
    }

    /// ` [local: …; remote: …]` for a path in the view.
    pub fn of(&self, path: &Path) -> String {
        let Ok(rel) = path.strip_prefix(&self.mnt) else {
            return String::new();
        };
        format!(
            " [local: {}; remote: {}]",
            on_disk(&self.local.join(rel)),
            on_disk(&self.remote.join(rel))
        )
    }
}

fn on_disk(path: &Path) -> String {
    match fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => "absent".to_owned(),
        Err(e) => e.to_string(),
        Ok(_) if is_whiteout(path) => "whiteout".to_owned(),
        Ok(m) if m.file_type().is_file() => format!(
            "file ino {} nlink {}, {}",
            m.ino(),
            m.nlink(),
            fs::read(path).map_or_else(|e| e.to_string(), |d| describe(&d))
        ),
        Ok(m) if m.file_type().is_symlink() => format!(
            "symlink ino {} to {:?}",
            m.ino(),
            fs::read_link(path).unwrap_or_default()
        ),
        Ok(m) => format!("{} ino {}", kind_of(&m.file_type()), m.ino()),
    }
}
