//! A tally of the Python frames in every pprof profile the tests read, for the bound on
//! unreadable frames, which holds over the whole suite rather than per test: when the run
//! names a file in [`TALLY_ENV`] (`cargo xtask test` does), [`tally`] appends one JSON line
//! per profile with Python frames (binary, test, Python frames, unreadable ones), each frame
//! counted once per sample it is in (by the profile's `samples` value where it has one).

use pyrometer_proto::naming::PYTHON_MAPPING;

/// Names the file the tally is appended to.
pub const TALLY_ENV: &str = "PYROMETER_FRAME_TALLY";
/// What a Python frame that could not be read is named.
pub const UNREADABLE: &str = "<unreadable frame>";

/// Python frames and unreadable ones in `p`, weighted by each sample's count.
pub fn python_frames(p: &pyrometer_proto::Profile) -> (u64, u64) {
    let name = |i: i64| p.string_table.get(i as usize).map_or("", String::as_str);
    let weight = p
        .sample_type
        .iter()
        .position(|t| name(t.r#type) == "samples");
    let python_mappings: std::collections::HashSet<u64> = p
        .mapping
        .iter()
        .filter(|m| name(m.filename) == PYTHON_MAPPING)
        .map(|m| m.id)
        .collect();
    let functions: std::collections::HashMap<u64, &str> =
        p.function.iter().map(|f| (f.id, name(f.name))).collect();
    // Per location: its Python frames (inlined lines count each) and unreadable ones.
    let locations: std::collections::HashMap<u64, (u64, u64)> = p
        .location
        .iter()
        .filter(|l| python_mappings.contains(&l.mapping_id))
        .map(|l| {
            let unreadable = l
                .line
                .iter()
                .filter(|line| functions.get(&line.function_id) == Some(&UNREADABLE))
                .count() as u64;
            (l.id, (l.line.len().max(1) as u64, unreadable))
        })
        .collect();
    let (mut python, mut unreadable) = (0, 0);
    for s in &p.sample {
        let n = weight
            .and_then(|i| s.value.get(i))
            .map_or(1, |&v| v.max(0) as u64);
        for id in &s.location_id {
            if let Some(&(frames, bad)) = locations.get(id) {
                python += frames * n;
                unreadable += bad * n;
            }
        }
    }
    (python, unreadable)
}

/// Appends `p`'s Python frames to the run's tally, when the run keeps one and `p` has any.
pub fn tally(p: &pyrometer_proto::Profile) {
    let Some(path) = std::env::var_os(TALLY_ENV) else {
        return;
    };
    let (python, unreadable) = python_frames(p);
    if python == 0 {
        return;
    }
    let (binary, test) = skip_ledger::current_test();
    let line = format!(
        "{{\"binary\":{},\"test\":{},\"python\":{python},\"unreadable\":{unreadable}}}",
        skip_ledger::json_string(&binary),
        skip_ledger::json_string(&test)
    );
    // A tally that cannot be kept leaves the suite's figure short: say so, loudly.
    if let Err(e) = skip_ledger::append_line(std::path::Path::new(&path), &line) {
        panic!(
            "cannot add to the frame tally {}: {e}",
            std::path::Path::new(&path).display()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pyrometer_proto::{Function, Line, Location, Mapping, Profile, Sample, ValueType};

    /// Two samples of one Python stack (one frame unreadable) and one native sample: the
    /// `samples` value weighs each, native frames are not counted.
    #[test]
    fn python_frames_are_counted_per_sample() {
        let strings: Vec<String> = [
            "",
            "samples",
            "count",
            "cpu",
            "nanoseconds",
            PYTHON_MAPPING,
            "/usr/bin/app",
            "f",
            UNREADABLE,
            "main",
        ]
        .map(String::from)
        .to_vec();
        let mapping = |id, filename| Mapping {
            id,
            filename,
            ..Default::default()
        };
        let function = |id, name| Function {
            id,
            name,
            ..Default::default()
        };
        let location = |id, mapping_id, function_id| Location {
            id,
            mapping_id,
            line: vec![Line {
                function_id,
                ..Default::default()
            }],
            ..Default::default()
        };
        let p = Profile {
            sample_type: vec![
                ValueType { r#type: 3, unit: 4 },
                ValueType { r#type: 1, unit: 2 },
            ],
            sample: vec![
                Sample {
                    location_id: vec![2, 1, 3],
                    value: vec![30_000_000, 3],
                    ..Default::default()
                },
                Sample {
                    location_id: vec![3],
                    value: vec![10_000_000, 1],
                    ..Default::default()
                },
            ],
            mapping: vec![mapping(1, 5), mapping(2, 6)],
            location: vec![location(1, 1, 1), location(2, 1, 2), location(3, 2, 3)],
            function: vec![function(1, 7), function(2, 8), function(3, 9)],
            string_table: strings,
            ..Default::default()
        };
        assert_eq!(python_frames(&p), (6, 3));
    }
}
