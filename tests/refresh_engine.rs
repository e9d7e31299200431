//! Live refresh on real mounts (DESIGN §5): the test plays the writer host, changing the
//! remote copy while it is mounted with a short refresh interval, and waits (bounded) for
//! the view to follow. Nothing here sleeps as a way of synchronizing.

mod common;

use std::fs;
use std::io::Read;
use std::path::Path;

use common::*;

const NEW_LAYER: &str = "5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e";
const NEW_SHORT: &str = "5e5e5e5e5e5e5e5e5e5e5e5e5e";
const NEW_IMAGE: &str = "6f6f6f6f6f6f6f6f6f6f6f6f6f6f6f6f6f6f6f6f6f6f6f6f6f6f6f6f6f6f6f6f";

fn fast() -> Options {
    Options {
        opts: "refresh=0.2".into(),
        ..Options::default()
    }
}

/// Every view path a ready layer `NEW_LAYER` and image `NEW_IMAGE` bring.
fn new_paths(m: &Mount) -> Vec<std::path::PathBuf> {
    vec![
        m.path(&format!("overlay/RO/{NEW_LAYER}")),
        m.path(&format!("overlay/{NEW_LAYER}")),
        m.path(&format!("overlay/l/{NEW_SHORT}")),
        m.path(&format!("overlay-layers/RO/{NEW_LAYER}")),
        m.path(&format!("overlay-layers/{NEW_LAYER}")),
        m.path(&format!("overlay-images/{NEW_IMAGE}")),
    ]
}

fn exists(p: &Path) -> bool {
    fs::symlink_metadata(p).is_ok()
}

fn read(p: &Path) -> String {
    let mut s = String::new();
    fs::File::open(p)
        .and_then(|mut f| f.read_to_string(&mut s))
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    s
}

fn add_new(remote: &Path, content: &str) {
    write_base_layer(remote, NEW_LAYER, NEW_SHORT, content, &tar_split_gz());
    write_image(remote, NEW_IMAGE, NEW_LAYER, &["new:latest"]);
}

fn remove_new(remote: &Path) {
    fs::remove_dir_all(remote.join("overlay-images").join(NEW_IMAGE)).unwrap();
    fs::remove_dir_all(remote.join("overlay/RO").join(NEW_LAYER)).unwrap();
    fs::remove_dir_all(remote.join("overlay-layers/RO").join(NEW_LAYER)).unwrap();
}

#[test]
fn added_objects_appear_even_where_a_failed_lookup_was_cached() {
    let mut m = Mount::with(fast(), |_| {});
    // The kernel caches these failures as negative entries, for an hour.
    for p in new_paths(&m) {
        assert_eq!(errno_of(fs::symlink_metadata(&p)), libc::ENOENT, "{p:?}");
    }
    assert!(!names(&m.path("overlay-images")).contains(&NEW_IMAGE.to_owned()));

    add_new(&m.remote, "hello from the writer\n");
    m.accept_remote_changes();
    eventually(10, "the new layer and image appear", || {
        new_paths(&m).iter().all(|p| exists(p))
    });
    assert!(names(&m.path("overlay-images")).contains(&NEW_IMAGE.to_owned()));
    assert!(names(&m.path("overlay/RO")).contains(&NEW_LAYER.to_owned()));
    assert!(names(&m.path("overlay/l")).contains(&NEW_SHORT.to_owned()));
    assert_eq!(
        read(&m.path(&format!("overlay/l/{NEW_SHORT}/hello"))),
        "hello from the writer\n"
    );
    let json = read(&m.path(&format!("overlay-images/{NEW_IMAGE}/images.json")));
    assert!(json.contains("new:latest"), "{json}");
}

#[test]
fn removed_objects_disappear_from_lookups_and_listings() {
    let mut m = Mount::with(fast(), |remote| add_new(remote, "x"));
    for p in new_paths(&m) {
        assert!(exists(&p), "{p:?} should be there at mount");
    }
    assert!(names(&m.path("overlay/RO")).contains(&NEW_LAYER.to_owned()));

    remove_new(&m.remote);
    m.accept_remote_changes();
    eventually(10, "the layer and image disappear", || {
        new_paths(&m).iter().all(|p| !exists(p))
    });
    assert!(!names(&m.path("overlay/RO")).contains(&NEW_LAYER.to_owned()));
    assert!(!names(&m.path("overlay")).contains(&NEW_LAYER.to_owned()));
    assert!(!names(&m.path("overlay/l")).contains(&NEW_SHORT.to_owned()));
    assert!(!names(&m.path("overlay-layers/RO")).contains(&NEW_LAYER.to_owned()));
    assert!(!names(&m.path("overlay-images")).contains(&NEW_IMAGE.to_owned()));
    // The fixture's own objects are untouched.
    assert!(exists(&m.path(&format!("overlay-images/{}", id("imageA")))));
}

#[test]
fn a_retag_is_read_through_the_view_with_fresh_attributes_and_data() {
    let mut m = Mount::with(fast(), |remote| add_new(remote, "x"));
    let json = m.path(&format!("overlay-images/{NEW_IMAGE}/images.json"));
    let before = read(&json);
    assert!(before.contains("new:latest"));
    let _ = fs::metadata(&json).unwrap();

    let retagged = image_json(
        NEW_IMAGE,
        NEW_LAYER,
        &["new:latest", "registry.example/new:v2-with-a-longer-tag"],
    );
    write_atomic(
        &m.remote
            .join("overlay-images")
            .join(NEW_IMAGE)
            .join("images.json"),
        retagged.as_bytes(),
    );
    m.accept_remote_changes();
    eventually(10, "the new images.json is read", || {
        read(&json) == retagged
    });
    assert_eq!(fs::metadata(&json).unwrap().len(), retagged.len() as u64);
}

