//! CSI names → on-disk names of volumes and BackingImages.
//!
//! CSI names are opaque strings of up to 128 bytes, case-sensitive and possibly upper case
//! (`pvc-<uuid>`, `snapshot-<uuid>`, or anything a user picks for a pre-provisioned content).
//! On disk a name must be a single safe path component. The mapping is deterministic, so every
//! retry of a call lands on the same object:
//! - a name that already is a safe lower-case name of at most [`MAX_PLAIN`] bytes is kept;
//! - any other name becomes its sanitized, lower-cased prefix plus `-` and 16 hex digits of
//!   the SHA-512 of the whole original name (so `A` and `a` map to different objects).
//!
//! Names containing `/`, NUL or `..` are refused outright: they are path tricks, not names.

use super::error::{CsiError, Result};
use super::sha512;

/// Longest name kept as it is.
pub const MAX_PLAIN: usize = 63;
/// Longest name accepted (the CSI limit for strings).
pub const MAX_NAME: usize = 128;
const PREFIX: usize = 40;

/// Maps the CSI `name` of a `what` ("volume", "snapshot", "backing image") to its on-disk name.
pub fn disk_name(what: &str, name: &str) -> Result<String> {
    if name.is_empty() {
        return Err(CsiError::InvalidArgument(format!(
            "{what} name is required"
        )));
    }
    if name.len() > MAX_NAME {
        return Err(CsiError::InvalidArgument(format!(
            "{what} name is {} bytes long; at most {MAX_NAME} are allowed",
            name.len()
        )));
    }
    if name.contains('\0') || name.contains('/') || name.contains("..") {
        return Err(CsiError::InvalidArgument(format!(
            "{what} name {:?} contains '/', '..' or NUL, which are not allowed",
            name.replace('\0', "\\0")
        )));
    }
    if is_plain(name) {
        return Ok(name.to_owned());
    }
    let mut prefix: String = name
        .chars()
        .map(|c| c.to_ascii_lowercase())
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' {
                c
            } else {
                '-'
            }
        })
        .take(PREFIX)
        .collect();
    while prefix.ends_with(['-', '.', '_']) {
        prefix.pop();
    }
    while prefix.starts_with(['-', '.', '_']) {
        prefix.remove(0);
    }
    let digest = sha512::digest(name.as_bytes());
    let hash: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    if prefix.is_empty() {
        Ok(format!("x-{hash}"))
    } else {
        Ok(format!("{prefix}-{hash}"))
    }
}

/// A name that is safe on disk as it is: `[a-z0-9][a-z0-9_.-]*`, at most [`MAX_PLAIN`] bytes,
/// without `..`.
pub fn is_plain(name: &str) -> bool {
    let bytes = name.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= MAX_PLAIN
        && (bytes[0].is_ascii_lowercase() || bytes[0].is_ascii_digit())
        && bytes
            .iter()
            .all(|&b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"_.-".contains(&b))
        && !name.contains("..")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_names_are_kept() {
        assert_eq!(disk_name("volume", "pvc-1234").unwrap(), "pvc-1234");
        assert_eq!(disk_name("volume", "bi-test").unwrap(), "bi-test");
    }

    #[test]
    fn other_names_are_mapped_deterministically() {
        let long = "A".repeat(128);
        let a = disk_name("snapshot", &long).unwrap();
        assert_eq!(a, disk_name("snapshot", &long).unwrap());
        assert!(is_plain(&a), "{a}");
        assert_ne!(
            disk_name("s", "Abc").unwrap(),
            disk_name("s", "aBc").unwrap()
        );
        assert!(is_plain(&disk_name("s", "___").unwrap()));
    }

    #[test]
    fn path_tricks_are_refused() {
        for bad in ["", "../x", "a/b", "a\0b", "..", &"a".repeat(129)] {
            assert!(disk_name("volume", bad).is_err(), "{bad:?}");
        }
    }
}
