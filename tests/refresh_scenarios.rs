//! Writer-host scenarios (DESIGN §4.3, §5): a separate process plays the writer host and
//! changes the remote tree while it is mounted, in iSulad's write order, one step at a time.
//! The mount runs with `refresh=0`, so rounds happen only when the test asks for one with
//! `layerfs refresh`; after each step the test looks at what a process sees through the mount.
//!
//! The writer process is this test binary run again with [`WRITER_OPS`] set: the
//! `writer_host_process` test then performs the operations it is given and exits. Run
//! without that variable, it does nothing.

mod common;

use std::collections::BTreeSet;
use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

use common::*;

/// The file holding the writer process's operations, as JSON.
const WRITER_OPS: &str = "LAYERFS_SCENARIO_WRITER_OPS";
/// The remote root the writer process works in.
const WRITER_ROOT: &str = "LAYERFS_SCENARIO_WRITER_ROOT";
/// Where the writer host's own absolute links point (its storage root).
const WRITER_STORAGE: &str = "/var/lib/isulad/storage";

// ---- The writer host ----

/// One file-system operation of the writer host, paths relative to the remote root.
#[derive(Debug, Clone, Serialize, Deserialize)]
enum Op {
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

fn b64(data: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(data)
}

fn unb64(data: &str) -> Vec<u8> {
    base64::engine::general_purpose::STANDARD
        .decode(data)
        .expect("writer data is base64")
}

fn write_atomic_op(path: &str, mode: u32, data: &[u8]) -> Op {
    Op::WriteAtomic {
        path: path.to_owned(),
        mode,
        data: b64(data),
    }
}

/// Runs `ops` in a separate writer process and waits for it. The mount's remote check then
/// takes the changed remote as its reference.
fn writer(m: &mut Mount, ops: Vec<Op>) {
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
    m.accept_remote_changes();
}

/// The writer host's side, a subprocess entry point and not a test: [`writer`] runs this
/// binary again with `--ignored --exact writer_host_process`.
#[test]
#[ignore = "a subprocess entry point, run by the writer scenarios"]
fn writer_host_process() {
    let (Ok(ops), Ok(root)) = (std::env::var(WRITER_OPS), std::env::var(WRITER_ROOT)) else {
        return;
    };
    let root = PathBuf::from(root);
    let ops = fs::read(&ops).expect("the writer ops file");
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
                let name = target.file_name().unwrap().to_string_lossy().into_owned();
                let tmp = target.with_file_name(format!(".tmp-{name}-{:010x}", 0xa5a5_0000 + n));
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
}

// ---- Layers and images in iSulad's format ----

fn sha256_hex(data: &[u8]) -> String {
    format!("{:x}", Sha256::digest(data))
}

/// A remote layer as a writer host lays it out (DESIGN §4.1).
#[derive(Debug, Clone)]
struct Layer {
    label: String,
    id: String,
    short: String,
    parent: Option<String>,
    /// `lower`: the ancestors' short ids, nearest first; empty for a base layer.
    lower: Vec<String>,
    /// Files of `diff/`: name, content.
    files: Vec<(String, Vec<u8>)>,
}

fn short_of(seed: &str) -> String {
    sha256_hex(format!("scenario-short:{seed}").as_bytes())[..26].to_owned()
}

impl Layer {
    fn base(label: &str) -> Layer {
        Layer {
            label: label.to_owned(),
            id: sha256_hex(format!("scenario-layer:{label}").as_bytes()),
            short: short_of(label),
            parent: None,
            lower: Vec::new(),
            files: vec![(
                "hello".to_owned(),
                format!("hello from layer {label}\n").into_bytes(),
            )],
        }
    }

    fn child(label: &str, parent: &Layer) -> Layer {
        let mut lower = vec![parent.short.clone()];
        lower.extend(parent.lower.iter().cloned());
        Layer {
            parent: Some(parent.id.clone()),
            lower,
            ..Layer::base(label)
        }
    }

    /// Three layers, each the parent of the next.
    fn chain(labels: [&str; 3]) -> [Layer; 3] {
        let a = Layer::base(labels[0]);
        let b = Layer::child(labels[1], &a);
        let c = Layer::child(labels[2], &b);
        [a, b, c]
    }

    fn overlay(&self) -> String {
        format!("overlay/RO/{}", self.id)
    }

    fn meta(&self) -> String {
        format!("overlay-layers/RO/{}", self.id)
    }

    fn tar_split_path(&self) -> String {
        format!("{}/{}.tar-split.gz", self.meta(), self.id)
    }

