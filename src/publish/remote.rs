//! The remote tree as a publisher sees it: where each object goes, which layers it already
//! holds by content, and whether a given object is ready.
//!
//! Readiness is judged by the very rules readers apply ([`LayoutIndex::judge`]), on just the
//! object asked about and its parent chain, so a publisher never reads the whole tree's
//! tar-splits to learn about one layer.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::chain::chain_id;
use super::error::{io_at, Result};
use super::source::read_json;
use crate::layout::{is_object_id, is_short_id, Layer, LayoutIndex, ObjectDirs, MAX_LOWER_DEPTH};

/// The three shared areas of a remote root, for one graph driver.
#[derive(Debug, Clone)]
pub(crate) struct Remote {
    pub driver: String,
    /// `<root>/<driver>/RO`.
    pub overlay_area: PathBuf,
    /// `<root>/<driver>-layers/RO`.
    pub layers_area: PathBuf,
    /// `<root>/<driver>-images`.
    pub images_area: PathBuf,
}

/// What the remote's layer metadata says, read once: chain IDs and the short ids in use.
#[derive(Debug, Default)]
pub(crate) struct Catalog {
    by_chain: HashMap<String, Vec<String>>,
    chain_of: HashMap<String, String>,
    shorts: HashSet<String>,
}

impl Catalog {
    /// The layers recorded with chain ID `chain`, in id order.
    pub fn with_chain(&self, chain: &str) -> &[String] {
        self.by_chain.get(chain).map_or(&[], Vec::as_slice)
    }

    /// The chain ID recorded for layer `id`, if its chain has diff digests all the way down.
    pub fn chain_of(&self, id: &str) -> Option<&str> {
        self.chain_of.get(id).map(String::as_str)
    }

    /// Whether some layer's `link` already holds `short`.
    pub fn short_in_use(&self, short: &str) -> bool {
        self.shorts.contains(short)
    }

    pub fn claim_short(&mut self, short: &str) {
        self.shorts.insert(short.to_owned());
    }
}

/// A ready remote layer: what a child layer needs of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Placed {
    pub id: String,
    pub short: String,
    /// The content of its `lower` file (`l/<a>:l/<b>…`), empty for a base layer.
    pub lower: String,
}

impl Placed {
    /// The `lower` of a layer on top of this one.
    pub fn lower_for_child(&self) -> String {
        if self.lower.is_empty() {
            format!("l/{}", self.short)
        } else {
            format!("l/{}:{}", self.short, self.lower)
        }
    }
}

impl Remote {
    pub fn new(root: &Path, driver: &str) -> Remote {
        Remote {
            driver: driver.to_owned(),
            overlay_area: root.join(driver).join("RO"),
            layers_area: root.join(format!("{driver}-layers")).join("RO"),
            images_area: root.join(format!("{driver}-images")),
        }
    }

    pub fn overlay_dir(&self, id: &str) -> PathBuf {
        self.overlay_area.join(id)
    }

    pub fn meta_dir(&self, id: &str) -> PathBuf {
        self.layers_area.join(id)
    }

    pub fn image_dir(&self, id: &str) -> PathBuf {
        self.images_area.join(id)
    }

    /// Reads every layer's `layer.json` and `link`. Unreadable objects are left out: they
    /// are not ready, so nothing can be skipped because of them.
    pub fn catalog(&self) -> Result<Catalog> {
        let mut records: HashMap<String, (Option<String>, Option<String>)> = HashMap::new();
        for id in list_ids(&self.layers_area)? {
            if let Ok((_, json)) = read_json(&self.meta_dir(&id).join("layer.json")) {
                let field = |k: &str| {
                    json.get(k)
                        .and_then(Value::as_str)
                        .filter(|s| !s.is_empty())
                        .map(str::to_owned)
                };
                records.insert(id, (field("parent"), field("diff-digest")));
            }
        }
        let mut catalog = Catalog::default();
        for id in records.keys() {
            // Walk down to a layer whose chain is known or a base, then compute upwards.
            let mut path = Vec::new();
            let mut at = Some(id.as_str());
            let mut below: Option<String> = None;
            let mut broken = false;
            while let Some(cur) = at {
                if let Some(known) = catalog.chain_of.get(cur) {
                    below = Some(known.clone());
                    break;
                }
                if path.len() > MAX_LOWER_DEPTH || path.contains(&cur) {
                    broken = true;
                    break;
                }
                let Some((parent, _)) = records.get(cur) else {
                    broken = true;
                    break;
                };
                path.push(cur);
                at = parent.as_deref();
            }
            if broken {
                continue;
            }
            for cur in path.into_iter().rev() {
                let diff = records.get(cur).and_then(|(_, d)| d.as_deref());
                let Some(chain) = diff.and_then(|d| chain_id(below.as_deref(), d)) else {
                    break;
                };
                catalog.chain_of.insert(cur.to_owned(), chain.clone());
                below = Some(chain);
            }
        }
        for (id, chain) in &catalog.chain_of {
            catalog
                .by_chain
                .entry(chain.clone())
                .or_default()
                .push(id.clone());
        }
        for ids in catalog.by_chain.values_mut() {
            ids.sort();
        }
        for id in list_ids(&self.overlay_area)? {
            if let Ok(link) = fs::read_to_string(self.overlay_dir(&id).join("link")) {
                catalog
                    .shorts
                    .insert(link.strip_suffix('\n').unwrap_or(&link).to_owned());
            }
        }
        Ok(catalog)
    }

