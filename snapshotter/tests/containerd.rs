//! The snapshotter under the real containerd (Debian's 1.6): images imported and run,
//! quotas from labels, shared layers kept instead of local copies, restarts and garbage
//! collection. Needs root, /dev/fuse, `containerd`, `runc` and `busybox-static`.

mod common;

use std::fs;

use common::*;

const IMAGE: &str = "docker.io/library/layerfs-test:1";

fn busybox_image() -> Image {
    Image {
        name: IMAGE.into(),
        layers: vec![
            Layer::busybox(),
            Layer::file("etc/marker", b"from the second layer\n"),
        ],
    }
}

/// `df -k /` inside a container: (total KiB, line).
fn df_total(out: &str) -> u64 {
    let line = out
        .lines()
        .find(|l| l.starts_with("overlay") || l.starts_with("/dev"))
        .unwrap_or_else(|| panic!("no df line in {out}"));
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

const FILL: &str = "df -k / | tail -n 1; dd if=/dev/zero of=/big bs=64k count=200 2>&1; echo dd=$?";

#[test]
fn quota_labels_limit_a_container_and_df_shows_it() {
    let view = View::new();
    let tmp = tempdir();
    let snapshotter = Snapshotter::start(
        &tmp.path().join("s.sock"),
        &view.mnt.join("snapshots"),
        None,
    );
    let containerd = Containerd::start(&tmp.path().join("containerd"), &snapshotter.socket);
    containerd.import(&busybox_image());

    let run = |id: &str, label: &str| {
        containerd.ctr_ok(&[
            "run",
            "--rm",
            "--snapshotter",
            "layerfs",
            "--snapshotter-label",
            label,
            IMAGE,
            id,
            "/bin/sh",
            "-c",
            FILL,
        ])
    };
    // containerd's own label, forwarded from `ctr run --snapshotter-label`.
    let out = run("max-size", "containerd.io/snapshot/max-size=1048576");
    assert_eq!(df_total(&out), 1024, "{out}");
    assert!(
        out.contains("No space left on device") && !out.contains("dd=0"),
        "{out}"
    );
    // The seed's storage { size }.
    let out = run(
        "storage-size",
        "containerd.io/snapshot/layerfs.storage.size=2M",
    );
    assert_eq!(df_total(&out), 2048, "{out}");
    assert!(out.contains("No space left on device"), "{out}");
    // No label: no limit.
    let out = containerd.ctr_ok(&[
        "run",
        "--rm",
        "--snapshotter",
        "layerfs",
        IMAGE,
        "free",
        "/bin/sh",
        "-c",
        FILL,
    ]);
    assert!(out.contains("dd=0"), "{out}");
    assert!(df_total(&out) > 4096, "{out}");
}

#[test]
fn quota_labels_where_the_root_cannot_enforce_them() {
    let tmp = tempdir();
    // A root outside any layerfs mount.
    let snapshotter =
        Snapshotter::start(&tmp.path().join("s.sock"), &tmp.path().join("plain"), None);
    let containerd = Containerd::start(&tmp.path().join("containerd"), &snapshotter.socket);
    containerd.import(&busybox_image());
    let run = |id: &str, labels: &[&str]| {
        let mut args = vec!["run", "--rm", "--snapshotter", "layerfs"];
        for l in labels {
            args.extend(["--snapshotter-label", l]);
        }
        args.extend([IMAGE, id, "/bin/sh", "-c", "echo ran"]);
        containerd.ctr(&args)
    };
    let strict = run(
        "strict",
        &["containerd.io/snapshot/layerfs.storage.size=1M"],
    );
    assert!(!strict.status.success(), "{}", output_text(&strict));
    let text = output_text(&strict);
    assert!(
        text.contains("cannot set a quota") && text.contains("plain directory"),
        "{text}"
    );

    let lenient = run(
        "lenient",
        &[
            "containerd.io/snapshot/layerfs.storage.size=1M",
            "containerd.io/snapshot/layerfs.storage.ignore-failed=true",
        ],
    );
    assert!(lenient.status.success(), "{}", output_text(&lenient));
    let hint = run("hint", &["containerd.io/snapshot/max-size=1048576"]);
    assert!(hint.status.success(), "{}", output_text(&hint));
    assert!(snapshotter
        .log_text()
        .contains("going on without the quota"));
}

#[test]
fn an_imported_image_the_shared_tree_holds_runs_on_the_shared_layers() {
    let view = View::new();
    let image = busybox_image();
    let ids = image.write_shared(&view.remote);
    view.refresh();
    let remote_before = tree_hash(&view.remote);
    let tmp = tempdir();
    let root = view.mnt.join("snapshots");
    let mut snapshotter = Snapshotter::start(&tmp.path().join("s.sock"), &root, None);
    let containerd = Containerd::start(&tmp.path().join("containerd"), &snapshotter.socket);

    containerd.import(&image);
    let log = snapshotter.log_text();
    assert_eq!(log.matches("dropping the local copy").count(), 2, "{log}");
    let freed: u64 = log
        .lines()
        .filter(|l| l.contains("dropping the local copy"))
        .filter_map(|l| {
            l.split("freed_bytes=")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum();
    eprintln!("local copies dropped at commit: {freed} bytes");
    assert!(
        freed >= 1 << 20,
        "busybox alone is more than a MiB: {freed}"
    );
    let left: Vec<_> = fs::read_dir(root.join("snapshots")).unwrap().collect();
    assert!(
        left.is_empty(),
        "no local copy of a shared layer is kept: {left:?}"
    );
    let table = fs::read_to_string(root.join("metadata.json")).unwrap();
    for id in &ids {
        assert!(table.contains(&format!("\"layer\": \"{id}\"")), "{table}");
    }

    // A restart of the snapshotter: containerd reconnects after its backoff.
    snapshotter.restart();
    let script =
        "cat /etc/marker; echo new > /etc/new; rm /bin/head; mkdir -p /d/e; mv /d /moved; \
                  ls /moved; test -e /bin/head && echo head-still-there; cat /etc/new";
    let run = || {
        let args = [
            "run",
            "--rm",
            "--snapshotter",
            "layerfs",
            IMAGE,
            "c1",
            "/bin/sh",
            "-c",
            script,
        ];
        containerd.ctr(&args)
    };
    let mut out = run();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !out.status.success() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_secs(1));
        let _ = containerd.ctr(&["containers", "rm", "c1"]);
        out = run();
    }
    let text = output_text(&out);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("from the second layer")
            && text.contains("\nnew\n")
            && text.contains("\ne\n"),
        "{text}"
    );
    assert!(!text.contains("head-still-there"), "{text}");

    // Garbage collection after the image goes: every snapshot, and nothing shared.
    containerd.ctr_ok(&["images", "rm", "--sync", IMAGE]);
    eventually(30, "garbage collection of the snapshots", || {
        let table = fs::read_to_string(root.join("metadata.json")).unwrap();
        !table.contains("\"kind\"")
    });
    assert!(fs::read_dir(root.join("snapshots"))
        .unwrap()
        .next()
        .is_none());
    for id in &ids {
        assert!(
            view.mnt
                .join("overlay/RO")
                .join(id)
                .join("diff/bin/busybox")
                .exists()
                || id != &ids[0]
        );
    }
    assert_eq!(
        tree_hash(&view.remote),
        remote_before,
        "the remote tree was modified"
    );
}

