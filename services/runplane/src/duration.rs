//! Durations on the command line (`--max-duration 1h30m`, `--grace 5s`) and in tables
//! (a run's age).

use std::time::Duration;

/// Parses `90s`, `10m`, `2h`, `1h30m`, `500ms`: one or more `<digits><unit>` with units
/// `h`, `m`, `s`, `ms`, largest first. Zero and anything else are refused, so a typo
/// never becomes "no limit". Used as a clap value parser: the error is a usage error.
pub fn parse_positive(text: &str) -> Result<Duration, String> {
    const EXPECTED: &str = "expected a duration like 90s, 10m, 2h or 1h30m";
    let mut rest = text.trim();
    if rest.is_empty() {
        return Err(EXPECTED.into());
    }
    let mut total = Duration::ZERO;
    let mut last_unit = u8::MAX;
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return Err(EXPECTED.into());
        }
        let value: u64 = rest[..digits].parse().map_err(|_| EXPECTED.to_owned())?;
        rest = &rest[digits..];
        let (unit, rank, len) = if rest.starts_with("ms") {
            (Duration::from_millis(1), 0, 2)
        } else if rest.starts_with('s') {
            (Duration::from_secs(1), 1, 1)
        } else if rest.starts_with('m') {
            (Duration::from_secs(60), 2, 1)
        } else if rest.starts_with('h') {
            (Duration::from_secs(3600), 3, 1)
        } else {
            return Err(EXPECTED.into());
        };
        if rank >= last_unit {
            return Err(format!("{EXPECTED} (units largest first, each once)"));
        }
        last_unit = rank;
        rest = &rest[len..];
        let part = u32::try_from(value)
            .ok()
            .and_then(|v| unit.checked_mul(v))
            .ok_or_else(|| "the duration is too long".to_owned())?;
        total = total
            .checked_add(part)
            .ok_or_else(|| "the duration is too long".to_owned())?;
    }
    if total.is_zero() {
        return Err("the duration must be positive".into());
    }
    Ok(total)
}

/// The protobuf form of `d`.
pub fn to_proto(d: Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nanos: d.subsec_nanos() as i32,
    }
}

/// A short age for a table: `42s`, `5m`, `3h12m`, `4d`.
pub fn short(d: chrono::TimeDelta) -> String {
    let s = d.num_seconds().max(0);
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m", s / 60),
        3600..86400 if s % 3600 >= 60 => format!("{}h{}m", s / 3600, s % 3600 / 60),
        3600..86400 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86400),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_the_usual_forms() {
        let secs = |s| Duration::from_secs(s);
        assert_eq!(parse_positive("90s"), Ok(secs(90)));
        assert_eq!(parse_positive("10m"), Ok(secs(600)));
        assert_eq!(parse_positive("2h"), Ok(secs(7200)));
        assert_eq!(parse_positive("1h30m"), Ok(secs(5400)));
        assert_eq!(parse_positive("1h0m5s"), Ok(secs(3605)));
        assert_eq!(parse_positive("1500ms"), Ok(Duration::from_millis(1500)));
    }

    #[test]
    fn refuses_zero_and_garbage() {
        for text in [
            "",
            "0",
            "0s",
            "0h0m",
            "90",
            "s",
            "1x",
            "1.5h",
            "-5s",
            "1m1h",
            "1s1s",
            "10 m",
            "1h30",
            "99999999999h",
        ] {
            assert!(parse_positive(text).is_err(), "{text:?} was accepted");
        }
    }

    #[test]
    fn ages_are_short() {
        let secs = chrono::TimeDelta::seconds;
        assert_eq!(short(secs(-3)), "0s");
        assert_eq!(short(secs(42)), "42s");
        assert_eq!(short(secs(300)), "5m");
        assert_eq!(short(secs(3 * 3600 + 12 * 60)), "3h12m");
        assert_eq!(short(secs(7200)), "2h");
        assert_eq!(short(secs(4 * 86400 + 5)), "4d");
    }
}
