//! A writer host's storage as iSulad lays it out with `storage-enable-remote-layer` on (DESIGN
//! §4.1), named as iSulad names it and written in the order iSulad writes it: a [`Layer`]'s
//! overlay dir in `mk_sub_directories` order, its `layer.json` saved incomplete before the diff
//! is applied and complete after, the tar-split growing in place; an [`Image`]'s `images.json`
//! rewritten at each stage of `register_image`; every file but the tar-split written
//! atomically through a `.tmp-` name. Ids are SHA-256 hex (an image's is its config's digest),
//! short ids 26 lowercase hex digits.
//!
//! A suite that plays the writer host turns layers and images into [`Op`]s, one file-system
//! call each, and has [`writer`] run them in a process of its own while the view is mounted, so
//! that a round can fall between any two of them. Suites that only need an object to be there
//! write it at once with the builders at the end ([`write_base_layer`], [`write_image`]).

use std::fs;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use base64::Engine as _;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

use super::Mount;

/// The file holding the writer process's operations, as JSON.
const WRITER_OPS: &str = "LAYERFS_SCENARIO_WRITER_OPS";

/// The remote root the writer process works in.
const WRITER_ROOT: &str = "LAYERFS_SCENARIO_WRITER_ROOT";

/// Where the writer host's own absolute links point (its storage root).
const WRITER_STORAGE: &str = "/var/lib/isulad/storage";

// ---- The writer host ----

/// One file-system operation of the writer host, paths relative to the remote root.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Op {
    /// `mkdir -p`, mode 0700 (iSulad's mode for its storage dirs).
    Mkdir(String),
    /// iSulad's `util_atomic_write_file`: `.tmp-<name>-<10 hex>` in the same dir, then
    /// `rename(2)`. Data in base64.
    WriteAtomic {
        path: String,
        mode: u32,
        data: String,
    },
    /// Truncate and write in place (how the tar-split is written).
    WriteInPlace {
        path: String,
        data: String,
    },
    /// Append to an existing file in place.
    Append {
        path: String,
        data: String,
    },
    Symlink {
        target: String,
        path: String,
    },
    /// Unlink a file or symlink.
    Unlink(String),
    /// `rm -rf` of a directory.
    RemoveAll(String),
    Rename {
        from: String,
        to: String,
    },
}

pub fn b64(data: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(data)
}

fn unb64(data: &str) -> Vec<u8> {
    base64::engine::general_purpose::STANDARD
        .decode(data)
        .expect("writer data is base64")
}

pub fn write_atomic_op(path: &str, mode: u32, data: &[u8]) -> Op {
    Op::WriteAtomic {
        path: path.to_owned(),
        mode,
        data: b64(data),
    }
}

