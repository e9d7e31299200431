//! `layerfs publish image`: copy one image from a writer host's own iSulad storage into the
//! shared remote tree, so that every reader sees it appear complete, or not at all.
//!
//! # The story
//!
//! The source image is found ([`source`](super::source)) and judged by the readiness rules
//! readers apply (DESIGN §4.3); an image a reader would not take is refused. Then, in
//! iSulad's order:
//!
//! 1. **Layers, parent first.** A layer already ready in the remote *with the same content*
//!    is skipped, whatever its directory is called: content is the OCI chain ID, computed
//!    from the `diff-digest`s down the parent chain ([`chain`](super::chain)). Otherwise its
//!    overlay dir (`diff/`, `link`, `work/`, `merged/`, `lower` or `empty/`) is built under a
//!    temporary name in `<driver>/RO/`, every file and directory synced, and renamed to
//!    `<driver>/RO/<id>`; then its metadata dir (`layer.json`, tar-split) the same way into
//!    `<driver>-layers/RO/<id>`. Each rename is followed by a sync of the area.
//! 2. **The image, last**, into `<driver>-images/<id>` the same way, once all of its layers
//!    are ready in the remote.
//!
//! A reader takes a layer only with both of its directories and a ready parent, and an
//! image only with a ready top layer, and never takes a temporary name for an id. So a
//! crash anywhere leaves nothing ready that is not complete, and a rerun picks up where the
//! last one stopped: it removes dead publishers' temporary directories
//! ([`place`](super::place)), skips what is ready, and adopts an overlay dir that was
//! renamed into place just before a crash if its tree matches the source.
//!
//! # Layers present under another id
//!
//! When the remote holds a layer's content under another id (another writer names layers
//! differently: iSulad uses `sha256(parent + "+" + diff)`, containers-storage the chain ID,
//! some writers random ids), that layer is used as it is and nothing is copied. The layers
//! published above it then name it: their `layer.json` gets its id as `parent` and their
//! `lower` its short link id, and when it is the image's top layer, the published
//! `images.json` gets its id as `layer`. Those are the only rewrites; every other byte of
//! the metadata is the source's. The image's identity (its id, the config digest, and its
//! manifest) does not depend on layer ids, so the rewrite is what iSulad itself would have
//! written had it pulled onto that remote.
//!
//! # Several publishers
//!
//! Renames never replace (`RENAME_NOREPLACE`, or a plain rename, which fails on a non-empty
//! directory). A publisher that loses a rename removes its copy, waits until the winner's
//! object is ready, and goes on; two publishers of one image both succeed and leave one
//! copy. An object that exists under its id but is not ready (another writer mid-way) is
//! waited for, up to [`Options::wait`], and never replaced.

use std::collections::HashMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;

use super::chain::hex;
use super::copy::{copy_tree, first_difference};
use super::error::{io_at, PublishError, Result};
use super::place::{self, TempDir};
use super::remote::{wait_for, Catalog, Placed, Remote};
use super::source::{self, SourceImage, SourceLayer};
use crate::layout::isulad_config_file_name;

/// How a publication runs.
#[derive(Debug, Clone)]
pub struct Options {
    /// The graph driver whose areas are read and written (`overlay`).
    pub driver: String,
    /// How long to wait for an object another writer is placing to become ready.
    pub wait: Duration,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            driver: "overlay".to_owned(),
            wait: Duration::from_secs(30),
        }
    }
}

/// What happened to one layer of the image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerOutcome {
    /// The layer's id in the source.
    pub id: String,
    /// The id the remote holds it under: `id`, or another layer with the same content.
    pub remote_id: String,
    /// Whether this run copied it (or part of it); `false` when it was already present.
    pub copied: bool,
}

/// What [`publish_image`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    pub image: String,
    pub names: Vec<String>,
    /// Whether this run placed the image directory; `false` when it was already present.
    pub image_copied: bool,
    /// The image's top layer in the remote.
    pub top_layer: String,
    /// The image's layers, base first.
    pub layers: Vec<LayerOutcome>,
}

