//! The top-functions table (`go tool pprof -top` style): per function, the value where it was
//! the leaf (flat) and the value of samples it appears in at all (cum).

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;

use crate::model::Profile;
use crate::output::{OutputError, check_type, folded::frame_name};

/// One function's totals for one sample type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopRow {
    /// The function's name as folded output and flame graphs show it (kernel ones `_[k]`).
    pub name: String,
    /// Its own value (as the leaf).
    pub flat: i64,
    /// Its value with what it called (anywhere in the stack).
    pub cum: i64,
}

/// Every function of the profile, sorted by flat value (largest first), then by name.
pub fn top_rows(profile: &Profile, type_index: usize) -> Result<Vec<TopRow>, OutputError> {
    check_type(profile, type_index)?;
    let names: Vec<String> = profile.frames.iter().map(frame_name).collect();
    let mut rows: HashMap<&str, (i64, i64)> = HashMap::new();
    let mut seen: HashSet<&str> = HashSet::new();
    for sample in &profile.samples {
        let value = sample.values[type_index];
        if value == 0 {
            continue;
        }
        let stack = profile.stacks.get(sample.stack);
        if let Some(&leaf) = stack.first() {
            rows.entry(&names[leaf as usize]).or_default().0 += value;
        }
        // A recursive function appears several times in one stack but its cum counts the
        // sample once, or cum could exceed the total.
        seen.clear();
        for &frame in stack {
            let name = names[frame as usize].as_str();
            if seen.insert(name) {
                rows.entry(name).or_default().1 += value;
            }
        }
    }
    let mut rows: Vec<TopRow> = rows
        .into_iter()
        .map(|(name, (flat, cum))| TopRow {
            name: name.to_string(),
            flat,
            cum,
        })
        .collect();
    rows.sort_by(|a, b| b.flat.cmp(&a.flat).then_with(|| a.name.cmp(&b.name)));
    Ok(rows)
}

/// Nanoseconds per unit for time units, so every time type prints in human units.
fn ns_per_unit(unit: &str) -> Option<i64> {
    match unit {
        "nanoseconds" | "ns" => Some(1),
        "microseconds" | "us" => Some(1_000),
        "milliseconds" | "ms" => Some(1_000_000),
        "seconds" | "s" => Some(1_000_000_000),
        _ => None,
    }
}

/// `value / scale` with at most two decimals and no trailing zeros ("1.23", "450", "1.5").
fn scaled(value: i64, scale: f64, suffix: &str) -> String {
    let text = format!("{:.2}", value as f64 / scale);
    let text = text.trim_end_matches('0').trim_end_matches('.');
    format!("{text}{suffix}")
}

/// A value of `unit` as people read it: times as "1.23s" / "450ms", bytes as "1.5MB",
/// counts (and unknown units) as plain integers.
pub fn format_value(value: i64, unit: &str) -> String {
    if value == 0 {
        return "0".to_string();
    }
    let magnitude = value.unsigned_abs();
    if let Some(ns) = ns_per_unit(unit) {
        let v = value.saturating_mul(ns);
        let m = magnitude.saturating_mul(ns as u64);
        return match m {
            1_000_000_000.. => scaled(v, 1e9, "s"),
            1_000_000.. => scaled(v, 1e6, "ms"),
            1_000.. => scaled(v, 1e3, "us"),
            _ => format!("{v}ns"),
        };
    }
    if unit == "bytes" {
        const K: u64 = 1024;
        return match magnitude {
            m if m >= K * K * K * K => scaled(value, (K * K * K * K) as f64, "TB"),
            m if m >= K * K * K => scaled(value, (K * K * K) as f64, "GB"),
            m if m >= K * K => scaled(value, (K * K) as f64, "MB"),
            m if m >= K => scaled(value, K as f64, "kB"),
            _ => format!("{value}B"),
        };
    }
    value.to_string()
}

fn percent(value: i64, total: i64) -> String {
    if total == 0 {
        return "0%".to_string();
    }
    let p = value as f64 * 100.0 / total as f64;
    if (p - 100.0).abs() < 0.005 {
        "100%".to_string()
    } else {
        format!("{p:.2}%")
    }
}

