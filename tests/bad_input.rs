//! Malformed and hostile remote content (DESIGN §4.3, §11): the objects it affects are not
//! ready, everything else is served, and the daemon neither crashes nor hangs.

mod common;

use std::ffi::{OsStr, OsString};
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use common::*;

fn layer_dir(remote: &Path, label: &str) -> PathBuf {
    remote.join("overlay/RO").join(id(label))
}

fn layer_meta(remote: &Path, label: &str) -> PathBuf {
    remote.join("overlay-layers/RO").join(id(label))
}

fn image_dir(remote: &Path, label: &str) -> PathBuf {
    remote.join("overlay-images").join(id(label))
}

fn mkfifo(path: &Path) {
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid C string.
    assert_eq!(
        unsafe { libc::mkfifo(c.as_ptr(), 0o644) },
        0,
        "mkfifo {}",
        path.display()
    );
}

fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v
}

/// Everything the walk saw.
#[derive(Default)]
struct Walked {
    entries: usize,
    files: usize,
}

/// Visits every entry below `dir` without following symlinks, reads every regular file and
/// every link target, and compares layer files with their remote originals.
fn walk(m_mnt: &Path, remote: &Path, dir: &Path, seen: &mut Walked) {
    let entries = fs::read_dir(dir).unwrap_or_else(|e| panic!("readdir {}: {e}", dir.display()));
    for e in entries {
        let e = e.unwrap_or_else(|err| panic!("readdir {}: {err}", dir.display()));
        let p = e.path();
        let meta =
            fs::symlink_metadata(&p).unwrap_or_else(|err| panic!("lstat {}: {err}", p.display()));
        seen.entries += 1;
        let ft = meta.file_type();
        if ft.is_dir() {
            walk(m_mnt, remote, &p, seen);
        } else if ft.is_symlink() {
            fs::read_link(&p).unwrap_or_else(|err| panic!("readlink {}: {err}", p.display()));
        } else if ft.is_file() {
            let data = fs::read(&p).unwrap_or_else(|err| panic!("read {}: {err}", p.display()));
            seen.files += 1;
            let rel = p.strip_prefix(m_mnt).unwrap();
            if rel.starts_with("overlay/RO") {
                assert_eq!(
                    data,
                    fs::read(remote.join(rel)).unwrap(),
                    "{} differs from the remote",
                    rel.display()
                );
            }
        }
    }
}

/// Mounts the fixture as changed by `prepare`, checks that exactly `layers` and `images`
/// (labels) are served, walks the whole view (with a deadline, so a hung daemon fails the
/// test), and checks the daemon is still alive. Returns the mount for further checks.
fn check(prepare: impl FnOnce(&Path), layers: &[&str], images: &[&str]) -> Mount {
    let m = Mount::with(Options::default(), prepare);
    let ids = sorted(layers.iter().map(|l| id(l)).collect());
    let shorts = sorted(layers.iter().map(|l| short(l)).collect());
    assert_eq!(names(&m.path("overlay/RO")), ids);
    assert_eq!(names(&m.path("overlay-layers/RO")), ids);
    assert_eq!(names(&m.path("overlay/l")), shorts);
    let mut with_skeleton = ids.clone();
    with_skeleton.extend(["RO".to_owned(), "l".to_owned()]);
    assert_eq!(names(&m.path("overlay")), sorted(with_skeleton));
    assert_eq!(
        names(&m.path("overlay-images")),
        sorted(images.iter().map(|i| id(i)).collect())
    );
    for label in ["L1", "L2", "L3", "L4", "L5"] {
        if !layers.contains(&label) {
            for home in [
                "overlay",
                "overlay/RO",
                "overlay-layers",
                "overlay-layers/RO",
            ] {
                let p = m.path(home).join(id(label));
                assert!(
                    fs::symlink_metadata(&p).is_err(),
                    "{} is served",
                    p.display()
                );
            }
        }
    }
    for label in ["imageA", "imageB", "imageC"] {
        if !images.contains(&label) {
            let p = m.path("overlay-images").join(id(label));
            assert!(
                fs::symlink_metadata(&p).is_err(),
                "{} is served",
                p.display()
            );
        }
    }

    let (tx, rx) = mpsc::channel();
    let (mnt, remote) = (m.mnt.clone(), m.remote.clone());
    std::thread::spawn(move || {
        let mut seen = Walked::default();
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            walk(&mnt, &remote, &mnt, &mut seen)
        }));
        let _ = tx.send(result.map(|()| seen));
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(Ok(seen)) => {
            assert!(seen.entries > 0 && (layers.is_empty() || seen.files > 0));
        }
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        Err(_) => panic!("walking the view did not finish: the daemon hangs"),
    }
    assert!(fs::metadata(&m.mnt).unwrap().is_dir());
    assert!(is_mounted(&m.mnt), "the daemon went away");
    m
}