#[test]
fn an_id_deleted_and_created_again_shows_the_new_content() {
    let mut m = Mount::with(fast(), |remote| add_new(remote, "first\n"));
    let hello = m.path(&format!("overlay/RO/{NEW_LAYER}/diff/hello"));
    let json = m.path(&format!("overlay-images/{NEW_IMAGE}/images.json"));
    assert_eq!(read(&hello), "first\n");
    let _ = read(&json);

    // Between two rounds: gone and back, with other content.
    remove_new(&m.remote);
    add_new(&m.remote, "second, longer\n");
    write_image(&m.remote, NEW_IMAGE, NEW_LAYER, &["again:latest"]);
    m.accept_remote_changes();
    eventually(10, "the re-created layer's content is read", || {
        fs::read_to_string(&hello).is_ok_and(|s| s == "second, longer\n")
    });
    eventually(10, "the re-created image's images.json is read", || {
        fs::read_to_string(&json).is_ok_and(|s| s.contains("again:latest"))
    });
}

#[test]
fn a_layer_with_a_truncated_tar_split_appears_once_it_is_complete() {
    let mut m = Mount::with(fast(), |_| {});
    let full = tar_split_gz();
    let tar_split = m
        .remote
        .join("overlay-layers/RO")
        .join(NEW_LAYER)
        .join(format!("{NEW_LAYER}.tar-split.gz"));
    write_base_layer(
        &m.remote,
        NEW_LAYER,
        NEW_SHORT,
        "x",
        &full[..full.len() / 2],
    );
    // A ready witness added at the same time tells when a round has looked at both.
    let witness = "7a7a7a7a7a7a7a7a7a7a7a7a7a7a7a7a7a7a7a7a7a7a7a7a7a7a7a7a7a7a7a7a";
    write_base_layer(&m.remote, witness, "7a7a7a7a7a7a7a7a7a7a7a7a7a", "w", &full);
    m.accept_remote_changes();
    let layer = m.path(&format!("overlay/RO/{NEW_LAYER}"));
    eventually(10, "the witness layer appears", || {
        exists(&m.path(&format!("overlay/RO/{witness}")))
    });
    assert!(
        !exists(&layer),
        "a truncated tar-split must keep the layer hidden"
    );

    // iSulad finishes writing the stream in place.
    fs::write(&tar_split, &full).unwrap();
    m.accept_remote_changes();
    eventually(10, "the completed layer appears", || exists(&layer));
}

#[test]
fn a_file_held_open_keeps_reading_after_its_layer_is_removed() {
    let mut m = Mount::with(fast(), |remote| add_new(remote, "still here\n"));
    let path = m.path(&format!("overlay/RO/{NEW_LAYER}/diff/hello"));
    let mut file = fs::File::open(&path).unwrap();

    remove_new(&m.remote);
    m.accept_remote_changes();
    eventually(10, "the layer disappears", || {
        !exists(&m.path(&format!("overlay/RO/{NEW_LAYER}")))
    });
    let mut s = String::new();
    file.read_to_string(&mut s).unwrap();
    assert_eq!(s, "still here\n");
    assert_eq!(errno_of(fs::metadata(&path)), libc::ENOENT);
}

#[test]
fn a_remote_area_created_after_mount_is_followed() {
    // A writer that has not pulled anything yet: no areas at all.
    let mut m = Mount::with(fast(), |remote| {
        for area in ["overlay", "overlay-layers", "overlay-images"] {
            fs::remove_dir_all(remote.join(area)).unwrap();
        }
    });
    assert!(names(&m.path("overlay/RO")).is_empty());
    assert!(names(&m.path("overlay-images")).is_empty());

    add_new(&m.remote, "first pull\n");
    m.accept_remote_changes();
    eventually(10, "the first pulled image appears", || {
        new_paths(&m).iter().all(|p| exists(p))
    });
    assert_eq!(
        read(&m.path(&format!("overlay/RO/{NEW_LAYER}/diff/hello"))),
        "first pull\n"
    );
}

#[test]
fn a_remote_that_goes_away_keeps_the_last_view_and_comes_back() {
    let mut m = Mount::with(fast(), |_| {});
    let image = m.path(&format!("overlay-images/{}", id("imageA")));
    assert!(exists(&image));
    let away = m.dir.path().join("remote-away");
    fs::rename(&m.remote, &away).unwrap();
    // Local paths keep working, and the last good index stays.
    fs::write(m.path("local-file"), "local").unwrap();
    assert_eq!(read(&m.path("local-file")), "local");
    assert!(exists(&image));
    names(&m.path(""));

    fs::rename(&away, &m.remote).unwrap();
    add_new(&m.remote, "after the outage\n");
    m.accept_remote_changes();
    eventually(10, "rounds resume after the remote is back", || {
        new_paths(&m).iter().all(|p| exists(p))
    });
}

#[test]
fn on_a_local_remote_inotify_triggers_rounds_between_ticks() {
    // A tick only every 10 minutes: anything seen sooner came through inotify.
    let mut m = Mount::with(
        Options {
            opts: "refresh=600".into(),
            ..Options::default()
        },
        |_| {},
    );
    assert!(!exists(&m.path(&format!("overlay-images/{NEW_IMAGE}"))));
    add_new(&m.remote, "via inotify\n");
    m.accept_remote_changes();
    eventually(10, "inotify brings the new image", || {
        new_paths(&m).iter().all(|p| exists(p))
    });
}
