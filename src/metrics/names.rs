//! Bounded label values: errno names and not-ready reason classes.
//!
//! A label value that comes from free text (a reason names files and ids) or from an
//! open-ended number would give Prometheus a new series for every distinct value. Both are
//! mapped onto fixed lists of `&'static str` here, which also keeps the request path free of
//! allocation.

/// The errnos a filesystem answers with, by name. Anything else is `other`.
const ERRNOS: &[(i32, &str)] = &[
    (libc::EPERM, "EPERM"),
    (libc::ENOENT, "ENOENT"),
    (libc::ESRCH, "ESRCH"),
    (libc::EINTR, "EINTR"),
    (libc::EIO, "EIO"),
    (libc::ENXIO, "ENXIO"),
    (libc::E2BIG, "E2BIG"),
    (libc::EBADF, "EBADF"),
    (libc::EAGAIN, "EAGAIN"),
    (libc::ENOMEM, "ENOMEM"),
    (libc::EACCES, "EACCES"),
    (libc::EFAULT, "EFAULT"),
    (libc::EBUSY, "EBUSY"),
    (libc::EEXIST, "EEXIST"),
    (libc::EXDEV, "EXDEV"),
    (libc::ENODEV, "ENODEV"),
    (libc::ENOTDIR, "ENOTDIR"),
    (libc::EISDIR, "EISDIR"),
    (libc::EINVAL, "EINVAL"),
    (libc::ENFILE, "ENFILE"),
    (libc::EMFILE, "EMFILE"),
    (libc::ENOTTY, "ENOTTY"),
    (libc::ETXTBSY, "ETXTBSY"),
    (libc::EFBIG, "EFBIG"),
    (libc::ENOSPC, "ENOSPC"),
    (libc::ESPIPE, "ESPIPE"),
    (libc::EROFS, "EROFS"),
    (libc::EMLINK, "EMLINK"),
    (libc::EPIPE, "EPIPE"),
    (libc::ERANGE, "ERANGE"),
    (libc::EDEADLK, "EDEADLK"),
    (libc::ENAMETOOLONG, "ENAMETOOLONG"),
    (libc::ENOLCK, "ENOLCK"),
    (libc::ENOSYS, "ENOSYS"),
    (libc::ENOTEMPTY, "ENOTEMPTY"),
    (libc::ELOOP, "ELOOP"),
    (libc::ENODATA, "ENODATA"),
    (libc::EOVERFLOW, "EOVERFLOW"),
    (libc::EILSEQ, "EILSEQ"),
    (libc::EOPNOTSUPP, "EOPNOTSUPP"),
    (libc::ENOTCONN, "ENOTCONN"),
    (libc::ETIMEDOUT, "ETIMEDOUT"),
    (libc::ESTALE, "ESTALE"),
    (libc::EDQUOT, "EDQUOT"),
    (libc::ECANCELED, "ECANCELED"),
];

/// The name of `errno` (`ENOENT`), or `other`. Callers pass positive errnos; a negative
/// one (as some replies carry them) is read as its absolute value.
pub fn errno_name(errno: i32) -> &'static str {
    let errno = errno.checked_abs().unwrap_or(0);
    ERRNOS
        .iter()
        .find(|(n, _)| *n == errno)
        .map_or("other", |(_, name)| name)
}

/// Every class [`reason_class`] answers, in the order the exposition lists them.
pub const REASON_CLASSES: &[&str] = &[
    "incomplete",
    "layer_json",
    "tar_split",
    "link",
    "diff",
    "lower",
    "images_json",
    "manifest",
    "config",
    "parent",
    "parent_chain",
    "top_layer",
    "missing",
    "unreadable",
    "other",
];

/// Reasons start with what failed, as the readiness rules write them: the file
/// (`layer.json: …`, `lower: …`), the object a dependent waits for (`parent <id>: not ready
/// (…)`, `top layer <id>: …`), a missing half (`<area>/<id>: missing`), or a directory that
/// could not be opened (`<area>/<id>: …`, `overlay dir: …`). Most specific first.
const PREFIXES: &[(&str, &str)] = &[
    ("layer.json: incomplete", "incomplete"),
    ("layer.json:", "layer_json"),
    ("tar-split.gz:", "tar_split"),
    ("link:", "link"),
    ("diff:", "diff"),
    ("lower:", "lower"),
    ("images.json:", "images_json"),
    ("manifest:", "manifest"),
    ("config ", "config"),
    ("parent chain ", "parent_chain"),
    ("parent ", "parent"),
    ("top layer ", "top_layer"),
    ("overlay dir:", "unreadable"),
    ("layer dir:", "unreadable"),
    ("image dir:", "unreadable"),
    ("cannot list:", "unreadable"),
];

/// The class of a not-ready reason: one of [`REASON_CLASSES`]. A reason joining two
/// problems (`a; b`, one per directory of a layer) is classed by its first.
pub fn reason_class(reason: &str) -> &'static str {
    let first = reason.split("; ").next().unwrap_or(reason);
    if let Some((_, class)) = PREFIXES.iter().find(|(p, _)| first.starts_with(p)) {
        return class;
    }
    if first == "missing" || first.ends_with(": missing") {
        return "missing";
    }
    // `<area>/<id>: <error>`: the object's directory itself would not open.
    match first.split_once(": ") {
        Some((path, _)) if path.contains('/') => "unreadable",
        _ => "other",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errnos_by_name() {
        assert_eq!(errno_name(libc::ENOENT), "ENOENT");
        assert_eq!(errno_name(-libc::ENOSPC), "ENOSPC");
        assert_eq!(errno_name(libc::EDQUOT), "EDQUOT");
        assert_eq!(errno_name(4000), "other");
        assert_eq!(errno_name(i32::MIN), "other");
    }

    #[test]
    fn reasons_fall_into_few_classes() {
        let id = "a".repeat(64);
        for (reason, class) in [
            (
                "layer.json: incomplete flag set (pull or import unfinished)".to_owned(),
                "incomplete",
            ),
            ("layer.json: malformed JSON (EOF)".into(), "layer_json"),
            ("tar-split.gz: truncated gzip stream".into(), "tar_split"),
            ("link: not a short id".into(), "link"),
            ("diff: not a directory".into(), "diff"),
            ("lower: entry 2 is l/X".into(), "lower"),
            ("images.json: id does not match".into(), "images_json"),
            ("manifest: malformed JSON".into(), "manifest"),
            (format!("config ={id}: missing"), "config"),
            (format!("parent {id}: not ready (missing)"), "parent"),
            (format!("parent chain loops back to {id}"), "parent_chain"),
            (
                format!("top layer {id}: not ready (diff: missing)"),
                "top_layer",
            ),
            ("missing".into(), "missing"),
            (format!("overlay/RO/{id}: missing"), "missing"),
            (
                format!("overlay/RO/{id}: missing; layer.json: malformed JSON"),
                "missing",
            ),
            (format!("overlay-layers/RO/{id}: symlink"), "unreadable"),
            ("cannot list: permission denied".into(), "unreadable"),
            ("something new".into(), "other"),
        ] {
            assert_eq!(reason_class(&reason), class, "{reason}");
            assert!(REASON_CLASSES.contains(&class));
        }
    }
}