/// Runs `ops` in a separate writer process and waits for it. The mount's remote check then
/// takes the changed remote as its reference. The process is the test binary run again for
/// its `writer_host_process`, which the calling test file declares with
/// [`writer_host_entry!`].
pub fn writer(m: &mut Mount, ops: Vec<Op>) {
    // The operations go through a file: their data can be larger than an environment
    // variable may be.
    let file = m.dir.path().join("writer-ops.json");
    fs::write(&file, serde_json::to_vec(&ops).unwrap()).unwrap();
    let out = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "writer_host_process",
            "--ignored",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(WRITER_OPS, &file)
        .env(WRITER_ROOT, &m.remote)
        .stdin(Stdio::null())
        .output()
        .expect("spawn the writer process");
    assert!(
        out.status.success(),
        "the writer process failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // A binary without the entry point runs no test and exits 0, having written nothing.
    assert!(
        !file.exists(),
        "no writer process took the operations: the test file must declare \
         `common::isulad::writer_host_entry!()`"
    );
    m.accept_remote_changes();
}

/// The writer host's side: performs the operations [`writer`] handed over, then removes
/// their file to say they were taken. Without [`writer`]'s variables, does nothing.
pub fn writer_host_main() {
    let (Ok(ops_file), Ok(root)) = (std::env::var(WRITER_OPS), std::env::var(WRITER_ROOT)) else {
        return;
    };
    let root = PathBuf::from(root);
    let ops = fs::read(&ops_file).expect("the writer ops file");
    let ops: Vec<Op> = serde_json::from_slice(&ops).expect("writer ops parse");
    for (n, op) in ops.into_iter().enumerate() {
        let at = |p: &str| root.join(p);
        match op {
            Op::Mkdir(p) => fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(at(&p))
                .unwrap_or_else(|e| panic!("mkdir {p}: {e}")),
            Op::WriteAtomic { path, mode, data } => {
                let target = at(&path);
                let tmp = atomic_tmp(&target, 0xa5a5_0000 + n as u64);
                let mut f = fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(mode)
                    .open(&tmp)
                    .unwrap_or_else(|e| panic!("create {}: {e}", tmp.display()));
                f.write_all(&unb64(&data)).unwrap();
                f.sync_all().unwrap();
                fs::set_permissions(&tmp, fs::Permissions::from_mode(mode)).unwrap();
                fs::rename(&tmp, &target).unwrap_or_else(|e| panic!("rename to {path}: {e}"));
            }
            Op::WriteInPlace { path, data } => {
                let mut f = fs::OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .mode(0o600)
                    .open(at(&path))
                    .unwrap_or_else(|e| panic!("open {path}: {e}"));
                f.write_all(&unb64(&data)).unwrap();
            }
            Op::Append { path, data } => {
                let mut f = fs::OpenOptions::new()
                    .append(true)
                    .open(at(&path))
                    .unwrap_or_else(|e| panic!("open {path}: {e}"));
                f.write_all(&unb64(&data)).unwrap();
            }
            Op::Symlink { target, path } => std::os::unix::fs::symlink(&target, at(&path))
                .unwrap_or_else(|e| panic!("symlink {path}: {e}")),
            Op::Unlink(p) => fs::remove_file(at(&p)).unwrap_or_else(|e| panic!("unlink {p}: {e}")),
            Op::RemoveAll(p) => {
                fs::remove_dir_all(at(&p)).unwrap_or_else(|e| panic!("rm -rf {p}: {e}"))
            }
            Op::Rename { from, to } => {
                fs::rename(at(&from), at(&to)).unwrap_or_else(|e| panic!("mv {from} {to}: {e}"))
            }
        }
    }
    fs::remove_file(&ops_file).expect("remove the writer ops file");
}

/// Declares, in a test file that calls [`writer`], the entry point its writer process runs: an
/// ignored test named `writer_host_process`, found with `--ignored --exact`. Only the files
/// that play the writer host carry it, each under that one name.
#[allow(unused_macros)]
macro_rules! writer_host_entry {
    () => {
        /// The writer host's side, a subprocess entry point and not a test:
        /// `common::isulad::writer` runs this binary again with
        /// `--ignored --exact writer_host_process`.
        #[test]
        #[ignore = "a subprocess entry point, run by the writer scenarios"]
        fn writer_host_process() {
            $crate::common::isulad::writer_host_main();
        }
    };
}
#[allow(unused_imports)]
pub(crate) use writer_host_entry;

// ---- Names and paths ----

/// `overlay/RO/<id>`: a read-only layer's overlay (driver) directory in the shared area.
pub fn overlay_dir(id: &str) -> String {
    format!("overlay/RO/{id}")
}

/// `overlay-layers/RO/<id>`: the layer's metadata directory.
pub fn meta_dir(id: &str) -> String {
    format!("overlay-layers/RO/{id}")
}

/// `overlay-layers/RO/<id>/<id>.tar-split.gz`.
pub fn tar_split_path(id: &str) -> String {
    format!("{}/{id}.tar-split.gz", meta_dir(id))
}

/// `overlay-images/<id>`: an image's directory (the whole images area is shared; it has no
/// `RO/`).
pub fn image_dir(id: &str) -> String {
    format!("overlay-images/{id}")
}

/// The file name of image `id`'s config: its big-data key `sha256:<id>` has a character
/// outside `[a-z0-9.]`, so the name is `=` and the key in standard base64.
pub fn config_name(id: &str) -> String {
    format!("={}", b64(format!("sha256:{id}").as_bytes()))
}

/// Where `util_atomic_write_file` writes `path` first: `.tmp-<name>-<10 hex>` in the same
/// directory, renamed over `path` once written.
pub fn atomic_tmp(path: &Path, n: u64) -> PathBuf {
    let name = path.file_name().unwrap().to_string_lossy();
    path.with_file_name(format!(".tmp-{name}-{n:010x}"))
}

/// `data` as one gzip stream, as `util_gzip_z` writes the tar-split.
pub fn gzip(data: &[u8]) -> Vec<u8> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(data).unwrap();
    gz.finish().unwrap()
}

