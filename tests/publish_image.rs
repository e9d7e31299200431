//! `layerfs publish image`: an image copied from a writer host's own iSulad storage into a
//! remote is judged ready there by the readers' rules, byte for byte the source's; a rerun
//! copies nothing; content already present under another id is reused; a publisher killed
//! mid-copy leaves nothing ready and a rerun finishes; two publishers at once leave one
//! copy; bad input fails cleanly.

mod common;

use std::collections::BTreeMap;
use std::ffi::CString;
use std::fs;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{copy_tree, id, pattern, repo, BIN};
use layerfs::layout::LayoutIndex;
use sha2::{Digest, Sha256};

const IMAGE_A: &str = "registry.example.com/layerfs/app:2.0";
const AREAS: [&str; 3] = ["overlay/RO", "overlay-layers/RO", "overlay-images"];

/// A writer host's storage root (a copy of the fixture) and an empty remote, in a temp dir.
struct Hosts {
    _tmp: tempfile::TempDir,
    source: PathBuf,
    remote: PathBuf,
}

fn hosts() -> Hosts {
    let tmp = tempfile::Builder::new()
        .prefix("layerfs-publish")
        .tempdir()
        .unwrap();
    let source = tmp.path().join("storage");
    copy_tree(&repo().join("fixtures/remote"), &source);
    let remote = tmp.path().join("remote");
    fs::create_dir(&remote).unwrap();
    Hosts {
        _tmp: tmp,
        source,
        remote,
    }
}

fn publish(h: &Hosts, image: &str) -> Output {
    publish_cmd(h, image).output().expect("run layerfs")
}

fn publish_cmd(h: &Hosts, image: &str) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args(["publish", "image"])
        .arg(&h.source)
        .arg(image)
        .arg("--remote")
        .arg(&h.remote)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

