//! Every "DESIGN §N" the repository cites leads somewhere: to a section of `docs/design.md`,
//! whose headings are numbered `## N.` and `### N.M`. A citation of a section that does not
//! exist, or of notes that are not in the repository, fails here.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

const REPO: &str = env!("CARGO_MANIFEST_DIR");

/// Where citations may be: the workspace's own sources, scripts and documents.
const EXTENSIONS: &[&str] = &["rs", "md", "sh", "py", "toml", "yaml", "yml", "service"];

/// Not the project's own text: build output, version control, vendored crates.
const SKIPPED_DIRS: &[&str] = &["target", ".git", "vendor"];

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if entry.file_type().unwrap().is_dir() {
            if !SKIPPED_DIRS.contains(&name.as_str()) {
                files(&path, out);
            }
        } else if path
            .extension()
            .is_some_and(|e| EXTENSIONS.contains(&e.to_string_lossy().as_ref()))
        {
            out.push(path);
        }
    }
}

/// The section numbers `docs/design.md` has: `2` for `## 2. …`, `4.3` for `### 4.3 …`.
fn sections() -> BTreeSet<String> {
    let text = fs::read_to_string(Path::new(REPO).join("docs/design.md")).unwrap();
    text.lines()
        .filter_map(|line| {
            let rest = line
                .strip_prefix("### ")
                .or_else(|| line.strip_prefix("## "))?;
            let number: String = rest
                .chars()
                .take_while(|c| c.is_ascii_digit() || *c == '.')
                .collect();
            let number = number.trim_end_matches('.');
            (!number.is_empty()).then(|| number.to_owned())
        })
        .collect()
}

/// The section numbers `text` cites as `DESIGN §N` or `DESIGN §N.M`.
fn citations(text: &str) -> Vec<String> {
    text.match_indices("DESIGN §")
        .map(|(at, cited)| {
            let number: String = text[at + cited.len()..]
                .chars()
                .take_while(|c| c.is_ascii_digit() || *c == '.')
                .collect();
            number.trim_end_matches('.').to_owned()
        })
        // "DESIGN §N" spelled out, as a pattern, cites nothing.
        .filter(|number| !number.is_empty())
        .collect()
}

#[test]
fn every_design_citation_names_a_section_of_docs_design_md() {
    let sections = sections();
    for wanted in ["1", "3", "4.1", "4.2", "4.3", "12", "14"] {
        assert!(
            sections.contains(wanted),
            "no section {wanted}: {sections:?}"
        );
    }
    let mut all = Vec::new();
    files(Path::new(REPO), &mut all);
    let mut cited = 0;
    let mut broken = Vec::new();
    for path in &all {
        let Ok(text) = fs::read_to_string(path) else {
            continue;
        };
        let rel = path.strip_prefix(REPO).unwrap().display().to_string();
        for number in citations(&text) {
            cited += 1;
            if !sections.contains(&number) {
                broken.push(format!("{rel}: DESIGN §{number}"));
            }
        }
        // Notes kept outside the repository lead nowhere for whoever clones it.
        for outside in [
            "ISULAD-FORMAT",
            "CONFORMANCE.md",
            "CSI-FACTS",
            "CONTAINERD-FACTS",
        ] {
            if text.contains(outside) && !rel.ends_with("design_refs.rs") {
                broken.push(format!(
                    "{rel}: cites {outside}, which is not in the repository"
                ));
            }
        }
    }
    assert!(
        cited > 40,
        "only {cited} citations found: is the walk right?"
    );
    assert!(
        broken.is_empty(),
        "citations that lead nowhere:\n{}",
        broken.join("\n")
    );
}

#[test]
fn citations_are_read_with_their_subsection() {
    assert_eq!(
        citations("see DESIGN §4.3. And DESIGN §10, DESIGN §12; cite as DESIGN §N."),
        ["4.3", "10", "12"]
    );
}