const ALL_LAYERS: &[&str] = &["L1", "L2", "L3", "L4"];
const ALL_IMAGES: &[&str] = &["imageA", "imageB"];

#[test]
fn untouched_fixture_walks_clean() {
    check(|_| {}, ALL_LAYERS, ALL_IMAGES);
}

#[test]
fn garbage_layer_json() {
    check(
        |r| {
            fs::write(
                layer_meta(r, "L4").join("layer.json"),
                b"{\"id\": \"\x00\xff garbage",
            )
            .unwrap()
        },
        &["L1", "L2", "L3"],
        &["imageB"],
    );
}

#[test]
fn layer_json_of_the_wrong_shape() {
    check(
        |r| {
            fs::write(layer_meta(r, "L4").join("layer.json"), b"[1, 2, 3]").unwrap();
            fs::write(layer_meta(r, "L3").join("layer.json"), b"{\"id\": 42}").unwrap();
        },
        &["L1", "L2"],
        &["imageB"],
    );
}

#[test]
fn layer_json_naming_another_layer() {
    check(
        |r| {
            let other = fs::read(layer_meta(r, "L3").join("layer.json")).unwrap();
            fs::write(layer_meta(r, "L4").join("layer.json"), other).unwrap();
        },
        &["L1", "L2", "L3"],
        &["imageB"],
    );
}

#[test]
fn layer_json_is_a_directory() {
    check(
        |r| {
            let p = layer_meta(r, "L4").join("layer.json");
            fs::remove_file(&p).unwrap();
            fs::create_dir(&p).unwrap();
        },
        &["L1", "L2", "L3"],
        &["imageB"],
    );
}

#[test]
fn truncated_tar_split() {
    check(
        |r| {
            let p = layer_meta(r, "L3").join(format!("{}.tar-split.gz", id("L3")));
            let data = fs::read(&p).unwrap();
            fs::write(&p, &data[..data.len() / 2]).unwrap();
        },
        &["L1", "L2"],
        &["imageB"],
    );
}

#[test]
fn tar_split_that_is_not_gzip() {
    check(
        |r| {
            let p = layer_meta(r, "L4").join(format!("{}.tar-split.gz", id("L4")));
            fs::write(&p, b"this is not a gzip stream at all").unwrap();
        },
        &["L1", "L2", "L3"],
        &["imageB"],
    );
}

#[test]
fn empty_link_file() {
    check(
        |r| fs::write(layer_dir(r, "L4").join("link"), b"").unwrap(),
        &["L1", "L2", "L3"],
        &["imageB"],
    );
}

#[test]
fn link_file_with_a_path_or_too_big() {
    check(
        |r| {
            fs::write(layer_dir(r, "L4").join("link"), b"../../../../etc").unwrap();
            fs::write(layer_dir(r, "L3").join("link"), vec![b'a'; 1 << 20]).unwrap();
        },
        &["L1", "L2"],
        &["imageB"],
    );
}

#[test]
fn lower_naming_paths_outside_l() {
    check(
        |r| {
            fs::write(
                layer_dir(r, "L4").join("lower"),
                b"l/../../../../etc:l/zzzzzzzzzzzzzzzzzzzzzzzzzz",
            )
            .unwrap()
        },
        &["L1", "L2", "L3"],
        &["imageB"],
    );
}

#[test]
fn diff_that_is_a_file() {
    check(
        |r| {
            let diff = layer_dir(r, "L4").join("diff");
            fs::remove_dir_all(&diff).unwrap();
            fs::write(&diff, b"not a dir").unwrap();
        },
        &["L1", "L2", "L3"],
        &["imageB"],
    );
}

#[test]
fn symlink_loops_inside_a_diff() {
    let m = check(
        |r| {
            let diff = layer_dir(r, "L1").join("diff");
            symlink("b", diff.join("a")).unwrap();
            symlink("a", diff.join("b")).unwrap();
            symlink("self", diff.join("self")).unwrap();
            symlink("loop/loop/loop", diff.join("loop")).unwrap();
        },
        ALL_LAYERS,
        ALL_IMAGES,
    );
    let diff = m.diff("L1");
    for (name, target) in [("a", "b"), ("b", "a"), ("self", "self")] {
        assert_eq!(fs::read_link(diff.join(name)).unwrap(), Path::new(target));
        // Only the kernel follows them, and gives up.
        assert_eq!(errno_of(fs::read(diff.join(name))), libc::ELOOP, "{name}");
    }
}

