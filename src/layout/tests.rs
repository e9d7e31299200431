//! Scans of small remote trees built in temporary directories.
//!
//! Negative tests start from the standard tree (base ← middle ← top layer, one image on top),
//! check that it is fully ready, break exactly one thing and check the verdict: so each of
//! them fails if the rule it covers stops being enforced.

use std::collections::BTreeSet;
use std::ffi::OsStr;
use std::fs;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::symlink;
use std::path::PathBuf;

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use flate2::write::GzEncoder;
use flate2::Compression;
use tempfile::TempDir;

use super::*;

const BASE: u8 = 1;
const MIDDLE: u8 = 2;
const TOP: u8 = 3;
const IMAGE: u8 = 0xa1;

/// A 64-hex id made of one repeated byte, so tests can name objects by a number.
fn id(n: u8) -> String {
    format!("{n:02x}").repeat(32)
}

/// A 26-hex short id in iSulad's style.
fn short(n: u8) -> String {
    format!("{n:02x}").repeat(13)
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut encoder = GzEncoder::new(Vec::new(), Compression::default());
    encoder.write_all(bytes).unwrap();
    encoder.finish().unwrap()
}

/// A remote root under construction.
struct Tree {
    tmp: TempDir,
}

impl Tree {
    fn new() -> Tree {
        Tree {
            tmp: tempfile::tempdir().unwrap(),
        }
    }

    /// The standard tree: three chained layers and an image on the top one.
    fn standard() -> Tree {
        let tree = Tree::new();
        tree.layer(BASE, None);
        tree.layer(MIDDLE, Some(BASE));
        tree.layer(TOP, Some(MIDDLE));
        tree.image(IMAGE, TOP);
        tree
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.tmp.path().join(rel)
    }

