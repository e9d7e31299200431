//! Size strings: what `layerfs quota set`, the `user.layerfs.quota` xattr and
//! `storage { size }` accept, and containerd's `max-size` label.
//!
//! A size is plain bytes (`1048576`) or a whole number with a unit `K`, `M`, `G`, `T` or `P`
//! (either case), optionally followed by `i`, `iB` or `B`. Every unit is binary: `10G`,
//! `10Gi`, `10GiB` and `10GB` are all 10 × 2³⁰ bytes. `GB` is read as 1024-based on purpose:
//! a quota is a limit on blocks, and a user writing `10GB` never wants 7 % less room than
//! `10G` gives. A bare `B` after the number is bytes (`100B`).
//!
//! The empty string is not an error but "no quota", which is why the result is an
//! `Option`: `""` (unset) and `"0"` (nothing may be allocated) mean different things.

/// containerd's snapshot label for a layer's size limit, in bytes as a decimal string.
pub const MAX_SIZE_LABEL: &str = "containerd.io/snapshot/max-size";

/// Binary units, in order; `E` only appears in output, as no input in it fits a u64 usefully.
const UNITS: [char; 6] = ['K', 'M', 'G', 'T', 'P', 'E'];
/// The units an input may use.
const INPUT_UNITS: usize = 5;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SizeError {
    #[error(
        "invalid size {input:?}: expected bytes or a number with K, M, G, T or P \
         (1024-based, optional i/iB)"
    )]
    Invalid { input: String },
    #[error("invalid size {input:?}: larger than {} bytes", u64::MAX)]
    Overflow { input: String },
    #[error("invalid label {label}={value:?}: expected bytes as a decimal number")]
    Label { label: String, value: String },
}

/// Parses a size string. `Ok(None)` for `""` (or only whitespace): no quota.
pub fn parse_size(s: &str) -> Result<Option<u64>, SizeError> {
    let trimmed = s.trim();
    if trimmed.is_empty() {
        return Ok(None);
    }
    let invalid = || SizeError::Invalid {
        input: s.to_owned(),
    };
    let overflow = || SizeError::Overflow {
        input: s.to_owned(),
    };
    let digits_end = trimmed
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(trimmed.len());
    let (digits, suffix) = trimmed.split_at(digits_end);
    if digits.is_empty() {
        return Err(invalid());
    }
    let multiplier = multiplier(suffix).ok_or_else(invalid)?;
    // Only ASCII digits are left, so the one way parsing can fail is overflow.
    let number: u64 = digits.parse().map_err(|_| overflow())?;
    number
        .checked_mul(multiplier)
        .map(Some)
        .ok_or_else(overflow)
}

/// The factor a suffix stands for, or `None` if it is not one we accept.
fn multiplier(suffix: &str) -> Option<u64> {
    if suffix.is_empty() || suffix == "B" {
        return Some(1);
    }
    let mut chars = suffix.chars();
    let unit = chars.next()?.to_ascii_uppercase();
    let power = UNITS[..INPUT_UNITS].iter().position(|&u| u == unit)?;
    match chars.as_str() {
        "" | "i" | "iB" | "B" => Some(1u64 << (10 * (power + 1))),
        _ => None,
    }
}

/// The limit containerd's [`MAX_SIZE_LABEL`] gives, if the label is among `labels`.
/// Unlike [`parse_size`], the value must be plain decimal bytes: that is containerd's
/// convention, and a unit there means whoever set the label meant something else.
pub fn from_labels<'a>(
    labels: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> Result<Option<u64>, SizeError> {
    let Some((_, value)) = labels.into_iter().find(|(k, _)| *k == MAX_SIZE_LABEL) else {
        return Ok(None);
    };
    let bad = || SizeError::Label {
        label: MAX_SIZE_LABEL.to_owned(),
        value: value.to_owned(),
    };
    let trimmed = value.trim();
    if trimmed.is_empty() || !trimmed.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    trimmed.parse().map(Some).map_err(|_| bad())
}

