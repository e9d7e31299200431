//! Rooms a reader can hold: no file of product code over 800 lines, no test file over
//! 1500, in every crate of the workspace. A file that grows past them is split by concern
//! (see how `view` keeps lookup, namespace changes and rename apart), not by line count.

use std::fs;
use std::path::{Path, PathBuf};

const PRODUCT_LINES: usize = 800;
const TEST_LINES: usize = 1500;

/// The workspace's folders of product code, and of tests.
const PRODUCT: &[&str] = &[
    "src",
    "csi/src",
    "snapshotter/src",
    "mount-helper/src",
    "benches/uring/src",
];
const TESTS: &[&str] = &[
    "tests",
    "csi/tests",
    "snapshotter/tests",
    "mount-helper/tests",
];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Unit tests kept beside the code, in a `tests.rs` of their own, are test files.
fn is_test_file(path: &Path) -> bool {
    path.file_name().is_some_and(|n| n == "tests.rs")
}

fn oversized(folders: &[&str], product: bool) -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for folder in folders {
        rust_files(&root.join(folder), &mut files);
    }
    files
        .into_iter()
        .filter_map(|path| {
            let limit = match product && !is_test_file(&path) {
                true => PRODUCT_LINES,
                false => TEST_LINES,
            };
            let lines = fs::read_to_string(&path).unwrap().lines().count();
            let shown = path.strip_prefix(root).unwrap().display().to_string();
            (lines > limit).then(|| format!("{shown}: {lines} lines (at most {limit})"))
        })
        .collect()
}

#[test]
fn no_product_file_is_over_800_lines() {
    let over = oversized(PRODUCT, true);
    assert!(over.is_empty(), "split these by concern: {over:#?}");
}

#[test]
fn no_test_file_is_over_1500_lines() {
    let over = oversized(TESTS, false);
    assert!(over.is_empty(), "split these by concern: {over:#?}");
}