/// The table of the `rows` functions with the largest flat value for one sample type.
/// Callers resolve `type_index` with [`Profile::type_index`]; an index out of range yields
/// the error's text instead of a table.
pub fn render(profile: &Profile, type_index: usize, rows: usize) -> String {
    let all = match top_rows(profile, type_index) {
        Ok(all) => all,
        Err(e) => return format!("{e}\n"),
    };
    let t = &profile.sample_types[type_index];
    let total = profile.total(type_index);
    let fmt = |v: i64| format_value(v, &t.unit);
    let mut out = String::new();
    let shown = all.len().min(rows);
    // Writing to a String cannot fail.
    let _ = writeln!(out, "Type: {} ({})", t.name, t.unit);
    let _ = writeln!(
        out,
        "Showing {shown} of {} functions, total {}",
        all.len(),
        fmt(total)
    );
    let _ = writeln!(
        out,
        "{:>10} {:>7} {:>7} {:>10} {:>7}  name",
        "flat", "flat%", "sum%", "cum", "cum%"
    );
    let mut sum = 0;
    for row in &all[..shown] {
        sum += row.flat;
        let _ = writeln!(
            out,
            "{:>10} {:>7} {:>7} {:>10} {:>7}  {}",
            fmt(row.flat),
            percent(row.flat, total),
            percent(sum, total),
            fmt(row.cum),
            percent(row.cum, total),
            row.name
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::fixture;

    fn row<'a>(rows: &'a [TopRow], name: &str) -> &'a TopRow {
        rows.iter().find(|r| r.name == name).unwrap()
    }

    #[test]
    fn flat_cum_and_order() {
        let rows = top_rows(&fixture::profile(), 0).unwrap();
        // Ties on flat (7 and 7) fall back to name order.
        let first: Vec<(&str, i64)> = rows
            .iter()
            .take(3)
            .map(|r| (r.name.as_str(), r.flat))
            .collect();
        assert_eq!(
            first,
            [
                ("<[u8: 8] as Debug>::fmt", 7),
                ("PyLong_FromLong", 7),
                ("fib", 4)
            ]
        );
        // fib is three frames deep in its own stack but counted once per sample.
        assert_eq!(row(&rows, "fib").cum, 4);
        // main of python3 and of libtrain share a name: 10 + 13 samples.
        assert_eq!(row(&rows, "main").cum, 23);
        assert_eq!(row(&rows, "main").flat, 0);
        assert_eq!(row(&rows, "do_syscall_64_[k]").cum, 3);
        assert!(rows.iter().all(|r| r.cum <= 24 && r.flat <= r.cum));
        let flat_sum: i64 = rows.iter().map(|r| r.flat).sum();
        assert_eq!(flat_sum, 24);
    }

    #[test]
    fn table_text() {
        let p = fixture::profile();
        let text = render(&p, 0, 3);
        let expected = "\
Type: samples (count)
Showing 3 of 14 functions, total 24
      flat   flat%    sum%        cum    cum%  name
         7  29.17%  29.17%          7  29.17%  <[u8: 8] as Debug>::fmt
         7  29.17%  58.33%          7  29.17%  PyLong_FromLong
         4  16.67%  75.00%          4  16.67%  fib
";
        assert_eq!(text, expected);
        let cpu = render(&p, 1, 100);
        assert_eq!(
            render(&p, 5, 1),
            "sample type index 5 out of range: the profile has 2 sample types\n"
        );
        assert!(cpu.contains("total 242.42ms\n"), "{cpu}");
        assert!(
            cpu.contains("  70.71ms  29.17%  29.17%    70.71ms  29.17%  <[u8"),
            "{cpu}"
        );
        assert!(cpu.contains("  232.32ms  95.83%  main\n"), "{cpu}");
    }

    #[test]
    fn human_units() {
        assert_eq!(format_value(1_230_000_000, "nanoseconds"), "1.23s");
        assert_eq!(format_value(450_000_000, "nanoseconds"), "450ms");
        assert_eq!(format_value(1_500, "nanoseconds"), "1.5us");
        assert_eq!(format_value(999, "nanoseconds"), "999ns");
        assert_eq!(format_value(-2_000_000_000, "nanoseconds"), "-2s");
        assert_eq!(format_value(3, "seconds"), "3s");
        assert_eq!(format_value(1_572_864, "bytes"), "1.5MB");
        assert_eq!(format_value(12_345_678, "count"), "12345678");
        assert_eq!(format_value(0, "nanoseconds"), "0");
    }
}