/// Publishes the image `image` (an id, a unique id prefix or a name) of the iSulad storage
/// root `source` into the remote tree `remote`. See the module documentation for what is
/// guaranteed.
pub fn publish_image(
    source: &Path,
    image: &str,
    remote: &Path,
    options: &Options,
) -> Result<Published> {
    let driver = options.driver.as_str();
    if driver.is_empty() || driver == "." || driver == ".." || driver.contains(['/', '\0']) {
        return Err(PublishError::BadDriver(driver.to_owned()));
    }
    let src = source::open(source, driver, image)?;
    tracing::info!(image = %src.id, layers = src.layers.len(), "publishing image");

    let remote = Remote::new(remote, driver);
    let host = place::host_name();
    for area in [
        &remote.overlay_area,
        &remote.layers_area,
        &remote.images_area,
    ] {
        place::ensure_dir(area, 0o700)?;
        place::remove_stale_temps(area, &host)?;
    }
    let mut publisher = Publisher {
        remote,
        host,
        wait: options.wait,
        catalog: Catalog::default(),
    };
    publisher.catalog = publisher.remote.catalog()?;

    let mut placed: HashMap<String, Placed> = HashMap::new();
    let mut layers = Vec::with_capacity(src.layers.len());
    for (i, layer) in src.layers.iter().enumerate() {
        let parent = layer.parent.as_ref().and_then(|p| placed.get(p));
        let parent_chain = i
            .checked_sub(1)
            .and_then(|below| src.layers[below].chain.as_deref());
        let (now, copied) = publisher.layer(layer, parent, parent_chain)?;
        tracing::info!(layer = %layer.id, remote = %now.id, copied, "layer in place");
        layers.push(LayerOutcome {
            id: layer.id.clone(),
            remote_id: now.id.clone(),
            copied,
        });
        placed.insert(layer.id.clone(), now);
    }
    let top_layer = layers
        .last()
        .map(|l| l.remote_id.clone())
        .unwrap_or_default();
    let image_copied = publisher.image(&src, &top_layer)?;
    tracing::info!(image = %src.id, copied = image_copied, "image in place");
    Ok(Published {
        image: src.id,
        names: src.names,
        image_copied,
        top_layer,
        layers,
    })
}

struct Publisher {
    remote: Remote,
    host: String,
    wait: Duration,
    catalog: Catalog,
}

impl Publisher {
    /// Makes `layer` ready in the remote over `parent` (its parent as placed there): the
    /// layer as the remote holds it, and whether this run copied anything of it.
    fn layer(
        &mut self,
        layer: &SourceLayer,
        parent: Option<&Placed>,
        parent_chain: Option<&str>,
    ) -> Result<(Placed, bool)> {
        let remote = &self.remote;
        // Present by content, under whatever name: the source's own id first.
        if let Some(chain) = &layer.chain {
            let mut ids: Vec<&String> = self.catalog.with_chain(chain).iter().collect();
            ids.sort_by_key(|id| **id != layer.id);
            for id in ids {
                if let Ok(ready) = remote.judge_layer(id) {
                    return Ok((remote.placed(&ready)?, false));
                }
            }
        }
        let overlay_dir = remote.overlay_dir(&layer.id);
        let meta_dir = remote.meta_dir(&layer.id);
        let lower = parent.map(Placed::lower_for_child);
        let mut copied = false;
        match (exists(&overlay_dir)?, exists(&meta_dir)?) {
            (false, false) => {
                copied |= self.write_overlay(layer, lower.as_deref(), &overlay_dir)?;
                copied |= self.write_meta(layer, parent, &meta_dir)?;
            }
            (true, false) if self.adoptable(layer, lower.as_deref(), &overlay_dir)? => {
                tracing::info!(layer = %layer.id, "overlay dir already in place (an earlier run's); adding its metadata");
                copied |= self.write_meta(layer, parent, &meta_dir)?;
            }
            // Someone else's object under this id, ready or being written: wait, never
            // replace.
            _ => {}
        }
        let remote = &self.remote;
        let ready = wait_for(self.wait, || remote.judge_layer(&layer.id)).map_err(|reason| {
            PublishError::RemoteNotReady {
                path: overlay_dir.clone(),
                reason,
                waited: self.wait,
            }
        })?;
        self.check_same_content(layer, parent, parent_chain, &meta_dir)?;
        Ok((remote.placed(&ready)?, copied))
    }