    fn lower_text(&self) -> Option<String> {
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
    fn overlay_skeleton(&self) -> Vec<Op> {
        let mut ops = self.overlay_skeleton_without_lower();
        ops.extend(self.lower_op());
        ops
    }

    fn overlay_skeleton_without_lower(&self) -> Vec<Op> {
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
    fn lower_op(&self) -> Vec<Op> {
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
    fn diff_files(&self) -> Vec<Op> {
        self.files
            .iter()
            .map(|(name, data)| Op::WriteInPlace {
                path: format!("{}/diff/{name}", self.overlay()),
                data: b64(data),
            })
            .collect()
    }

    fn layer_json(&self, incomplete: bool) -> Vec<u8> {
        let mut v = serde_json::json!({
            "id": self.id,
            "created": "2026-01-01T00:00:00.000000000Z",
            "compressed-diff-digest": format!("sha256:{}", sha256_hex(self.label.as_bytes())),
            "compressed-size": 1234,
            "diff-digest": format!("sha256:{}", self.id),
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
    fn meta_begin(&self) -> Vec<Op> {
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
    fn tar_split(&self) -> Vec<u8> {
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
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        gz.write_all(lines.as_bytes()).unwrap();
        gz.finish().unwrap()
    }

    fn tar_split_op(&self) -> Op {
        Op::WriteInPlace {
            path: self.tar_split_path(),
            data: b64(&self.tar_split()),
        }
    }

    /// `layer.json` saved again with `"incompelte": false` after `apply_diff`.
    fn meta_end(&self) -> Vec<Op> {
        vec![write_atomic_op(
            &format!("{}/layer.json", self.meta()),
            0o600,
            &self.layer_json(false),
        )]
    }

    /// The metadata dir, complete.
    fn meta_complete(&self) -> Vec<Op> {
        let mut ops = self.meta_begin();
        ops.push(self.tar_split_op());
        ops.extend(self.meta_end());
        ops
    }

    /// The overlay dir, complete with its diff.
    fn overlay_complete(&self) -> Vec<Op> {
        let mut ops = self.overlay_skeleton();
        ops.extend(self.diff_files());
        ops
    }

    /// A whole layer in iSulad's order: driver dir, metadata saved incomplete, the diff
    /// applied (files, tar-split), metadata saved complete.
    fn create(&self) -> Vec<Op> {
        let mut ops = self.overlay_skeleton();
        ops.extend(self.meta_begin());
        ops.extend(self.diff_files());
        ops.push(self.tar_split_op());
        ops.extend(self.meta_end());
        ops
    }

    /// `overlay2_rm_layer`: unlink `l/<short>`, unlink the `overlay/<id>` symlink, remove
    /// `overlay/RO/<id>`.
    fn remove_overlay(&self) -> Vec<Op> {
        vec![
            Op::Unlink(format!("overlay/l/{}", self.short)),
            Op::Unlink(format!("overlay/{}", self.id)),
            Op::RemoveAll(self.overlay()),
        ]
    }

    /// The layer store's part of a removal: its symlink and `overlay-layers/RO/<id>`.
    fn remove_meta(&self) -> Vec<Op> {
        vec![
            Op::Unlink(format!("overlay-layers/{}", self.id)),
            Op::RemoveAll(self.meta()),
        ]
    }

    /// A whole layer removal: driver first, then the layer store.
    fn remove(&self) -> Vec<Op> {
        let mut ops = self.remove_overlay();
        ops.extend(self.remove_meta());
        ops
    }
}

/// A remote image as a writer host lays it out (DESIGN §4.1).
#[derive(Debug, Clone)]
struct Image {
    label: String,
    id: String,
    top: String,
    names: Vec<String>,
    config: Vec<u8>,
    manifest: Vec<u8>,
}

impl Image {
    fn on(label: &str, top: &Layer, names: &[&str]) -> Image {
        let config = serde_json::to_vec(&serde_json::json!({
            "architecture": "amd64",
            "os": "linux",
            "config": {"Labels": {"scenario": label}},
            "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{}", top.id)]},
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

    fn dir(&self) -> String {
        format!("overlay-images/{}", self.id)
    }

    fn config_name(&self) -> String {
        format!("={}", b64(format!("sha256:{}", self.id).as_bytes()))
    }

    /// `images.json` at a stage of `register_image`.
    fn images_json(&self, names: &[String], stage: usize) -> Vec<u8> {
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

    fn write_json(&self, names: &[String], stage: usize) -> Op {
        write_atomic_op(
            &format!("{}/images.json", self.dir()),
            0o600,
            &self.images_json(names, stage),
        )
    }

    /// `register_image`: create, add names, set config, set manifest, loaded time, size;
    /// each rewriting `images.json`.
    fn create(&self) -> Vec<Op> {
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
    fn retag(&mut self, names: &[&str]) -> Vec<Op> {
        self.names = names.iter().map(|n| n.to_string()).collect();
        vec![self.write_json(&self.names, 4)]
    }

    fn remove(&self) -> Vec<Op> {
        vec![Op::RemoveAll(self.dir())]
    }
}

fn concat(parts: impl IntoIterator<Item = Vec<Op>>) -> Vec<Op> {
    parts.into_iter().flatten().collect()
}

// ---- The mount and its control socket ----

fn on_demand() -> Options {
    Options {
        opts: "refresh=0".into(),
        ..Options::default()
    }
}

/// A fixture mount whose rounds run only on demand.
fn mount() -> Mount {
    Mount::with(on_demand(), |_| {})
}

/// `layerfs refresh --json`: runs a round, which must succeed; returns its report.
fn refresh(m: &Mount) -> Value {
    let out = cli(&["refresh", "--json"], &m.mnt);
    assert!(
        out.status.success(),
        "layerfs refresh failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("refresh --json prints JSON")
}

/// `layerfs status --json`.
fn status(m: &Mount) -> Value {
    let out = cli(&["status", "--json"], &m.mnt);
    assert!(
        out.status.success(),
        "layerfs status failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("status --json prints JSON")
}

/// The ids a round report lists under `key` (`added`, `removed`, `changed`), as `kind id`.
fn listed(round: &Value, key: &str) -> BTreeSet<String> {
    round[key]
        .as_array()
        .unwrap_or_else(|| panic!("no {key} in {round}"))
        .iter()
        .map(|o| {
            format!(
                "{} {}",
                o["kind"].as_str().unwrap(),
                o["id"].as_str().unwrap()
            )
        })
        .collect()
}

fn refs(layers: &[&Layer], images: &[&Image]) -> BTreeSet<String> {
    layers
        .iter()
        .map(|l| format!("layer {}", l.id))
        .chain(images.iter().map(|i| format!("image {}", i.id)))
        .collect()
}

/// The reason `status` gives for a not-ready object, if it lists it.
/// The entry `images --json` prints for image `id`, if it lists one.
fn cli_image(m: &Mount, id: &str) -> Option<Value> {
    let out = cli(&["images", "--json"], &m.mnt);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .find(|i| i["id"] == id)
        .cloned()
}

fn not_ready_reason(status: &Value, kind: &str, id: &str) -> Option<String> {
    status["last_round"]["not_ready"]
        .as_array()
        .unwrap_or_else(|| panic!("no not_ready in {status}"))
        .iter()
        .find(|n| n["kind"] == kind && n["name"].as_str() == Some(id))
        .map(|n| n["reason"].as_str().unwrap_or_default().to_owned())
}

// ---- What a process sees through the mount ----

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_owned())
        .collect()
}

fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v.dedup();
    v
}

fn absent(p: &Path) {
    match fs::symlink_metadata(p) {
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
        other => panic!("{} should not exist in the view: {other:?}", p.display()),
    }
}

fn read(p: &Path) -> Vec<u8> {
    fs::read(p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()))
}

/// Every symlink the view shows in the layer dirs resolves to a directory.
fn assert_links_resolve(m: &Mount) {
    for dir in ["overlay", "overlay/l", "overlay-layers"] {
        for name in names(&m.path(dir)) {
            let p = m.path(dir).join(&name);
            let meta = fs::symlink_metadata(&p).unwrap_or_else(|e| panic!("lstat {p:?}: {e}"));
            if meta.file_type().is_symlink() {
                let target = fs::metadata(&p)
                    .unwrap_or_else(|e| panic!("{} is a dangling link: {e}", p.display()));
                assert!(target.is_dir(), "{} does not lead to a dir", p.display());
            }
        }
    }
}

/// Checks the whole remote part of the view: exactly the fixture's ready objects plus
/// `visible` of the scenario's are served, with their links, metadata and content; the
/// scenario's other objects are nowhere; no link dangles.
/// Checks that both per-layer directories list exactly the layers `ids`.
fn assert_layer_dirs(m: &Mount, ids: &[String]) {
    assert_eq!(names(&m.path("overlay/RO")), ids, "overlay/RO");
    assert_eq!(
        names(&m.path("overlay-layers/RO")),
        ids,
        "overlay-layers/RO"
    );
}

fn expect_view(m: &Mount, layers: &[&Layer], images: &[&Image], visible: &[&str]) {
    for label in visible {
        assert!(
            layers.iter().any(|l| l.label == *label) || images.iter().any(|i| i.label == *label),
            "no scenario object {label}"
        );
    }
    let exp = expected();
    let shown = |label: &str| visible.contains(&label);
    let mut ids = strings(&exp["ready_layers"]);
    let mut shorts: Vec<String> = ids
        .iter()
        .map(|i| exp["layer_shorts"][i].as_str().unwrap().to_owned())
        .collect();
    let mut image_ids = strings(&exp["ready_images"]);
    for l in layers.iter().filter(|l| shown(&l.label)) {
        ids.push(l.id.clone());
        shorts.push(l.short.clone());
    }
    for i in images.iter().filter(|i| shown(&i.label)) {
        image_ids.push(i.id.clone());
    }
    let ids = sorted(ids);
    let with = |extra: &[&str]| {
        sorted(
            ids.iter()
                .cloned()
                .chain(extra.iter().map(|s| s.to_string()))
                .collect(),
        )
    };
    assert_layer_dirs(m, &ids);
    assert_eq!(names(&m.path("overlay")), with(&["RO", "l"]), "overlay");
    assert_eq!(
        names(&m.path("overlay-layers")),
        with(&["RO"]),
        "overlay-layers"
    );
    assert_eq!(names(&m.path("overlay/l")), sorted(shorts), "overlay/l");
    assert_eq!(
        names(&m.path("overlay-images")),
        sorted(image_ids),
        "overlay-images"
    );

    for l in layers {
        let paths = [
            m.path("overlay").join(&l.id),
            m.path("overlay/RO").join(&l.id),
            m.path("overlay-layers").join(&l.id),
            m.path("overlay-layers/RO").join(&l.id),
            m.path("overlay/l").join(&l.short),
        ];
        if !shown(&l.label) {
            paths.iter().for_each(|p| absent(p));
            continue;
        }
        for home in ["overlay", "overlay-layers"] {
            let link = m.path(home).join(&l.id);
            assert!(fs::symlink_metadata(&link)
                .unwrap()
                .file_type()
                .is_symlink());
            assert_eq!(
                fs::read_link(&link).unwrap(),
                m.mnt.join(home).join("RO").join(&l.id),
                "{home}/{}",
                l.label
            );
            assert!(fs::metadata(&link).unwrap().is_dir());
        }
        let l_link = m.path("overlay/l").join(&l.short);
        assert_eq!(
            fs::read_link(&l_link).unwrap(),
            Path::new("..").join(&l.id).join("diff"),
            "l/ link of {}",
            l.label
        );
        for (name, data) in &l.files {
            assert_eq!(
                &read(&l_link.join(name)),
                data,
                "{name} via l/ of {}",
                l.label
            );
            assert_eq!(
                &read(&m.path("overlay").join(&l.id).join("diff").join(name)),
                data,
                "{name} via overlay/<id> of {}",
                l.label
            );
        }
        let ro = m.path("overlay/RO").join(&l.id);
        assert_eq!(read(&ro.join("link")), l.short.as_bytes());
        match l.lower_text() {
            Some(lower) => assert_eq!(read(&ro.join("lower")), lower.as_bytes()),
            None => absent(&ro.join("lower")),
        }
        let json = m.path("overlay-layers").join(&l.id).join("layer.json");
        assert_eq!(
            read(&json),
            read(&m.remote.join(l.meta()).join("layer.json"))
        );
    }

    for i in images {
        let dir = m.path("overlay-images").join(&i.id);
        if !shown(&i.label) {
            absent(&dir);
            continue;
        }
        assert!(fs::symlink_metadata(&dir).unwrap().is_dir());
        for name in [
            "images.json".to_owned(),
            "manifest".to_owned(),
            i.config_name(),
        ] {
            let remote = read(&m.remote.join(i.dir()).join(&name));
            assert_eq!(read(&dir.join(&name)), remote, "{}/{name}", i.label);
            assert_eq!(
                fs::metadata(dir.join(&name)).unwrap().len(),
                remote.len() as u64,
                "{}/{name} size",
                i.label
            );
        }
        let json: Value = serde_json::from_slice(&read(&dir.join("images.json"))).unwrap();
        assert_eq!(json["names"], serde_json::json!(i.names), "{}", i.label);
    }
    assert_links_resolve(m);
}

/// Looks every scenario path up (and reads the listings) so that the kernel caches them,
/// entries that exist and failed lookups alike: a round must invalidate what it changes.
fn warm(m: &Mount, layers: &[&Layer], images: &[&Image]) {
    for dir in [
        "overlay",
        "overlay/RO",
        "overlay/l",
        "overlay-layers",
        "overlay-layers/RO",
        "overlay-images",
    ] {
        names(&m.path(dir));
    }
    for l in layers {
        for p in [
            m.path("overlay").join(&l.id),
            m.path("overlay/RO").join(&l.id),
            m.path("overlay-layers").join(&l.id),
            m.path("overlay-layers/RO").join(&l.id),
            m.path("overlay/l").join(&l.short),
        ] {
            let _ = fs::symlink_metadata(&p);
            let _ = fs::metadata(&p);
        }
        for (name, _) in &l.files {
            let _ = fs::read(m.path("overlay/l").join(&l.short).join(name));
        }
    }
    for i in images {
        let _ = fs::read(m.path("overlay-images").join(&i.id).join("images.json"));
    }
}

// ---- Scenarios ----

/// Scenario 1: A whole pull written at once: a layer chain and two images appear after one
/// round.
#[test]
fn a_pull_written_at_once_appears_after_one_round() {
    let mut m = mount();
    let [a, b, c] = Layer::chain(["pull-a", "pull-b", "pull-c"]);
    let top = Image::on("pull-top", &c, &["registry.example/pull:2"]);
    let mid = Image::on("pull-mid", &b, &["registry.example/pull:1"]);
    let (layers, images) = ([&a, &b, &c], [&top, &mid]);
    warm(&m, &layers, &images);
    expect_view(&m, &layers, &images, &[]);

    writer(
        &mut m,
        concat([
            a.create(),
            b.create(),
            c.create(),
            top.create(),
            mid.create(),
        ]),
    );
    let round = refresh(&m);
    assert_eq!(listed(&round, "added"), refs(&layers, &images), "{round}");
    assert!(listed(&round, "removed").is_empty(), "{round}");
    expect_view(
        &m,
        &layers,
        &images,
        &["pull-a", "pull-b", "pull-c", "pull-top", "pull-mid"],
    );

    // The stack iSulad would mount for the top layer resolves through the view.
    let lower = String::from_utf8(read(&m.path("overlay/RO").join(&c.id).join("lower"))).unwrap();
    for entry in lower.split(':') {
        assert!(
            m.path("overlay").join(entry).join("hello").is_file(),
            "{entry}"
        );
    }
    let names_of_top = cli_image(&m, &top.id).map(|i| i["names"].clone());
    assert_eq!(
        names_of_top,
        Some(serde_json::json!(["registry.example/pull:2"]))
    );

    // A second round with nothing new changes nothing.
    let out = cli(&["refresh"], &m.mnt);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(": 0 added, 0 removed, 0 changed\n"), "{text}");
    assert!(text.contains("ready: 7 layers, 4 images"), "{text}");
}

/// Scenario 2: An image written before its layers stays invisible until its whole chain is
/// ready.
#[test]
fn an_image_before_its_layers_waits_for_the_whole_chain() {
    let mut m = mount();
    let a = Layer::base("early-a");
    let b = Layer::child("early-b", &a);
    let img = Image::on("early-img", &b, &["early:latest"]);
    let (layers, images) = ([&a, &b], [&img]);

    writer(&mut m, img.create());
    refresh(&m);
    expect_view(&m, &layers, &images, &[]);
    let reason =
        not_ready_reason(&status(&m), "image", &img.id).expect("image listed as not ready");
    assert!(reason.contains(&b.id), "{reason}");

    writer(&mut m, a.create());
    let round = refresh(&m);
    assert_eq!(listed(&round, "added"), refs(&[&a], &[]), "{round}");
    expect_view(&m, &layers, &images, &["early-a"]);

    // The top layer half-written: still nothing of the image.
    writer(&mut m, concat([b.overlay_skeleton(), b.meta_begin()]));
    refresh(&m);
    expect_view(&m, &layers, &images, &["early-a"]);

    writer(
        &mut m,
        concat([b.diff_files(), vec![b.tar_split_op()], b.meta_end()]),
    );
    let round = refresh(&m);
    assert_eq!(listed(&round, "added"), refs(&[&b], &[&img]), "{round}");
    expect_view(&m, &layers, &images, &["early-a", "early-b", "early-img"]);
    assert_eq!(not_ready_reason(&status(&m), "image", &img.id), None);
}

/// Scenario 2b: An image written step by step on ready layers (`register_image`): invisible
/// until its config and manifest are both there, then each later rewrite of `images.json`
/// is a change the view follows.
#[test]
fn an_image_registered_step_by_step_appears_with_its_manifest() {
    let mut m = mount();
    let l = Layer::base("register-l");
    let img = Image::on("register-img", &l, &["register:latest"]);
    writer(&mut m, l.create());
    refresh(&m);
    let ops = img.create();
    // create + add_name; set_config (config, then images.json); set_manifest (manifest,
    // then images.json); set_loaded_time; set_image_size.
    let steps: [(std::ops::Range<usize>, bool); 6] = [
        (0..3, false),
        (3..4, false),
        (4..5, false),
        (5..7, true),
        (7..8, true),
        (8..9, true),
    ];
    assert_eq!(ops.len(), 9);
    let mut was_visible = false;
    for (range, visible) in steps {
        writer(&mut m, ops[range.clone()].to_vec());
        let round = refresh(&m);
        let shown: &[&str] = if visible {
            &["register-l", "register-img"]
        } else {
            &["register-l"]
        };
        expect_view(&m, &[&l], &[&img], shown);
        let expected_key = match (was_visible, visible) {
            (false, true) => "added",
            (true, true) => "changed",
            _ => "",
        };
        for key in ["added", "changed", "removed"] {
            let want = if key == expected_key {
                refs(&[], &[&img])
            } else {
                BTreeSet::new()
            };
            assert_eq!(
                listed(&round, key),
                want,
                "{key} after ops {range:?}: {round}"
            );
        }
        if !visible {
            assert!(
                not_ready_reason(&status(&m), "image", &img.id).is_some(),
                "after ops {range:?}"
            );
        }
        was_visible = visible;
    }
}

/// Scenario 3: A layer's metadata dir without its overlay dir, and the reverse: invisible until
/// both.
#[test]
fn a_layer_needs_both_its_overlay_and_metadata_dirs() {
    let mut m = mount();
    let meta_first = Layer::base("meta-first");
    let overlay_first = Layer::base("overlay-first");
    let layers = [&meta_first, &overlay_first];
    warm(&m, &layers, &[]);

    writer(
        &mut m,
        concat([meta_first.meta_complete(), overlay_first.overlay_complete()]),
    );
    let round = refresh(&m);
    assert!(listed(&round, "added").is_empty(), "{round}");
    expect_view(&m, &layers, &[], &[]);
    let s = status(&m);
    for l in layers {
        let reason = not_ready_reason(&s, "layer", &l.id).unwrap_or_else(|| panic!("{s}"));
        assert!(reason.contains("missing"), "{reason}");
    }

    writer(
        &mut m,
        concat([meta_first.overlay_complete(), overlay_first.meta_complete()]),
    );
    let round = refresh(&m);
    assert_eq!(listed(&round, "added"), refs(&layers, &[]), "{round}");
    expect_view(&m, &layers, &[], &["meta-first", "overlay-first"]);
}

/// Scenario 4a: A layer being pulled: `incompelte` set, the tar-split still growing (a
/// truncated gzip stream), then complete.
#[test]
fn a_layer_being_pulled_appears_only_when_complete() {
    let mut m = mount();
    let l = Layer::base("pulling");
    let layers = [&l];
    let gz = l.tar_split();
    let (head, tail) = gz.split_at(gz.len() / 2);

    // Driver dir done, metadata saved incomplete, diff applied, tar-split half written.
    writer(
        &mut m,
        concat([
            l.overlay_skeleton(),
            l.meta_begin(),
            l.diff_files(),
            vec![Op::WriteInPlace {
                path: l.tar_split_path(),
                data: b64(head),
            }],
        ]),
    );
    refresh(&m);
    expect_view(&m, &layers, &[], &[]);
    let reason = not_ready_reason(&status(&m), "layer", &l.id).expect("not ready");
    assert!(reason.contains("incomplete"), "{reason}");

    // The flag cleared (another host may see the new layer.json before the end of the
    // tar-split): still not ready while the stream is truncated.
    writer(&mut m, l.meta_end());
    refresh(&m);
    expect_view(&m, &layers, &[], &[]);
    let reason = not_ready_reason(&status(&m), "layer", &l.id).expect("not ready");
    assert!(reason.contains("tar-split"), "{reason}");

    writer(
        &mut m,
        vec![Op::Append {
            path: l.tar_split_path(),
            data: b64(tail),
        }],
    );
    let round = refresh(&m);
    assert_eq!(listed(&round, "added"), refs(&layers, &[]), "{round}");
    expect_view(&m, &layers, &[], &["pulling"]);
    assert_eq!(not_ready_reason(&status(&m), "layer", &l.id), None);
}

/// Scenario 4b: A child layer whose `lower` is not written yet (the last step of its overlay
/// dir).
#[test]
fn a_child_layer_appears_once_its_lower_is_written() {
    let mut m = mount();
    let parent = Layer::base("lower-parent");
    let child = Layer::child("lower-child", &parent);
    let layers = [&parent, &child];

    writer(
        &mut m,
        concat([
            parent.create(),
            child.overlay_skeleton_without_lower(),
            child.meta_begin(),
            child.diff_files(),
            vec![child.tar_split_op()],
            child.meta_end(),
        ]),
    );
    refresh(&m);
    expect_view(&m, &layers, &[], &["lower-parent"]);
    let reason = not_ready_reason(&status(&m), "layer", &child.id).expect("not ready");
    assert!(reason.contains("lower"), "{reason}");

    writer(&mut m, child.lower_op());
    let round = refresh(&m);
    assert_eq!(listed(&round, "added"), refs(&[&child], &[]), "{round}");
    expect_view(&m, &layers, &[], &["lower-parent", "lower-child"]);
}

/// Scenario 5: A chain L→M→N with M missing: N and the images on it stay invisible until M
/// arrives.
#[test]
fn a_missing_middle_layer_hides_its_descendants_until_it_arrives() {
    let mut m = mount();
    let [l, mid, n] = Layer::chain(["chain-l", "chain-m", "chain-n"]);
    let on_n = Image::on("chain-img-n", &n, &["chain:n"]);
    let on_l = Image::on("chain-img-l", &l, &["chain:l"]);
    let (layers, images) = ([&l, &mid, &n], [&on_n, &on_l]);
    warm(&m, &layers, &images);

    writer(
        &mut m,
        concat([l.create(), n.create(), on_n.create(), on_l.create()]),
    );
    let round = refresh(&m);
    assert_eq!(listed(&round, "added"), refs(&[&l], &[&on_l]), "{round}");
    expect_view(&m, &layers, &images, &["chain-l", "chain-img-l"]);
    let s = status(&m);
    let reason = not_ready_reason(&s, "layer", &n.id).expect("N not ready");
    assert!(reason.contains(&mid.id), "{reason}");
    let reason = not_ready_reason(&s, "image", &on_n.id).expect("image on N not ready");
    assert!(reason.contains(&mid.id), "{reason}");

    writer(&mut m, mid.create());
    let round = refresh(&m);
    assert_eq!(
        listed(&round, "added"),
        refs(&[&mid, &n], &[&on_n]),
        "{round}"
    );
    expect_view(
        &m,
        &layers,
        &images,
        &[
            "chain-l",
            "chain-m",
            "chain-n",
            "chain-img-n",
            "chain-img-l",
        ],
    );
}

/// Scenario 6: An empty or bad `link` file keeps a layer invisible; once fixed it appears.
#[test]
fn a_layer_with_an_empty_or_bad_link_appears_once_fixed() {
    let mut m = mount();
    let l = Layer::base("badlink");
    let layers = [&l];
    let link = format!("{}/link", l.overlay());
    let ops: Vec<Op> = l
        .create()
        .into_iter()
        .map(|op| match op {
            Op::WriteAtomic { path, .. } if path == link => write_atomic_op(&link, 0o644, b""),
            op => op,
        })
        .collect();
    writer(&mut m, ops);
    refresh(&m);
    expect_view(&m, &layers, &[], &[]);
    let reason = not_ready_reason(&status(&m), "layer", &l.id).expect("not ready");
    assert!(reason.contains("link"), "{reason}");

    for bad in [
        "../../../../etc/passwd".as_bytes(),
        b"0123456789ABCDEFabcdef0123",
        b"0123456789abcdef0123456789abcdef",
        b"0123456789abcdef012345678\0",
    ] {
        writer(&mut m, vec![write_atomic_op(&link, 0o644, bad)]);
        let round = refresh(&m);
        assert!(listed(&round, "added").is_empty(), "{bad:?}: {round}");
        expect_view(&m, &layers, &[], &[]);
    }

    writer(
        &mut m,
        vec![write_atomic_op(&link, 0o644, l.short.as_bytes())],
    );
    let round = refresh(&m);
    assert_eq!(listed(&round, "added"), refs(&layers, &[]), "{round}");
    expect_view(&m, &layers, &[], &["badlink"]);
}

/// Scenario 7: Garbage in the shared areas (temp dirs and files, bad names, non-directories
/// named like ids) never becomes visible; a temp dir renamed into place does.
#[test]
fn garbage_in_the_shared_areas_never_becomes_visible() {
    let mut m = mount();
    let real = Layer::base("garbage-real");
    let img = Image::on("garbage-img", &real, &["garbage:real"]);
    let upper = real.id.to_uppercase();
    let short_id = &real.id[..63];
    let tmp = format!(".tmp-{}", real.id);
    let mut ops = Vec::new();
    // Full layer content under names that are not ids.
    for name in [upper.as_str(), short_id, tmp.as_str(), "not-a-layer"] {
        for (area, part) in [
            ("overlay/RO", real.overlay_complete()),
            ("overlay-layers/RO", real.meta_complete()),
        ] {
            let from = format!("{area}/{}", real.id);
            ops.extend(
                part.into_iter()
                    .filter_map(|op| relocate(op, &from, &format!("{area}/{name}"))),
            );
        }
    }
    // Files and links named like ids.
    let file_id = sha256_hex(b"garbage-file");
    ops.extend([
        write_atomic_op(&format!("overlay/RO/{file_id}"), 0o600, b"not a dir"),
        write_atomic_op(&format!("overlay-layers/RO/{file_id}"), 0o600, b"not a dir"),
        write_atomic_op(&format!("overlay-images/{file_id}"), 0o600, b"not a dir"),
        write_atomic_op("overlay/RO/.tmp-link-0a1b2c3d4e", 0o600, b"half"),
        write_atomic_op(
            "overlay-layers/RO/.tmp-layer.json-0a1b2c3d4e",
            0o600,
            b"{\"id\":",
        ),
        write_atomic_op("overlay-images/.tmp-images.json-0a1b2c3d4e", 0o600, b"{"),
    ]);
    // An image dir with an upper-case name and a temp image dir, both complete.
    for name in [img.id.to_uppercase(), format!(".tmp-{}", img.id)] {
        let from = img.dir();
        ops.extend(
            img.create()
                .into_iter()
                .filter_map(|op| relocate(op, &from, &format!("overlay-images/{name}"))),
        );
    }
    writer(&mut m, ops);
    let round = refresh(&m);
    for key in ["added", "removed", "changed"] {
        assert!(listed(&round, key).is_empty(), "{key}: {round}");
    }
    expect_view(&m, &[&real], &[&img], &[]);
    for area in [
        "overlay/RO",
        "overlay",
        "overlay-layers/RO",
        "overlay-layers",
        "overlay-images",
    ] {
        for name in [
            upper.as_str(),
            short_id,
            tmp.as_str(),
            "not-a-layer",
            &file_id,
        ] {
            absent(&m.path(area).join(name));
        }
    }

    // The temp dirs renamed into place are a layer and an image like any other.
    writer(
        &mut m,
        vec![
            Op::Rename {
                from: format!("overlay/RO/{tmp}"),
                to: real.overlay(),
            },
            Op::Rename {
                from: format!("overlay-layers/RO/{tmp}"),
                to: real.meta(),
            },
            Op::Rename {
                from: format!("overlay-images/.tmp-{}", img.id),
                to: img.dir(),
            },
        ],
    );
    let round = refresh(&m);
    assert_eq!(listed(&round, "added"), refs(&[&real], &[&img]), "{round}");
    expect_view(&m, &[&real], &[&img], &["garbage-real", "garbage-img"]);
}

/// `op` moved from under `from` to under `to`; the writer's links outside it are dropped.
fn relocate(op: Op, from: &str, to: &str) -> Option<Op> {
    let mv = |p: String| p.strip_prefix(from).map(|rest| format!("{to}{rest}"));
    Some(match op {
        Op::Mkdir(p) => Op::Mkdir(mv(p)?),
        Op::WriteAtomic { path, mode, data } => Op::WriteAtomic {
            path: mv(path)?,
            mode,
            data,
        },
        Op::WriteInPlace { path, data } => Op::WriteInPlace {
            path: mv(path)?,
            data,
        },
        _ => return None,
    })
}

/// Two images sharing a base layer; `x` has its own top layer.
fn two_images() -> (Layer, Layer, Image, Image) {
    let base = Layer::base("rm-base");
    let top = Layer::child("rm-top", &base);
    let x = Image::on("rm-x", &top, &["rm:x"]);
    let y = Image::on("rm-y", &base, &["rm:y"]);
    (base, top, x, y)
}

/// The images of [`two_images`], written by the writer host and shown after one round.
fn two_images_shown(m: &mut Mount) -> (Layer, Layer, Image, Image) {
    let (base, top, x, y) = two_images();
    writer(
        m,
        concat([base.create(), top.create(), x.create(), y.create()]),
    );
    refresh(m);
    expect_view(m, &[&base, &top], &[&x, &y], &ALL_OF_TWO_IMAGES);
    (base, top, x, y)
}

const ALL_OF_TWO_IMAGES: [&str; 4] = ["rm-base", "rm-top", "rm-x", "rm-y"];

/// Scenario 8a: An image and its unused layer removed by the writer: gone after one round, the
/// shared layer stays, nothing dangles.
#[test]
fn an_image_removal_takes_its_unused_layers_in_one_round() {
    let mut m = mount();
    let (base, top, x, y) = two_images_shown(&mut m);
    let (layers, images) = ([&base, &top], [&x, &y]);
    warm(&m, &layers, &images);

    // `isula rmi x`: the image, then its layers from the top while unused.
    writer(&mut m, concat([x.remove(), top.remove()]));
    let round = refresh(&m);
    assert_eq!(listed(&round, "removed"), refs(&[&top], &[&x]), "{round}");
    assert!(listed(&round, "added").is_empty(), "{round}");
    expect_view(&m, &layers, &images, &["rm-base", "rm-y"]);
    let s = status(&m);
    assert_eq!(not_ready_reason(&s, "layer", &top.id), None, "{s}");
    assert_eq!(not_ready_reason(&s, "image", &x.id), None, "{s}");
}

/// Scenario 8b: The same removal with a round after every step of it: at no point does the view
/// show a link that does not resolve.
#[test]
fn an_image_removal_step_by_step_never_leaves_a_dangling_link() {
    let mut m = mount();
    let (base, top, x, y) = two_images_shown(&mut m);
    let (layers, images) = ([&base, &top], [&x, &y]);

    let steps: Vec<(Vec<Op>, &[&str])> = vec![
        (x.remove(), &["rm-base", "rm-top", "rm-y"]),
        // overlay2_rm_layer: the writer's l/ link and symlink go first; the view does not
        // use them.
        (
            vec![Op::Unlink(format!("overlay/l/{}", top.short))],
            &["rm-base", "rm-top", "rm-y"],
        ),
        (
            vec![Op::Unlink(format!("overlay/{}", top.id))],
            &["rm-base", "rm-top", "rm-y"],
        ),
        // The recursive removal of RO/<id>, caught half way: diff/ gone, link still there.
        (
            vec![Op::RemoveAll(format!("{}/diff", top.overlay()))],
            &["rm-base", "rm-y"],
        ),
        (vec![Op::RemoveAll(top.overlay())], &["rm-base", "rm-y"]),
        // Then the layer store's part.
        (top.remove_meta(), &["rm-base", "rm-y"]),
    ];
    for (ops, visible) in steps {
        warm(&m, &layers, &images);
        writer(&mut m, ops);
        refresh(&m);
        expect_view(&m, &layers, &images, visible);
    }
    let s = status(&m);
    assert_eq!(not_ready_reason(&s, "layer", &top.id), None, "{s}");
}

/// Scenario 9: A layer removed while an image still needs it: the image is not ready any more
/// and `status` says which layer it misses.
#[test]
fn a_layer_removed_under_an_image_makes_the_image_not_ready() {
    let mut m = mount();
    let [l, mid, n] = Layer::chain(["needed-l", "needed-m", "needed-n"]);
    let img = Image::on("needed-img", &n, &["needed:latest"]);
    let (layers, images) = ([&l, &mid, &n], [&img]);
    writer(
        &mut m,
        concat([l.create(), mid.create(), n.create(), img.create()]),
    );
    refresh(&m);
    expect_view(
        &m,
        &layers,
        &images,
        &["needed-l", "needed-m", "needed-n", "needed-img"],
    );
    warm(&m, &layers, &images);

    writer(&mut m, mid.remove());
    let round = refresh(&m);
    assert_eq!(
        listed(&round, "removed"),
        refs(&[&mid, &n], &[&img]),
        "{round}"
    );
    expect_view(&m, &layers, &images, &["needed-l"]);
    let s = status(&m);
    let reason = not_ready_reason(&s, "image", &img.id).expect("image listed as not ready");
    assert!(reason.contains(&mid.id), "{reason}");
    let reason = not_ready_reason(&s, "layer", &n.id).expect("N listed as not ready");
    assert!(reason.contains(&mid.id), "{reason}");
}

/// Scenario 10: A re-tag on the writer (`images.json` rewritten atomically) reaches the view
/// with fresh size and data: longer, shorter, and of the same length.
#[test]
fn a_retag_reaches_the_view_with_fresh_size_and_data() {
    let mut m = mount();
    let l = Layer::base("retag-l");
    let mut img = Image::on("retag-img", &l, &["retag:1"]);
    writer(&mut m, concat([l.create(), img.create()]));
    refresh(&m);
    expect_view(&m, &[&l], &[&img], &["retag-l", "retag-img"]);
    let json = m.path("overlay-images").join(&img.id).join("images.json");

    for names in [
        &[
            "retag:1",
            "registry.example/a/much/longer/repository/name:v2.0.0-retagged",
        ][..],
        &["r:3"][..],
        // Same length, other bytes: only the stamps tell.
        &["r:4"][..],
    ] {
        // Read and stat it first, so that the kernel holds its attributes and pages.
        let before = read(&json);
        let mut held = fs::File::open(&json).unwrap();
        let ops = img.retag(names);
        writer(&mut m, ops);
        let round = refresh(&m);
        assert_eq!(listed(&round, "changed"), refs(&[], &[&img]), "{round}");
        let now = read(&m.remote.join(img.dir()).join("images.json"));
        assert_ne!(before, now);
        assert_eq!(read(&json), now);
        assert_eq!(fs::metadata(&json).unwrap().len(), now.len() as u64);
        expect_view(&m, &[&l], &[&img], &["retag-l", "retag-img"]);
        // A file opened before the re-tag is the old one, as on the writer's own disk.
        let mut old = Vec::new();
        held.seek(SeekFrom::Start(0)).unwrap();
        held.read_to_end(&mut old).unwrap();
        assert_eq!(old, before);
    }
    let entry = cli_image(&m, &img.id);
    assert_eq!(
        entry.map(|e| e["names"].clone()),
        Some(serde_json::json!(["r:4"]))
    );

    // A layer's metadata rewritten (names added to its layer.json) is a change too.
    let json = m.path("overlay-layers").join(&l.id).join("layer.json");
    let before = read(&json);
    let mut named: Value = serde_json::from_slice(&l.layer_json(false)).unwrap();
    named["names"] = serde_json::json!(["retag-layer-name"]);
    let named = serde_json::to_vec(&named).unwrap();
    writer(
        &mut m,
        vec![write_atomic_op(
            &format!("{}/layer.json", l.meta()),
            0o600,
            &named,
        )],
    );
    let round = refresh(&m);
    assert_eq!(listed(&round, "changed"), refs(&[&l], &[]), "{round}");
    assert_ne!(before, named);
    assert_eq!(read(&json), named);
    assert_eq!(fs::metadata(&json).unwrap().len(), named.len() as u64);
}

/// Scenario 11: An id deleted and created again with other content between two rounds: the view
/// shows the new content, under the new short id.
#[test]
fn an_id_deleted_and_created_again_between_rounds_shows_the_new_content() {
    let mut m = mount();
    let mut first = Layer::base("again");
    first
        .files
        .push(("same".into(), b"first pull: AAAA\n".to_vec()));
    let img_first = Image::on("again-img", &first, &["again:1"]);
    writer(&mut m, concat([first.create(), img_first.create()]));
    refresh(&m);
    expect_view(&m, &[&first], &[&img_first], &["again", "again-img"]);
    let hello = m.path("overlay/RO").join(&first.id).join("diff/hello");
    let same = m.path("overlay/RO").join(&first.id).join("diff/same");
    assert_eq!(read(&hello), first.files[0].1);
    assert_eq!(read(&same), first.files[1].1);
    // A reader of the first pull's file keeps it open across the re-creation.
    let mut held = fs::File::open(&same).unwrap();

    let mut second = first.clone();
    second.short = short_of("again-second-pull");
    second.files = vec![
        (
            "hello".into(),
            b"the second pull, with longer content\n".to_vec(),
        ),
        // Same size as before, other bytes.
        ("same".into(), b"other pull: BBBB\n".to_vec()),
    ];
    assert_eq!(first.files[1].1.len(), second.files[1].1.len());
    let mut img_second = img_first.clone();
    img_second.names = vec!["again:2".into(), "again:latest".into()];
    writer(
        &mut m,
        concat([
            img_first.remove(),
            first.remove(),
            second.create(),
            img_second.create(),
        ]),
    );
    refresh(&m);
    expect_view(&m, &[&second], &[&img_second], &["again", "again-img"]);
    absent(&m.path("overlay/l").join(&first.short));
    assert_eq!(read(&hello), second.files[0].1);
    assert_eq!(read(&same), second.files[1].1);
    let mut old = Vec::new();
    held.read_to_end(&mut old).unwrap();
    assert_eq!(old, first.files[1].1, "the held file is the first pull's");
    assert_eq!(
        fs::metadata(&hello).unwrap().len(),
        second.files[0].1.len() as u64
    );
}

/// Scenario 12: Entries the host created itself with the names of remote objects win over the
/// synthesized ones, before and after rounds, without errors.
#[test]
fn a_local_entry_named_like_a_remote_object_wins() {
    let mut m = mount();
    let l = Layer::base("collide");
    let other = Layer::base("collide-other");
    // The host made `overlay/<id>` a real dir and `l/<short>` a link of its own.
    fs::create_dir(m.path("overlay").join(&l.id)).unwrap();
    fs::create_dir(m.path("overlay").join(&l.id).join("diff")).unwrap();
    fs::write(
        m.path("overlay").join(&l.id).join("diff/mine"),
        "host's own\n",
    )
    .unwrap();
    let own_target = format!("../{}/diff", other.id);
    std::os::unix::fs::symlink(&own_target, m.path("overlay/l").join(&l.short)).unwrap();
    // And it pulled the same image itself: its own `images.json` for that id.
    let img = Image::on("collide-img", &l, &["collide:remote"]);
    let own_json = img.images_json(&["collide:pulled-here".to_owned()], 4);
    fs::create_dir(m.path("overlay-images").join(&img.id)).unwrap();
    fs::write(
        m.path("overlay-images").join(&img.id).join("images.json"),
        &own_json,
    )
    .unwrap();

    let check = |m: &Mount, remote_ready: bool| {
        let dir = m.path("overlay").join(&l.id);
        let meta = fs::symlink_metadata(&dir).unwrap();
        assert!(meta.is_dir(), "the host's dir wins");
        assert_eq!(read(&dir.join("diff/mine")), b"host's own\n");
        assert_eq!(
            fs::read_link(m.path("overlay/l").join(&l.short)).unwrap(),
            Path::new(&own_target)
        );
        let listing = dtypes(&m.path("overlay"));
        assert_eq!(listing.get(&l.id), Some(&"dir"));
        let overlay_names = names(&m.path("overlay"));
        assert_eq!(
            overlay_names.iter().filter(|n| **n == l.id).count(),
            1,
            "{overlay_names:?}"
        );
        let l_names = names(&m.path("overlay/l"));
        assert_eq!(
            l_names.iter().filter(|n| **n == l.short).count(),
            1,
            "{l_names:?}"
        );
        let image = m.path("overlay-images").join(&img.id);
        assert!(fs::symlink_metadata(&image).unwrap().is_dir());
        assert_eq!(read(&image.join("images.json")), own_json);
        let image_names = names(&m.path("overlay-images"));
        assert_eq!(
            image_names.iter().filter(|n| **n == img.id).count(),
            1,
            "{image_names:?}"
        );
        // The remote layer's own dirs are there when it is ready, and the remote image's
        // files the host does not have show through its dir.
        let ro = m.path("overlay/RO").join(&l.id);
        if remote_ready {
            assert_eq!(read(&image.join("manifest")), img.manifest);
            assert_eq!(read(&ro.join("diff/hello")), l.files[0].1);
            assert_eq!(
                fs::read_link(m.path("overlay-layers").join(&l.id)).unwrap(),
                m.mnt.join("overlay-layers/RO").join(&l.id)
            );
        } else {
            absent(&ro);
            absent(&m.path("overlay-layers").join(&l.id));
        }
        assert!(is_mounted(&m.mnt));
    };
    check(&m, false);

    writer(&mut m, concat([l.create(), img.create()]));
    let round = refresh(&m);
    assert_eq!(round["error"], Value::Null, "{round}");
    assert_eq!(listed(&round, "added"), refs(&[&l], &[&img]), "{round}");
    check(&m, true);
    // And once more, with nothing changed.
    refresh(&m);
    check(&m, true);

    writer(&mut m, concat([img.remove(), l.remove()]));
    let round = refresh(&m);
    assert_eq!(listed(&round, "removed"), refs(&[&l], &[&img]), "{round}");
    check(&m, false);
    assert!(m
        .local
        .join("overlay")
        .join(&l.id)
        .join("diff/mine")
        .is_file());
}

/// Scenario 13: An image and its layers removed while the mount was down are not there after
/// the remount, and nothing dangles.
#[test]
fn objects_removed_while_unmounted_are_gone_after_remount() {
    let mut m = mount();
    let (base, top, x, y) = two_images_shown(&mut m);
    let (layers, images) = ([&base, &top], [&x, &y]);
    // The host looked them up: the kernel held them until the unmount.
    warm(&m, &layers, &images);

    m.unmount();
    writer(
        &mut m,
        concat([x.remove(), top.remove(), y.remove(), base.remove()]),
    );
    m.mount(&on_demand());
    expect_view(&m, &layers, &images, &[]);
    let s = status(&m);
    for l in layers {
        assert_eq!(not_ready_reason(&s, "layer", &l.id), None, "{s}");
    }
    let round = refresh(&m);
    for key in ["added", "removed", "changed"] {
        assert!(listed(&round, key).is_empty(), "{round}");
    }
}

/// Scenario 14: A process holding a file of a layer that is then removed keeps reading it; new
/// lookups fail.
#[test]
fn an_open_file_of_a_removed_layer_keeps_its_data() {
    let mut m = mount();
    let mut l = Layer::base("held");
    let big: Vec<u8> = (0..1_048_576u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    l.files.push(("big".into(), big.clone()));
    writer(&mut m, l.create());
    refresh(&m);
    expect_view(&m, &[&l], &[], &["held"]);

    let path = m.path("overlay/l").join(&l.short).join("big");
    let mut file = fs::File::open(&path).unwrap();
    let mut first = vec![0u8; 4096];
    file.read_exact(&mut first).unwrap();
    assert_eq!(first, big[..4096]);

    writer(&mut m, l.remove());
    let round = refresh(&m);
    assert_eq!(listed(&round, "removed"), refs(&[&l], &[]), "{round}");
    expect_view(&m, &[&l], &[], &[]);

    let mut rest = Vec::new();
    file.read_to_end(&mut rest).unwrap();
    assert_eq!(rest, big[4096..], "the rest of the held file");
    file.seek(SeekFrom::Start(0)).unwrap();
    let mut again = Vec::new();
    file.read_to_end(&mut again).unwrap();
    assert_eq!(again, big, "the held file read again from the start");
    assert_eq!(errno_of(fs::metadata(&path)), libc::ENOENT);
    assert_eq!(
        errno_of(fs::File::open(
            m.path("overlay/RO").join(&l.id).join("diff/big")
        )),
        libc::ENOENT
    );
}

/// Moves the remote root away and back, even when the test fails in between.
struct Away {
    remote: PathBuf,
    away: PathBuf,
    gone: bool,
}

impl Away {
    fn take(m: &Mount) -> Away {
        let away = m.dir.path().join("remote-unreachable");
        fs::rename(&m.remote, &away).unwrap();
        Away {
            remote: m.remote.clone(),
            away,
            gone: true,
        }
    }

    fn bring_back(&mut self) {
        if self.gone {
            fs::rename(&self.away, &self.remote).unwrap();
            self.gone = false;
        }
    }
}

impl Drop for Away {
    fn drop(&mut self) {
        if self.gone {
            let _ = fs::rename(&self.away, &self.remote);
        }
    }
}

fn epoch_secs(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH).unwrap().as_secs_f64()
}

/// A mount with layer `outage` and an image on it, ready, and a layer `outage-later` the
/// writer adds once the remote is back.
fn outage_setup() -> (Mount, Layer, Image, Layer) {
    let mut m = mount();
    let l = Layer::base("outage");
    let img = Image::on("outage-img", &l, &["outage:latest"]);
    let later = Layer::base("outage-later");
    writer(&mut m, concat([l.create(), img.create()]));
    refresh(&m);
    expect_view(&m, &[&l, &later], &[&img], &["outage", "outage-img"]);
    (m, l, img, later)
}

/// Takes the remote away and runs a round, which must fail.
fn fail_a_round(m: &Mount) -> Away {
    let away = Away::take(m);
    let out = cli(&["refresh"], &m.mnt);
    assert!(!out.status.success(), "a round without a remote must fail");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("could not scan the remote"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    away
}

/// Scenario 15a: The remote unreachable, then back: `status` says unhealthy since when, the
/// last good index and its links stay, local paths keep working, and a round after the remote
/// is back reports healthy again and brings what the writer added meanwhile.
#[test]
fn an_unreachable_remote_is_reported_and_recovers() {
    let (mut m, l, img, later) = outage_setup();
    let healthy_since = status(&m)["remote_health"]["since"].as_f64().unwrap();

    let before = epoch_secs(SystemTime::now());
    let mut away = fail_a_round(&m);
    let s = status(&m);
    let health = &s["remote_health"];
    assert_eq!(health["healthy"], false, "{s}");
    let since = health["since"].as_f64().expect("since");
    assert!(
        since >= before - 1.0 && since <= epoch_secs(SystemTime::now()) + 1.0,
        "{s}"
    );
    assert!(since >= healthy_since, "{s}");
    assert!(
        health["last_error"].as_str().is_some_and(|e| !e.is_empty()),
        "{s}"
    );
    assert!(s["last_round"]["error"].as_str().is_some(), "{s}");
    assert_eq!(s["last_round"]["ready_layers"], 5, "{s}");
    assert_eq!(s["last_round"]["ready_images"], 3, "{s}");
    let human = String::from_utf8_lossy(&cli(&["status"], &m.mnt).stdout).into_owned();
    assert!(human.contains("NOT ANSWERING since"), "{human}");

    // The last good index stays: its links are all still served, as they were.
    let ids = sorted(
        strings(&expected()["ready_layers"])
            .into_iter()
            .chain([l.id.clone()])
            .collect(),
    );
    let mut with_skeleton = ids.clone();
    with_skeleton.extend(["RO".to_owned(), "l".to_owned()]);
    assert_eq!(names(&m.path("overlay")), sorted(with_skeleton));
    assert!(names(&m.path("overlay/l")).contains(&l.short));
    assert_eq!(
        fs::read_link(m.path("overlay").join(&l.id)).unwrap(),
        m.mnt.join("overlay/RO").join(&l.id)
    );
    assert_eq!(
        fs::read_link(m.path("overlay/l").join(&l.short)).unwrap(),
        Path::new("..").join(&l.id).join("diff")
    );
    let v: Value = serde_json::from_slice(&cli(&["images", "--json"], &m.mnt).stdout).unwrap();
    assert!(
        v.as_array()
            .unwrap()
            .iter()
            .any(|i| i["id"] == img.id.as_str()),
        "{v}"
    );
    // Local paths keep working.
    fs::write(m.path("host-note"), "written during the outage").unwrap();
    assert_eq!(read(&m.path("host-note")), b"written during the outage");
    // A second failing round keeps the first failure's time.
    assert!(!cli(&["refresh"], &m.mnt).status.success());
    assert_eq!(status(&m)["remote_health"]["since"].as_f64(), Some(since));

    away.bring_back();
    let back = epoch_secs(SystemTime::now());
    writer(&mut m, later.create());
    let round = refresh(&m);
    assert_eq!(round["error"], Value::Null, "{round}");
    assert_eq!(listed(&round, "added"), refs(&[&later], &[]), "{round}");
    let s = status(&m);
    assert_eq!(s["remote_health"]["healthy"], true, "{s}");
    assert!(
        s["remote_health"]["since"].as_f64().unwrap() >= back - 1.0,
        "{s}"
    );
    expect_view(
        &m,
        &[&l, &later],
        &[&img],
        &["outage", "outage-img", "outage-later"],
    );
    assert_eq!(read(&m.path("host-note")), b"written during the outage");
}

/// Scenario 15b: While the remote does not answer (and `hide_unhealthy` is off), the view keeps
/// serving the last good state: the ready layers' and images' directories stay listed and
/// looked up, and the links into them keep resolving.
#[test]
fn an_unreachable_remote_keeps_the_last_good_view() {
    let (m, l, img, _later) = outage_setup();
    let _away = fail_a_round(&m);
    let ids = sorted(
        strings(&expected()["ready_layers"])
            .into_iter()
            .chain([l.id.clone()])
            .collect(),
    );
    assert_layer_dirs(&m, &ids);
    assert!(
        names(&m.path("overlay-images")).contains(&img.id),
        "overlay-images"
    );
    for id in &ids {
        for home in ["overlay/RO", "overlay-layers/RO"] {
            let p = m.path(home).join(id);
            assert!(
                fs::symlink_metadata(&p).is_ok_and(|m| m.is_dir()),
                "{}",
                p.display()
            );
        }
    }
    assert!(fs::symlink_metadata(m.path("overlay-images").join(&img.id)).is_ok_and(|m| m.is_dir()));
    assert_links_resolve(&m);
}

/// Scenario 14b: `fstat` on a file held open across the removal of its layer still answers, as
/// on any local file system for an open file whose name is gone (`cp`, `mmap` users and
/// runtimes copying out of a layer ask for the size of what they hold).
#[test]
fn an_open_file_of_a_removed_layer_can_still_be_fstated() {
    let mut m = mount();
    let l = Layer::base("held-stat");
    writer(&mut m, l.create());
    refresh(&m);
    let path = m.path("overlay/l").join(&l.short).join("hello");
    let file = fs::File::open(&path).unwrap();
    let size = l.files[0].1.len() as u64;

    writer(&mut m, l.remove());
    let round = refresh(&m);
    assert_eq!(listed(&round, "removed"), refs(&[&l], &[]), "{round}");
    assert_eq!(errno_of(fs::metadata(&path)), libc::ENOENT);
    // Reading still works...
    let mut data = Vec::new();
    (&file).read_to_end(&mut data).unwrap();
    assert_eq!(data, l.files[0].1);
    // ...and so must asking what is being read.
    let meta = file.metadata().expect("fstat of the held file");
    assert_eq!(meta.len(), size);
    assert!(meta.is_file());
}

/// An empty tmpfs mounted over a directory of the remote, unmounted on drop even when the
/// test fails.
struct Covered {
    path: PathBuf,
    mounted: bool,
}

impl Covered {
    fn over(path: &Path) -> Covered {
        let status = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                "size=1m,mode=0700",
                "layerfs-test-cover",
            ])
            .arg(path)
            .status()
            .expect("mount tmpfs");
        assert!(status.success(), "mount tmpfs over {}", path.display());
        Covered {
            path: path.to_owned(),
            mounted: true,
        }
    }

    /// Detaches the mount. Lazily: the daemon keeps the directory it re-opened under the
    /// mount until its next round re-opens the real one, as it would keep any remote
    /// directory it holds.
    fn remove(&mut self) {
        if self.mounted {
            let status = Command::new("umount")
                .arg("-l")
                .arg(&self.path)
                .status()
                .unwrap();
            assert!(status.success(), "umount {}", self.path.display());
            self.mounted = false;
        }
    }
}

impl Drop for Covered {
    fn drop(&mut self) {
        if self.mounted {
            let _ = Command::new("umount").arg("-l").arg(&self.path).status();
        }
    }
}

/// Scenario 15c: A remote area hidden under an empty mount (a share remounted, a snapshot
/// switched) and uncovered again: while covered the remote says it is empty and its objects
/// go; uncovered, a round brings them back and the view reads their files from the real
/// directory again.
#[test]
fn an_area_covered_by_an_empty_mount_and_uncovered_comes_back() {
    let (mut m, l, img, later) = outage_setup();
    let other = Image::on("outage-other", &later, &["outage:other"]);
    let images_dir = m.remote.join("overlay-images");
    // The kernel holds the image dir and its files.
    warm(&m, &[&l], &[&img]);

    let mut cover = Covered::over(&images_dir);
    let round = refresh(&m);
    assert_eq!(round["error"], Value::Null, "{round}");
    let fixture: Vec<String> = strings(&expected()["ready_images"]);
    let mut gone = refs(&[], &[&img]);
    gone.extend(fixture.iter().map(|i| format!("image {i}")));
    assert_eq!(listed(&round, "removed"), gone, "{round}");
    assert!(names(&m.path("overlay-images")).is_empty());
    absent(&m.path("overlay-images").join(&img.id));
    assert_eq!(status(&m)["remote_health"]["healthy"], true);

    cover.remove();
    // Meanwhile the writer pulled another image.
    writer(&mut m, concat([later.create(), other.create()]));
    let round = refresh(&m);
    let mut back = refs(&[&later], &[&img, &other]);
    back.extend(fixture.iter().map(|i| format!("image {i}")));
    assert_eq!(listed(&round, "added"), back, "{round}");
    expect_view(
        &m,
        &[&l, &later],
        &[&img, &other],
        &["outage", "outage-img", "outage-later", "outage-other"],
    );
}

/// The layout directories show the remote's own attributes (mode, owner, times). When the
/// writer host changes them, the next round shows the change at once, not once the kernel's
/// attribute timeout (an hour by default) has passed.
#[test]
fn a_layout_directory_s_changed_attributes_show_after_one_round() {
    use std::os::unix::fs::MetadataExt;
    let mut m = mount();
    for dir in ["overlay", "overlay-layers", "overlay-images"] {
        let (shown, remote) = (m.path(dir), m.remote.join(dir));
        let before = fs::metadata(&shown).unwrap().mode() & 0o7777;
        assert_eq!(before, fs::metadata(&remote).unwrap().mode() & 0o7777);
        let mode = if before == 0o750 { 0o755 } else { 0o750 };
        fs::set_permissions(&remote, fs::Permissions::from_mode(mode)).unwrap();
        refresh(&m);
        assert_eq!(
            fs::metadata(&shown).unwrap().mode() & 0o7777,
            mode,
            "{dir} after the remote's mode changed from {before:o} to {mode:o}"
        );
    }
    m.accept_remote_changes();
}