fn ok(out: &Output) -> String {
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "publish failed ({}): {text}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

fn failed(out: &Output) -> String {
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn scan(remote: &Path) -> LayoutIndex {
    LayoutIndex::scan(remote, "overlay")
}

fn chain_a() -> Vec<String> {
    ["L1", "L2", "L3", "L4"].iter().map(|l| id(l)).collect()
}

/// The remote has image A and its four layers ready, and nothing else not ready.
fn assert_a_ready(remote: &Path) {
    let index = scan(remote);
    assert!(
        index.not_ready().is_empty(),
        "not ready: {:?}",
        index.not_ready()
    );
    let image = index.image(&id("imageA")).expect("image A ready");
    assert_eq!(image.names, vec![IMAGE_A.to_owned()]);
    for layer in chain_a() {
        assert!(index.layer(&layer).is_some(), "layer {layer} ready");
    }
}

fn assert_no_temps(remote: &Path) {
    for area in AREAS {
        let Ok(entries) = fs::read_dir(remote.join(area)) else {
            continue;
        };
        for e in entries {
            let name = e.unwrap().file_name().to_string_lossy().into_owned();
            assert!(!name.starts_with('.'), "{name} left in {area}");
        }
    }
}

/// The ids in an area of the remote.
fn ids_in(remote: &Path, area: &str) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(remote.join(area))
        .map(|d| {
            d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

fn lxattrs(path: &Path) -> BTreeMap<Vec<u8>, Vec<u8>> {
    let c = CString::new(path.as_os_str().as_bytes()).unwrap();
    let mut buf = vec![0u8; 65536];
    let n = unsafe { libc::llistxattr(c.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    assert!(n >= 0, "llistxattr {}", path.display());
    let mut out = BTreeMap::new();
    for name in buf[..n as usize]
        .split(|b| *b == 0)
        .filter(|n| !n.is_empty())
    {
        let cn = CString::new(name).unwrap();
        let mut val = vec![0u8; 65536];
        let m =
            unsafe { libc::lgetxattr(c.as_ptr(), cn.as_ptr(), val.as_mut_ptr().cast(), val.len()) };
        assert!(m >= 0);
        val.truncate(m as usize);
        out.insert(name.to_vec(), val);
    }
    out
}

/// Everything about a tree: per path, type/mode, owner, size, device, mtime, content digest,
/// link target, every xattr (trusted ones included) and which paths share an inode.
fn tree(root: &Path) -> BTreeMap<Vec<u8>, String> {
    let mut out = BTreeMap::new();
    let mut inodes: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
    let mut stack = vec![root.to_owned()];
    while let Some(p) = stack.pop() {
        let m = fs::symlink_metadata(&p).unwrap();
        let rel = p
            .strip_prefix(root)
            .unwrap()
            .as_os_str()
            .as_bytes()
            .to_vec();
        let content = if m.is_file() {
            format!("{:x}", Sha256::digest(fs::read(&p).unwrap()))
        } else if m.file_type().is_symlink() {
            fs::read_link(&p).unwrap().display().to_string()
        } else {
            String::new()
        };
        let shared = if !m.is_dir() && m.nlink() > 1 {
            String::from_utf8_lossy(inodes.entry(m.ino()).or_insert_with(|| rel.clone()))
                .into_owned()
        } else {
            String::new()
        };
        let mtime = if m.file_type().is_symlink() || m.is_dir() || m.is_file() {
            format!("{}.{}", m.mtime(), m.mtime_nsec())
        } else {
            String::new()
        };
        out.insert(
            rel,
            format!(
                "{:o} {}:{} {} {} {mtime} {content} {:?} {shared}",
                m.mode(),
                m.uid(),
                m.gid(),
                if m.is_file() { m.len() } else { 0 },
                m.rdev(),
                lxattrs(&p)
            ),
        );
        if m.is_dir() {
            for e in fs::read_dir(&p).unwrap() {
                stack.push(e.unwrap().path());
            }
        }
    }
    out
}

fn set_xattr(path: &Path, name: &str, value: &[u8]) {
    let c = CString::new(path.as_os_str().as_bytes()).unwrap();
    let n = CString::new(name).unwrap();
    let rc = unsafe {
        libc::lsetxattr(
            c.as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    assert_eq!(rc, 0, "setxattr {name} on {}", path.display());
}

fn mknod(path: &Path, mode: u32, dev: u64) {
    let c = CString::new(path.as_os_str().as_bytes()).unwrap();
    assert_eq!(
        unsafe { libc::mknod(c.as_ptr(), mode, dev) },
        0,
        "{}",
        path.display()
    );
}

/// Gives the source layers what real diff trees hold: an opaque dir, a whiteout, a hard
/// link, a foreign owner, a set-ID mode, a FIFO, a non-UTF-8 name, a sparse file.
fn enrich(source: &Path) {
    let l1 = source.join("overlay/RO").join(id("L1")).join("diff");
    let l3 = source.join("overlay/RO").join(id("L3")).join("diff");
    fs::create_dir(l3.join("var")).unwrap();
    set_xattr(&l3.join("var"), "trusted.overlay.opaque", b"y");
    mknod(&l3.join("etc/removed"), libc::S_IFCHR, 0);
    fs::hard_link(l3.join("etc/app.conf"), l3.join("etc/app.conf.link")).unwrap();
    std::os::unix::fs::chown(l3.join("etc/app.conf"), Some(1234), Some(5678)).unwrap();
    fs::set_permissions(l1.join("bin/hello"), fs::Permissions::from_mode(0o4755)).unwrap();
    mknod(&l1.join("fifo"), libc::S_IFIFO | 0o640, 0);
    let odd = std::ffi::OsStr::from_bytes(b"caf\xe9");
    fs::write(l1.join(odd), b"latin-1 name").unwrap();
    set_xattr(&l1.join(odd), "user.origin", b"kept");
    fs::File::create(l1.join("sparse"))
        .unwrap()
        .set_len(1 << 30)
        .unwrap();
    // A layer kept as a real directory rather than through the RO area and a symlink.
    for area in ["overlay", "overlay-layers"] {
        let link = source.join(area).join(id("L2"));
        fs::remove_file(&link).unwrap();
        fs::rename(source.join(area).join("RO").join(id("L2")), &link).unwrap();
    }
}

#[test]
fn an_image_arrives_ready_and_identical() {
    let h = hosts();
    enrich(&h.source);
    let out = ok(&publish(&h, IMAGE_A));
    assert!(out.contains("4 of 4 layers copied, image copied"), "{out}");
    assert_a_ready(&h.remote);
    assert_no_temps(&h.remote);
    // Nothing but the image and its chain.
    assert_eq!(ids_in(&h.remote, "overlay-images"), vec![id("imageA")]);
    let mut chain = chain_a();
    chain.sort();
    assert_eq!(ids_in(&h.remote, "overlay/RO"), chain);
    assert_eq!(ids_in(&h.remote, "overlay-layers/RO"), chain);

    for layer in chain_a() {
        let src_overlay = if layer == id("L2") {
            h.source.join("overlay").join(&layer)
        } else {
            h.source.join("overlay/RO").join(&layer)
        };
        let dst_overlay = h.remote.join("overlay/RO").join(&layer);
        assert_eq!(
            tree(&src_overlay.join("diff")),
            tree(&dst_overlay.join("diff")),
            "diff of {layer}"
        );
        for file in ["link", "lower"] {
            assert_eq!(
                fs::read(src_overlay.join(file)).ok(),
                fs::read(dst_overlay.join(file)).ok(),
                "{file} of {layer}"
            );
        }
        assert_eq!(
            dst_overlay.join("empty").exists(),
            layer == id("L1"),
            "empty/ only in the base layer"
        );
        for dir in ["work", "merged"] {
            assert_eq!(
                fs::metadata(dst_overlay.join(dir)).unwrap().mode() & 0o7777,
                0o700
            );
        }
        let src_meta = if layer == id("L2") {
            h.source.join("overlay-layers").join(&layer)
        } else {
            h.source.join("overlay-layers/RO").join(&layer)
        };
        let dst_meta = h.remote.join("overlay-layers/RO").join(&layer);
        for e in fs::read_dir(&src_meta).unwrap() {
            let name = e.unwrap().file_name();
            assert_eq!(
                fs::read(src_meta.join(&name)).unwrap(),
                fs::read(dst_meta.join(&name)).unwrap(),
                "{name:?} of {layer}"
            );
        }
    }
    let src_image = h.source.join("overlay-images").join(id("imageA"));
    let dst_image = h.remote.join("overlay-images").join(id("imageA"));
    for e in fs::read_dir(&src_image).unwrap() {
        let name = e.unwrap().file_name();
        assert_eq!(
            fs::read(src_image.join(&name)).unwrap(),
            fs::read(dst_image.join(&name)).unwrap(),
            "{name:?} of the image"
        );
    }
    // Sparse stays sparse.
    let sparse = h
        .remote
        .join("overlay/RO")
        .join(id("L1"))
        .join("diff/sparse");
    assert!(fs::metadata(sparse).unwrap().blocks() < 1024);
}

#[test]
fn a_rerun_copies_nothing() {
    let h = hosts();
    ok(&publish(&h, IMAGE_A));
    let before = tree(&h.remote);
    // By id prefix this time.
    let out = ok(&publish(&h, &id("imageA")[..12]));
    assert!(
        out.contains("0 of 4 layers copied, image already present"),
        "{out}"
    );
    assert_eq!(out.matches("skipped (already present)").count(), 5, "{out}");
    assert_eq!(before, tree(&h.remote), "a rerun changes nothing");
}

/// Puts layer `label` of the source into the remote under `new_id`, over `parent`.
fn place_as(
    h: &Hosts,
    label: &str,
    new_id: &str,
    parent: Option<&str>,
    short: &str,
    lower: Option<&str>,
) {
    let src_overlay = h.source.join("overlay/RO").join(id(label));
    let dst_overlay = h.remote.join("overlay/RO").join(new_id);
    fs::create_dir_all(&dst_overlay).unwrap();
    copy_tree(&src_overlay.join("diff"), &dst_overlay.join("diff"));
    fs::write(dst_overlay.join("link"), short).unwrap();
    if let Some(lower) = lower {
        fs::write(dst_overlay.join("lower"), lower).unwrap();
    }
    let src_meta = h.source.join("overlay-layers/RO").join(id(label));
    let dst_meta = h.remote.join("overlay-layers/RO").join(new_id);
    fs::create_dir_all(&dst_meta).unwrap();
    let mut json: serde_json::Value =
        serde_json::from_slice(&fs::read(src_meta.join("layer.json")).unwrap()).unwrap();
    json["id"] = new_id.into();
    match parent {
        Some(p) => json["parent"] = p.into(),
        None => {
            json.as_object_mut().unwrap().remove("parent");
        }
    }
    fs::write(
        dst_meta.join("layer.json"),
        serde_json::to_vec(&json).unwrap(),
    )
    .unwrap();
    fs::copy(
        src_meta.join(format!("{}.tar-split.gz", id(label))),
        dst_meta.join(format!("{new_id}.tar-split.gz")),
    )
    .unwrap();
}

#[test]
fn a_layer_present_under_its_chain_id_is_skipped() {
    let h = hosts();
    // Another writer's names for L1 and L2: same content, other ids and short links.
    let other_l1 = "1".repeat(64);
    let other_l2 = "2".repeat(64);
    let s1 = "aaaaaaaaaaaaaaaaaaaaaaaaaa";
    let s2 = "bbbbbbbbbbbbbbbbbbbbbbbbbb";
    place_as(&h, "L1", &other_l1, None, s1, None);
    place_as(
        &h,
        "L2",
        &other_l2,
        Some(&other_l1),
        s2,
        Some(&format!("l/{s1}")),
    );
    let index = scan(&h.remote);
    assert!(index.layer(&other_l2).is_some(), "{:?}", index.not_ready());

    let out = ok(&publish(&h, IMAGE_A));
    assert!(
        out.contains(&format!(
            "layer {}: skipped (already present as {other_l1})",
            id("L1")
        )),
        "{out}"
    );
    assert!(
        out.contains(&format!(
            "layer {}: skipped (already present as {other_l2})",
            id("L2")
        )),
        "{out}"
    );
    assert!(out.contains("2 of 4 layers copied"), "{out}");
    assert!(!h.remote.join("overlay/RO").join(id("L1")).exists());
    assert!(!h.remote.join("overlay/RO").join(id("L2")).exists());

    // L3 now sits on the other writer's L2.
    let l3 = h
        .remote
        .join("overlay-layers/RO")
        .join(id("L3"))
        .join("layer.json");
    let json: serde_json::Value = serde_json::from_slice(&fs::read(l3).unwrap()).unwrap();
    assert_eq!(json["parent"], other_l2.as_str());
    let lower =
        fs::read_to_string(h.remote.join("overlay/RO").join(id("L3")).join("lower")).unwrap();
    assert_eq!(lower, format!("l/{s2}:l/{s1}"));
    let index = scan(&h.remote);
    let image = index.image(&id("imageA")).expect("image A ready");
    assert_eq!(image.top_layer, id("L4"));

    // Image B's top layer is L2: its images.json names the remote's copy.
    let out = ok(&publish(&h, "app:1.0"));
    assert!(out.contains("0 of 2 layers copied, image copied"), "{out}");
    let index = scan(&h.remote);
    let b = index.image(&id("imageB")).expect("image B ready");
    assert_eq!(b.top_layer, other_l2);
    assert!(index.not_ready().is_empty(), "{:?}", index.not_ready());
}

/// Adds to the source a layer over L4 holding one big file, and an image on it.
fn add_big_image(source: &Path) -> (String, String) {
    let top = "6".repeat(64);
    let image = "7".repeat(64);
    let short = "66666666666666666666666666";
    let overlay = source.join("overlay/RO").join(&top);
    fs::create_dir_all(overlay.join("diff/data")).unwrap();
    let mut f = fs::File::create(overlay.join("diff/data/big.bin")).unwrap();
    let chunk = pattern(1 << 20, 42);
    for _ in 0..200 {
        f.write_all(&chunk).unwrap();
    }
    drop(f);
    fs::write(overlay.join("link"), short).unwrap();
    let l4_lower =
        fs::read_to_string(source.join("overlay/RO").join(id("L4")).join("lower")).unwrap();
    fs::write(
        overlay.join("lower"),
        format!("l/{}:{l4_lower}", common::short("L4")),
    )
    .unwrap();
    let meta = source.join("overlay-layers/RO").join(&top);
    fs::create_dir_all(&meta).unwrap();
    let json = serde_json::json!({
        "id": top, "parent": id("L4"),
        "diff-digest": format!("sha256:{}", "6".repeat(64)), "diff-size": 200 << 20,
        "created": "2024-03-01T12:00:00Z",
    });
    fs::write(meta.join("layer.json"), serde_json::to_vec(&json).unwrap()).unwrap();
    fs::write(
        meta.join(format!("{top}.tar-split.gz")),
        common::isulad::gzip(b"{\"type\":1,\"name\":\"data/big.bin\"}\n"),
    )
    .unwrap();
    let a = source.join("overlay-images").join(id("imageA"));
    let dir = source.join("overlay-images").join(&image);
    fs::create_dir_all(&dir).unwrap();
    fs::copy(a.join("manifest"), dir.join("manifest")).unwrap();
    fs::copy(
        a.join(common::isulad::config_name(&id("imageA"))),
        dir.join(common::isulad::config_name(&image)),
    )
    .unwrap();
    let json = serde_json::json!({"id": image, "names": ["big:1"], "layer": top});
    fs::write(dir.join("images.json"), serde_json::to_vec(&json).unwrap()).unwrap();
    (top, image)
}

fn temp_for(remote: &Path, id: &str) -> bool {
    fs::read_dir(remote.join("overlay/RO")).is_ok_and(|d| {
        d.filter_map(Result::ok).any(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            n.starts_with('.') && n.ends_with(id)
        })
    })
}

#[test]
fn a_publisher_killed_mid_copy_leaves_nothing_ready_and_a_rerun_finishes() {
    let h = hosts();
    let (top, image) = add_big_image(&h.source);
    let mut child = publish_cmd(&h, "big:1").spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !temp_for(&h.remote, &top) {
        assert!(
            Instant::now() < deadline,
            "no temporary directory for the big layer"
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "publish ended before the big layer"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    child.kill().unwrap();
    let status = child.wait().unwrap();
    assert!(!status.success(), "publish finished before it was killed");

    let index = scan(&h.remote);
    assert!(index.image(&image).is_none(), "the image must not be ready");
    assert!(
        index.layer(&top).is_none(),
        "the big layer must not be ready"
    );
    assert!(!h.remote.join("overlay/RO").join(&top).exists());
    assert!(!h.remote.join("overlay-images").join(&image).exists());

    let out = ok(&publish(&h, "big:1"));
    assert!(out.contains("1 of 5 layers copied, image copied"), "{out}");
    let index = scan(&h.remote);
    assert!(index.image(&image).is_some(), "{:?}", index.not_ready());
    assert!(index.not_ready().is_empty(), "{:?}", index.not_ready());
    assert_no_temps(&h.remote);
    let rel = "diff/data/big.bin";
    assert_eq!(
        tree(&h.source.join("overlay/RO").join(&top).join("diff")),
        tree(&h.remote.join("overlay/RO").join(&top).join("diff")),
        "{rel}"
    );
}

#[test]
fn two_publishers_at_once_leave_one_copy() {
    for round in 0..5 {
        let h = hosts();
        let a = publish_cmd(&h, IMAGE_A).spawn().unwrap();
        let b = publish_cmd(&h, &id("imageA")).spawn().unwrap();
        let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
        let (ta, tb) = (ok(&a), ok(&b));
        assert_a_ready(&h.remote);
        assert_no_temps(&h.remote);
        let mut chain = chain_a();
        chain.sort();
        assert_eq!(ids_in(&h.remote, "overlay/RO"), chain, "round {round}");
        assert_eq!(
            ids_in(&h.remote, "overlay-layers/RO"),
            chain,
            "round {round}"
        );
        assert_eq!(ids_in(&h.remote, "overlay-images"), vec![id("imageA")]);
        // Between them, each object was placed once.
        let copied = |t: &str| t.lines().filter(|l| l.ends_with(": copied")).count();
        assert!(copied(&ta) + copied(&tb) >= 5, "{ta}\n{tb}");
    }
}

#[test]
fn bad_input_fails_cleanly() {
    let h = hosts();
    let err = failed(&publish(&h, "nosuch:image"));
    assert!(err.contains("no image \"nosuch:image\""), "{err}");

    // Images B (39c4…) and C (3cc6…) both start with 3.
    let err = failed(&publish(&h, "3"));
    assert!(
        err.contains("ambiguous") && err.contains(&id("imageB")),
        "{err}"
    );

    // Image C's top layer does not exist.
    let err = failed(&publish(&h, &id("imageC")));
    assert!(
        err.contains("not complete") && err.contains("missing"),
        "{err}"
    );

    // An image on L5, whose pull never finished.
    let dir = h.source.join("overlay-images").join("5".repeat(64));
    fs::create_dir(&dir).unwrap();
    let a = h.source.join("overlay-images").join(id("imageA"));
    fs::copy(a.join("manifest"), dir.join("manifest")).unwrap();
    fs::copy(
        a.join(common::isulad::config_name(&id("imageA"))),
        dir.join(common::isulad::config_name(&"5".repeat(64))),
    )
    .unwrap();
    let json = serde_json::json!({"id": "5".repeat(64), "names": ["half:1"], "layer": id("L5")});
    fs::write(dir.join("images.json"), serde_json::to_vec(&json).unwrap()).unwrap();
    let err = failed(&publish(&h, "half:1"));
    assert!(err.contains("incomplete"), "{err}");

    // Malformed metadata, and a layer symlink that loops.
    fs::write(dir.join("images.json"), b"{not json").unwrap();
    let err = failed(&publish(&h, &"5".repeat(64)));
    assert!(err.contains("malformed JSON"), "{err}");
    let loop_at = h.source.join("overlay-layers").join(id("L4"));
    fs::remove_file(&loop_at).unwrap();
    std::os::unix::fs::symlink(&loop_at, &loop_at).unwrap();
    fs::rename(
        h.source.join("overlay-layers/RO").join(id("L4")),
        h.source.join("overlay-layers/RO/.moved"),
    )
    .unwrap();
    let err = failed(&publish(&h, IMAGE_A));
    assert!(err.contains("symlink loop"), "{err}");

    let index = scan(&h.remote);
    assert_eq!(index.images().count(), 0);
    assert_eq!(index.layers().count(), 0);
    assert_no_temps(&h.remote);
}
