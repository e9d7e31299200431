//! Objects of a writer host's storage as iSulad lays it out with `storage-enable-remote-layer`
//! on (DESIGN §4.1), written at once into a remote tree, for suites that only need them there.

use std::fs;
use std::path::Path;

/// Writes `bytes` to `path` the way iSulad does: a temporary file, then `rename(2)`.
pub fn write_atomic(path: &Path, bytes: &[u8]) {
    let tmp = path.with_file_name(format!(
        ".tmp-{}-0123456789",
        path.file_name().unwrap().to_string_lossy()
    ));
    fs::write(&tmp, bytes).unwrap();
    fs::rename(&tmp, path).unwrap();
}

/// A gzip stream of one tar-split line.
pub fn tar_split_gz() -> Vec<u8> {
    use std::io::Write;
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(br#"{"type":1,"name":"hello","size":13,"payload":"kGuXHeJgaa0="}"#)
        .unwrap();
    gz.finish().unwrap()
}

/// Writes a base layer `id` (short id `short`) into a remote tree as a writer host does:
/// the overlay dir with one file `diff/hello` holding `content`, then the metadata dir.
/// `tar_split` is the tar-split file's content (complete or not).
pub fn write_base_layer(remote: &Path, id: &str, short: &str, content: &str, tar_split: &[u8]) {
    let overlay = remote.join("overlay/RO").join(id);
    fs::create_dir_all(overlay.join("diff")).unwrap();
    fs::write(overlay.join("diff/hello"), content).unwrap();
    write_atomic(&overlay.join("link"), short.as_bytes());
    fs::create_dir_all(overlay.join("work")).unwrap();
    fs::create_dir_all(overlay.join("empty")).unwrap();
    let meta = remote.join("overlay-layers/RO").join(id);
    fs::create_dir_all(&meta).unwrap();
    let json = format!(r#"{{"id":"{id}","diff-digest":"sha256:{id}","incompelte":false}}"#);
    write_atomic(&meta.join("layer.json"), json.as_bytes());
    fs::write(meta.join(format!("{id}.tar-split.gz")), tar_split).unwrap();
}

/// Writes image `id` on top layer `top` with repository names `names`, as iSulad does.
pub fn write_image(remote: &Path, id: &str, top: &str, names: &[&str]) {
    let dir = remote.join("overlay-images").join(id);
    fs::create_dir_all(&dir).unwrap();
    write_atomic(
        &dir.join("images.json"),
        image_json(id, top, names).as_bytes(),
    );
    let config = {
        use base64::Engine as _;
        let key = format!("sha256:{id}");
        format!("={}", base64::engine::general_purpose::STANDARD.encode(key))
    };
    write_atomic(&dir.join(config), br#"{"architecture":"amd64"}"#);
    write_atomic(&dir.join("manifest"), br#"{"schemaVersion":2}"#);
}

pub fn image_json(id: &str, top: &str, names: &[&str]) -> String {
    let names: Vec<String> = names.iter().map(|n| format!("\"{n}\"")).collect();
    format!(
        r#"{{"id":"{id}","names":[{}],"layer":"{top}","size":42}}"#,
        names.join(",")
    )
}
