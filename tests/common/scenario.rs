//! The mount side of the writer-host scenarios (DESIGN §4.3, §5): a fixture mount whose
//! refresh rounds run only when the test asks (`refresh=0`, then `layerfs refresh`), what a
//! round and `status` report about the model's objects, and what a process must see through
//! the view for the objects a scenario says are visible: exactly those and the fixture's ready
//! ones, with their links, metadata and content, nothing of the rest, no link dangling. A
//! scenario warms the kernel's caches first, so that a round must also invalidate what it
//! changes.

use std::collections::BTreeSet;
use std::fs;
use std::path::Path;

use serde_json::Value;

use super::isulad::{Image, Layer};
use super::{cli, expected, names, Mount, Options};

// ---- The mount and its control socket ----

/// Mount options under which rounds run only when the test asks for one.
pub fn on_demand() -> Options {
    Options {
        opts: "refresh=0".into(),
        ..Options::default()
    }
}

/// A fixture mount whose rounds run only on demand.
pub fn mount() -> Mount {
    Mount::with(on_demand(), |_| {})
}

/// `layerfs refresh --json`: runs a round, which must succeed; returns its report.
pub fn refresh(m: &Mount) -> Value {
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
pub fn status(m: &Mount) -> Value {
    let out = cli(&["status", "--json"], &m.mnt);
    assert!(
        out.status.success(),
        "layerfs status failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("status --json prints JSON")
}

/// The ids a round report lists under `key` (`added`, `removed`, `changed`), as `kind id`.
pub fn listed(round: &Value, key: &str) -> BTreeSet<String> {
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

pub fn refs(layers: &[&Layer], images: &[&Image]) -> BTreeSet<String> {
    layers
        .iter()
        .map(|l| format!("layer {}", l.id))
        .chain(images.iter().map(|i| format!("image {}", i.id)))
        .collect()
}

/// The entry `images --json` prints for image `id`, if it lists one.
pub fn cli_image(m: &Mount, id: &str) -> Option<Value> {
    let out = cli(&["images", "--json"], &m.mnt);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .find(|i| i["id"] == id)
        .cloned()
}

/// The reason `status` gives for a not-ready object, if it lists it.
pub fn not_ready_reason(status: &Value, kind: &str, id: &str) -> Option<String> {
    status["last_round"]["not_ready"]
        .as_array()
        .unwrap_or_else(|| panic!("no not_ready in {status}"))
        .iter()
        .find(|n| n["kind"] == kind && n["name"].as_str() == Some(id))
        .map(|n| n["reason"].as_str().unwrap_or_default().to_owned())
}

// ---- What a process sees through the mount ----

pub fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_owned())
        .collect()
}

pub fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v.dedup();
    v
}

pub fn absent(p: &Path) {
    match fs::symlink_metadata(p) {
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
        other => panic!("{} should not exist in the view: {other:?}", p.display()),
    }
}

pub fn read(p: &Path) -> Vec<u8> {
    fs::read(p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()))
}

/// Every symlink the view shows in the layer dirs resolves to a directory.
pub fn assert_links_resolve(m: &Mount) {
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

/// Checks that both per-layer directories list exactly the layers `ids`.
pub fn assert_layer_dirs(m: &Mount, ids: &[String]) {
    assert_eq!(names(&m.path("overlay/RO")), ids, "overlay/RO");
    assert_eq!(
        names(&m.path("overlay-layers/RO")),
        ids,
        "overlay-layers/RO"
    );
}

/// Checks the whole remote part of the view: exactly the fixture's ready objects plus
/// `visible` of the scenario's are served, with their links, metadata and content; the
/// scenario's other objects are nowhere; no link dangles.
pub fn expect_view(m: &Mount, layers: &[&Layer], images: &[&Image], visible: &[&str]) {
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
pub fn warm(m: &Mount, layers: &[&Layer], images: &[&Image]) {
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
