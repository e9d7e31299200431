//! Writer-host scenarios of objects arriving (DESIGN §4.3, §5): a separate process plays the
//! writer host and writes layers and images into the remote while it is mounted, in iSulad's
//! write order, one step at a time. The mount runs with `refresh=0`, so rounds happen only when
//! the test asks for one with `layerfs refresh`; after each step the test looks at what a
//! process sees through the mount. An object shows the round after it is whole and all it
//! stands on is ready, and not before: a layer half pulled, an image ahead of its layers, a
//! chain with a gap and a bad `link` stay hidden, and garbage beside the real objects never
//! shows.
//!
//! The writer is this test binary run again for its ignored `writer_host_process`, declared
//! below, which performs the operations it is handed and exits; run any other way, it does
//! nothing.

mod common;

use std::collections::BTreeSet;

use common::cli;
use common::isulad::*;
use common::scenario::*;

common::isulad::writer_host_entry!();

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