#[test]
fn odd_names_inside_a_diff() {
    let odd: Vec<OsString> = vec![
        OsStr::from_bytes(b"not-utf8-\xff\xfe").to_owned(),
        OsString::from("new\nline"),
        OsString::from("x".repeat(255)),
        OsString::from("-leading-dash"),
        OsString::from(" spaces "),
        OsString::from("back\\slash"),
        OsString::from("\u{1F600}.txt"),
        OsString::from(".wh.looks-like-a-whiteout"),
    ];
    let names_in = odd.clone();
    let m = check(
        move |r| {
            let diff = layer_dir(r, "L2").join("diff");
            for (i, name) in names_in.iter().enumerate() {
                fs::write(diff.join(name), format!("file {i}\n")).unwrap();
            }
            let dir = diff.join(OsStr::from_bytes(b"dir-\x80\n"));
            fs::create_dir(&dir).unwrap();
            fs::write(dir.join("inner"), b"inner\n").unwrap();
        },
        ALL_LAYERS,
        ALL_IMAGES,
    );
    let diff = m.diff("L2");
    let listed: Vec<OsString> = fs::read_dir(&diff)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    for (i, name) in odd.iter().enumerate() {
        assert!(listed.contains(name), "{name:?} not listed: {listed:?}");
        assert_eq!(
            fs::read(diff.join(name)).unwrap(),
            format!("file {i}\n").into_bytes()
        );
    }
    assert_eq!(
        fs::read(diff.join(OsStr::from_bytes(b"dir-\x80\n")).join("inner")).unwrap(),
        b"inner\n"
    );
    // A 256-byte name does not exist anywhere; asking for it is a plain error.
    let too_long = fs::symlink_metadata(diff.join("y".repeat(256)));
    assert_eq!(errno_of(too_long), libc::ENAMETOOLONG);
}

#[test]
fn special_files_and_deep_nesting_inside_a_diff() {
    let m = check(
        |r| {
            let diff = layer_dir(r, "L1").join("diff");
            mkfifo(&diff.join("fifo"));
            let mut deep = diff.join("deep");
            for _ in 0..100 {
                deep.push("d");
            }
            fs::create_dir_all(&deep).unwrap();
            fs::write(deep.join("bottom"), b"bottom\n").unwrap();
            symlink("/nonexistent/target", diff.join("dangling")).unwrap();
        },
        ALL_LAYERS,
        ALL_IMAGES,
    );
    use std::os::unix::fs::FileTypeExt;
    let diff = m.diff("L1");
    assert!(fs::symlink_metadata(diff.join("fifo"))
        .unwrap()
        .file_type()
        .is_fifo());
    assert_eq!(dtypes(&diff)["fifo"], "other");
    let mut deep = diff.join("deep");
    for _ in 0..100 {
        deep.push("d");
    }
    assert_eq!(fs::read(deep.join("bottom")).unwrap(), b"bottom\n");
    assert_eq!(
        fs::read_link(diff.join("dangling")).unwrap(),
        Path::new("/nonexistent/target")
    );
}

#[test]
fn fifo_in_place_of_images_json() {
    check(
        |r| {
            let p = image_dir(r, "imageB").join("images.json");
            fs::remove_file(&p).unwrap();
            mkfifo(&p);
        },
        ALL_LAYERS,
        &["imageA"],
    );
}

#[test]
fn fifo_in_place_of_layer_json_and_link() {
    check(
        |r| {
            let p = layer_meta(r, "L4").join("layer.json");
            fs::remove_file(&p).unwrap();
            mkfifo(&p);
            let p = layer_dir(r, "L3").join("link");
            fs::remove_file(&p).unwrap();
            mkfifo(&p);
        },
        &["L1", "L2"],
        &["imageB"],
    );
}

#[test]
fn oversized_and_garbage_image_files() {
    check(
        |r| {
            // Larger than any sane images.json, and not JSON either.
            fs::write(
                image_dir(r, "imageB").join("images.json"),
                vec![b'{'; 17 << 20],
            )
            .unwrap();
            fs::write(
                image_dir(r, "imageA").join("manifest"),
                b"\xff\xfe\x00garbage",
            )
            .unwrap();
        },
        ALL_LAYERS,
        &[],
    );
}

#[test]
fn everything_at_once() {
    check(
        |r| {
            fs::write(layer_meta(r, "L4").join("layer.json"), b"{{{").unwrap();
            let diff = layer_dir(r, "L1").join("diff");
            symlink("b", diff.join("a")).unwrap();
            symlink("a", diff.join("b")).unwrap();
            mkfifo(&diff.join("fifo"));
            fs::write(diff.join(OsStr::from_bytes(b"\xc3\x28\n")), b"odd\n").unwrap();
            let p = image_dir(r, "imageB").join("images.json");
            fs::remove_file(&p).unwrap();
            mkfifo(&p);
            fs::write(layer_dir(r, "L5").join("link"), b"").unwrap();
            fs::write(r.join("overlay/RO/stray-file"), b"").unwrap();
            symlink("/", r.join("overlay-images").join("0".repeat(64))).unwrap();
        },
        &["L1", "L2", "L3"],
        &[],
    );
}