// ---- Layers and images in iSulad's format ----

pub fn sha256_hex(data: &[u8]) -> String {
    format!("{:x}", Sha256::digest(data))
}

/// A remote layer as a writer host lays it out (DESIGN §4.1), named as iSulad names it: a
/// base layer by its diff ID, every further one `sha256(parent + "+" + diffID)`.
#[derive(Debug, Clone)]
pub struct Layer {
    pub label: String,
    pub id: String,
    /// The digest of the layer's uncompressed diff (`diff-digest`).
    pub diff_id: String,
    pub short: String,
    pub parent: Option<String>,
    /// `lower`: the ancestors' short ids, nearest first; empty for a base layer.
    pub lower: Vec<String>,
    /// Files of `diff/`: name, content.
    pub files: Vec<(String, Vec<u8>)>,
}

pub fn short_of(seed: &str) -> String {
    sha256_hex(format!("scenario-short:{seed}").as_bytes())[..26].to_owned()
}

impl Layer {
    pub fn base(label: &str) -> Layer {
        let diff_id = sha256_hex(format!("scenario-layer:{label}").as_bytes());
        Layer {
            label: label.to_owned(),
            id: diff_id.clone(),
            diff_id,
            short: short_of(label),
            parent: None,
            lower: Vec::new(),
            files: vec![(
                "hello".to_owned(),
                format!("hello from layer {label}\n").into_bytes(),
            )],
        }
    }

    pub fn child(label: &str, parent: &Layer) -> Layer {
        let mut lower = vec![parent.short.clone()];
        lower.extend(parent.lower.iter().cloned());
        let base = Layer::base(label);
        Layer {
            id: sha256_hex(format!("{}+{}", parent.id, base.diff_id).as_bytes()),
            parent: Some(parent.id.clone()),
            lower,
            ..base
        }
    }

    /// Three layers, each the parent of the next.
    pub fn chain(labels: [&str; 3]) -> [Layer; 3] {
        let a = Layer::base(labels[0]);
        let b = Layer::child(labels[1], &a);
        let c = Layer::child(labels[2], &b);
        [a, b, c]
    }

    pub fn overlay(&self) -> String {
        overlay_dir(&self.id)
    }

    pub fn meta(&self) -> String {
        meta_dir(&self.id)
    }

    pub fn tar_split_path(&self) -> String {
        tar_split_path(&self.id)
    }

    pub fn lower_text(&self) -> Option<String> {
        (!self.lower.is_empty()).then(|| {
            self.lower
                .iter()
                .map(|s| format!("l/{s}"))
                .collect::<Vec<_>>()
                .join(":")
        })
    }

    /// `overlay/RO/<id>` with its writer symlink, in `mk_sub_directories` order, up to and
    /// including `lower` (or `empty/`); `diff/` stays empty until the diff is applied.
    pub fn overlay_skeleton(&self) -> Vec<Op> {
        let mut ops = self.overlay_skeleton_without_lower();
        ops.extend(self.lower_op());
        ops
    }