    /// Refuses a ready layer under the source's id that records other content: another
    /// diff, or a parent that is neither the one placed below it nor one with its content.
    fn check_same_content(
        &self,
        layer: &SourceLayer,
        parent: Option<&Placed>,
        parent_chain: Option<&str>,
        meta_dir: &Path,
    ) -> Result<()> {
        let Ok((_, theirs)) = source::read_json(&meta_dir.join("layer.json")) else {
            return Ok(()); // just judged ready; gone since, which the image's judge will see
        };
        let field = |json: &Value, k: &str| {
            json.get(k)
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
        };
        let their_parent = field(&theirs, "parent");
        let same_diff = field(&theirs, "diff-digest") == field(&layer.json, "diff-digest");
        let same_parent = their_parent.as_deref() == parent.map(|p| p.id.as_str())
            || (parent_chain.is_some()
                && their_parent
                    .as_deref()
                    .and_then(|p| self.catalog.chain_of(p))
                    == parent_chain);
        if same_diff && same_parent {
            return Ok(());
        }
        Err(PublishError::Conflict {
            path: meta_dir.to_owned(),
            id: layer.id.clone(),
            detail: format!(
                "diff-digest {:?} over parent {:?}, the source's {:?} over {:?}",
                field(&theirs, "diff-digest"),
                their_parent,
                field(&layer.json, "diff-digest"),
                parent.map(|p| &p.id),
            ),
        })
    }

