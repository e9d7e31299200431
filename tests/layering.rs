//! The layering `src/lib.rs` states holds: no top-level module names one of a later layer
//! (`crate::<module>` anywhere in its files, docs included), so no two modules depend on
//! each other. Inside every folder of product code, of this crate and of the other crates
//! of the workspace, the files import each other without circles too.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;

/// The layers, as `src/lib.rs` lists them.
const LAYERS: &[&[&str]] = &[
    &["store", "layout"],
    &["report", "quota", "journal", "publish"],
    &["view"],
    &["notice"],
    &["fs", "refresh", "metrics"],
    &[
        "config",
        "mount",
        "keeper",
        "expose",
        "launch",
        "daemon",
        "inherited",
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
        names.extend(names_after(&text[at + "crate::".len()..]));
    }
    names
}

/// The names a path continues with: `x` in `x::…`, or each of `{x, y::z}`.
fn names_after(rest: &str) -> Vec<String> {
    match rest.strip_prefix('{') {
        Some(group) => group[..group.find('}').unwrap_or(group.len())]
            .split(',')
            .map(|part| ident(part.trim_start()))
            .collect(),
        None => vec![ident(rest)],
    }
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
                let names = names_after(&text[at + "crate::quota::".len()..]);
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

/// The modules of one folder: `name` (a file `name.rs`, or a folder `name/` with its files)
/// and the product text of each, tests left out: the module's own file (where `super::`
/// means this folder), and all its files.
fn folder_modules(dir: &Path) -> BTreeMap<String, (String, String)> {
    let mut modules = BTreeMap::new();
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let Some(stem) = path.file_stem().and_then(|s| s.to_str()) else {
            continue;
        };
        let module = stem.to_owned();
        // The folder's own module file declares and re-exports its children; tests may
        // reach into anything.
        if ["mod", "lib", "main", "tests"].contains(&stem) {
            continue;
        }
        let is_module = path.is_dir() && path.join("mod.rs").exists();
        if !(is_module || path.extension().is_some_and(|e| e == "rs")) {
            continue;
        }
        let mut texts = Vec::new();
        sources(&path, &mut texts);
        let all: String = texts.iter().map(|t| product_text(t)).collect();
        let own = if is_module { path.join("mod.rs") } else { path };
        let own = product_text(&fs::read_to_string(own).unwrap());
        modules.insert(module, (own, all));
    }
    modules
}

/// `text` without its comments and its `#[cfg(test)]` module.
fn product_text(text: &str) -> String {
    let code = match text.find("#[cfg(test)]\nmod tests") {
        Some(at) => &text[..at],
        None => text,
    };
    code.lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The siblings a module names: `super::x` or `x` in `use super::{…}` in its own file
/// (`own`), `<path>::x` or `<path>::{…}` in any of its files (`all`).
fn siblings_named(
    own: &str,
    all: &str,
    path: &str,
    siblings: &BTreeSet<String>,
) -> BTreeSet<String> {
    let mut named = BTreeSet::new();
    for (text, prefix) in [(own, "super::".to_owned()), (all, format!("{path}::"))] {
        for (at, _) in text.match_indices(prefix.as_str()) {
            let before = text[..at].chars().next_back();
            if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            let names = names_after(&text[at + prefix.len()..]);
            named.extend(names.into_iter().filter(|n| siblings.contains(n)));
        }
    }
    named
}

/// The circles among `edges`: each a set of modules that reach one another (Tarjan).
fn circles(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct Walk<'a> {
        edges: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        found: Vec<Vec<String>>,
    }
    impl<'a> Walk<'a> {
        // Recursion as deep as one folder's module count, which this repository decides.
        fn visit(&mut self, v: &'a str) {
            let n = self.index.len();
            self.index.insert(v, n);
            self.low.insert(v, n);
            self.stack.push(v);
            for w in self.edges.get(v).into_iter().flatten() {
                if !self.index.contains_key(w.as_str()) {
                    self.visit(w);
                    let low = self.low[v].min(self.low[w.as_str()]);
                    self.low.insert(v, low);
                } else if self.stack.contains(&w.as_str()) {
                    let low = self.low[v].min(self.index[w.as_str()]);
                    self.low.insert(v, low);
                }
            }
            if self.low[v] == self.index[v] {
                let mut circle = Vec::new();
                while let Some(w) = self.stack.pop() {
                    circle.push(w.to_owned());
                    if w == v {
                        break;
                    }
                }
                if circle.len() > 1 {
                    circle.sort();
                    self.found.push(circle);
                }
            }
        }
    }
    let mut walk = Walk {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        found: Vec::new(),
    };
    for v in edges.keys() {
        if !walk.index.contains_key(v.as_str()) {
            walk.visit(v);
        }
    }
    walk.found
}

/// Every folder of product code below `root`, with the path its items are named by from
/// inside the crate (`crate::view` for `src/view`).
fn folders(root: &Path, path: &str, out: &mut Vec<(std::path::PathBuf, String)>) {
    out.push((root.to_owned(), path.to_owned()));
    for entry in fs::read_dir(root).unwrap() {
        let dir = entry.unwrap().path();
        if dir.is_dir() {
            let name = dir.file_name().unwrap().to_str().unwrap().to_owned();
            folders(&dir, &format!("{path}::{name}"), out);
        }
    }
}

#[test]
fn no_files_of_one_folder_import_each_other_in_a_circle() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut all = Vec::new();
    for krate in [
        "src",
        "csi/src",
        "snapshotter/src",
        "mount-helper/src",
        "benches/uring/src",
    ] {
        folders(&repo.join(krate), "crate", &mut all);
    }
    let mut found = Vec::new();
    for (dir, path) in &all {
        let modules = folder_modules(dir);
        let names: BTreeSet<String> = modules.keys().cloned().collect();
        let edges: BTreeMap<String, BTreeSet<String>> = modules
            .iter()
            .map(|(module, (own, all))| {
                // At the top of a crate, `super::` names nothing of it.
                let own = if path == "crate" { "" } else { own.as_str() };
                let mut named = siblings_named(own, all, path, &names);
                named.remove(module);
                (module.clone(), named)
            })
            .collect();
        for circle in circles(&edges) {
            let rel = dir.strip_prefix(repo).unwrap().display().to_string();
            found.push(format!("{rel}: {}", circle.join(" <-> ")));
        }
    }
    assert!(
        found.is_empty(),
        "files importing each other in a circle:\n{}",
        found.join("\n")
    );
}

#[test]
fn a_circle_is_found() {
    let edges: BTreeMap<String, BTreeSet<String>> = [
        ("a", vec!["b"]),
        ("b", vec!["c"]),
        ("c", vec!["a"]),
        ("d", vec!["a"]),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.into_iter().map(str::to_owned).collect()))
    .collect();
    assert_eq!(circles(&edges), vec![vec!["a", "b", "c"]]);
    let names: BTreeSet<String> = ["io", "ledger"].map(str::to_owned).into();
    let io: BTreeSet<String> = ["io".to_owned()].into();
    assert_eq!(
        siblings_named("", "crate::quota::io::f()", "crate::quota", &names),
        io
    );
    // `super::` in a file deeper down names that file's own folder.
    assert!(siblings_named("", "super::io::f()", "crate::quota", &names).is_empty());
    assert_eq!(
        siblings_named("use super::{io::x, ledger};", "", "crate::quota", &names),
        names
    );
}