    pub fn overlay_skeleton_without_lower(&self) -> Vec<Op> {
        let dir = self.overlay();
        vec![
            Op::Mkdir(dir.clone()),
            Op::Symlink {
                target: format!("{WRITER_STORAGE}/overlay/RO/{}", self.id),
                path: format!("overlay/{}", self.id),
            },
            Op::Mkdir(format!("{dir}/diff")),
            Op::Mkdir("overlay/l".into()),
            Op::Symlink {
                target: format!("../{}/diff", self.id),
                path: format!("overlay/l/{}", self.short),
            },
            write_atomic_op(&format!("{dir}/link"), 0o644, self.short.as_bytes()),
            Op::Mkdir(format!("{dir}/work")),
            Op::Mkdir(format!("{dir}/merged")),
        ]
    }

    /// The last step of the overlay dir: `lower` for a child, `empty/` for a base layer.
    pub fn lower_op(&self) -> Vec<Op> {
        match self.lower_text() {
            Some(lower) => vec![write_atomic_op(
                &format!("{}/lower", self.overlay()),
                0o644,
                lower.as_bytes(),
            )],
            None => vec![Op::Mkdir(format!("{}/empty", self.overlay()))],
        }
    }

    /// The diff applied into `diff/`.
    pub fn diff_files(&self) -> Vec<Op> {
        self.files
            .iter()
            .map(|(name, data)| Op::WriteInPlace {
                path: format!("{}/diff/{name}", self.overlay()),
                data: b64(data),
            })
            .collect()
    }

    pub fn layer_json(&self, incomplete: bool) -> Vec<u8> {
        let mut v = serde_json::json!({
            "id": self.id,
            "created": "2026-01-01T00:00:00.000000000Z",
            "compressed-diff-digest": format!("sha256:{}", sha256_hex(self.label.as_bytes())),
            "compressed-size": 1234,
            "diff-digest": format!("sha256:{}", self.diff_id),
            "incompelte": incomplete,
        });
        if let Some(parent) = &self.parent {
            v["parent"] = Value::String(parent.clone());
        }
        if !incomplete {
            v["diff-size"] = serde_json::json!(self.files.iter().map(|f| f.1.len()).sum::<usize>());
        }
        serde_json::to_vec(&v).unwrap()
    }

    /// `overlay-layers/RO/<id>` with its writer symlink and `layer.json` saved with
    /// `"incompelte": true`, as before `apply_diff`.
    pub fn meta_begin(&self) -> Vec<Op> {
        vec![
            Op::Mkdir(self.meta()),
            Op::Symlink {
                target: format!("{WRITER_STORAGE}/overlay-layers/RO/{}", self.id),
                path: format!("overlay-layers/{}", self.id),
            },
            write_atomic_op(
                &format!("{}/layer.json", self.meta()),
                0o600,
                &self.layer_json(true),
            ),
        ]
    }

    /// The tar-split: gzip'ed JSON lines in tar-split's entry format.
    pub fn tar_split(&self) -> Vec<u8> {
        let mut lines = String::new();
        for (pos, (name, data)) in self.files.iter().enumerate() {
            let entry = serde_json::json!({
                "type": 1,
                "name": name,
                "size": data.len(),
                "payload": b64(&Sha256::digest(data)[..8]),
                "position": pos,
            });
            lines.push_str(&format!("{entry}\n"));
        }
        gzip(lines.as_bytes())
    }

    pub fn tar_split_op(&self) -> Op {
        Op::WriteInPlace {
            path: self.tar_split_path(),
            data: b64(&self.tar_split()),
        }
    }

    /// `layer.json` saved again with `"incompelte": false` after `apply_diff`.
    pub fn meta_end(&self) -> Vec<Op> {
        vec![write_atomic_op(
            &format!("{}/layer.json", self.meta()),
            0o600,
            &self.layer_json(false),
        )]
    }

    /// The metadata dir, complete.
    pub fn meta_complete(&self) -> Vec<Op> {
        let mut ops = self.meta_begin();
        ops.push(self.tar_split_op());
        ops.extend(self.meta_end());
        ops
    }

    /// The overlay dir, complete with its diff.
    pub fn overlay_complete(&self) -> Vec<Op> {
        let mut ops = self.overlay_skeleton();
        ops.extend(self.diff_files());
        ops
    }

