//! The pull path of Kubernetes: containerd's CRI plugin pulls an image from a registry
//! and unpacks it with the remote-snapshot label. Layers the shared tree holds are adopted:
//! neither fetched from the registry nor applied. The same pull with containerd's overlayfs
//! snapshotter fetches and applies every layer.

mod common;

use std::path::Path;

use common::*;

mod cri {
    include!(concat!(env!("OUT_DIR"), "/runtime.v1.rs"));
}

fn image() -> Image {
    Image {
        name: "docker.io/library/layerfs-cri:1".into(),
        layers: vec![Layer::busybox(), Layer::file("etc/marker", b"cri\n")],
    }
}

/// Pushes `image` to `registry` as `<registry>/layerfs/cri:1`, through a containerd of its
/// own, and returns that reference.
fn push(image: &Image, registry: &Registry, dir: &Path) -> String {
    push_all(&[(image, "layerfs/cri:1")], registry, dir).remove(0)
}

/// Pushes each image to `registry` as `<registry>/<repository:tag>`, through a containerd of
/// its own, and returns those references.
fn push_all(images: &[(&Image, &str)], registry: &Registry, dir: &Path) -> Vec<String> {
    let tmp = dir.join("pusher");
    let snapshotter = Snapshotter::start(&dir.join("pusher.sock"), &tmp.join("snapshots"), None);
    let containerd = Containerd::start(&tmp.join("containerd"), &snapshotter.socket);
    let mut references = Vec::new();
    for (image, name) in images {
        containerd.import(image);
        let reference = format!("{}/{name}", registry.address);
        containerd.ctr_ok(&["images", "tag", &image.name, &reference]);
        containerd.ctr_ok(&["images", "push", "--plain-http", &reference]);
        references.push(reference);
    }
    references
}

fn cri_config(snapshotter: &str, registry: &Registry) -> String {
    format!(
        r#"[plugins."io.containerd.grpc.v1.cri".containerd]
  snapshotter = "{snapshotter}"
[plugins."io.containerd.grpc.v1.cri".registry.mirrors."{address}"]
  endpoint = ["http://{address}"]
"#,
        address = registry.address
    )
}

async fn cri_pull(containerd: &Containerd, reference: &str) -> String {
    let channel = unix_channel(&containerd.socket).await;
    let mut client = cri::image_service_client::ImageServiceClient::new(channel);
    let request = cri::PullImageRequest {
        image: Some(cri::ImageSpec {
            image: reference.into(),
        }),
    };
    let mut last = None;
    // The CRI plugin finishes starting a moment after containerd's socket is up.
    for _ in 0..60 {
        match client.pull_image(request.clone()).await {
            Ok(r) => return r.into_inner().image_ref,
            Err(e)
                if e.code() == tonic::Code::Unimplemented
                    || e.code() == tonic::Code::Unavailable =>
            {
                last = Some(e);
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            }
            Err(e) => panic!("PullImage: {e:?}\n{}", containerd.log()),
        }
    }
    panic!("PullImage never answered: {last:?}");
}