    /// Judges layer `id` with its parent chain: the ready layer, or why it is not ready.
    pub fn judge_layer(&self, id: &str) -> Result<Layer, String> {
        let mut dirs = ObjectDirs::default();
        self.add_chain(&mut dirs, id);
        let index = LayoutIndex::judge(&dirs, &self.driver);
        index
            .layer(id)
            .cloned()
            .ok_or_else(|| reason_for(&index, id))
    }

    /// Judges image `id` with its top layer's chain: its top layer, or why it is not ready.
    pub fn judge_image(&self, id: &str) -> Result<String, String> {
        let mut dirs = ObjectDirs::default();
        let dir = self.image_dir(id);
        if let Ok((_, json)) = read_json(&dir.join("images.json")) {
            if let Some(top) = json.get("layer").and_then(Value::as_str) {
                self.add_chain(&mut dirs, top);
            }
        }
        dirs.images.insert(id.to_owned(), dir);
        let index = LayoutIndex::judge(&dirs, &self.driver);
        index
            .image(id)
            .map(|i| i.top_layer.clone())
            .ok_or_else(|| reason_for(&index, id))
    }

    /// Adds the directories of layer `id` and of its parents, as their metadata names them.
    fn add_chain(&self, dirs: &mut ObjectDirs, id: &str) {
        let mut at = Some(id.to_owned());
        while let Some(cur) = at.take() {
            if !is_object_id(&cur) || dirs.layers.contains_key(&cur) {
                break;
            }
            if dirs.layers.len() > MAX_LOWER_DEPTH {
                break;
            }
            dirs.overlay.insert(cur.clone(), self.overlay_dir(&cur));
            dirs.layers.insert(cur.clone(), self.meta_dir(&cur));
            at = read_json(&self.meta_dir(&cur).join("layer.json"))
                .ok()
                .and_then(|(_, json)| json.get("parent")?.as_str().map(str::to_owned))
                .filter(|p| !p.is_empty());
        }
    }

    /// What a child of the ready layer `layer` needs of it: its short id and `lower`.
    pub fn placed(&self, layer: &Layer) -> Result<Placed> {
        let path = self.overlay_dir(&layer.id).join("lower");
        let lower = match fs::read_to_string(&path) {
            Ok(text) => text.strip_suffix('\n').unwrap_or(&text).to_owned(),
            Err(e) if e.kind() == io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(io_at(&path)(e)),
        };
        debug_assert!(is_short_id(&layer.short));
        Ok(Placed {
            id: layer.id.clone(),
            short: layer.short.clone(),
            lower,
        })
    }
}

/// Why `id` is not in `index`, as the judge put it.
fn reason_for(index: &LayoutIndex, id: &str) -> String {
    index
        .not_ready()
        .iter()
        .find(|nr| nr.name == id)
        .map(|nr| nr.reason.clone())
        .unwrap_or_else(|| "missing".to_owned())
}

/// The id-named entries of an area; none if the area does not exist.
fn list_ids(area: &Path) -> Result<Vec<String>> {
    let entries = match fs::read_dir(area) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_at(area)(e)),
    };
    let mut ids = Vec::new();
    for entry in entries {
        let entry = entry.map_err(io_at(area))?;
        if let Some(name) = entry.file_name().to_str().filter(|n| is_object_id(n)) {
            ids.push(name.to_owned());
        }
    }
    ids.sort();
    Ok(ids)
}

/// Polls `check` until it succeeds or `wait` has passed; the last failure then.
pub(crate) fn wait_for<T>(
    wait: Duration,
    mut check: impl FnMut() -> Result<T, String>,
) -> Result<T, String> {
    let deadline = Instant::now() + wait;
    loop {
        match check() {
            Ok(v) => return Ok(v),
            Err(reason) if Instant::now() >= deadline => return Err(reason),
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}