    /// A whole layer in iSulad's order: driver dir, metadata saved incomplete, the diff
    /// applied (files, tar-split), metadata saved complete.
    pub fn create(&self) -> Vec<Op> {
        let mut ops = self.overlay_skeleton();
        ops.extend(self.meta_begin());
        ops.extend(self.diff_files());
        ops.push(self.tar_split_op());
        ops.extend(self.meta_end());
        ops
    }

    /// `overlay2_rm_layer`: unlink `l/<short>`, unlink the `overlay/<id>` symlink, remove
    /// `overlay/RO/<id>`.
    pub fn remove_overlay(&self) -> Vec<Op> {
        vec![
            Op::Unlink(format!("overlay/l/{}", self.short)),
            Op::Unlink(format!("overlay/{}", self.id)),
            Op::RemoveAll(self.overlay()),
        ]
    }

    /// The layer store's part of a removal: its symlink and `overlay-layers/RO/<id>`.
    pub fn remove_meta(&self) -> Vec<Op> {
        vec![
            Op::Unlink(format!("overlay-layers/{}", self.id)),
            Op::RemoveAll(self.meta()),
        ]
    }

    /// A whole layer removal: driver first, then the layer store.
    pub fn remove(&self) -> Vec<Op> {
        let mut ops = self.remove_overlay();
        ops.extend(self.remove_meta());
        ops
    }
}

/// A remote image as a writer host lays it out (DESIGN §4.1).
#[derive(Debug, Clone)]
pub struct Image {
    pub label: String,
    pub id: String,
    pub top: String,
    pub names: Vec<String>,
    pub config: Vec<u8>,
    pub manifest: Vec<u8>,
}

impl Image {
    pub fn on(label: &str, top: &Layer, names: &[&str]) -> Image {
        let config = serde_json::to_vec(&serde_json::json!({
            "architecture": "amd64",
            "os": "linux",
            "config": {"Labels": {"scenario": label}},
            "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{}", top.diff_id)]},
        }))
        .unwrap();
        let id = sha256_hex(&config);
        let manifest = serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
            "config": {
                "mediaType": "application/vnd.docker.container.image.v1+json",
                "size": config.len(),
                "digest": format!("sha256:{id}"),
            },
            "layers": [],
        }))
        .unwrap();
        Image {
            label: label.to_owned(),
            id,
            top: top.id.clone(),
            names: names.iter().map(|n| n.to_string()).collect(),
            config,
            manifest,
        }
    }

    pub fn dir(&self) -> String {
        image_dir(&self.id)
    }

    pub fn config_name(&self) -> String {
        config_name(&self.id)
    }

    /// `images.json` at a stage of `register_image`.
    pub fn images_json(&self, names: &[String], stage: usize) -> Vec<u8> {
        let mut v = serde_json::json!({
            "id": self.id,
            "digest": format!("sha256:{}", sha256_hex(&self.manifest)),
            "layer": self.top,
            "metadata": "{}",
            "created": "2026-01-01T00:00:00Z",
        });
        if stage >= 1 {
            v["names"] = serde_json::json!(names);
        }
        if stage >= 2 {
            let key = format!("sha256:{}", self.id);
            v["big-data-names"] = serde_json::json!([key, "manifest"]);
            v["big-data-sizes"] = serde_json::json!({
                key.clone(): self.config.len(),
                "manifest": self.manifest.len(),
            });
            v["big-data-digests"] = serde_json::json!({
                key.clone(): key,
                "manifest": format!("sha256:{}", sha256_hex(&self.manifest)),
            });
        }
        if stage >= 3 {
            v["loaded"] = Value::String("2026-01-02T00:00:00.000000000Z".into());
        }
        if stage >= 4 {
            v["size"] = serde_json::json!(4242);
        }
        serde_json::to_vec(&v).unwrap()
    }

    pub fn write_json(&self, names: &[String], stage: usize) -> Op {
        write_atomic_op(
            &format!("{}/images.json", self.dir()),
            0o600,
            &self.images_json(names, stage),
        )
    }

    /// `register_image`: create, add names, set config, set manifest, loaded time, size;
    /// each rewriting `images.json`.
    pub fn create(&self) -> Vec<Op> {
        let dir = self.dir();
        vec![
            Op::Mkdir(dir.clone()),
            self.write_json(&[], 0),
            self.write_json(&self.names, 1),
            write_atomic_op(
                &format!("{dir}/{}", self.config_name()),
                0o600,
                &self.config,
            ),
            self.write_json(&self.names, 2),
            write_atomic_op(&format!("{dir}/manifest"), 0o600, &self.manifest),
            self.write_json(&self.names, 2),
            self.write_json(&self.names, 3),
            self.write_json(&self.names, 4),
        ]
    }

    /// A re-tag: `images.json` rewritten with other names.
    pub fn retag(&mut self, names: &[&str]) -> Vec<Op> {
        self.names = names.iter().map(|n| n.to_string()).collect();
        vec![self.write_json(&self.names, 4)]
    }

    pub fn remove(&self) -> Vec<Op> {
        vec![Op::RemoveAll(self.dir())]
    }
}

