//! Every RPC of the Snapshots service, through gRPC as containerd calls it, on a root in a
//! plain directory (no quota support) and with shared layers from a plain directory laid
//! out as a view.

mod common;

use std::collections::HashMap;
use std::fs;
use std::path::Path;

use common::*;
use layerfs_snapshotter::api::snapshots::*;
use layerfs_snapshotter::api::types::Mount;
use tonic::Code;

type Client = snapshots_client::SnapshotsClient<tonic::transport::Channel>;

const REF: &str = "containerd.io/snapshot.ref";

async fn prepare(
    c: &mut Client,
    key: &str,
    parent: &str,
    labels: HashMap<String, String>,
) -> Result<Vec<Mount>, tonic::Status> {
    c.prepare(PrepareSnapshotRequest {
        snapshotter: "layerfs".into(),
        key: key.into(),
        parent: parent.into(),
        labels,
    })
    .await
    .map(|r| r.into_inner().mounts)
}

async fn commit(c: &mut Client, name: &str, key: &str) -> Result<(), tonic::Status> {
    c.commit(CommitSnapshotRequest {
        snapshotter: "layerfs".into(),
        name: name.into(),
        key: key.into(),
        labels: HashMap::new(),
        parent: String::new(),
    })
    .await
    .map(|_| ())
}

async fn stat(c: &mut Client, key: &str) -> Result<Info, tonic::Status> {
    c.stat(StatSnapshotRequest {
        snapshotter: "layerfs".into(),
        key: key.into(),
    })
    .await
    .map(|r| r.into_inner().info.unwrap())
}

async fn remove(c: &mut Client, key: &str) -> Result<(), tonic::Status> {
    c.remove(RemoveSnapshotRequest {
        snapshotter: "layerfs".into(),
        key: key.into(),
    })
    .await
    .map(|_| ())
}

async fn list(c: &mut Client, filters: &[&str]) -> Vec<Info> {
    list_snapshots(c, filters).await
}

async fn mounts(c: &mut Client, key: &str) -> Result<Vec<Mount>, tonic::Status> {
    c.mounts(MountsRequest {
        snapshotter: "layerfs".into(),
        key: key.into(),
    })
    .await
    .map(|r| r.into_inner().mounts)
}

async fn usage(c: &mut Client, key: &str) -> UsageResponse {
    c.usage(UsageRequest {
        snapshotter: "layerfs".into(),
        key: key.into(),
    })
    .await
    .unwrap()
    .into_inner()
}

