use std::path::Path;

use super::*;

/// A view of the shipped fixture tree over an empty local tree, with the index a scan of
/// the fixture gives.
fn fixture_view(local: &Path) -> View {
    let remote = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/remote");
    let layout = Layout::new("overlay", &local.join("mnt"), LinkStyle::Absolute);
    View::new(
        layout,
        open_root(local).unwrap(),
        open_root(&remote).unwrap(),
        LayoutIndex::scan(&remote, "overlay"),
    )
    .unwrap()
}

/// A refresh round that removes a layer between a lookup's resolving its name and building
/// its node: the node is built by the index the name was resolved with, a shared layer
/// like the remote directory it was found as, not a private directory that merges nothing.
#[test]
fn a_node_is_built_by_the_index_its_name_was_found_with() {
    let tmp = tempfile::tempdir().unwrap();
    let view = fixture_view(tmp.path());
    let id = view
        .index()
        .layers()
        .next()
        .expect("a ready layer")
        .id
        .clone();
    let driver = view.lookup(ROOT_INO, OsStr::new("overlay")).unwrap().node;
    let ro = view.lookup(driver.ino, OsStr::new("RO")).unwrap().node;
    assert_eq!(ro.zone, Zone::DriverRo);

    let name = OsStr::new(&*id);
    let c = cname(name).unwrap();
    let index = IndexOnce::of(&view);
    let found = view.resolve(&ro, name, &c, &index, Probe::Open).unwrap();
    assert!(
        matches!(found, Found::Remote { .. }),
        "{id} is a remote layer"
    );
    view.swap_index(LayoutIndex::default());
    let entry = view.materialize(&ro, name, &c, &index, found).unwrap();
    assert_eq!(entry.node.zone, Zone::Shared, "the node of layer {id}");
}
