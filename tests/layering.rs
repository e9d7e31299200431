//! The layering `src/lib.rs` states holds: no top-level module names one of a later layer
//! (`crate::<module>` anywhere in its files, docs included), so no two modules depend on
//! each other.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;

/// The layers, as `src/lib.rs` lists them.
const LAYERS: &[&[&str]] = &[
    &["store", "layout"],
    &["report", "quota"],
    &["view"],
    &["fs", "refresh", "metrics"],
    &[
        "config",
        "mount",
        "expose",
        "launch",
        "daemon",
        "local_lock",
        "logging",
        "error",
        "control",
        "cli",
    ],
];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|layer| layer.contains(&module))
}

fn sources(path: &Path, out: &mut Vec<String>) {
    if path.is_dir() {
        for entry in fs::read_dir(path).unwrap() {
            sources(&entry.unwrap().path(), out);
        }
    } else if path.extension().is_some_and(|e| e == "rs") {
        out.push(fs::read_to_string(path).unwrap());
    }
}

/// The top-level modules `text` names as `crate::<module>` or in `use crate::{…}`.
fn named(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    for (at, _) in text.match_indices("crate::") {
        let rest = &text[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let group = &group[..group.find('}').unwrap_or(group.len())];
            for part in group.split(',') {
                names.push(ident(part.trim_start()));
            }
        } else {
            names.push(ident(rest));
        }
    }
    names
}

fn ident(s: &str) -> String {
    s.chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect()
}

/// Each top-level module of `src/` and the others it names.
fn imports() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut edges = BTreeMap::new();
    for entry in fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        let module = path.file_stem().unwrap().to_str().unwrap().to_owned();
        if module == "lib" || module == "main" {
            continue;
        }
        let mut texts = Vec::new();
        sources(&path, &mut texts);
        let names: BTreeSet<String> = texts
            .iter()
            .flat_map(|t| named(t))
            .filter(|n| *n != module && layer_of(n).is_some())
            .collect();
        edges.insert(module, names);
    }
    edges
}

#[test]
fn no_module_names_one_of_a_later_layer() {
    let mut wrong = Vec::new();
    for (module, names) in imports() {
        let layer = layer_of(&module)
            .unwrap_or_else(|| panic!("src/{module} is in no layer of this test and lib.rs"));
        for other in names {
            if layer_of(&other).is_some_and(|l| l > layer) {
                wrong.push(format!("{module} -> {other}"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "modules that name a later layer: {wrong:?}"
    );
}

#[test]
fn no_two_modules_name_each_other() {
    let edges = imports();
    let mut pairs = Vec::new();
    for (a, names) in &edges {
        for b in names {
            if a < b && edges.get(b).is_some_and(|n| n.contains(a)) {
                pairs.push(format!("{a} <-> {b}"));
            }
        }
    }
    assert!(pairs.is_empty(), "modules that name each other: {pairs:?}");
}

/// The view and the FUSE glue reach quotas through the seam alone: they name the items
/// `quota` exports (the `Accounting` trait and the values it takes and returns), never one
/// of its modules, but `size`, the size strings users write.
#[test]
fn view_and_fs_use_quota_through_its_seam() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let modules: BTreeSet<String> = fs::read_dir(src.join("quota"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter_map(|p| Some(p.file_stem()?.to_str()?.to_owned()))
        .filter(|m| m != "mod" && m != "size")
        .collect();
    let mut wrong = Vec::new();
    for user in ["view", "fs"] {
        let mut texts = Vec::new();
        sources(&src.join(user), &mut texts);
        for text in &texts {
            for (at, _) in text.match_indices("crate::quota::") {
                let rest = &text[at + "crate::quota::".len()..];
                let names: Vec<String> = match rest.strip_prefix('{') {
                    Some(group) => group[..group.find('}').unwrap_or(group.len())]
                        .split(',')
                        .map(|part| ident(part.trim_start()))
                        .collect(),
                    None => vec![ident(rest)],
                };
                wrong.extend(
                    names
                        .into_iter()
                        .filter(|n| modules.contains(n))
                        .map(|n| format!("{user} -> quota::{n}")),
                );
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "quota internals named outside the seam: {wrong:?}"
    );
}
