//! How `status` writes times and durations: UTC dates without a time zone database, ages
//! ("12s ago"), milliseconds and seconds.

use std::time::{Duration, SystemTime};

/// Seconds since the epoch.
pub(super) fn secs(t: SystemTime) -> f64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

pub(super) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

pub(super) fn millis(ms: f64) -> String {
    if ms < 1000.0 {
        format!("{ms:.1} ms")
    } else {
        format!("{:.2} s", ms / 1000.0)
    }
}

pub(super) fn seconds(s: f64) -> String {
    if s.fract() == 0.0 {
        format!("{s:.0}s")
    } else {
        format!("{s}s")
    }
}

/// `2024-05-01 12:00:03 UTC (12s ago)`.
pub(super) fn when(t: f64, now: f64) -> String {
    format!("{} ({})", utc(t), ago(now - t))
}

pub(super) fn ago(secs: f64) -> String {
    if !secs.is_finite() || secs < 0.0 {
        return "just now".to_owned();
    }
    let s = secs as u64;
    match s {
        0 => "just now".to_owned(),
        1..=119 => format!("{s}s ago"),
        120..=7199 => format!("{}m ago", s / 60),
        7200..=172_799 => format!("{}h ago", s / 3600),
        _ => format!("{}d ago", s / 86400),
    }
}

/// Seconds since the epoch as a UTC date and time (no time zone database needed).
pub(super) fn utc(t: f64) -> String {
    if !(0.0..=1e12).contains(&t) {
        return "?".to_owned();
    }
    let secs = t as i64;
    let (days, rem) = (secs.div_euclid(86400), secs.rem_euclid(86400));
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian (Howard Hinnant's
/// `civil_from_days`).
pub(super) fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_read_well() {
        assert_eq!(utc(0.0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc(951_782_400.0), "2000-02-29 00:00:00 UTC");
        assert_eq!(utc(f64::NAN), "?");
        assert_eq!(ago(0.4), "just now");
        assert_eq!(ago(-5.0), "just now");
        assert_eq!(ago(90.0), "90s ago");
        assert_eq!(ago(7200.0), "2h ago");
        assert_eq!(ago(3.0 * 86400.0), "3d ago");
        assert_eq!(millis(0.25), "0.2 ms");
        assert_eq!(millis(1500.0), "1.50 s");
        assert_eq!(seconds(2.5), "2.5s");
    }
}