    /// Whether the overlay dir at `dir`, placed without its metadata, is a complete copy
    /// of `layer`'s over the expected parent: the state a crash between the two renames
    /// leaves, or another publisher of this layer between its two.
    fn adoptable(&self, layer: &SourceLayer, lower: Option<&str>, dir: &Path) -> Result<bool> {
        let link_ok = fs::read_to_string(dir.join("link"))
            .is_ok_and(|l| crate::layout::is_short_id(l.strip_suffix('\n').unwrap_or(&l)));
        let theirs = match fs::read_to_string(dir.join("lower")) {
            Ok(text) => Some(text.strip_suffix('\n').unwrap_or(&text).to_owned()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => return Err(io_at(&dir.join("lower"))(e)),
        };
        if !link_ok || theirs.as_deref() != lower {
            return Ok(false);
        }
        let diff = dir.join("diff");
        if !exists(&diff)? {
            return Ok(false);
        }
        let difference = first_difference(&layer.overlay_dir.join("diff"), &diff)?;
        if let Some(what) = &difference {
            tracing::info!(layer = %layer.id, %what, "overlay dir in place differs from the source");
        }
        Ok(difference.is_none())
    }

    /// Builds the overlay dir of `layer` and renames it into place; whether this run placed
    /// it (`false`: another publisher did first).
    fn write_overlay(
        &mut self,
        layer: &SourceLayer,
        lower: Option<&str>,
        target: &Path,
    ) -> Result<bool> {
        let mut tmp = TempDir::create(&self.remote.overlay_area, &self.host, &layer.id, 0o700)?;
        let diff = tmp.path.join("diff");
        let stats = {
            let mut tick = || tmp.heartbeat();
            copy_tree(&layer.overlay_dir.join("diff"), &diff, &mut tick)?
        };
        tracing::debug!(layer = %layer.id, entries = stats.entries, bytes = stats.bytes, "diff copied");
        let short = if self.catalog.short_in_use(&layer.short) {
            random_short()?
        } else {
            layer.short.clone()
        };
        self.catalog.claim_short(&short);
        place::write_file(&tmp.path.join("link"), 0o644, short.as_bytes())?;
        for sub in ["work", "merged"] {
            make_dir(&tmp.path.join(sub))?;
        }
        match lower {
            Some(lower) => place::write_file(&tmp.path.join("lower"), 0o644, lower.as_bytes())?,
            None => make_dir(&tmp.path.join("empty"))?,
        }
        tmp.place(target)
    }

    /// Builds the metadata dir of `layer` (naming `parent` as placed in the remote) and
    /// renames it into place; whether this run placed it.
    fn write_meta(
        &self,
        layer: &SourceLayer,
        parent: Option<&Placed>,
        target: &Path,
    ) -> Result<bool> {
        let tmp = TempDir::create(&self.remote.layers_area, &self.host, &layer.id, 0o700)?;
        let json = match parent {
            Some(p) if layer.parent.as_deref() != Some(p.id.as_str()) => {
                let mut json = layer.json.clone();
                json["parent"] = Value::String(p.id.clone());
                serde_json::to_vec(&json).map_err(|e| PublishError::BadSource {
                    path: layer.meta_dir.join("layer.json"),
                    reason: e.to_string(),
                })?
            }
            _ => layer.json_bytes.clone(),
        };
        copy_other_files(&layer.meta_dir, &tmp.path, &["layer.json"])?;
        place::write_file(&tmp.path.join("layer.json"), 0o600, &json)?;
        tmp.place(target)
    }

    /// Places the image directory, naming `top_layer` as its top layer; whether this run
    /// placed it.
    fn image(&self, src: &SourceImage, top_layer: &str) -> Result<bool> {
        let remote = &self.remote;
        let target = remote.image_dir(&src.id);
        let mut copied = false;
        if remote.judge_image(&src.id).is_err() && !exists(&target)? {
            let tmp = TempDir::create(&remote.images_area, &self.host, &src.id, 0o700)?;
            // iSulad's order: the config, the manifest, the rest; images.json last.
            let config = isulad_config_file_name(&src.id);
            for name in [config.as_str(), "manifest"] {
                place::copy_file(&src.dir.join(name), &tmp.path.join(name), 0o600)?;
            }
            copy_other_files(&src.dir, &tmp.path, &[&config, "manifest", "images.json"])?;
            let src_top = src.json.get("layer").and_then(Value::as_str);
            let json = if src_top == Some(top_layer) {
                src.json_bytes.clone()
            } else {
                let mut json = src.json.clone();
                json["layer"] = Value::String(top_layer.to_owned());
                serde_json::to_vec(&json).map_err(|e| PublishError::BadSource {
                    path: src.dir.join("images.json"),
                    reason: e.to_string(),
                })?
            };
            place::write_file(&tmp.path.join("images.json"), 0o600, &json)?;
            copied = tmp.place(&target)?;
        }
        let top = wait_for(self.wait, || remote.judge_image(&src.id)).map_err(|reason| {
            PublishError::RemoteNotReady {
                path: target.clone(),
                reason,
                waited: self.wait,
            }
        })?;
        if top != top_layer {
            tracing::warn!(image = %src.id, %top, "the remote's copy of the image names another top layer");
        }
        Ok(copied)
    }
}

/// Copies the regular files of `from` into `to`, keeping their modes, but `skip` and
/// dot-prefixed names (a writer's temporary files).
fn copy_other_files(from: &Path, to: &Path, skip: &[&str]) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let mut entries: Vec<(PathBuf, std::ffi::OsString)> = Vec::new();
    for entry in fs::read_dir(from).map_err(io_at(from))? {
        let entry = entry.map_err(io_at(from))?;
        entries.push((entry.path(), entry.file_name()));
    }
    entries.sort();
    for (path, name) in entries {
        let text = name.to_string_lossy();
        if text.starts_with('.') || skip.iter().any(|s| *s == text) {
            continue;
        }
        let meta = fs::symlink_metadata(&path).map_err(io_at(&path))?;
        if !meta.is_file() {
            tracing::warn!(path = %path.display(), "not a regular file; not published");
            continue;
        }
        place::copy_file(&path, &to.join(&name), meta.permissions().mode() & 0o7777)?;
    }
    Ok(())
}

fn make_dir(path: &Path) -> Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    fs::DirBuilder::new()
        .mode(0o700)
        .create(path)
        .map_err(io_at(path))?;
    place::set_mode(path, 0o700)
}

/// Whether `path` exists, without following a symlink there.
fn exists(path: &Path) -> Result<bool> {
    match fs::symlink_metadata(path) {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(io_at(path)(e)),
    }
}

/// A fresh short link id as iSulad makes one: 13 random bytes in lowercase hex.
fn random_short() -> Result<String> {
    use std::io::Read;
    let path = Path::new("/dev/urandom");
    let mut bytes = [0u8; 13];
    fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(io_at(path))?;
    Ok(hex(&bytes))
}