/// Usage of a snapshot with a quota is the quota's own figures, the ones
/// `layerfs quota get` shows; `SupportedQuota` holds inside the mount.
#[tokio::test(flavor = "multi_thread")]
async fn usage_of_a_limited_snapshot_is_its_quota_s_usage() {
    use layerfs_snapshotter::api::snapshots::{PrepareSnapshotRequest, UsageRequest};
    let view = View::new();
    let tmp = tempdir();
    let snapshotter = Snapshotter::start(
        &tmp.path().join("s.sock"),
        &view.mnt.join("snapshots"),
        None,
    );
    let mut client = snapshotter.client().await;
    let mounts = client
        .prepare(PrepareSnapshotRequest {
            snapshotter: "layerfs".into(),
            key: "default/1/limited".into(),
            parent: String::new(),
            labels: labels(&[("containerd.io/snapshot/layerfs.storage.size", "4M")]),
        })
        .await
        .unwrap()
        .into_inner()
        .mounts;
    let fs_dir = std::path::PathBuf::from(&mounts[0].source);
    fs::write(fs_dir.join("data"), vec![1u8; 3 << 20]).unwrap();
    let too_much = fs::write(fs_dir.join("more"), vec![1u8; 2 << 20]);
    assert_eq!(too_much.unwrap_err().raw_os_error(), Some(libc::ENOSPC));

    let usage = client
        .usage(UsageRequest {
            snapshotter: "layerfs".into(),
            key: "default/1/limited".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let dir = fs_dir.parent().unwrap();
    let out = std::process::Command::new(layerfs_bin())
        .args(["quota", "get", "--json"])
        .arg(&view.mnt)
        .arg(dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", output_text(&out));
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(info["limit"], 4 << 20);
    assert_eq!(
        usage.size,
        info["used"].as_i64().unwrap(),
        "{usage:?} {info}"
    );
    assert_eq!(usage.inodes, info["inodes_used"].as_i64().unwrap());
    assert!(usage.size >= 3 << 20 && usage.size <= 4 << 20, "{usage:?}");
}

/// `ctr image import` of a three-layer image whose layers the remote tree holds under
/// `naming`: containerd 1.6 never sends the remote-snapshot label, so it unpacks every
/// layer, and every commit keeps the shared layer's files instead of the local copy,
/// whatever the layers' directories are called. A container then runs on the shared
/// layers alone.
async fn ctr_import_dedupes_every_layer_of_a_remote_named(naming: Naming) {
    let view = View::new();
    let (image, _) = images_sharing_a_base("layerfs-import");
    let ids = image.write_shared_named(&view.remote, naming);
    view.refresh();
    let remote_before = tree_hash(&view.remote);
    let tmp = tempdir();
    let root = view.mnt.join("snapshots");
    let snapshotter = Snapshotter::start(&tmp.path().join("s.sock"), &root, None);
    let containerd = Containerd::start(&tmp.path().join("containerd"), &snapshotter.socket);

    containerd.import(&image);
    let log = snapshotter.log_text();
    assert_eq!(
        log.matches("dropping the local copy").count(),
        3,
        "{naming:?}: {log}"
    );
    let left: Vec<_> = fs::read_dir(root.join("snapshots")).unwrap().collect();
    assert!(
        left.is_empty(),
        "{naming:?}: no local copy of a shared layer is kept: {left:?}"
    );
    for chain in image.chain_ids() {
        let info = proxy_snapshot_of_chain(&snapshotter.socket, &chain)
            .await
            .unwrap_or_else(|| panic!("{naming:?}: no snapshot of {chain}"));
        let usage = proxy_usage(&snapshotter.socket, &info.name).await;
        assert!(
            usage.size > 0 && usage.inodes > 0,
            "{naming:?}: a deduplicated layer reports its own size: {usage:?}"
        );
    }

    let script = "cat /etc/a-1 /etc/a-2; ls /bin/busybox; echo new > /etc/new; cat /etc/new";
    // runc keeps its state by container id in one directory for every containerd on the
    // host, so tests that run at once need ids of their own.
    let id = format!("c-{naming:?}").to_lowercase();
    let (options, printed) = containerd.run_kept(&[], &image.name, &id, script);
    assert_eq!(printed, "a-1\na-2\n/bin/busybox\nnew\n", "{naming:?}");
    let lower = mount_option(options.iter().map(String::as_str), "lowerdir");
    let mnt = fs::canonicalize(&view.mnt).unwrap();
    let shared: Vec<String> = ids
        .iter()
        .rev()
        .map(|id| {
            mnt.join("overlay/RO")
                .join(id)
                .join("diff")
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    assert_eq!(lower, shared.join(":"), "{naming:?}");
    containerd.remove_container(&id);
    drop(containerd);
    assert_eq!(
        tree_hash(&view.remote),
        remote_before,
        "the remote tree was modified"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn ctr_import_dedupes_every_layer_of_an_isulad_named_remote() {
    ctr_import_dedupes_every_layer_of_a_remote_named(Naming::Isulad).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn ctr_import_dedupes_every_layer_of_a_randomly_named_remote() {
    ctr_import_dedupes_every_layer_of_a_remote_named(Naming::Random).await;
}

/// The fast path under containerd: a container without a quota writes to upper and work
/// dirs on the local disk directly (under `.layerfs-snapshotter/` of the layerfs mount's
/// local dir), reads its image from the shared layers in the view, and its snapshot's
/// Usage counts what it wrote; a container with a quota keeps them under the root, in the
/// view, where the quota is enforced.
#[tokio::test(flavor = "multi_thread")]
async fn a_container_without_a_quota_writes_on_the_local_disk_directly() {
    let view = View::new();
    let (image, _) = images_sharing_a_base("layerfs-fast");
    image.write_shared(&view.remote);
    view.refresh();
    let tmp = tempdir();
    let root = view.mnt.join("snapshots");
    let snapshotter = Snapshotter::start(&tmp.path().join("s.sock"), &root, None);
    let containerd = Containerd::start(&tmp.path().join("containerd"), &snapshotter.socket);
    containerd.import(&image);

    let script = "dd if=/dev/zero of=/etc/written bs=64k count=16 2>/dev/null; sync; cat /etc/a-2";
    let (fast, printed) = containerd.run_kept(&[], &image.name, "fast", script);
    assert_eq!(printed, "a-2\n");
    let (limited, printed) = containerd.run_kept(
        &[
            "--snapshotter-label",
            "containerd.io/snapshot/layerfs.storage.size=4M",
        ],
        &image.name,
        "limited",
        script,
    );
    assert_eq!(printed, "a-2\n");

    let mnt = fs::canonicalize(&view.mnt).unwrap();
    let local = fs::canonicalize(&view.local)
        .unwrap()
        .join(".layerfs-snapshotter");
    let option = |options: &[String], key: &str| {
        std::path::PathBuf::from(mount_option(options.iter().map(String::as_str), key))
    };
    for dir in ["upperdir", "workdir"] {
        let path = option(&fast, dir);
        assert!(
            path.starts_with(&local) && !path.starts_with(&mnt),
            "{dir} not on the local disk under {}: {}",
            local.display(),
            path.display()
        );
    }
    for lower in mount_option(fast.iter().map(String::as_str), "lowerdir").split(':') {
        assert!(
            std::path::Path::new(lower).starts_with(mnt.join("overlay/RO")),
            "a shared lower dir outside the view: {lower}"
        );
    }
    let in_root = fs::canonicalize(&root).unwrap();
    for dir in ["upperdir", "workdir"] {
        let path = option(&limited, dir);
        assert!(
            path.starts_with(&in_root),
            "{dir} of a container with a quota not under the root {}: {}",
            in_root.display(),
            path.display()
        );
    }

    let written = option(&fast, "upperdir").join("etc/written");
    assert_eq!(fs::metadata(&written).unwrap().len(), 1 << 20);
    let key = proxy_snapshots(&snapshotter.socket)
        .await
        .into_iter()
        .find(|i| i.name.ends_with("/fast"))
        .expect("the container's snapshot")
        .name;
    let usage = proxy_usage(&snapshotter.socket, &key).await;
    assert!(usage.size >= 1 << 20, "{usage:?}");
    for id in ["fast", "limited"] {
        containerd.remove_container(id);
    }
}

/// Containers keep writing while the snapshotter is killed (SIGKILL) and started again: a
/// container on the fast path and one with a quota both finish with every line they wrote,
/// the quota still holds, their snapshots are still served, and a new container starts.
#[tokio::test(flavor = "multi_thread")]
async fn containers_write_on_through_a_snapshotter_crash() {
    let view = View::new();
    let (image, _) = images_sharing_a_base("layerfs-crash");
    image.write_shared_named(&view.remote, Naming::Isulad);
    view.refresh();
    let tmp = tempdir();
    let root = view.mnt.join("snapshots");
    let mut snapshotter = Snapshotter::start(&tmp.path().join("s.sock"), &root, None);
    let containerd = Containerd::start(&tmp.path().join("containerd"), &snapshotter.socket);
    containerd.import(&image);

    // About 4 s of appends, each line checked at the end.
    let script =
        "i=0; while [ $i -lt 400 ]; do echo line-$i >> /etc/log; i=$((i+1)); usleep 10000; done; \
                  wc -l < /etc/log; dd if=/dev/zero of=/etc/big bs=1M count=8 2>/dev/null";
    let wrapped = format!(
        "( {script} ) > /script.out 2>&1; echo script-ended >> /script.out; exec sleep 600"
    );
    let quota = "containerd.io/snapshot/layerfs.storage.size=4M";
    for (id, label) in [("crash-fast", None), ("crash-limited", Some(quota))] {
        let mut args = vec!["run", "-d", "--snapshotter", "layerfs"];
        if let Some(label) = label {
            args.extend(["--snapshotter-label", label]);
        }
        args.extend([image.name.as_str(), id, "/bin/sh", "-c", &wrapped]);
        containerd.ctr_ok(&args);
    }
    let uppers: Vec<std::path::PathBuf> = ["crash-fast", "crash-limited"]
        .iter()
        .map(|id| {
            let options = containerd.snapshot_mount_options("default", id);
            std::path::PathBuf::from(mount_option(options.iter().map(String::as_str), "upperdir"))
        })
        .collect();
    let lines = |upper: &std::path::Path| {
        fs::read_to_string(upper.join("etc/log"))
            .unwrap_or_default()
            .lines()
            .count()
    };
    eventually(30, "the writers to start", || {
        uppers.iter().all(|u| lines(u) > 10)
    });

    snapshotter.kill();
    let during: Vec<usize> = uppers.iter().map(|u| lines(u)).collect();
    std::thread::sleep(std::time::Duration::from_millis(1500));
    for (upper, before) in uppers.iter().zip(&during) {
        assert!(
            lines(upper) > *before,
            "{} stopped writing without the snapshotter",
            upper.display()
        );
    }
    snapshotter.start_again();

    for upper in &uppers {
        let out = upper.join("script.out");
        let mut printed = String::new();
        eventually(60, "the writers to finish", || {
            printed = fs::read_to_string(&out).unwrap_or_default();
            printed.ends_with("script-ended\n")
        });
        let log = fs::read_to_string(upper.join("etc/log")).unwrap();
        let expected: String = (0..400).map(|i| format!("line-{i}\n")).collect();
        assert_eq!(log, expected, "{}", upper.display());
        assert!(printed.starts_with("400\n"), "{printed}");
    }
    let big = |upper: &std::path::Path| fs::metadata(upper.join("etc/big")).map_or(0, |m| m.len());
    assert_eq!(
        big(&uppers[0]),
        8 << 20,
        "the container without a quota wrote it all"
    );
    assert!(
        big(&uppers[1]) < 4 << 20,
        "the quota still holds: {}",
        big(&uppers[1])
    );

    for id in ["crash-fast", "crash-limited"] {
        let key = proxy_snapshots(&snapshotter.socket)
            .await
            .into_iter()
            .find(|i| i.name.ends_with(&format!("/{id}")))
            .unwrap_or_else(|| panic!("the snapshot of {id} after the crash"))
            .name;
        let usage = proxy_usage(&snapshotter.socket, &key).await;
        assert!(usage.size > 0, "{id}: {usage:?}");
    }
    let out = containerd.ctr_ok(&[
        "run",
        "--rm",
        "--snapshotter",
        "layerfs",
        &image.name,
        "crash-after",
        "/bin/cat",
        "/etc/a-2",
    ]);
    assert_eq!(out, "a-2\n");
    for id in ["crash-fast", "crash-limited"] {
        containerd.remove_container(id);
    }
}
