//! List filters, in containerd's filter syntax: `field==value`, `field!=value` or a bare
//! `field` (present), joined by `,` (all must hold); a request's several filters are
//! alternatives. Fields are `name`, `parent`, `kind` and `labels.<key>`, where a key with
//! odd characters is quoted (`labels."containerd.io/snapshot.ref"`). containerd checks
//! what a proxy lists again, so a filter is a saving, not a guarantee; regular expressions
//! (`~=`) are refused rather than ignored.

use crate::error::Error;
use crate::meta::{Kind, Record};

#[derive(Debug, Clone, PartialEq, Eq)]
enum Op {
    Present,
    Equal(String),
    NotEqual(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Term {
    field: Vec<String>,
    op: Op,
}

/// One filter: terms that must all hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Filter(Vec<Term>);

impl Filter {
    pub fn parse(text: &str) -> Result<Filter, Error> {
        let bad = |why: &str| Error::InvalidArgument(format!("filter {text:?}: {why}"));
        let mut terms = Vec::new();
        let mut rest = text.trim_start();
        while !rest.is_empty() {
            let mut field = Vec::new();
            loop {
                let (part, after) = word(rest).ok_or_else(|| bad("expected a field name"))?;
                field.push(part);
                rest = after.trim_start();
                match rest.strip_prefix('.') {
                    Some(after) => rest = after,
                    None => break,
                }
            }
            let op = if let Some(after) = rest.strip_prefix("==") {
                let (value, after) = value(after.trim_start()).ok_or_else(|| bad("bad value"))?;
                rest = after;
                Op::Equal(value)
            } else if let Some(after) = rest.strip_prefix("!=") {
                let (value, after) = value(after.trim_start()).ok_or_else(|| bad("bad value"))?;
                rest = after;
                Op::NotEqual(value)
            } else if rest.starts_with("~=") {
                return Err(bad("regular expressions are not supported"));
            } else {
                Op::Present
            };
            terms.push(Term { field, op });
            rest = rest.trim_start();
            match rest.strip_prefix(',') {
                Some(after) => rest = after.trim_start(),
                None if rest.is_empty() => {}
                None => return Err(bad("expected `,` between terms")),
            }
        }
        Ok(Filter(terms))
    }

    pub fn matches(&self, name: &str, record: &Record) -> bool {
        self.0.iter().all(|term| {
            let value = field(&term.field, name, record);
            match &term.op {
                Op::Present => value.is_some(),
                Op::Equal(want) => value.as_deref() == Some(want.as_str()),
                Op::NotEqual(want) => value.as_deref() != Some(want.as_str()),
            }
        })
    }
}

/// Whether `record` passes any of `filters` (all, when there are none).
pub fn any(filters: &[Filter], name: &str, record: &Record) -> bool {
    filters.is_empty() || filters.iter().any(|f| f.matches(name, record))
}

fn field(path: &[String], name: &str, record: &Record) -> Option<String> {
    match path {
        [f] if f == "name" => Some(name.to_owned()),
        // containerd's own adaptor: always present, empty for a snapshot without one.
        [f] if f == "parent" => Some(record.parent.clone().unwrap_or_default()),
        [f] if f == "kind" => Some(kind_name(record.kind).to_owned()),
        [f, key @ ..] if f == "labels" && !key.is_empty() => {
            record.labels.get(&key.join(".")).cloned()
        }
        _ => None,
    }
}

pub fn kind_name(kind: Kind) -> &'static str {
    match kind {
        Kind::View => "view",
        Kind::Active => "active",
        Kind::Committed => "committed",
    }
}

/// A field name part: a quoted string, or a run of characters that are not syntax.
fn word(s: &str) -> Option<(String, &str)> {
    if s.starts_with('"') {
        return quoted(s);
    }
    let end = s
        .find(|c: char| matches!(c, '.' | ',' | '=' | '!' | '~' | '"') || c.is_whitespace())
        .unwrap_or(s.len());
    (end > 0).then(|| (s[..end].to_owned(), &s[end..]))
}

/// A value: a quoted string, or everything up to the next `,`.
fn value(s: &str) -> Option<(String, &str)> {
    if s.starts_with('"') {
        return quoted(s);
    }
    let end = s.find(',').unwrap_or(s.len());
    let v = s[..end].trim_end();
    (!v.is_empty()).then(|| (v.to_owned(), &s[end..]))
}

fn quoted(s: &str) -> Option<(String, &str)> {
    let mut out = String::new();
    let mut chars = s.char_indices().skip(1);
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return Some((out, &s[i + 1..])),
            '\\' => out.push(chars.next()?.1),
            c => out.push(c),
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::Backing;
    use std::collections::BTreeMap;

    fn record(parent: &str, labels: &[(&str, &str)]) -> Record {
        Record {
            id: 1,
            place: Default::default(),
            kind: Kind::Committed,
            parent: (!parent.is_empty()).then(|| parent.to_owned()),
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>(),
            created: 0,
            updated: 0,
            backing: Backing::Local,
            chain: None,
            quota: None,
            usage: None,
        }
    }

    #[test]
    fn the_remote_snapshot_filter_containerd_sends() {
        let text =
            r#"labels."containerd.io/snapshot.ref"==sha256:abc,parent=="default/2/sha256:p""#;
        let f = Filter::parse(text).unwrap();
        let good = record(
            "default/2/sha256:p",
            &[("containerd.io/snapshot.ref", "sha256:abc")],
        );
        assert!(f.matches("n", &good));
        assert!(!f.matches("n", &record("default/2/sha256:p", &[])));
        assert!(!f.matches(
            "n",
            &record("other", &[("containerd.io/snapshot.ref", "sha256:abc")])
        ));
        // What containerd sends for a base layer: an empty parent.
        let base = Filter::parse(r#"labels."containerd.io/snapshot.ref"==x,parent=="""#).unwrap();
        assert!(base.matches("n", &record("", &[("containerd.io/snapshot.ref", "x")])));
        assert!(!base.matches("n", &record("p", &[("containerd.io/snapshot.ref", "x")])));
    }

    #[test]
    fn other_forms() {
        let r = record("p", &[("containerd.io/gc.root", "1"), ("a", "b")]);
        assert!(Filter::parse("kind==committed").unwrap().matches("n", &r));
        assert!(Filter::parse("name!=m").unwrap().matches("n", &r));
        assert!(Filter::parse("labels.containerd.io/gc.root")
            .unwrap()
            .matches("n", &r));
        assert!(Filter::parse("labels.a==b, name==n")
            .unwrap()
            .matches("n", &r));
        assert!(!Filter::parse("labels.missing").unwrap().matches("n", &r));
        assert!(!Filter::parse("unknown==x").unwrap().matches("n", &r));
        let alternatives = [
            Filter::parse("name==x").unwrap(),
            Filter::parse("name==n").unwrap(),
        ];
        assert!(any(&alternatives, "n", &r));
        assert!(any(&[], "n", &r));
    }

    #[test]
    fn malformed_filters_are_refused() {
        for bad in ["name~=a.*", "==x", "name==", "labels.\"open", "name==a,,"] {
            assert!(
                matches!(Filter::parse(bad), Err(Error::InvalidArgument(_))),
                "{bad}"
            );
        }
    }
}