    fn write(&self, rel: &str, bytes: impl AsRef<[u8]>) {
        let path = self.path(rel);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, bytes).unwrap();
    }

    fn read(&self, rel: &str) -> String {
        fs::read_to_string(self.path(rel)).unwrap()
    }

    fn remove(&self, rel: &str) {
        let path = self.path(rel);
        if path.is_dir() {
            fs::remove_dir_all(path).unwrap();
        } else {
            fs::remove_file(path).unwrap();
        }
    }

    /// Replaces `rel` by a symlink to a copy of it elsewhere, so only the link is wrong.
    fn symlink_instead(&self, rel: &str) {
        let outside = self.path(&format!("outside-{}", rel.replace('/', "_")));
        fs::rename(self.path(rel), &outside).unwrap();
        symlink(&outside, self.path(rel)).unwrap();
    }

    /// A well-formed layer `n` (both directories, tar-split included); its `lower` extends the
    /// parent's as a writer would, so parents must be added first.
    fn layer(&self, n: u8, parent: Option<u8>) {
        self.layer_with_short(n, parent, &short(n));
    }

    fn layer_with_short(&self, n: u8, parent: Option<u8>, link: &str) {
        let (id, overlay) = (id(n), format!("overlay/RO/{}", id(n)));
        fs::create_dir_all(self.path(&format!("{overlay}/diff"))).unwrap();
        self.write(&format!("{overlay}/link"), link);
        if let Some(p) = parent {
            let parent_dir = format!("overlay/RO/{}", self::id(p));
            let mut lower = format!("l/{}", self.read(&format!("{parent_dir}/link")));
            if let Ok(rest) = fs::read_to_string(self.path(&format!("{parent_dir}/lower"))) {
                lower = format!("{lower}:{rest}");
            }
            self.write(&format!("{overlay}/lower"), lower);
        }
        let parent_field = parent.map(|p| format!(r#","parent":"{}""#, self::id(p)));
        let json = format!(
            r#"{{"id":"{id}"{},"diff-digest":"sha256:{id}","incompelte":false}}"#,
            parent_field.unwrap_or_default()
        );
        let meta = format!("overlay-layers/RO/{id}");
        self.write(&format!("{meta}/layer.json"), json);
        let tar_split = gzip(br#"{"type":1,"name":"hello","size":13,"payload":"kGuXHeJgaa0="}"#);
        self.write(&format!("{meta}/{id}.tar-split.gz"), tar_split);
    }

    /// A well-formed image `n` whose top layer is `top`.
    fn image(&self, n: u8, top: u8) {
        let dir = format!("overlay-images/{}", id(n));
        let json = format!(
            r#"{{"id":"{}","names":["busybox:latest"],"layer":"{}","size":42}}"#,
            id(n),
            id(top)
        );
        self.write(&format!("{dir}/images.json"), json);
        self.write(&format!("{dir}/manifest"), r#"{"schemaVersion":2}"#);
        self.write(&config_path(n), r#"{"architecture":"amd64"}"#);
    }

    fn scan(&self) -> LayoutIndex {
        LayoutIndex::scan(self.tmp.path(), "overlay")
    }
}

fn overlay(n: u8) -> String {
    format!("overlay/RO/{}", id(n))
}

fn meta(n: u8) -> String {
    format!("overlay-layers/RO/{}", id(n))
}

fn layer_json(n: u8) -> String {
    format!("{}/layer.json", meta(n))
}

fn tar_split(n: u8) -> String {
    format!("{}/{}.tar-split.gz", meta(n), id(n))
}

fn image_dir(n: u8) -> String {
    format!("overlay-images/{}", id(n))
}

fn config_path(n: u8) -> String {
    let name = STANDARD.encode(format!("sha256:{}", id(n)));
    format!("{}/={name}", image_dir(n))
}

/// The reason `name` is not ready; fails if it is ready or unknown.
fn reason(index: &LayoutIndex, kind: ObjectKind, name: &str) -> String {
    let ready = match kind {
        ObjectKind::Layer => index.layer(name).is_some(),
        ObjectKind::Image => index.image(name).is_some(),
    };
    assert!(!ready, "{name} is ready");
    match index
        .not_ready()
        .iter()
        .find(|nr| nr.kind == kind && nr.name == name)
    {
        Some(nr) => nr.reason.clone(),
        None => panic!("{name} not listed as not ready: {:?}", index.not_ready()),
    }
}

fn assert_all_ready(index: &LayoutIndex) {
    assert!(index.not_ready().is_empty(), "{:?}", index.not_ready());
    assert_eq!(index.layers().count(), 3);
    assert_eq!(index.images().count(), 1);
}

/// Builds the standard tree, checks it is ready, applies `damage`, and returns the new index.
fn damaged(damage: impl FnOnce(&Tree)) -> LayoutIndex {
    let tree = Tree::standard();
    assert_all_ready(&tree.scan());
    damage(&tree);
    tree.scan()
}

/// Asserts that `damage` makes layer `n` not ready with a reason containing `needle`, and
/// that the image above it follows.
fn assert_breaks_layer(n: u8, needle: &str, damage: impl FnOnce(&Tree)) {
    let index = damaged(damage);
    let why = reason(&index, ObjectKind::Layer, &id(n));
    assert!(why.contains(needle), "reason {why:?} lacks {needle:?}");
    assert!(index.image(&id(IMAGE)).is_none());
}

fn assert_breaks_image(needle: &str, damage: impl FnOnce(&Tree)) {
    let index = damaged(damage);
    let why = reason(&index, ObjectKind::Image, &id(IMAGE));
    assert!(why.contains(needle), "reason {why:?} lacks {needle:?}");
}

// --- the good case -------------------------------------------------------------------------

#[test]
fn standard_tree_is_ready() {
    let index = Tree::standard().scan();
    assert_all_ready(&index);
    assert_eq!(index.driver(), "overlay");
    let top = index.layer(&id(TOP)).unwrap();
    assert_eq!(top.short, short(TOP));
    assert_eq!(top.parent, Some(id(MIDDLE)));
    assert_eq!(index.layer(&id(BASE)).unwrap().parent, None);
    assert_eq!(index.layer_by_short(&short(MIDDLE)).unwrap().id, id(MIDDLE));
    let image = index.image(&id(IMAGE)).unwrap();
    assert_eq!(image.top_layer, id(TOP));
    assert_eq!(image.names, ["busybox:latest"]);
    let ids: Vec<_> = index.layers().map(|l| l.id.clone()).collect();
    assert_eq!(ids, [id(BASE), id(MIDDLE), id(TOP)]);
}

#[test]
fn empty_or_missing_roots_give_empty_indexes() {
    let tree = Tree::new();
    let index = tree.scan();
    assert_eq!(index.layers().count(), 0);
    assert!(index.not_ready().is_empty());

    let index = LayoutIndex::scan(&tree.path("does-not-exist"), "overlay");
    assert_eq!(index.layers().count(), 0);
    assert_eq!(
        index.not_ready().len(),
        3,
        "one line per area: {:?}",
        index.not_ready()
    );
}

#[test]
fn other_driver_names_select_other_areas() {
    let tree = Tree::standard();
    assert_eq!(
        LayoutIndex::scan(tree.tmp.path(), "overlay2")
            .layers()
            .count(),
        0
    );
    fs::rename(tree.path("overlay"), tree.path("overlay2")).unwrap();
    fs::rename(tree.path("overlay-layers"), tree.path("overlay2-layers")).unwrap();
    fs::rename(tree.path("overlay-images"), tree.path("overlay2-images")).unwrap();
    let index = LayoutIndex::scan(tree.tmp.path(), "overlay2");
    assert_all_ready(&index);
}

#[test]
fn driver_names_cannot_climb_out() {
    let tree = Tree::standard();
    for bad in ["", "..", "../overlay", "a/b"] {
        let index = LayoutIndex::scan(tree.tmp.path(), bad);
        assert_eq!(index.layers().count(), 0, "{bad:?}");
        assert_eq!(index.not_ready()[0].reason, "invalid graph driver name");
    }
}

#[test]
fn trailing_newlines_are_tolerated() {
    let tree = Tree::standard();
    tree.write(
        &format!("{}/link", overlay(MIDDLE)),
        format!("{}\n", short(MIDDLE)),
    );
    tree.write(
        &format!("{}/lower", overlay(TOP)),
        format!("l/{}:l/{}\n", short(MIDDLE), short(BASE)),
    );
    assert_all_ready(&tree.scan());
}

#[test]
fn base32_short_ids_are_accepted() {
    let tree = Tree::new();
    tree.layer_with_short(BASE, None, "ABCDEFGHIJKLMNOPQRSTUVWXY2");
    tree.layer_with_short(MIDDLE, Some(BASE), "MNOPQRSTUVWXYZ234567ABCDEF");
    let index = tree.scan();
    assert!(index.not_ready().is_empty(), "{:?}", index.not_ready());
    assert_eq!(
        index
            .layer_by_short("ABCDEFGHIJKLMNOPQRSTUVWXY2")
            .unwrap()
            .id,
        id(BASE)
    );
}

#[test]
fn layer_without_diff_digest_needs_no_tar_split() {
    let tree = Tree::standard();
    tree.write(&layer_json(BASE), format!(r#"{{"id":"{}"}}"#, id(BASE)));
    tree.remove(&tar_split(BASE));
    assert_all_ready(&tree.scan());
}

#[test]
fn false_incomplete_flags_and_unknown_fields_are_fine() {
    let tree = Tree::standard();
    let json = format!(
        r#"{{"id":"{}","incomplete":false,"flags":{{"incomplete":false,"x":[1]}},"new-field":{{}},"names":null}}"#,
        id(BASE)
    );
    tree.write(&layer_json(BASE), json);
    assert_all_ready(&tree.scan());
}

// --- overlay dir rules ---------------------------------------------------------------------

#[test]
fn missing_link() {
    assert_breaks_layer(TOP, "link: missing", |t| {
        t.remove(&format!("{}/link", overlay(TOP)))
    });
}

#[test]
fn malformed_links() {
    let bad = [
        "c3343428f60aab9c86d24293f",      // 25 characters
        "C3343428F60AAB9C86D24293F6",     // uppercase hex
        "c3343428f60aab9c86d24293f6\n\n", // two newlines
        "c3343428f60aab9c86d24293f6 ",    // trailing space
        "../../../../../../../../etc",    // a path
    ];
    for link in bad {
        assert_breaks_layer(TOP, "link: not a short id", |t| {
            t.write(&format!("{}/link", overlay(TOP)), link)
        });
    }
}

#[test]
fn missing_diff() {
    assert_breaks_layer(TOP, "diff: missing", |t| {
        t.remove(&format!("{}/diff", overlay(TOP)))
    });
}

#[test]
fn diff_that_is_a_file() {
    assert_breaks_layer(TOP, "diff: not a directory", |t| {
        t.remove(&format!("{}/diff", overlay(TOP)));
        t.write(&format!("{}/diff", overlay(TOP)), "");
    });
}

#[test]
fn diff_that_is_a_symlink() {
    assert_breaks_layer(TOP, "diff: is a symlink", |t| {
        t.symlink_instead(&format!("{}/diff", overlay(TOP)))
    });
}

#[test]
fn missing_lower_with_parent() {
    assert_breaks_layer(
        TOP,
        "lower: missing although layer.json names parent",
        |t| t.remove(&format!("{}/lower", overlay(TOP))),
    );
}

#[test]
fn lower_on_a_base_layer() {
    assert_breaks_layer(
        BASE,
        "lower: present although layer.json names no parent",
        |t| {
            t.write(
                &format!("{}/lower", overlay(BASE)),
                format!("l/{}", short(TOP)),
            )
        },
    );
}

#[test]
fn lower_not_starting_with_the_parent() {
    assert_breaks_layer(TOP, "first entry", |t| {
        t.write(
            &format!("{}/lower", overlay(TOP)),
            format!("l/{}:l/{}", short(BASE), short(MIDDLE)),
        )
    });
}

#[test]
fn lower_missing_an_ancestor() {
    assert_breaks_layer(TOP, "ends before the parent chain", |t| {
        t.write(
            &format!("{}/lower", overlay(TOP)),
            format!("l/{}", short(MIDDLE)),
        )
    });
}

#[test]
fn lower_naming_an_unknown_short_id() {
    assert_breaks_layer(TOP, "entry 2", |t| {
        t.write(
            &format!("{}/lower", overlay(TOP)),
            format!("l/{}:l/{}", short(MIDDLE), short(0x77)),
        )
    });
}

#[test]
fn lower_with_bad_syntax() {
    for lower in [
        short(MIDDLE),
        format!("l/{}::l/{}", short(MIDDLE), short(BASE)),
        String::new(),
    ] {
        assert_breaks_layer(TOP, "lower: ", |t| {
            t.write(&format!("{}/lower", overlay(TOP)), &lower)
        });
    }
}

#[test]
fn shared_short_ids_make_both_layers_not_ready() {
    let tree = Tree::standard();
    tree.layer_with_short(0x50, None, &short(BASE));
    let index = tree.scan();
    assert!(reason(&index, ObjectKind::Layer, &id(0x50)).contains("also used by"));
    assert!(reason(&index, ObjectKind::Layer, &id(BASE)).contains("also used by"));
    assert!(index.layer_by_short(&short(BASE)).is_none());
}

// --- layer metadata rules ------------------------------------------------------------------

#[test]
fn missing_overlay_dir() {
    assert_breaks_layer(TOP, "overlay/RO/", |t| t.remove(&overlay(TOP)));
}

#[test]
fn missing_layer_dir() {
    assert_breaks_layer(TOP, "overlay-layers/RO/", |t| t.remove(&meta(TOP)));
}

#[test]
fn missing_layer_json() {
    assert_breaks_layer(TOP, "layer.json: missing", |t| t.remove(&layer_json(TOP)));
}

#[test]
fn malformed_layer_json() {
    for json in ["", "{", "[]", r#"{"id":3}"#, r#"{"incompelte":"yes"}"#] {
        assert_breaks_layer(TOP, "layer.json: malformed JSON", |t| {
            t.write(&layer_json(TOP), json)
        });
    }
}

#[test]
fn layer_json_with_another_id() {
    assert_breaks_layer(TOP, "id does not match", |t| {
        t.write(
            &layer_json(TOP),
            format!(r#"{{"id":"{}","parent":"{}"}}"#, id(0x44), id(MIDDLE)),
        )
    });
}

#[test]
fn incomplete_layers() {
    for flag in [
        r#""incompelte":true"#,
        r#""incomplete":true"#,
        r#""flags":{"incomplete":true}"#,
    ] {
        let json = format!(r#"{{"id":"{}","parent":"{}",{flag}}}"#, id(TOP), id(MIDDLE));
        assert_breaks_layer(TOP, "incomplete flag set", |t| {
            t.write(&layer_json(TOP), &json)
        });
    }
}

#[test]
fn parent_that_is_not_an_id() {
    assert_breaks_layer(TOP, "parent is not a 64-hex layer id", |t| {
        t.write(
            &layer_json(TOP),
            format!(r#"{{"id":"{}","parent":"../../etc"}}"#, id(TOP)),
        )
    });
}

#[test]
fn missing_tar_split() {
    assert_breaks_layer(
        TOP,
        "tar-split.gz: missing although layer.json sets diff-digest",
        |t| t.remove(&tar_split(TOP)),
    );
}

#[test]
fn truncated_tar_split() {
    let whole = gzip(br#"{"type":1,"name":"hello","size":13,"payload":"kGuXHeJgaa0="}"#);
    // In the trailer, in the deflate data, and right after the header.
    for len in [whole.len() - 6, whole.len() / 2, 12, 5] {
        assert_breaks_layer(TOP, "tar-split.gz: truncated gzip stream", |t| {
            t.write(&tar_split(TOP), &whole[..len]);
        });
    }
}

#[test]
fn empty_tar_split() {
    assert_breaks_layer(TOP, "tar-split.gz: empty file", |t| {
        t.write(&tar_split(TOP), "")
    });
}

#[test]
fn tar_split_that_is_not_gzip() {
    assert_breaks_layer(TOP, "tar-split.gz: not a valid gzip stream", |t| {
        t.write(
            &tar_split(TOP),
            "plain text, long enough to hold a gzip header",
        )
    });
}

#[test]
fn huge_json_is_refused_without_reading_it() {
    assert_breaks_layer(TOP, "layer.json: larger than the 16 MiB read cap", |t| {
        let file = fs::File::create(t.path(&layer_json(TOP))).unwrap();
        file.set_len(17 << 20).unwrap();
    });
}

#[test]
fn fifo_in_place_of_a_file_does_not_hang() {
    assert_breaks_layer(TOP, "layer.json: not a regular file", |t| {
        t.remove(&layer_json(TOP));
        nix::unistd::mkfifo(&t.path(&layer_json(TOP)), nix::sys::stat::Mode::S_IRWXU).unwrap();
    });
}

// --- chains --------------------------------------------------------------------------------

#[test]
fn missing_middle_layer_sinks_the_chain() {
    let index = damaged(|t| {
        t.remove(&overlay(MIDDLE));
        t.remove(&meta(MIDDLE));
    });
    let why = reason(&index, ObjectKind::Layer, &id(TOP));
    assert_eq!(why, format!("parent {}: not ready (missing)", id(MIDDLE)));
    assert!(index.layer(&id(BASE)).is_some());
    let why = reason(&index, ObjectKind::Image, &id(IMAGE));
    assert!(
        why.contains(&format!("ancestor {}: missing", id(MIDDLE))),
        "{why}"
    );
}

#[test]
fn broken_ancestor_is_named_in_descendants() {
    let index = damaged(|t| t.remove(&format!("{}/link", overlay(BASE))));
    let why = reason(&index, ObjectKind::Layer, &id(TOP));
    assert_eq!(
        why,
        format!(
            "parent {}: not ready (ancestor {}: link: missing)",
            id(MIDDLE),
            id(BASE)
        )
    );
    let why = reason(&index, ObjectKind::Layer, &id(MIDDLE));
    assert_eq!(
        why,
        format!("parent {}: not ready (link: missing)", id(BASE))
    );
}

#[test]
fn cycles_are_detected() {
    let tree = Tree::standard();
    // 0x60 → 0x61 → 0x62 → 0x60, and 0x63 hangs below the cycle.
    for (n, parent) in [(0x60, 0x61), (0x61, 0x62), (0x62, 0x60), (0x63, 0x60)] {
        tree.layer(n, None);
        let json = format!(r#"{{"id":"{}","parent":"{}"}}"#, id(n), id(parent));
        tree.write(&layer_json(n), json);
        tree.write(
            &format!("{}/lower", overlay(n)),
            format!("l/{}", short(parent)),
        );
    }
    let index = tree.scan();
    for n in [0x60, 0x61, 0x62] {
        assert!(reason(&index, ObjectKind::Layer, &id(n)).contains("loops back"));
    }
    assert!(
        reason(&index, ObjectKind::Layer, &id(0x63)).starts_with(&format!("parent {}", id(0x60)))
    );
    assert_eq!(
        index.layers().count(),
        3,
        "the standard chain is unaffected"
    );
}

#[test]
fn self_parent_is_a_cycle() {
    assert_breaks_layer(TOP, "loops back", |t| {
        t.write(
            &layer_json(TOP),
            format!(r#"{{"id":"{}","parent":"{}"}}"#, id(TOP), id(TOP)),
        );
        t.write(
            &format!("{}/lower", overlay(TOP)),
            format!("l/{}", short(TOP)),
        );
    });
}

#[test]
fn chains_deeper_than_the_overlay_limit() {
    let tree = Tree::new();
    // Layer n has n - 1 ancestors: 129 is the deepest allowed, 130 is one too deep.
    tree.layer(1, None);
    for n in 2..=130u8 {
        tree.layer(n, Some(n - 1));
    }
    let index = tree.scan();
    assert!(index.layer(&id(129)).is_some(), "{:?}", index.not_ready());
    assert!(reason(&index, ObjectKind::Layer, &id(130)).contains("lower: more than 128 entries"));

    // With `lower` cut back to 128 entries, the chain itself is what is too deep.
    let lower = tree.read(&format!("{}/lower", overlay(130)));
    let entries: Vec<&str> = lower.split(':').take(128).collect();
    tree.write(&format!("{}/lower", overlay(130)), entries.join(":"));
    let why = reason(&tree.scan(), ObjectKind::Layer, &id(130));
    assert_eq!(why, "parent chain deeper than 128 layers");
}

// --- symlinks, names, garbage --------------------------------------------------------------

#[test]
fn symlinked_overlay_dir() {
    assert_breaks_layer(TOP, "is a symlink", |t| t.symlink_instead(&overlay(TOP)));
}

#[test]
fn symlinked_layer_dir() {
    assert_breaks_layer(TOP, "is a symlink", |t| t.symlink_instead(&meta(TOP)));
}

#[test]
fn symlinked_link_file() {
    assert_breaks_layer(TOP, "link: is a symlink", |t| {
        t.symlink_instead(&format!("{}/link", overlay(TOP)))
    });
}

#[test]
fn symlinked_layer_json() {
    assert_breaks_layer(TOP, "layer.json: is a symlink", |t| {
        t.symlink_instead(&layer_json(TOP))
    });
}

#[test]
fn symlinked_area() {
    let index = damaged(|t| t.symlink_instead("overlay/RO"));
    assert!(index
        .not_ready()
        .iter()
        .any(|nr| nr.name == "overlay/RO" && nr.reason.contains("symlink")));
    assert_eq!(index.layers().count(), 0);
}

#[test]
fn symlinked_image_dir() {
    assert_breaks_image("is a symlink", |t| t.symlink_instead(&image_dir(IMAGE)));
}

#[test]
fn garbage_is_never_an_id() {
    let tree = Tree::standard();
    let stray = [
        "overlay/RO/.tmp-link-0123456789",
        "overlay-layers/RO/short",
        "overlay-images/README",
        "overlay-images/.tmp-images.json-abcdef0123",
    ];
    for rel in stray {
        tree.write(rel, "x");
    }
    // Id-shaped names that are plain files, uppercase, or too long.
    tree.write(&format!("overlay/RO/{}", id(0x70)), "not a dir");
    fs::create_dir_all(tree.path(&format!("overlay/RO/{}", id(0xab).to_uppercase()))).unwrap();
    fs::create_dir_all(tree.path(&format!("overlay-images/{}0", id(0x71)))).unwrap();
    fs::create_dir_all(tree.path("overlay/l")).unwrap();
    // Non-UTF-8 names.
    let root = tree.path("overlay-layers/RO");
    fs::create_dir_all(root.join(OsStr::from_bytes(b"\xff\xfe"))).unwrap();
    fs::write(
        tree.path("overlay-images")
            .join(OsStr::from_bytes(b"bad\x80name")),
        "x",
    )
    .unwrap();
    assert_all_ready(&tree.scan());
}

// --- image rules ---------------------------------------------------------------------------

#[test]
fn missing_images_json() {
    assert_breaks_image("images.json: missing", |t| {
        t.remove(&format!("{}/images.json", image_dir(IMAGE)))
    });
}

#[test]
fn malformed_images_json() {
    assert_breaks_image("images.json: malformed JSON", |t| {
        t.write(&format!("{}/images.json", image_dir(IMAGE)), r#"{"id":"#)
    });
}

#[test]
fn images_json_with_another_id() {
    assert_breaks_image("id does not match", |t| {
        let json = format!(r#"{{"id":"{}","layer":"{}"}}"#, id(0x99), id(TOP));
        t.write(&format!("{}/images.json", image_dir(IMAGE)), json);
    });
}

#[test]
fn image_without_top_layer() {
    assert_breaks_image("`layer` (top layer) is missing", |t| {
        t.write(
            &format!("{}/images.json", image_dir(IMAGE)),
            format!(r#"{{"id":"{}"}}"#, id(IMAGE)),
        );
    });
}

#[test]
fn missing_manifest() {
    assert_breaks_image("manifest: missing", |t| {
        t.remove(&format!("{}/manifest", image_dir(IMAGE)))
    });
}

#[test]
fn malformed_manifest() {
    assert_breaks_image("manifest: malformed JSON", |t| {
        t.write(
            &format!("{}/manifest", image_dir(IMAGE)),
            "schemaVersion: 2",
        )
    });
}

#[test]
fn missing_config() {
    assert_breaks_image("config =c2hhMjU2O", |t| t.remove(&config_path(IMAGE)));
}

#[test]
fn image_on_a_missing_top_layer() {
    assert_breaks_image(
        &format!("top layer {}: not ready (missing)", id(0x42)),
        |t| {
            let json = format!(r#"{{"id":"{}","layer":"{}"}}"#, id(IMAGE), id(0x42));
            t.write(&format!("{}/images.json", image_dir(IMAGE)), json);
        },
    );
}

#[test]
fn image_on_a_broken_chain() {
    assert_breaks_image(
        &format!("top layer {}: not ready (ancestor {}", id(TOP), id(BASE)),
        |t| {
            t.write(
                &layer_json(BASE),
                format!(r#"{{"id":"{}","incompelte":true}}"#, id(BASE)),
            )
        },
    );
}

// --- the index as a value ------------------------------------------------------------------

#[test]
fn index_is_a_shareable_value() {
    fn shareable<T: Clone + Send + Sync + 'static>() {}
    shareable::<LayoutIndex>();
}

#[test]
fn fingerprints_tell_changed_objects_apart() {
    let tree = Tree::standard();
    let before = tree.scan();
    let again = tree.scan();
    let fp = |index: &LayoutIndex| index.image_fingerprint(&id(IMAGE)).unwrap().clone();
    assert!(!fp(&before).files_differ(&fp(&again)));
    assert!(fp(&before).get(Part::Config).is_some());
    assert_eq!(
        before.layer_fingerprint(&id(TOP)).unwrap().parts().count(),
        6
    );

    // A re-tag of the same length: only the content hash (and inode) can tell.
    let json = format!(
        r#"{{"id":"{}","names":["busybox:newest"],"layer":"{}","size":42}}"#,
        id(IMAGE),
        id(TOP)
    );
    tree.write(&format!("{}/images.json", image_dir(IMAGE)), json);
    let after = tree.scan();
    assert!(fp(&before).files_differ(&fp(&after)));
    assert_ne!(
        fp(&before).get(Part::ImagesJson).unwrap().content_hash,
        fp(&after).get(Part::ImagesJson).unwrap().content_hash
    );
    assert_eq!(after.image(&id(IMAGE)).unwrap().names, ["busybox:newest"]);
}

// ---- Incremental scans ----

fn scanner(tree: &Tree) -> Scanner {
    let mut s = Scanner::new(tree.tmp.path(), "overlay");
    // Test trees are seconds old at most: trust stamps at once, check files every scan.
    s.racy_margin = std::time::Duration::ZERO;
    s
}

#[test]
fn an_unchanged_tree_is_not_read_again() {
    let tree = Tree::standard();
    let mut s = scanner(&tree);
    s.full_check_every = 1000;
    let first = s.scan().unwrap();
    assert_all_ready(&first);
    assert_eq!(s.stats().listed, 3);
    assert_eq!(s.stats().probed, 7, "3 overlay dirs, 3 layer dirs, 1 image");
    let again = s.scan().unwrap();
    assert_all_ready(&again);
    assert_eq!(
        s.stats(),
        ScanStats {
            listed: 0,
            probed: 0,
            reused: 7,
            dirty: false,
        }
    );
    assert_eq!(
        first.image_fingerprint(&id(IMAGE)),
        again.image_fingerprint(&id(IMAGE))
    );
    assert!(s.scan_if_changed(false).unwrap().is_none());
    assert!(s.scan_if_changed(true).unwrap().is_some());
    tree.image(0xa2, TOP);
    assert!(s.scan_if_changed(false).unwrap().is_some());
}

#[test]
fn incremental_scans_see_additions_removals_and_rewrites() {
    let tree = Tree::standard();
    let mut s = scanner(&tree);
    s.scan().unwrap();

    tree.layer(4, Some(TOP));
    tree.image(0xa2, 4);
    let index = s.scan().unwrap();
    assert!(index.layer(&id(4)).is_some() && index.image(&id(0xa2)).is_some());
    assert_eq!(s.stats().listed, 3);

    // A re-tag: images.json replaced through a rename.
    let before = index.image_fingerprint(&id(IMAGE)).cloned().unwrap();
    let dir = tree.path(&image_dir(IMAGE));
    fs::write(
        dir.join(".tmp"),
        format!(
            r#"{{"id":"{}","names":["busybox:v2"],"layer":"{}"}}"#,
            id(IMAGE),
            id(TOP)
        ),
    )
    .unwrap();
    fs::rename(dir.join(".tmp"), dir.join("images.json")).unwrap();
    let index = s.scan().unwrap();
    assert_eq!(index.image(&id(IMAGE)).unwrap().names, vec!["busybox:v2"]);
    assert!(index
        .image_fingerprint(&id(IMAGE))
        .unwrap()
        .files_differ(&before));

    tree.remove(&image_dir(0xa2));
    tree.remove(&overlay(4));
    tree.remove(&meta(4));
    let index = s.scan().unwrap();
    assert!(index.layer(&id(4)).is_none() && index.image(&id(0xa2)).is_none());
    assert_all_ready(&index);
}

#[test]
fn named_objects_are_brought_up_to_date_alone() {
    let tree = Tree::standard();
    let mut s = scanner(&tree);
    s.full_check_every = 1000;
    s.scan().unwrap();

    tree.layer(4, Some(TOP));
    tree.image(0xa2, 4);
    tree.image(0xa3, TOP);
    let named = |ids: &[u8]| ids.iter().map(|n| id(*n)).collect::<BTreeSet<String>>();
    let index = s
        .scan_named(&named(&[4]), &named(&[0xa2]))
        .unwrap()
        .expect("the named objects changed");
    assert!(index.layer(&id(4)).is_some() && index.image(&id(0xa2)).is_some());
    assert!(index.image(&id(0xa3)).is_none(), "not named, not read");
    assert_eq!(s.stats().listed, 0, "no area listed");
    assert!(s.scan_named(&named(&[4]), &named(&[])).unwrap().is_none());

    // A named object that went is dropped, with what stands on it.
    tree.remove(&overlay(4));
    tree.remove(&meta(4));
    let index = s.scan_named(&named(&[4]), &named(&[])).unwrap().unwrap();
    assert!(index.layer(&id(4)).is_none() && index.image(&id(0xa2)).is_none());

    // The next scan lists the areas whose stamps moved and finds the rest; the named ones
    // agree with a scan from scratch.
    let index = s.scan().unwrap();
    assert!(index.image(&id(0xa3)).is_some());
    let fresh = scanner(&tree).scan().unwrap();
    assert_eq!(
        index.images().map(|i| &i.id).collect::<Vec<_>>(),
        fresh.images().map(|i| &i.id).collect::<Vec<_>>()
    );
}

#[test]
fn light_scans_cost_what_they_look_at_in_turn_not_the_tree() {
    let tree = Tree::standard();
    for n in 10..40 {
        tree.layer(n, None);
        tree.image(n + 100, n);
    }
    let mut s = scanner(&tree);
    s.scan().unwrap();
    s.set_light(Some(1));
    let idle = s.scan_if_changed(false).unwrap();
    assert!(idle.is_none());
    let stats = s.stats();
    assert_eq!((stats.listed, stats.probed), (0, 0));
    // One object per area looked at (its stamp), the rest trusted as they were: all reused.
    assert_eq!(stats.reused, 33 + 33 + 31, "{stats:?}");

    // Objects added still show (the area's stamp moved; new names are probed) ...
    tree.layer(50, None);
    tree.image(150, 50);
    let index = s.scan_if_changed(false).unwrap().expect("new objects");
    assert!(index.image(&id(150)).is_some());
    assert_eq!(s.stats().probed, 3, "only the new names: {:?}", s.stats());
    // ... and so do objects removed.
    tree.remove(&image_dir(150));
    let index = s.scan_if_changed(false).unwrap().expect("an object gone");
    assert!(index.image(&id(150)).is_none());

    // A re-tag (a rename inside an image dir) is left to the rotation: every image is
    // looked at within as many light scans as there are images.
    let json = format!("{}/images.json", image_dir(IMAGE));
    let dir = tree.path(&image_dir(IMAGE));
    fs::write(
        dir.join(".tmp"),
        format!(
            r#"{{"id":"{}","names":["busybox:light"],"layer":"{}"}}"#,
            id(IMAGE),
            id(TOP)
        ),
    )
    .unwrap();
    fs::rename(dir.join(".tmp"), tree.path(&json)).unwrap();
    let mut seen = false;
    for _ in 0..40 {
        if let Some(index) = s.scan_if_changed(false).unwrap() {
            seen |= index.image(&id(IMAGE)).unwrap().names == ["busybox:light"];
        }
    }
    assert!(seen, "the rotation reached the re-tagged image");
}

#[test]
fn a_removed_parent_makes_cached_children_not_ready() {
    let tree = Tree::standard();
    let mut s = scanner(&tree);
    s.full_check_every = 1000;
    s.scan().unwrap();
    tree.remove(&overlay(BASE));
    tree.remove(&meta(BASE));
    let index = s.scan().unwrap();
    assert_eq!(index.layers().count(), 0);
    assert!(index.image(&id(IMAGE)).is_none());
    assert!(reason(&index, ObjectKind::Image, &id(IMAGE)).contains("not ready"));
}

#[test]
fn an_in_place_edit_is_found_by_the_full_check() {
    let tree = Tree::standard();
    let mut s = scanner(&tree);
    s.full_check_every = 1;
    s.scan().unwrap();
    // Written in place: the directory's stamp does not move.
    let json = tree.path(&format!("{}/images.json", image_dir(IMAGE)));
    let dir_before = fs::metadata(json.parent().unwrap())
        .unwrap()
        .modified()
        .unwrap();
    fs::write(
        &json,
        format!(
            r#"{{"id":"{}","names":["edited:in-place"],"layer":"{}"}}"#,
            id(IMAGE),
            id(TOP)
        ),
    )
    .unwrap();
    assert_eq!(
        fs::metadata(json.parent().unwrap())
            .unwrap()
            .modified()
            .unwrap(),
        dir_before
    );
    let index = s.scan().unwrap();
    assert_eq!(
        index.image(&id(IMAGE)).unwrap().names,
        vec!["edited:in-place"]
    );
}

#[test]
fn a_completed_tar_split_is_found_and_a_known_one_is_not_decoded_again() {
    let tree = Tree::standard();
    let path = tree.path(&tar_split(TOP));
    let full = fs::read(&path).unwrap();
    fs::write(&path, &full[..full.len() - 4]).unwrap();
    let mut s = scanner(&tree);
    let index = s.scan().unwrap();
    assert!(index.layer(&id(TOP)).is_none());
    assert!(reason(&index, ObjectKind::Layer, &id(TOP)).contains("truncated"));
    fs::write(&path, &full).unwrap();
    let index = s.scan().unwrap();
    assert_all_ready(&index);
}

/// A tar-split found unusable is kept in the layer's fingerprint: while it stays as it was,
/// later scans (checking every file each time) do not probe the layer again. They decoded
/// the stream every scan, up to 1 GiB of it for each such layer. Once it changes, it is
/// judged again.
#[test]
fn an_unusable_tar_split_is_not_decoded_again_until_it_changes() {
    let tree = Tree::standard();
    let path = tree.path(&tar_split(TOP));
    let full = fs::read(&path).unwrap();
    for full_check_every in [1, 1000] {
        fs::write(&path, &full[..full.len() - 4]).unwrap();
        let mut s = scanner(&tree);
        s.full_check_every = full_check_every;
        let index = s.scan().unwrap();
        assert!(reason(&index, ObjectKind::Layer, &id(TOP)).contains("truncated"));
        let index = s.scan().unwrap();
        assert!(reason(&index, ObjectKind::Layer, &id(TOP)).contains("truncated"));
        assert_eq!(s.stats().probed, 0, "{full_check_every}: {:?}", s.stats());
        assert_same_index(&index, &tree.scan(), "still truncated");
        // Completed in place: the layer directory's stamp stays as it was.
        fs::write(&path, &full).unwrap();
        assert_all_ready(&s.scan().unwrap());
    }
}

#[test]
fn a_vanished_root_fails_the_scan_instead_of_emptying_it() {
    let tree = Tree::standard();
    let mut s = scanner(&tree);
    s.scan().unwrap();
    let mut away = tree.tmp.path().as_os_str().to_owned();
    away.push("-away");
    let away = PathBuf::from(away);
    fs::rename(tree.tmp.path(), &away).unwrap();
    let result = s.scan();
    fs::rename(&away, tree.tmp.path()).unwrap();
    let err = result.unwrap_err();
    assert!(err.0.contains("remote root"), "{err}");
    assert_all_ready(&s.scan().unwrap());
}

// ---- Incremental readiness ----

/// A small deterministic generator (SplitMix64): the same seed gives the same sequence of
/// changes, so a failure can be replayed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize]
    }
}

/// Layer slots and image slots of the random trees: few enough that changes collide.
const LAYER_SLOTS: [u8; 16] = [
    0x10, 0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x17, 0x18, 0x19, 0x1a, 0x1b, 0x1c, 0x1d, 0x1e, 0x1f,
];
const IMAGE_SLOTS: [u8; 5] = [0xb0, 0xb1, 0xb2, 0xb3, 0xb4];
/// A layer id no slot ever holds: a parent or top layer that is missing for good.
const NOWHERE: u8 = 0xee;

impl Tree {
    /// Writes layer `n` naming `parent`, with a `lower` derived from whatever the parent's
    /// directory holds now (a made-up entry when it holds nothing usable).
    fn layer_on(&self, n: u8, parent: Option<u8>, link: &str) {
        let overlay = overlay(n);
        fs::create_dir_all(self.path(&format!("{overlay}/diff"))).unwrap();
        self.write(&format!("{overlay}/link"), link);
        let _ = fs::remove_file(self.path(&format!("{overlay}/lower")));
        if let Some(p) = parent {
            let parent_dir = self::overlay(p);
            let parent_link = fs::read_to_string(self.path(&format!("{parent_dir}/link")))
                .unwrap_or_else(|_| short(p));
            let mut lower = format!("l/{parent_link}");
            if let Ok(rest) = fs::read_to_string(self.path(&format!("{parent_dir}/lower"))) {
                lower = format!("{lower}:{rest}");
            }
            self.write(&format!("{overlay}/lower"), lower);
        }
        let parent_field = parent.map(|p| format!(r#","parent":"{}""#, id(p)));
        let json = format!(
            r#"{{"id":"{}"{},"diff-digest":"sha256:{}"}}"#,
            id(n),
            parent_field.unwrap_or_default(),
            id(n)
        );
        self.write(&layer_json(n), json);
        let stream = gzip(br#"{"type":1,"name":"hello","size":13,"payload":"kGuXHeJgaa0="}"#);
        self.write(&tar_split(n), stream);
    }

    /// The parent layer `n` names now, if its `layer.json` is readable.
    fn parent_of(&self, n: u8) -> Option<u8> {
        let json = fs::read_to_string(self.path(&layer_json(n))).ok()?;
        let at = json.find(r#""parent":""#)? + r#""parent":""#.len();
        u8::from_str_radix(json.get(at..at + 2)?, 16).ok()
    }

    fn remove_if_present(&self, rel: &str) {
        let path = self.path(rel);
        if path.is_dir() {
            fs::remove_dir_all(path).unwrap();
        } else if path.exists() {
            fs::remove_file(path).unwrap();
        }
    }

    /// One random change: layers added, removed, broken, re-parented (cycles included),
    /// fixed; short ids shared; images added, removed, broken or pointed elsewhere.
    fn random_change(&self, rng: &mut Rng) -> String {
        let n = rng.pick(&LAYER_SLOTS);
        let m = rng.pick(&LAYER_SLOTS);
        let i = rng.pick(&IMAGE_SLOTS);
        match rng.below(13) {
            0 | 1 => {
                let parent = match rng.below(4) {
                    0 => None,
                    1 => Some(NOWHERE),
                    _ => Some(m),
                };
                self.layer_on(n, parent, &short(n));
                format!("layer {n:x} on {parent:x?}")
            }
            2 => {
                // Fixed in place: well-formed on the parent it already names.
                let parent = self.parent_of(n);
                self.layer_on(n, parent, &short(n));
                format!("layer {n:x} rewritten on {parent:x?}")
            }
            3 => {
                match rng.below(3) {
                    0 => self.remove_if_present(&overlay(n)),
                    1 => self.remove_if_present(&meta(n)),
                    _ => {
                        self.remove_if_present(&overlay(n));
                        self.remove_if_present(&meta(n));
                    }
                }
                format!("layer {n:x} removed")
            }
            4 => {
                let what = match rng.below(6) {
                    0 => {
                        self.remove_if_present(&format!("{}/link", overlay(n)));
                        "link removed"
                    }
                    1 => {
                        self.remove_if_present(&format!("{}/diff", overlay(n)));
                        "diff removed"
                    }
                    2 => {
                        self.write(&tar_split(n), b"\x1f\x8b\x08");
                        "tar-split truncated"
                    }
                    3 => {
                        let json = format!(r#"{{"id":"{}","incomplete":true}}"#, id(n));
                        self.write(&layer_json(n), json);
                        "incomplete"
                    }
                    4 => {
                        self.write(&format!("{}/lower", overlay(n)), format!("l/{}", short(m)));
                        "lower replaced"
                    }
                    _ => {
                        self.write(&layer_json(n), "{");
                        "layer.json malformed"
                    }
                };
                format!("layer {n:x}: {what}")
            }
            5 => {
                // Possibly closing a cycle: n below m, whatever m is below.
                let link = fs::read_to_string(self.path(&format!("{}/link", overlay(n))))
                    .unwrap_or_else(|_| short(n));
                self.layer_on(n, Some(m), &link);
                format!("layer {n:x} re-parented on {m:x}")
            }
            6 => {
                let parent = self.parent_of(n);
                self.layer_on(n, parent, &short(m));
                format!("layer {n:x} claims the short id of {m:x}")
            }
            7 => {
                // A chain of a few layers, each on the previous one.
                let len = 2 + rng.below(4) as usize;
                let start = rng.below(LAYER_SLOTS.len() as u64) as usize;
                let mut parent = None;
                for k in 0..len {
                    let layer = LAYER_SLOTS[(start + k) % LAYER_SLOTS.len()];
                    self.layer_on(layer, parent, &short(layer));
                    parent = Some(layer);
                }
                format!("chain of {len} from {:x}", LAYER_SLOTS[start])
            }
            8 | 9 => {
                let top = if rng.below(5) == 0 { NOWHERE } else { n };
                self.image(i, top);
                format!("image {i:x} on {top:x}")
            }
            10 => {
                self.remove_if_present(&image_dir(i));
                format!("image {i:x} removed")
            }
            11 => {
                self.remove_if_present(&format!("{}/manifest", image_dir(i)));
                format!("image {i:x}: manifest removed")
            }
            _ => {
                self.remove_if_present(&overlay(n));
                self.remove_if_present(&meta(n));
                self.layer_on(n, Some(m), &short(n));
                format!("layer {n:x} deleted and created again on {m:x}")
            }
        }
    }
}

/// Fails with a readable message unless `a` and `b` hold the same objects, fingerprints,
/// short ids and not-ready reasons.
fn assert_same_index(a: &LayoutIndex, b: &LayoutIndex, context: &str) {
    let layers = |i: &LayoutIndex| -> Vec<(Layer, Fingerprint)> {
        i.layers_with_fingerprints()
            .map(|(l, f)| (l.clone(), f.clone()))
            .collect()
    };
    let images = |i: &LayoutIndex| -> Vec<(Image, Fingerprint)> {
        i.images_with_fingerprints()
            .map(|(l, f)| (l.clone(), f.clone()))
            .collect()
    };
    let ids = |i: &LayoutIndex| -> Vec<String> {
        let layers = i.layers().map(|l| format!("layer {}", &l.id[..2]));
        layers
            .chain(i.images().map(|l| format!("image {}", &l.id[..2])))
            .collect()
    };
    assert_eq!(a.driver, b.driver, "{context}");
    assert_eq!(ids(a), ids(b), "{context}: ready objects");
    assert_eq!(a.not_ready(), b.not_ready(), "{context}: not ready");
    assert_eq!(layers(a), layers(b), "{context}: ready layers");
    assert_eq!(a.by_short, b.by_short, "{context}: short ids");
    assert_eq!(images(a), images(b), "{context}: ready images");
}

#[test]
fn incremental_readiness_equals_a_full_resolve_after_every_change() {
    for seed in 1..=4u64 {
        let tree = Tree::new();
        let mut rng = Rng(seed);
        // Stamps are never trusted, so every object is read again each scan: the facts are
        // those a scan from scratch reads. (With the default margin, a slow run would trust
        // objects left alone for two seconds, and miss a file rewritten in place.)
        let mut fresh = Scanner::new(tree.tmp.path(), "overlay");
        fresh.racy_margin = std::time::Duration::from_secs(1 << 40);
        // Stamps trusted at once and listings reused: the facts may lag behind the tree,
        // but the verdicts must still be those of a full resolve over the same facts.
        let mut trusting = Scanner::new(tree.tmp.path(), "overlay");
        trusting.racy_margin = std::time::Duration::ZERO;
        trusting.full_check_every = 3;
        let mut log = Vec::new();
        for step in 0..80 {
            for _ in 0..1 + rng.below(3) {
                log.push(tree.random_change(&mut rng));
            }
            let context = format!("seed {seed}, step {step}, after: {}", log.join("; "));
            let index = fresh.scan().unwrap();
            assert_same_index(&index, &fresh.resolve_from_scratch(), &context);
            assert_same_index(&index, &tree.scan(), &context);
            let index = trusting.scan().unwrap();
            assert_same_index(&index, &trusting.resolve_from_scratch(), &context);
        }
        let ready = fresh.scan().unwrap().layers().count();
        assert!(
            ready > 0,
            "seed {seed}: the changes never made a layer ready"
        );
    }
}

#[test]
fn a_change_at_the_base_reaches_every_descendant_and_image() {
    let tree = Tree::new();
    tree.layer(0x10, None);
    let mut parent = 0x10;
    for n in 0x11..0x30 {
        tree.layer(n, Some(parent));
        parent = n;
    }
    tree.image(0xb0, 0x2f);
    tree.image(0xb1, 0x20);
    let mut s = scanner(&tree);
    // The tar-split is rewritten in place: only a full check of the files sees it.
    s.full_check_every = 1;
    assert_eq!(s.scan().unwrap().layers().count(), 0x20);

    tree.write(&tar_split(0x10), b"\x1f\x8b\x08");
    let index = s.scan().unwrap();
    assert_same_index(&index, &tree.scan(), "base broken");
    assert_eq!(index.layers().count(), 0);
    assert_eq!(index.images().count(), 0);
    assert!(reason(&index, ObjectKind::Image, &id(0xb0)).contains("ancestor"));

    tree.layer(0x10, None);
    let index = s.scan().unwrap();
    assert_same_index(&index, &tree.scan(), "base fixed");
    assert_eq!(index.layers().count(), 0x20);
    assert_eq!(index.images().count(), 2);
}

#[test]
fn unchanged_objects_are_shared_with_the_last_index() {
    let tree = Tree::standard();
    tree.layer(4, None);
    let mut s = scanner(&tree);
    let before = s.scan().unwrap();
    tree.image(0xa2, 4);
    let after = s.scan().unwrap();
    assert!(after.image(&id(0xa2)).is_some());
    for n in [BASE, MIDDLE, TOP, 4] {
        assert!(std::ptr::eq(
            before.layer(&id(n)).unwrap(),
            after.layer(&id(n)).unwrap()
        ));
    }
    assert!(std::ptr::eq(
        before.image(&id(IMAGE)).unwrap(),
        after.image(&id(IMAGE)).unwrap()
    ));
}
