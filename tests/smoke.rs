mod common;
use common::*;

#[test]
fn mount_shows_the_layout_and_unmounts() {
    let m = Mount::new();
    assert_eq!(
        names(&m.mnt),
        vec!["overlay", "overlay-images", "overlay-layers"]
    );
    let link = std::fs::read_link(m.path("overlay").join(id("L1"))).unwrap();
    assert_eq!(link, m.mnt.join("overlay/RO").join(id("L1")));
}