/// A compact, `df -h`-style rendering for tables: `0`, `100B`, `4.0K`, `8.0M`, `10G`.
/// One decimal below 10 of a unit, none above; rounded up, as `df -h` does, so a limit
/// shown never looks larger than the room that is left under it rounds to.
pub fn human(bytes: u64) -> String {
    if bytes == 0 {
        return "0".to_owned();
    }
    if bytes < 1024 {
        return format!("{bytes}B");
    }
    let bytes = u128::from(bytes);
    let mut power = 1;
    while power < UNITS.len() && bytes >= 1u128 << (10 * (power + 1)) {
        power += 1;
    }
    let mut scale = 1u128 << (10 * power);
    loop {
        let unit = UNITS[power - 1];
        let tenths = bytes.saturating_mul(10).div_ceil(scale);
        if tenths < 100 {
            return format!("{}.{}{unit}", tenths / 10, tenths % 10);
        }
        let whole = bytes.div_ceil(scale);
        // Rounding up can reach the next unit (1023.5K is 1.0M, not 1024K).
        if whole < 1024 || power == UNITS.len() {
            return format!("{whole}{unit}");
        }
        power += 1;
        scale <<= 10;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const K: u64 = 1 << 10;
    const M: u64 = 1 << 20;
    const G: u64 = 1 << 30;
    const T: u64 = 1 << 40;
    const P: u64 = 1 << 50;

    #[test]
    fn empty_is_no_quota_and_zero_is_a_limit() {
        assert_eq!(parse_size(""), Ok(None));
        assert_eq!(parse_size("   "), Ok(None));
        assert_eq!(parse_size("0"), Ok(Some(0)));
        assert_eq!(parse_size("0G"), Ok(Some(0)));
    }

    #[test]
    fn plain_bytes() {
        assert_eq!(parse_size("1048576"), Ok(Some(M)));
        assert_eq!(parse_size("100B"), Ok(Some(100)));
        assert_eq!(parse_size("007"), Ok(Some(7)));
        assert_eq!(parse_size(" 42\n"), Ok(Some(42)));
        assert_eq!(parse_size(&u64::MAX.to_string()), Ok(Some(u64::MAX)));
    }

    #[test]
    fn every_unit_and_suffix_is_binary() {
        for (unit, factor) in [('K', K), ('M', M), ('G', G), ('T', T), ('P', P)] {
            for letter in [unit, unit.to_ascii_lowercase()] {
                for tail in ["", "i", "iB", "B"] {
                    let input = format!("3{letter}{tail}");
                    assert_eq!(parse_size(&input), Ok(Some(3 * factor)), "{input}");
                }
            }
        }
        assert_eq!(parse_size("10G"), Ok(Some(10 * G)));
        assert_eq!(parse_size("10Gi"), Ok(Some(10 * G)));
        assert_eq!(parse_size("10GiB"), Ok(Some(10 * G)));
        assert_eq!(parse_size("10GB"), Ok(Some(10 * G)));
        assert_eq!(parse_size("512M"), Ok(Some(512 * M)));
        assert_eq!(parse_size("\t512Mi "), Ok(Some(512 * M)));
    }

    #[test]
    fn malformed_sizes_are_refused_with_what_is_accepted() {
        for input in [
            "-1", "-1G", "+1G", "1.5G", "1,5G", ".5G", "10X", "10E", "G", "Gi", "B", "10 G", "1 0",
            "10GiB!", "10Gib", "10gb", "10Bi", "10iB", "10i", "10GG", "ten", "0x10", "1e9", "１０",
            "10G\u{0}",
        ] {
            let err = parse_size(input).unwrap_err();
            assert_eq!(
                err,
                SizeError::Invalid {
                    input: input.to_owned()
                },
                "{input}"
            );
        }
        assert_eq!(
            parse_size("10X").unwrap_err().to_string(),
            "invalid size \"10X\": expected bytes or a number with K, M, G, T or P \
             (1024-based, optional i/iB)"
        );
    }

    #[test]
    fn overflow_has_its_own_message() {
        for input in [
            "18446744073709551616",
            "99999999999999999999999",
            "16384P",
            "17179869184G",
        ] {
            assert_eq!(
                parse_size(input),
                Err(SizeError::Overflow {
                    input: input.to_owned()
                }),
                "{input}"
            );
        }
        assert_eq!(parse_size("16383P"), Ok(Some(16383 * P)));
        assert_eq!(
            parse_size("16384P").unwrap_err().to_string(),
            "invalid size \"16384P\": larger than 18446744073709551615 bytes"
        );
    }

    #[test]
    fn the_max_size_label_is_decimal_bytes() {
        let none: [(&str, &str); 0] = [];
        assert_eq!(from_labels(none), Ok(None));
        assert_eq!(from_labels([("other", "5")]), Ok(None));
        assert_eq!(
            from_labels([("other", "x"), (MAX_SIZE_LABEL, "1073741824")]),
            Ok(Some(G))
        );
        assert_eq!(from_labels([(MAX_SIZE_LABEL, "0")]), Ok(Some(0)));
        assert_eq!(from_labels([(MAX_SIZE_LABEL, " 10 ")]), Ok(Some(10)));
        for value in ["", "10G", "-1", "1.5", "18446744073709551616", "+3"] {
            assert_eq!(
                from_labels([(MAX_SIZE_LABEL, value)]),
                Err(SizeError::Label {
                    label: MAX_SIZE_LABEL.to_owned(),
                    value: value.to_owned()
                }),
                "{value:?}"
            );
        }
        assert_eq!(
            from_labels([(MAX_SIZE_LABEL, "10G")])
                .unwrap_err()
                .to_string(),
            "invalid label containerd.io/snapshot/max-size=\"10G\": \
             expected bytes as a decimal number"
        );
    }

    #[test]
    fn human_is_compact_and_rounds_up() {
        assert_eq!(human(0), "0");
        assert_eq!(human(1), "1B");
        assert_eq!(human(100), "100B");
        assert_eq!(human(1023), "1023B");
        assert_eq!(human(K), "1.0K");
        assert_eq!(human(4 * K), "4.0K");
        assert_eq!(human(4 * K + 1), "4.1K");
        assert_eq!(human(8 * M), "8.0M");
        assert_eq!(human(10 * G), "10G");
        assert_eq!(human(10 * G - 1), "10G");
        assert_eq!(human(15 * G + G / 2), "16G");
        assert_eq!(human(1023 * K), "1023K");
        assert_eq!(human(1023 * K + 1), "1.0M");
        assert_eq!(human(3 * T), "3.0T");
        assert_eq!(human(5 * P), "5.0P");
        assert_eq!(human(u64::MAX), "16E");
    }
}
