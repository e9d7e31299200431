//! What a worker believes its directories hold: names to entries, and files to objects that
//! hard links share, each with its content, its xattr and whether it is still an untouched
//! remote file. Every operation changes the model as it changes the view. After a failure
//! the view's answer becomes the model and the name is tainted, so that one failure is
//! counted where it happens, and the final check leaves the name out until an operation
//! sets it again.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

use serde_json::{json, Value};

use crate::common::xattr_get;
use crate::protocol::XATTR;
use crate::verify::{hex, sha};
use crate::worker::Worker;

/// Names a worker creates things under (in each of its directories).
pub const POOL: usize = 32;

pub fn pool_name(k: usize) -> String {
    format!("n{k:02}")
}

#[derive(Clone, Debug)]
pub enum Ent {
    /// A regular file: the object it links to (hard links share one).
    File(u64),
    Link(String),
    /// Always empty.
    Dir,
}

pub struct Obj {
    pub data: Vec<u8>,
    pub links: u32,
    pub xattr: Option<Vec<u8>>,
    /// Still the untouched remote file (a change would copy it up).
    pub remote: bool,
}

pub struct Area {
    pub dir: PathBuf,
    pub names: BTreeMap<String, Ent>,
    /// Names to create things under (existing or not).
    pub pool: Vec<String>,
}

impl Worker {
    pub fn new_obj(&mut self, data: Vec<u8>) -> u64 {
        let o = self.next_obj;
        self.next_obj += 1;
        self.objs.insert(
            o,
            Obj {
                data,
                links: 0,
                xattr: None,
                remote: false,
            },
        );
        o
    }

    pub fn ent(&self, a: usize, name: &str) -> Option<Ent> {
        self.areas[a].names.get(name).cloned()
    }

    pub fn path(&self, a: usize, name: &str) -> PathBuf {
        self.areas[a].dir.join(name)
    }

    /// Removes a name from the model (the object goes with its last link).
    pub fn drop_name(&mut self, a: usize, name: &str) {
        self.tainted.remove(&(a, name.to_owned()));
        if let Some(Ent::File(o)) = self.areas[a].names.remove(name) {
            let obj = self.objs.get_mut(&o).unwrap();
            obj.links -= 1;
            if obj.links == 0 {
                self.objs.remove(&o);
            }
        }
    }

    /// Puts `ent` under `name`, replacing what was there.
    pub fn put(&mut self, a: usize, name: &str, ent: Ent) {
        self.drop_name(a, name);
        if let Ent::File(o) = ent {
            self.objs.get_mut(&o).unwrap().links += 1;
        }
        self.areas[a].names.insert(name.to_owned(), ent);
    }

    /// After a failure: takes what the view shows for `name` as the model, so one failure
    /// is not reported again by every later operation on the name. The name stays tainted
    /// until an operation sets it again.
    pub fn resync(&mut self, a: usize, name: &str) {
        self.resync_model(a, name);
        self.tainted.insert((a, name.to_owned()));
    }

    fn resync_model(&mut self, a: usize, name: &str) {
        let path = self.path(a, name);
        match fs::symlink_metadata(&path) {
            Ok(m) if m.file_type().is_file() => {
                let data = fs::read(&path).unwrap_or_default();
                let xattr = xattr_get(&path, XATTR).ok();
                // Another name of the same file in the model (a link the model missed)?
                let mut shared = None;
                if m.nlink() > 1 {
                    'find: for (b, area) in self.areas.iter().enumerate() {
                        for (n, e) in &area.names {
                            let Ent::File(o) = e else { continue };
                            if (b, n.as_str()) != (a, name)
                                && fs::symlink_metadata(area.dir.join(n))
                                    .is_ok_and(|x| x.ino() == m.ino())
                            {
                                shared = Some(*o);
                                break 'find;
                            }
                        }
                    }
                }
                let current = match self.ent(a, name) {
                    Some(Ent::File(o)) => Some(o),
                    _ => None,
                };
                let o = match (shared, current) {
                    (Some(o), _) => o,
                    (None, Some(o)) if self.objs[&o].links == 1 => o,
                    (None, _) => self.new_obj(Vec::new()),
                };
                let obj = self.objs.get_mut(&o).unwrap();
                obj.data = data;
                obj.xattr = xattr;
                obj.remote = false;
                if current != Some(o) {
                    self.put(a, name, Ent::File(o));
                }
            }
            Ok(m) if m.file_type().is_symlink() => {
                let target = fs::read_link(&path)
                    .map(|t| t.to_string_lossy().into_owned())
                    .unwrap_or_default();
                self.put(a, name, Ent::Link(target));
            }
            Ok(m) if m.file_type().is_dir() => self.put(a, name, Ent::Dir),
            _ => self.drop_name(a, name),
        }
    }

    // ---- the final model ----

    pub fn model_json(&self) -> Value {
        let areas: Vec<Value> = self
            .areas
            .iter()
            .enumerate()
            .map(|(a, area)| {
                let mut entries: serde_json::Map<String, Value> = area
                    .names
                    .iter()
                    .map(|(name, ent)| {
                        let v = match ent {
                            Ent::File(o) => {
                                let obj = &self.objs[o];
                                json!({
                                    "kind": "file",
                                    "obj": o,
                                    "links": obj.links,
                                    "len": obj.data.len(),
                                    "sha256": sha(&obj.data),
                                    "xattr": obj.xattr.as_deref().map(hex),
                                })
                            }
                            Ent::Link(t) => json!({"kind": "symlink", "target": t}),
                            Ent::Dir => json!({"kind": "dir"}),
                        };
                        (name.clone(), v)
                    })
                    .collect();
                for (_, name) in self.tainted.iter().filter(|(b, _)| *b == a) {
                    entries.insert(name.clone(), json!({"kind": "unknown"}));
                }
                json!({"dir": area.dir.display().to_string(), "entries": entries})
            })
            .collect();
        json!({ "areas": areas })
    }
}