/// The value of option `key` (`upperdir`, `lowerdir`) of the first of `mounts`.
fn option(mounts: &[Mount], key: &str) -> String {
    let prefix = format!("{key}=");
    mounts[0]
        .options
        .iter()
        .find_map(|o| o.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no {key} in {mounts:?}"))
        .to_owned()
}

fn code<T: std::fmt::Debug>(r: Result<T, tonic::Status>) -> Code {
    r.unwrap_err().code()
}

fn snapshot_dirs(root: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(root.join("snapshots"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[tokio::test]
async fn the_lifecycle_of_snapshots_and_the_errors_containerd_expects() {
    let tmp = tempdir();
    let root = tmp.path().join("root");
    let s = Snapshotter::start(&tmp.path().join("s.sock"), &root, None);
    let mut c = s.client().await;

    // A base layer: a bind mount of its own directory.
    let m = prepare(&mut c, "default/1/extract a", "", HashMap::new())
        .await
        .unwrap();
    assert_eq!(m.len(), 1);
    assert_eq!(m[0].r#type, "bind");
    assert_eq!(m[0].options, ["rw", "rbind"]);
    let base_fs = Path::new(&m[0].source).to_owned();
    assert!(base_fs.starts_with(fs::canonicalize(&root).unwrap()));
    fs::write(base_fs.join("hello"), b"hello").unwrap();
    assert_eq!(
        code(prepare(&mut c, "default/1/extract a", "", HashMap::new()).await),
        Code::AlreadyExists
    );
    assert_eq!(
        code(prepare(&mut c, "", "", HashMap::new()).await),
        Code::InvalidArgument
    );
    assert_eq!(
        code(prepare(&mut c, "k", "missing", HashMap::new()).await),
        Code::NotFound
    );
    assert_eq!(
        code(prepare(&mut c, "k", "default/1/extract a", HashMap::new()).await),
        Code::InvalidArgument,
        "an active parent"
    );

    commit(&mut c, "default/2/base", "default/1/extract a")
        .await
        .unwrap();
    assert_eq!(
        code(stat(&mut c, "default/1/extract a").await),
        Code::NotFound
    );
    let info = stat(&mut c, "default/2/base").await.unwrap();
    assert_eq!(info.kind, Kind::Committed as i32);
    assert_eq!(info.parent, "");
    assert_eq!(code(commit(&mut c, "x", "missing").await), Code::NotFound);
    assert_eq!(
        code(commit(&mut c, "x", "default/2/base").await),
        Code::FailedPrecondition
    );
    assert_eq!(
        code(mounts(&mut c, "default/2/base").await),
        Code::FailedPrecondition
    );
    let base_usage = usage(&mut c, "default/2/base").await;
    assert!(
        base_usage.size >= 4096 && base_usage.inodes >= 2,
        "{base_usage:?}"
    );

    // A container over it: an overlay with upper and work beside each other.
    let m = prepare(&mut c, "default/3/ctr", "default/2/base", HashMap::new())
        .await
        .unwrap();
    assert_eq!(m[0].r#type, "overlay");
    let opt = |name: &str| {
        m[0].options
            .iter()
            .find_map(|o| o.strip_prefix(name))
            .unwrap()
            .to_owned()
    };
    assert_eq!(opt("lowerdir="), base_fs.to_string_lossy());
    assert!(Path::new(&opt("upperdir=")).is_dir());
    assert!(Path::new(&opt("workdir=")).is_dir());
    assert_eq!(mounts(&mut c, "default/3/ctr").await.unwrap(), m);
    assert_eq!(
        code(commit(&mut c, "default/2/base", "default/3/ctr").await),
        Code::AlreadyExists
    );

    // Views: a bind of the one parent, read-only.
    let v = c
        .view(ViewSnapshotRequest {
            snapshotter: "layerfs".into(),
            key: "default/4/view".into(),
            parent: "default/2/base".into(),
            labels: HashMap::new(),
        })
        .await
        .unwrap()
        .into_inner()
        .mounts;
    assert_eq!(v[0].r#type, "bind");
    assert_eq!(v[0].source, base_fs.to_string_lossy());
    assert_eq!(v[0].options, ["ro", "rbind"]);
    assert_eq!(
        code(commit(&mut c, "n", "default/4/view").await),
        Code::FailedPrecondition
    );

    // Update: labels only, one by one or all at once.
    let mut info = stat(&mut c, "default/2/base").await.unwrap();
    info.labels = labels(&[("a", "1"), ("b", "2")]);
    let updated = c
        .update(UpdateSnapshotRequest {
            snapshotter: "layerfs".into(),
            info: Some(info.clone()),
            update_mask: None,
        })
        .await
        .unwrap()
        .into_inner()
        .info
        .unwrap();
    assert_eq!(updated.labels, labels(&[("a", "1"), ("b", "2")]));
    info.labels = labels(&[("b", "3")]);
    let updated = c
        .update(UpdateSnapshotRequest {
            snapshotter: "layerfs".into(),
            info: Some(info.clone()),
            update_mask: Some(prost_types::FieldMask {
                paths: vec!["labels.a".into(), "labels.b".into()],
            }),
        })
        .await
        .unwrap()
        .into_inner()
        .info
        .unwrap();
    assert_eq!(
        updated.labels,
        labels(&[("b", "3")]),
        "labels.a absent: removed"
    );
    let refused = c
        .update(UpdateSnapshotRequest {
            snapshotter: "layerfs".into(),
            info: Some(info),
            update_mask: Some(prost_types::FieldMask {
                paths: vec!["parent".into()],
            }),
        })
        .await;
    assert_eq!(code(refused), Code::InvalidArgument);

    // List, with and without filters.
    assert_eq!(list(&mut c, &[]).await.len(), 3);
    let committed = list(&mut c, &["kind==committed"]).await;
    assert_eq!(committed.len(), 1);
    assert_eq!(
        list(&mut c, &["labels.b==3", "name==default/3/ctr"])
            .await
            .len(),
        2
    );

    // Remove: children first; then the directories go.
    assert_eq!(
        code(remove(&mut c, "default/2/base").await),
        Code::FailedPrecondition
    );
    assert_eq!(code(remove(&mut c, "nothing").await), Code::NotFound);
    remove(&mut c, "default/3/ctr").await.unwrap();
    remove(&mut c, "default/4/view").await.unwrap();
    remove(&mut c, "default/2/base").await.unwrap();
    assert!(list(&mut c, &[]).await.is_empty());
    assert!(
        snapshot_dirs(&root).is_empty(),
        "{:?}",
        snapshot_dirs(&root)
    );
    assert!(!base_fs.exists());
}

#[tokio::test]
async fn snapshots_survive_a_restart_and_cleanup_removes_orphans() {
    let tmp = tempdir();
    let root = tmp.path().join("root");
    let mut s = Snapshotter::start(&tmp.path().join("s.sock"), &root, None);
    let mut c = s.client().await;
    let m = prepare(&mut c, "k1", "", HashMap::new()).await.unwrap();
    fs::write(Path::new(&m[0].source).join("f"), b"data").unwrap();
    commit(&mut c, "c1", "k1").await.unwrap();
    let active = prepare(&mut c, "k2", "c1", labels(&[("x", "y")]))
        .await
        .unwrap();
    let before = list(&mut c, &[]).await;

    // A crash between making a directory and recording it leaves an orphan.
    fs::create_dir_all(root.join("snapshots/999/fs/deep")).unwrap();
    s.restart();
    let mut c = s.client().await;
    assert_eq!(list(&mut c, &[]).await, before);
    assert_eq!(mounts(&mut c, "k2").await.unwrap(), active);
    assert_eq!(
        stat(&mut c, "k2").await.unwrap().labels,
        labels(&[("x", "y")])
    );
    assert!(
        !snapshot_dirs(&root).contains(&"999".to_string()),
        "start-up removes orphans"
    );

    fs::create_dir_all(root.join("snapshots/998")).unwrap();
    c.cleanup(CleanupRequest {
        snapshotter: "layerfs".into(),
    })
    .await
    .unwrap();
    assert_eq!(snapshot_dirs(&root).len(), 2, "{:?}", snapshot_dirs(&root));
    // Ids are never reused, even after a removal.
    remove(&mut c, "k2").await.unwrap();
    let again = prepare(&mut c, "k3", "c1", HashMap::new()).await.unwrap();
    assert_ne!(again, active);
}

#[tokio::test]
async fn quota_labels_where_quotas_cannot_be_enforced() {
    let tmp = tempdir();
    let root = tmp.path().join("root");
    let s = Snapshotter::start(&tmp.path().join("s.sock"), &root, None);
    let mut c = s.client().await;
    let strict = prepare(
        &mut c,
        "strict",
        "",
        labels(&[("containerd.io/snapshot/layerfs.storage.size", "1M")]),
    )
    .await;
    let e = strict.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("plain directory"), "{}", e.message());
    assert_eq!(code(stat(&mut c, "strict").await), Code::NotFound);
    assert!(snapshot_dirs(&root).is_empty(), "nothing was made");

    let max_size_is_strict = labels(&[
        ("containerd.io/snapshot/max-size", "1048576"),
        (
            "containerd.io/snapshot/layerfs.storage.ignore-failed",
            "false",
        ),
    ]);
    assert_eq!(
        code(prepare(&mut c, "strict2", "", max_size_is_strict).await),
        Code::FailedPrecondition
    );

    // Going on without: the seed's ignore-failed, or max-size alone (a hint).
    prepare(
        &mut c,
        "lenient",
        "",
        labels(&[
            ("containerd.io/snapshot/layerfs.storage.size", "1M"),
            (
                "containerd.io/snapshot/layerfs.storage.ignore-failed",
                "true",
            ),
        ]),
    )
    .await
    .unwrap();
    prepare(
        &mut c,
        "hint",
        "",
        labels(&[("containerd.io/snapshot/max-size", "1048576")]),
    )
    .await
    .unwrap();
    assert!(s.log_text().contains("going on without the quota"));

    let bad = prepare(
        &mut c,
        "bad",
        "",
        labels(&[("containerd.io/snapshot/layerfs.storage.size", "lots")]),
    )
    .await;
    assert_eq!(code(bad), Code::InvalidArgument);
    assert_eq!(snapshot_dirs(&root).len(), 2);
}

/// containerd's remote-snapshot protocol, call by call as its metadata store makes it
/// (`metadata/snapshot.go` createSnapshot): Prepare with the chain ID label, AlreadyExists,
/// List with the label-and-parent filter, then Stat of what List gave.
#[tokio::test]
async fn shared_layers_are_adopted_through_the_remote_snapshot_protocol() {
    let tmp = tempdir();
    let view = tmp.path().join("view");
    let image = Image {
        name: "x".into(),
        layers: vec![Layer::file("etc/one", b"1"), Layer::file("etc/two", b"2")],
    };
    let ids = image.write_shared(&view);
    let view_before = tree_hash(&view);
    let chains = image.chain_ids();
    let root = tmp.path().join("root");
    let s = Snapshotter::start(&tmp.path().join("s.sock"), &root, Some(&view));
    let mut c = s.client().await;

    let adopt = |key: &'static str, parent: String, chain: String| {
        let mut c = c.clone();
        async move {
            let labels = labels(&[(REF, &chain)]);
            let e = prepare(&mut c, key, &parent, labels).await.unwrap_err();
            assert_eq!(e.code(), Code::AlreadyExists, "{e:?}");
            let filter = format!(r#"labels."{REF}"=={chain},parent=="{parent}""#);
            let found = list(&mut c, &[&filter]).await;
            assert_eq!(found.len(), 1, "{found:?}");
            let info = stat(&mut c, &found[0].name).await.unwrap();
            assert_eq!(info.kind, Kind::Committed as i32);
            assert_eq!(info.parent, parent);
            info.name
        }
    };
    let base = adopt("k8s.io/1/extract-1 a", String::new(), chains[0].clone()).await;
    let top = adopt("k8s.io/3/extract-2 b", base.clone(), chains[1].clone()).await;
    assert_eq!(top, format!("k8s.io/3/{}", chains[1]));
    assert!(
        snapshot_dirs(&root).is_empty(),
        "adopted layers take no local space"
    );
    let top_usage = usage(&mut c, &top).await;
    assert!(
        top_usage.size > 0 && top_usage.inodes > 0,
        "an adopted layer reports its own size: {top_usage:?}"
    );

    // A container over them sees the shared files, nearest layer first.
    let m = prepare(&mut c, "k8s.io/5/ctr", &top, HashMap::new())
        .await
        .unwrap();
    let lower = option(&m, "lowerdir");
    let expect: Vec<String> = ids
        .iter()
        .rev()
        .map(|id| {
            view.join("overlay/RO")
                .join(id)
                .join("diff")
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    assert_eq!(lower, expect.join(":"));

    // Over another parent, or a chain the view lacks: an ordinary active snapshot.
    let elsewhere = prepare(&mut c, "k8s.io/6/x", "", labels(&[(REF, &chains[1])]))
        .await
        .unwrap();
    assert_eq!(elsewhere[0].r#type, "bind");
    let unknown = format!("sha256:{}", "0".repeat(64));
    prepare(&mut c, "k8s.io/7/y", "", labels(&[(REF, &unknown)]))
        .await
        .unwrap();

    // Removing adopted snapshots never touches the shared files.
    remove(&mut c, "k8s.io/5/ctr").await.unwrap();
    remove(&mut c, &top).await.unwrap();
    remove(&mut c, &base).await.unwrap();
    assert_eq!(tree_hash(&view), view_before);
}

/// `ctr image import` in containerd 1.6 never sends the label: the unpacked layer is
/// committed under its chain ID, and the shared copy replaces the local one.
#[tokio::test]
async fn a_committed_chain_the_view_holds_drops_the_local_copy() {
    let tmp = tempdir();
    let view = tmp.path().join("view");
    let image = Image {
        name: "x".into(),
        layers: vec![
            Layer::file("etc/one", &[7u8; 100_000]),
            Layer::file("etc/two", b"2"),
        ],
    };
    let ids = image.write_shared(&view);
    let chains = image.chain_ids();
    let root = tmp.path().join("root");
    let s = Snapshotter::start(&tmp.path().join("s.sock"), &root, Some(&view));
    let mut c = s.client().await;

    let m = prepare(&mut c, "default/1/extract-1 a", "", HashMap::new())
        .await
        .unwrap();
    tar::Archive::new(&image.layers[0].tar[..])
        .unpack(&m[0].source)
        .unwrap();
    let base = format!("default/2/{}", chains[0]);
    commit(&mut c, &base, "default/1/extract-1 a")
        .await
        .unwrap();
    assert!(snapshot_dirs(&root).is_empty(), "the local copy is gone");
    assert!(s.log_text().contains("dropping the local copy"));
    let ctr = prepare(&mut c, "default/3/ctr", &base, HashMap::new())
        .await
        .unwrap();
    assert_eq!(
        ctr[0].options.last().unwrap(),
        &format!(
            "lowerdir={}",
            view.join("overlay/RO").join(&ids[0]).join("diff").display()
        )
    );

    // A commit under a chain the view lacks, or a name that is not a chain, stays local.
    let m = prepare(&mut c, "default/4/extract-2 b", &base, HashMap::new())
        .await
        .unwrap();
    let upper = option(&m, "upperdir");
    fs::write(Path::new(&upper).join("other"), b"x").unwrap();
    let unknown = format!("default/5/sha256:{}", "0".repeat(64));
    commit(&mut c, &unknown, "default/4/extract-2 b")
        .await
        .unwrap();
    assert_eq!(snapshot_dirs(&root).len(), 2, "{:?}", snapshot_dirs(&root));

    // After a restart the shared backing is still what the table says.
    drop(c);
    let mut s = s;
    s.restart();
    let mut c = s.client().await;
    assert_eq!(mounts(&mut c, "default/3/ctr").await.unwrap(), ctr);
}

/// A snapshot over a parent committed under a name that is no chain ID has layers below it
/// whose chain is unknown: it is never taken for a shared base layer, which has none.
/// Committed or prepared under a base layer's chain ID, it stays local, with its own
/// files. Before, "no parent" and "a parent of unknown chain" were alike, and the commit
/// replaced the snapshot's files with the base layer's.
#[tokio::test]
async fn a_snapshot_over_a_parent_of_unknown_chain_is_never_a_shared_base_layer() {
    let tmp = tempdir();
    let view = tmp.path().join("view");
    let image = Image {
        name: "x".into(),
        layers: vec![Layer::file("etc/one", b"1"), Layer::file("etc/two", b"2")],
    };
    image.write_shared(&view);
    let chains = image.chain_ids();
    let root = tmp.path().join("root");
    let s = Snapshotter::start(&tmp.path().join("s.sock"), &root, Some(&view));
    let mut c = s.client().await;

    prepare(&mut c, "default/1/extract-1 a", "", HashMap::new())
        .await
        .unwrap();
    commit(&mut c, "default/2/plain", "default/1/extract-1 a")
        .await
        .unwrap();
    let m = prepare(
        &mut c,
        "default/3/extract-2 b",
        "default/2/plain",
        HashMap::new(),
    )
    .await
    .unwrap();
    let upper = option(&m, "upperdir");
    fs::write(Path::new(&upper).join("mine"), b"x").unwrap();
    let named = format!("default/4/{}", chains[0]);
    commit(&mut c, &named, "default/3/extract-2 b")
        .await
        .unwrap();
    assert!(
        !s.log_text().contains("dropping the local copy"),
        "the commit took the shared base layer's files"
    );
    assert_eq!(snapshot_dirs(&root).len(), 2, "{:?}", snapshot_dirs(&root));
    let ctr = prepare(&mut c, "default/5/ctr", &named, HashMap::new())
        .await
        .unwrap();
    let lower = option(&ctr, "lowerdir");
    assert!(
        !lower.contains(&view.to_string_lossy().into_owned()),
        "a lower dir in the shared tree: {lower}"
    );

    // Nor is one above it, whatever its name says.
    prepare(&mut c, "default/6/extract-3 c", &named, HashMap::new())
        .await
        .unwrap();
    commit(
        &mut c,
        &format!("default/7/{}", chains[1]),
        "default/6/extract-3 c",
    )
    .await
    .unwrap();
    assert!(
        !s.log_text().contains("dropping the local copy"),
        "the commit over it took the shared top layer's files"
    );
    assert_eq!(snapshot_dirs(&root).len(), 4, "{:?}", snapshot_dirs(&root));

    // Prepared with the label: an ordinary active snapshot, not an adopted one.
    let labelled = labels(&[(REF, &chains[0])]);
    let m = prepare(&mut c, "default/8/extract-4 d", "default/2/plain", labelled)
        .await
        .unwrap();
    assert_eq!(m[0].r#type, "overlay", "{m:?}");
}

/// A refresh that removes a shared layer still in use: the snapshots stay listed, and a
/// new mount over them fails with a message naming the layer, instead of a bare ENOENT
/// from mount(2).
#[tokio::test]
async fn a_shared_layer_gone_from_the_view_is_named_when_mounting() {
    let tmp = tempdir();
    let view = tmp.path().join("view");
    let image = Image {
        name: "x".into(),
        layers: vec![Layer::file("etc/one", b"1")],
    };
    let ids = image.write_shared(&view);
    let chain = image.chain_ids().remove(0);
    let s = Snapshotter::start(
        &tmp.path().join("s.sock"),
        &tmp.path().join("root"),
        Some(&view),
    );
    let mut c = s.client().await;
    let e = prepare(&mut c, "ns/1/a", "", labels(&[(REF, &chain)]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists);
    let name = format!("ns/1/{chain}");
    prepare(&mut c, "ns/2/ctr", &name, HashMap::new())
        .await
        .unwrap();

    fs::remove_dir_all(view.join("overlay/RO").join(&ids[0])).unwrap();
    let e = mounts(&mut c, "ns/2/ctr").await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert!(
        e.message().contains(&ids[0]) && e.message().contains("gone"),
        "{}",
        e.message()
    );
    assert!(stat(&mut c, &name).await.is_ok());
    // And it can still be removed, children first, as garbage collection does.
    remove(&mut c, "ns/2/ctr").await.unwrap();
    remove(&mut c, &name).await.unwrap();
}

/// Many clients at once, each making, committing, stacking on and removing its own
/// snapshots, with Cleanup and List running beside them: every call answers as if alone,
/// and nothing is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_clients_leave_a_consistent_table() {
    let tmp = tempdir();
    let root = tmp.path().join("root");
    let s = Snapshotter::start(&tmp.path().join("s.sock"), &root, None);
    let c = s.client().await;
    let mut tasks = Vec::new();
    for t in 0..8 {
        let mut c = c.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..25 {
                let key = format!("ns/{t}-{i}/extract");
                let name = format!("ns/{t}-{i}/layer");
                let child = format!("ns/{t}-{i}/ctr");
                let m = prepare(&mut c, &key, "", HashMap::new()).await.unwrap();
                fs::write(Path::new(&m[0].source).join("f"), format!("{t}-{i}")).unwrap();
                commit(&mut c, &name, &key).await.unwrap();
                let m = prepare(&mut c, &child, &name, HashMap::new())
                    .await
                    .unwrap();
                let lower = option(&m, "lowerdir");
                assert_eq!(
                    fs::read_to_string(Path::new(&lower).join("f")).unwrap(),
                    format!("{t}-{i}")
                );
                assert_eq!(code(remove(&mut c, &name).await), Code::FailedPrecondition);
                remove(&mut c, &child).await.unwrap();
                remove(&mut c, &name).await.unwrap();
            }
        }));
    }
    let mut side = c.clone();
    let watcher = tokio::spawn(async move {
        for _ in 0..50 {
            side.cleanup(CleanupRequest {
                snapshotter: "layerfs".into(),
            })
            .await
            .unwrap();
            let _ = list(&mut side, &[]).await;
        }
    });
    for t in tasks {
        t.await.unwrap();
    }
    watcher.await.unwrap();
    let mut c = c;
    assert!(list(&mut c, &[]).await.is_empty());
    c.cleanup(CleanupRequest {
        snapshotter: "layerfs".into(),
    })
    .await
    .unwrap();
    assert!(
        snapshot_dirs(&root).is_empty(),
        "{:?}",
        snapshot_dirs(&root)
    );
}

/// containerd's remote-snapshot protocol for one layer: Prepare with the chain ID label
/// answered ALREADY_EXISTS, then List with containerd's filter finds the committed snapshot
/// over `parent`. Returns its name.
async fn adopt(c: &mut Client, key: &str, parent: &str, chain: &str) -> String {
    let e = prepare(c, key, parent, labels(&[(REF, chain)]))
        .await
        .map(|m| format!("{m:?}"))
        .expect_err("the shared layer was not adopted: an active snapshot was made");
    assert_eq!(e.code(), Code::AlreadyExists, "{e:?}");
    let filter = format!(r#"labels."{REF}"=={chain},parent=="{parent}""#);
    let found = list(c, &[&filter]).await;
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].kind, Kind::Committed as i32);
    found[0].name.clone()
}

/// An image of three small layers, `/etc/one`, `/etc/two`, `/etc/three`; the first
/// `depth` of them.
fn small_image(depth: usize) -> Image {
    let layers = [
        Layer::file("etc/one", &[1u8; 100_000]),
        Layer::file("etc/two", b"two\n"),
        Layer::file("etc/three", b"three\n"),
    ];
    Image {
        name: "small".into(),
        layers: layers.into_iter().take(depth).collect(),
    }
}

/// Unmounts what a test mounted, also when the test fails.
struct Unmount(std::path::PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        let ok = std::process::Command::new("umount")
            .arg(&self.0)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(&self.0)
                .status();
        }
    }
}

fn mount(kind: &str, options: &str, source: &str, target: &Path) -> Unmount {
    fs::create_dir_all(target).unwrap();
    let out = std::process::Command::new("mount")
        .args(["-t", kind, "-o", options, source])
        .arg(target)
        .output()
        .unwrap();
    assert!(out.status.success(), "mount: {}", output_text(&out));
    Unmount(target.to_owned())
}

/// Shared layers are found by what `layer.json` says they hold, not by their directory
/// names; a layer a writer publishes after the snapshotter started is found once the view
/// is refreshed, with no restart.
#[tokio::test(flavor = "multi_thread")]
async fn a_layer_published_after_start_is_adopted_after_a_refresh() {
    let view = View::new();
    let first = small_image(2).write_shared_named(&view.remote, Naming::Isulad);
    view.refresh();
    let image = small_image(3);
    let chains = image.chain_ids();
    let tmp = tempdir();
    let s = Snapshotter::start(
        &tmp.path().join("s.sock"),
        &view.mnt.join("snapshots"),
        None,
    );
    let mut c = s.client().await;
    let base = adopt(&mut c, "k8s.io/1/extract-1 a", "", &chains[0]).await;
    let mid = adopt(&mut c, "k8s.io/3/extract-2 b", &base, &chains[1]).await;

    // Not on the remote yet: an ordinary active snapshot, which containerd fills itself.
    let m = prepare(
        &mut c,
        "k8s.io/5/extract-3 c",
        &mid,
        labels(&[(REF, &chains[2])]),
    )
    .await
    .unwrap();
    assert_eq!(m[0].r#type, "overlay", "{m:?}");
    remove(&mut c, "k8s.io/5/extract-3 c").await.unwrap();

    let ids = image.write_shared_named(&view.remote, Naming::Isulad);
    assert_eq!(
        ids[..2],
        first[..],
        "the first two layers are not written again"
    );
    view.refresh();
    let top = adopt(&mut c, "k8s.io/6/extract-4 d", &mid, &chains[2]).await;
    let info = stat(&mut c, &top).await.unwrap();
    assert_eq!(info.parent, mid);
    assert_eq!(
        info.labels.get(REMOTE_LABEL).map(String::as_str),
        Some(REMOTE_LABEL_VALUE),
        "{info:?}"
    );

    // A container over it sees the layer's files.
    let m = prepare(&mut c, "k8s.io/8/ctr", &top, HashMap::new())
        .await
        .unwrap();
    let lower = option(&m, "lowerdir");
    let nearest = lower.split(':').next().unwrap();
    assert_eq!(
        fs::read(Path::new(nearest).join("etc/three")).unwrap(),
        b"three\n"
    );
}

/// A layer a writer takes off the remote tree is no longer offered once the view is
/// refreshed: a labelled Prepare for it makes an ordinary active snapshot.
#[tokio::test(flavor = "multi_thread")]
async fn a_layer_taken_off_the_remote_is_not_adopted_after_a_refresh() {
    let view = View::new();
    let image = small_image(3);
    let ids = image.write_shared_named(&view.remote, Naming::Random);
    view.refresh();
    let chains = image.chain_ids();
    let tmp = tempdir();
    let s = Snapshotter::start(
        &tmp.path().join("s.sock"),
        &view.mnt.join("snapshots"),
        None,
    );
    let mut c = s.client().await;
    let base = adopt(&mut c, "k8s.io/1/extract-1 a", "", &chains[0]).await;
    let mid = adopt(&mut c, "k8s.io/3/extract-2 b", &base, &chains[1]).await;
    let top = adopt(&mut c, "k8s.io/5/extract-3 c", &mid, &chains[2]).await;
    remove(&mut c, &top).await.unwrap();

    remove_shared(&view.remote, &ids[2]);
    view.refresh();
    let m = prepare(
        &mut c,
        "k8s.io/7/extract-4 d",
        &mid,
        labels(&[(REF, &chains[2])]),
    )
    .await
    .expect("a layer gone from the remote is not offered");
    assert_eq!(m[0].r#type, "overlay", "{m:?}");
    let info = stat(&mut c, "k8s.io/7/extract-4 d").await.unwrap();
    assert_eq!(info.kind, Kind::Active as i32);
    assert!(
        !option(&m, "upperdir").contains(&ids[2]),
        "the active snapshot's files are its own: {m:?}"
    );
}

/// Usage of a snapshot backed by a shared layer, adopted or deduplicated, is the layer's
/// own size and inodes: what the same layer takes when it is unpacked and committed
/// locally. Usage of an active snapshot without a quota is what was written in it.
#[tokio::test]
async fn usage_of_a_shared_layer_is_what_the_layer_takes_unpacked_locally() {
    let tmp = tempdir();
    let view = tmp.path().join("view");
    let image = small_image(2);
    image.write_shared(&view);
    let chains = image.chain_ids();
    let root = tmp.path().join("root");
    let s = Snapshotter::start(&tmp.path().join("s.sock"), &root, Some(&view));
    let mut c = s.client().await;

    // The same layers unpacked into snapshots committed under names that are no chain ID,
    // so they stay local.
    let m = prepare(&mut c, "local/1/a", "", HashMap::new())
        .await
        .unwrap();
    tar::Archive::new(&image.layers[0].tar[..])
        .unpack(&m[0].source)
        .unwrap();
    commit(&mut c, "local/2/base", "local/1/a").await.unwrap();
    let m = prepare(&mut c, "local/3/b", "local/2/base", HashMap::new())
        .await
        .unwrap();
    tar::Archive::new(&image.layers[1].tar[..])
        .unpack(option(&m, "upperdir"))
        .unwrap();
    commit(&mut c, "local/4/mid", "local/3/b").await.unwrap();
    let local_base = usage(&mut c, "local/2/base").await;
    let local_mid = usage(&mut c, "local/4/mid").await;
    assert!(
        local_base.size >= 100_000 && local_base.inodes >= 3,
        "{local_base:?}"
    );
    assert!(local_mid.size > 0 && local_mid.inodes >= 2, "{local_mid:?}");

    let base = adopt(&mut c, "k8s.io/1/extract-1 a", "", &chains[0]).await;
    let mid = adopt(&mut c, "k8s.io/3/extract-2 b", &base, &chains[1]).await;
    assert_eq!(
        usage(&mut c, &base).await,
        local_base,
        "the adopted base layer"
    );
    assert_eq!(
        usage(&mut c, &mid).await,
        local_mid,
        "the adopted second layer"
    );

    let m = prepare(&mut c, "default/1/extract-1 a", "", HashMap::new())
        .await
        .unwrap();
    tar::Archive::new(&image.layers[0].tar[..])
        .unpack(&m[0].source)
        .unwrap();
    let deduped = format!("default/2/{}", chains[0]);
    commit(&mut c, &deduped, "default/1/extract-1 a")
        .await
        .unwrap();
    assert!(s.log_text().contains("dropping the local copy"));
    assert_eq!(
        usage(&mut c, &deduped).await,
        local_base,
        "the deduplicated base layer"
    );

    let m = prepare(&mut c, "k8s.io/5/ctr", &mid, HashMap::new())
        .await
        .unwrap();
    fs::write(
        Path::new(&option(&m, "upperdir")).join("written"),
        vec![7u8; 1 << 20],
    )
    .unwrap();
    let active = usage(&mut c, "k8s.io/5/ctr").await;
    assert!(active.size >= 1 << 20, "{active:?}");
}

/// A quota too small for the directories a snapshot needs before anything is written in
/// it is refused as INVALID_ARGUMENT naming the smallest size that works, and that size
/// works; a missing parent is NOT_FOUND.
#[tokio::test(flavor = "multi_thread")]
async fn a_quota_too_small_for_a_snapshot_s_own_dirs_is_refused_with_the_minimum() {
    let view = View::new();
    let tmp = tempdir();
    let root = view.mnt.join("snapshots");
    let s = Snapshotter::start(&tmp.path().join("s.sock"), &root, None);
    let mut c = s.client().await;
    let size = |n: &str| labels(&[("containerd.io/snapshot/layerfs.storage.size", n)]);
    assert_eq!(
        code(prepare(&mut c, "default/1/k", "default/0/missing", size("1M")).await),
        Code::NotFound
    );

    prepare(&mut c, "default/1/extract", "", HashMap::new())
        .await
        .unwrap();
    commit(&mut c, "default/2/base", "default/1/extract")
        .await
        .unwrap();
    for (key, parent) in [
        ("default/3/alone", ""),
        ("default/4/over", "default/2/base"),
    ] {
        let e = prepare(&mut c, key, parent, size("1")).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{key}: {e:?}");
        let minimum = minimum_bytes(e.message())
            .unwrap_or_else(|| panic!("{key}: no \"at least <N> bytes\" in {:?}", e.message()));
        assert!(minimum > 1, "{key}: {}", e.message());
        assert_eq!(
            code(stat(&mut c, key).await),
            Code::NotFound,
            "{key}: nothing was made"
        );
        let e = prepare(&mut c, key, parent, size(&(minimum - 1).to_string()))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{key}: {e:?}");
        prepare(&mut c, key, parent, size(&minimum.to_string()))
            .await
            .unwrap_or_else(|e| panic!("{key}: a quota of the minimum, {minimum}: {e:?}"));
    }
}

/// N in a message that says "at least <N> bytes".
fn minimum_bytes(message: &str) -> Option<u64> {
    let mut words = message.split("at least ").nth(1)?.split_whitespace();
    let n = words.next()?.parse().ok()?;
    words.next()?.starts_with("bytes").then_some(n)
}

/// A root whose filesystem is full fails a Prepare with RESOURCE_EXHAUSTED, the code of
/// "out of space", not INTERNAL.
#[tokio::test]
async fn a_prepare_on_a_full_root_is_resource_exhausted() {
    let tmp = tempdir();
    let root = tmp.path().join("root");
    let _mounted = mount("tmpfs", "size=1m,nr_inodes=64", "none", &root);
    let s = Snapshotter::start(&tmp.path().join("s.sock"), &root, None);
    let mut c = s.client().await;
    prepare(&mut c, "default/1/a", "", HashMap::new())
        .await
        .unwrap();

    let mut fill = fs::File::create(root.join("fill")).unwrap();
    let chunk = vec![0u8; 64 << 10];
    while std::io::Write::write_all(&mut fill, &chunk).is_ok() {}
    drop(fill);
    let mut n = 0;
    while fs::File::create(root.join(format!("inode-{n}"))).is_ok() {
        n += 1;
    }

    let e = prepare(&mut c, "default/2/b", "", HashMap::new())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert_eq!(code(stat(&mut c, "default/2/b").await), Code::NotFound);
}

/// The fast path: an active snapshot without a quota has its upper and work dirs on the
/// local disk directly, beside the view's local dir, and only its shared lowers in the
/// view; one with a quota keeps them under the snapshotter's root, in the view, where the
/// quota is enforced. A fast-path snapshot mounts, takes writes, and a child of it, once
/// committed, sees them.
#[tokio::test(flavor = "multi_thread")]
async fn an_active_snapshot_without_a_quota_writes_on_the_local_disk_directly() {
    let view = View::new();
    let image = small_image(3);
    image.write_shared(&view.remote);
    view.refresh();
    let chains = image.chain_ids();
    let tmp = tempdir();
    let root = view.mnt.join("snapshots");
    let s = Snapshotter::start(&tmp.path().join("s.sock"), &root, None);
    let mut c = s.client().await;
    let base = adopt(&mut c, "k8s.io/1/extract-1 a", "", &chains[0]).await;
    let mid = adopt(&mut c, "k8s.io/3/extract-2 b", &base, &chains[1]).await;
    let top = adopt(&mut c, "k8s.io/5/extract-3 c", &mid, &chains[2]).await;

    let mnt = fs::canonicalize(&view.mnt).unwrap();
    let local = fs::canonicalize(&view.local)
        .unwrap()
        .join(".layerfs-snapshotter");
    let m = prepare(&mut c, "k8s.io/7/ctr", &top, HashMap::new())
        .await
        .unwrap();
    assert_eq!(m[0].r#type, "overlay", "{m:?}");
    for dir in ["upperdir", "workdir"] {
        let path = option(&m, dir);
        assert!(
            Path::new(&path).starts_with(&local) && !Path::new(&path).starts_with(&mnt),
            "{dir} not on the local disk under {}: {path}",
            local.display()
        );
    }
    for lower in option(&m, "lowerdir").split(':') {
        assert!(
            Path::new(lower).starts_with(mnt.join("overlay/RO")),
            "a shared lower dir outside the view: {lower}"
        );
    }

    let limited = prepare(
        &mut c,
        "k8s.io/8/limited",
        &top,
        labels(&[("containerd.io/snapshot/layerfs.storage.size", "4M")]),
    )
    .await
    .unwrap();
    let in_root = fs::canonicalize(&root).unwrap();
    for dir in ["upperdir", "workdir"] {
        let path = option(&limited, dir);
        assert!(
            Path::new(&path).starts_with(&in_root),
            "{dir} of a snapshot with a quota not under the root {}: {path}",
            in_root.display()
        );
    }

    let target = tmp.path().join("rootfs");
    {
        let options: Vec<&str> = m[0].options.iter().map(String::as_str).collect();
        let _mounted = mount("overlay", &options.join(","), "overlay", &target);
        assert_eq!(fs::read(target.join("etc/three")).unwrap(), b"three\n");
        fs::write(target.join("etc/written"), vec![7u8; 1 << 20]).unwrap();
    }
    let active = usage(&mut c, "k8s.io/7/ctr").await;
    assert!(active.size >= 1 << 20, "{active:?}");
    commit(&mut c, "k8s.io/9/committed", "k8s.io/7/ctr")
        .await
        .unwrap();
    let child = prepare(
        &mut c,
        "k8s.io/10/child",
        "k8s.io/9/committed",
        HashMap::new(),
    )
    .await
    .unwrap();
    {
        let options: Vec<&str> = child[0].options.iter().map(String::as_str).collect();
        let _mounted = mount("overlay", &options.join(","), "overlay", &target);
        assert_eq!(fs::read(target.join("etc/written")).unwrap().len(), 1 << 20);
        assert_eq!(fs::read(target.join("etc/one")).unwrap().len(), 100_000);
    }
}