/// How many of `image`'s layer blobs containerd's content store holds.
fn fetched_layers(containerd: &Containerd, image: &Image) -> usize {
    let blobs = containerd.ctr_ok(&["-n", "k8s.io", "content", "ls", "--quiet"]);
    assert!(
        blobs.lines().count() >= 2,
        "the manifest and config are there: {blobs}"
    );
    image
        .layers
        .iter()
        .filter(|l| {
            blobs
                .lines()
                .any(|b| b.trim() == format!("sha256:{}", l.diff_id()))
        })
        .count()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cri_pull_adopts_the_shared_layers_instead_of_fetching_them() {
    let image = image();
    let tmp = tempdir();
    let registry = Registry::start(&tmp.path().join("registry"));
    let reference = push(&image, &registry, tmp.path());

    // With the layerfs snapshotter over a view that holds the layers: nothing fetched.
    let view = View::new();
    image.write_shared(&view.remote);
    view.refresh();
    let remote_before = tree_hash(&view.remote);
    let root = view.mnt.join("snapshots");
    let snapshotter = Snapshotter::start(&tmp.path().join("s.sock"), &root, None);
    let containerd = Containerd::start_with(
        &tmp.path().join("containerd"),
        &snapshotter.socket,
        &cri_config("layerfs", &registry),
    );
    let image_ref = cri_pull(&containerd, &reference).await;
    assert!(image_ref.starts_with("sha256:"), "{image_ref}");
    let log = snapshotter.log_text();
    assert_eq!(log.matches("adopted a shared layer").count(), 2, "{log}");
    assert_eq!(
        log.matches("commit name=").count(),
        0,
        "nothing applied: {log}"
    );
    assert_eq!(fetched_layers(&containerd, &image), 0, "no layer fetched");
    assert!(std::fs::read_dir(root.join("snapshots"))
        .unwrap()
        .next()
        .is_none());
    let out = containerd.ctr_ok(&[
        "-n",
        "k8s.io",
        "run",
        "--rm",
        "--snapshotter",
        "layerfs",
        &reference,
        "c",
        "/bin/cat",
        "/etc/marker",
    ]);
    assert_eq!(out, "cri\n");
    drop(containerd);
    assert_eq!(tree_hash(&view.remote), remote_before);

    // The same pull with containerd's own overlayfs snapshotter fetches and applies both.
    let plain = Containerd::start_with(
        &tmp.path().join("containerd-overlayfs"),
        &snapshotter.socket,
        &cri_config("overlayfs", &registry),
    );
    cri_pull(&plain, &reference).await;
    assert_eq!(fetched_layers(&plain, &image), 2);
}

/// A CRI pull of each of two images whose three layers the remote tree holds under
/// `naming`, sharing their base: every layer is adopted, whatever the layers' directories
/// are called, so none is fetched or applied, and the containers see every layer's files.
async fn a_cri_pull_adopts_every_layer_of_a_remote_named(naming: Naming) {
    let (a, b) = images_sharing_a_base("layerfs-cri");
    let tmp = tempdir();
    let registry = Registry::start(&tmp.path().join("registry"));
    let references = push_all(
        &[(&a, "layerfs/cri:a"), (&b, "layerfs/cri:b")],
        &registry,
        tmp.path(),
    );

    let view = View::new();
    let ids_a = a.write_shared_named(&view.remote, naming);
    let ids_b = b.write_shared_named(&view.remote, naming);
    assert_eq!(ids_a[0], ids_b[0], "the remote holds the shared base once");
    view.refresh();
    let remote_before = tree_hash(&view.remote);
    let root = view.mnt.join("snapshots");
    let snapshotter = Snapshotter::start(&tmp.path().join("s.sock"), &root, None);
    let containerd = Containerd::start_with(
        &tmp.path().join("containerd"),
        &snapshotter.socket,
        &cri_config("layerfs", &registry),
    );

    for (image, reference) in [(&a, &references[0]), (&b, &references[1])] {
        cri_pull(&containerd, reference).await;
        assert_eq!(
            fetched_layers(&containerd, image),
            0,
            "{naming:?}: layers of {reference} fetched from the registry\n{}",
            snapshotter.log_text()
        );
    }
    let log = snapshotter.log_text();
    assert_eq!(
        log.matches("commit name=").count(),
        0,
        "{naming:?}: nothing applied: {log}"
    );
    assert!(
        std::fs::read_dir(root.join("snapshots"))
            .unwrap()
            .next()
            .is_none(),
        "{naming:?}: no local copy of a shared layer"
    );
    for image in [&a, &b] {
        for chain in image.chain_ids() {
            let info = proxy_snapshot_of_chain(&snapshotter.socket, &chain)
                .await
                .unwrap_or_else(|| panic!("{naming:?}: no snapshot of {chain}"));
            assert_eq!(
                info.labels.get(REMOTE_LABEL).map(String::as_str),
                Some(REMOTE_LABEL_VALUE),
                "{naming:?}: {info:?}"
            );
            // What an operator sees: containerd overlays its own labels on the proxy's.
            let shown = containerd.ctr_ok(&[
                "-n",
                "k8s.io",
                "snapshots",
                "--snapshotter",
                "layerfs",
                "info",
                &chain,
            ]);
            let shown: serde_json::Value = serde_json::from_str(&shown).unwrap();
            assert_eq!(
                shown["Labels"][REMOTE_LABEL], REMOTE_LABEL_VALUE,
                "{naming:?}: {shown}"
            );
        }
    }

    for (tag, reference) in [("a", &references[0]), ("b", &references[1])] {
        // runc keeps its state by container id in one directory for every containerd on
        // the host, so tests that run at once need ids of their own.
        let id = format!("c-{tag}-{naming:?}").to_lowercase();
        let out = containerd.ctr_ok(&[
            "-n",
            "k8s.io",
            "run",
            "--rm",
            "--snapshotter",
            "layerfs",
            reference,
            &id,
            "/bin/cat",
            &format!("/etc/{tag}-1"),
            &format!("/etc/{tag}-2"),
        ]);
        assert_eq!(out, format!("{tag}-1\n{tag}-2\n"), "{naming:?}");
    }
    drop(containerd);
    assert_eq!(tree_hash(&view.remote), remote_before);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cri_pull_adopts_every_layer_of_an_isulad_named_remote() {
    a_cri_pull_adopts_every_layer_of_a_remote_named(Naming::Isulad).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cri_pull_adopts_every_layer_of_a_chain_named_remote() {
    a_cri_pull_adopts_every_layer_of_a_remote_named(Naming::Chain).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cri_pull_adopts_every_layer_of_a_randomly_named_remote() {
    a_cri_pull_adopts_every_layer_of_a_remote_named(Naming::Random).await;
}