pub fn concat(parts: impl IntoIterator<Item = Vec<Op>>) -> Vec<Op> {
    parts.into_iter().flatten().collect()
}

// ---- Objects written at once ----

/// Writes `bytes` to `path` the way iSulad does: a temporary file, then `rename(2)`.
pub fn write_atomic(path: &Path, bytes: &[u8]) {
    let tmp = atomic_tmp(path, 0x01_2345_6789);
    fs::write(&tmp, bytes).unwrap();
    fs::rename(&tmp, path).unwrap();
}

/// A gzip stream of one tar-split line.
pub fn tar_split_gz() -> Vec<u8> {
    gzip(br#"{"type":1,"name":"hello","size":13,"payload":"kGuXHeJgaa0="}"#)
}

/// Writes a base layer `id` (short id `short`) into a remote tree as a writer host does:
/// the overlay dir with what `mk_sub_directories` makes in it for a base layer, `diff/`
/// holding one file `hello` with `content`, then the metadata dir. `tar_split` is the
/// tar-split file's content (complete or not).
pub fn write_base_layer(remote: &Path, id: &str, short: &str, content: &str, tar_split: &[u8]) {
    let overlay = remote.join(overlay_dir(id));
    fs::create_dir_all(overlay.join("diff")).unwrap();
    fs::write(overlay.join("diff/hello"), content).unwrap();
    write_atomic(&overlay.join("link"), short.as_bytes());
    fs::create_dir_all(overlay.join("work")).unwrap();
    fs::create_dir_all(overlay.join("merged")).unwrap();
    fs::create_dir_all(overlay.join("empty")).unwrap();
    let meta = remote.join(meta_dir(id));
    fs::create_dir_all(&meta).unwrap();
    let json = format!(r#"{{"id":"{id}","diff-digest":"sha256:{id}","incompelte":false}}"#);
    write_atomic(&meta.join("layer.json"), json.as_bytes());
    fs::write(remote.join(tar_split_path(id)), tar_split).unwrap();
}

/// Writes image `id` on top layer `top` with repository names `names`, as iSulad does.
pub fn write_image(remote: &Path, id: &str, top: &str, names: &[&str]) {
    let dir = remote.join(image_dir(id));
    fs::create_dir_all(&dir).unwrap();
    write_atomic(
        &dir.join("images.json"),
        image_json(id, top, names).as_bytes(),
    );
    write_atomic(&dir.join(config_name(id)), br#"{"architecture":"amd64"}"#);
    write_atomic(&dir.join("manifest"), br#"{"schemaVersion":2}"#);
}

/// A minimal `images.json`: id, names, top layer and size.
pub fn image_json(id: &str, top: &str, names: &[&str]) -> String {
    let names: Vec<String> = names.iter().map(|n| format!("\"{n}\"")).collect();
    format!(
        r#"{{"id":"{id}","names":[{}],"layer":"{top}","size":42}}"#,
        names.join(",")
    )
}
