//! Writer-host scenarios of objects that change or go after the view showed them (DESIGN §4.3,
//! §5): a separate process plays the writer host and changes the remote while it is mounted,
//! in iSulad's order, and the mount runs its rounds only when the test asks (`refresh=0`).
//! After a round the view follows: removals (at once, and caught at every step) leave nothing
//! dangling, a layer removed under an image takes the image with it, a re-tag shows fresh size
//! and data, an id removed and created again shows its new content, and objects removed while
//! unmounted are gone after the remount. What a host holds is kept: an open file of a removed
//! layer still reads and answers `fstat`, and this host's own entries named like remote
//! objects win. The layout directories show the remote's attributes after one round.
//!
//! The writer is this test binary run again for its ignored `writer_host_process`, declared
//! below, which performs the operations it is handed and exits; run any other way, it does
//! nothing.

mod common;

use std::fs;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use serde_json::Value;

use common::isulad::*;
use common::scenario::*;
use common::{dtypes, errno_of, is_mounted, names, Mount};

common::isulad::writer_host_entry!();

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

// ---- Scenarios ----

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
