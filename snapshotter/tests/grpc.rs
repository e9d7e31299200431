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
    let mut stream = c
        .list(ListSnapshotsRequest {
            snapshotter: "layerfs".into(),
            filters: filters.iter().map(|f| f.to_string()).collect(),
        })
        .await
        .unwrap()
        .into_inner();
    let mut out = Vec::new();
    while let Some(batch) = stream.message().await.unwrap() {
        out.extend(batch.info);
    }
    out
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
    assert_eq!(usage(&mut c, &top).await.size, 0);

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
