//! Comparing two profiles function by function, for CI regression gates (`pyrometer diff`):
//! the engine is the `pyrometer-diff` crate (shared with the collector); this module feeds it
//! [`Profile`]s.

pub use pyrometer_diff::{
    Aggregate, Diff, DiffOptions, FunctionDiff, Side, Totals, erfc, two_sided_p, z_statistic,
};

use crate::model::{FrameKind, Profile};
use crate::output::folded::frame_name;

/// How many samples a sample's value of the compared type stands for: the count type's
/// value when the profile has one, else the value over the sampling period (a CPU-time-only
/// pprof), else the value itself.
fn sample_count_fn(profile: &Profile, type_index: usize) -> impl Fn(&[i64]) -> u64 {
    let counts = profile
        .sample_types
        .iter()
        .position(|t| t.unit == "count" && t.name == "samples");
    let same_period_type = profile.period > 0
        && profile
            .period_type
            .as_ref()
            .is_some_and(|t| *t == profile.sample_types[type_index]);
    let period = profile.period;
    move |values: &[i64]| -> u64 {
        let n = match counts {
            Some(c) => values[c],
            None if same_period_type => values[type_index] / period,
            None => values[type_index],
        };
        u64::try_from(n).unwrap_or(0)
    }
}

fn aggregate(profile: &Profile, type_index: usize, kernel: bool) -> Aggregate {
    let frames: Vec<(String, bool)> = profile
        .frames
        .iter()
        .map(|f| (frame_name(f), f.kind == FrameKind::Kernel))
        .collect();
    let count_of = sample_count_fn(profile, type_index);
    let mut out = Aggregate::new(kernel);
    let mut stack: Vec<(&str, bool)> = Vec::new();
    for sample in &profile.samples {
        stack.clear();
        stack.extend(profile.stacks.get(sample.stack).iter().map(|&f| {
            let (name, kernel) = &frames[f as usize];
            (name.as_str(), *kernel)
        }));
        out.add(&stack, sample.values[type_index], count_of(&sample.values));
    }
    out
}

/// Compares `base` (type `base_type`) with `new` (type `new_type`).
pub fn diff(
    base: &Profile,
    base_type: usize,
    new: &Profile,
    new_type: usize,
    options: DiffOptions,
) -> Diff {
    let a = aggregate(base, base_type, options.kernel);
    let b = aggregate(new, new_type, options.kernel);
    pyrometer_diff::compare(&a, &b, options)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::input::read_folded;
    use serde_json::json;

    fn profile(text: &str) -> Profile {
        read_folded(text).unwrap()
    }

    fn find<'a>(d: &'a Diff, name: &str) -> &'a FunctionDiff {
        d.functions.iter().find(|f| f.name == name).unwrap()
    }

    #[test]
    fn shares_are_normalized_and_recursion_counts_once() {
        // New ran twice as long: equal shares, no change.
        let base = profile("main;f;f;g 10\nmain;h 30\n");
        let new = profile("main;f;f;g 20\nmain;h 60\n");
        let d = diff(&base, 0, &new, 0, DiffOptions::default());
        let f = find(&d, "f");
        assert_eq!(f.base.inclusive_samples, 10);
        assert_eq!(f.base_inclusive_pct, 25.0);
        assert_eq!(f.new_inclusive_pct, 25.0);
        assert_eq!(f.base_self_pct, 0.0);
        assert_eq!(find(&d, "g").base_self_pct, 25.0);
        assert_eq!(find(&d, "main").new_inclusive_pct, 100.0);
        assert!(d.regressions(0.0).is_empty());
        assert_eq!(d.base.samples, 40);
        assert_eq!(d.new.samples, 80);
    }

    #[test]
    fn significant_growth_is_a_regression() {
        // slow: 50 % -> 66.7 %, with 3000 samples each (z ~ 13).
        let base = profile("main;slow 1500\nmain;other 1500\n");
        let new = profile("main;slow 2000\nmain;other 1000\n");
        let d = diff(&base, 0, &new, 0, DiffOptions::default());
        let slow = find(&d, "slow");
        assert!((slow.self_delta() - 16.67).abs() < 0.01);
        assert!(slow.z > 12.0 && slow.p_value < 1e-9, "{slow:?}");
        let names: Vec<&str> = d.regressions(5.0).iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, ["slow"]);
        assert!(d.regressions(20.0).is_empty());
        assert_eq!(d.functions.first().unwrap().name, "slow");
        assert_eq!(d.top_shrinkage(1).next().unwrap().name, "other");
        // Inclusive: main is 100 % in both, so nothing changes for it.
        let incl = DiffOptions {
            inclusive: true,
            ..DiffOptions::default()
        };
        let d = diff(&base, 0, &new, 0, incl);
        assert_eq!(find(&d, "main").inclusive_delta(), 0.0);
        assert_eq!(d.regressions(5.0).len(), 1);
    }

    #[test]
    fn kernel_time_is_charged_to_the_user_caller_unless_asked() {
        // Preemption noise: the interrupt-return path grows from 1 % to 10 % of both
        // functions' samples. Charged to the callers, shares do not move; judged on its own,
        // the kernel frame is a regression.
        let base = profile(
            "main;a 495\nmain;a;irqentry_exit_[k] 5\nmain;b 495\nmain;b;irqentry_exit_[k] 5\n",
        );
        let new = profile(
            "main;a 450\nmain;a;irqentry_exit_[k] 50\nmain;b 450\nmain;b;irqentry_exit_[k] 50\n",
        );
        let d = diff(&base, 0, &new, 0, DiffOptions::default());
        assert!(d.regressions(5.0).is_empty(), "{:?}", d.functions);
        assert!(d.functions.iter().all(|f| f.name != "irqentry_exit_[k]"));
        assert_eq!(find(&d, "a").new_self_pct, 50.0);
        let kernel = DiffOptions {
            kernel: true,
            ..DiffOptions::default()
        };
        let d = diff(&base, 0, &new, 0, kernel);
        let names: Vec<&str> = d.regressions(5.0).iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, ["irqentry_exit_[k]"]);
        // A slower syscall still shows, as its caller's growth; kernel-only stacks stay.
        let base = profile("main;w;write_[k] 100\nmain;c 900\nworker_thread_[k];work_[k] 100\n");
        let new = profile("main;w;write_[k] 400\nmain;c 600\nworker_thread_[k];work_[k] 100\n");
        let d = diff(&base, 0, &new, 0, DiffOptions::default());
        let names: Vec<&str> = d.regressions(5.0).iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, ["w"]);
        assert!(find(&d, "work_[k]").new_self_pct > 0.0);
    }

    #[test]
    fn large_but_insignificant_changes_pass() {
        // 5 of 10 -> 7 of 10: +20 pts, but z ~ 0.9.
        let d = diff(
            &profile("a;x 5\na;y 5\n"),
            0,
            &profile("a;x 7\na;y 3\n"),
            0,
            DiffOptions {
                min_samples: 0,
                ..DiffOptions::default()
            },
        );
        let x = find(&d, "x");
        assert!(x.self_delta() > 19.0 && x.p_value > 0.3, "{x:?}");
        assert!(d.regressions(5.0).is_empty());
    }

    #[test]
    fn min_samples_is_honoured() {
        // 0 -> 30 of 1000: significant (z ~ 5.5), +3 pts.
        let base = profile("a;x 1000\n");
        let new = profile("a;x 970\na;y 30\n");
        let with = |min_samples| {
            diff(
                &base,
                0,
                &new,
                0,
                DiffOptions {
                    min_samples,
                    ..DiffOptions::default()
                },
            )
        };
        assert_eq!(with(30).regressions(2.0).len(), 1);
        assert!(with(31).regressions(2.0).is_empty());
    }

    #[test]
    fn table_and_json_list_the_offenders() {
        let base = profile("main;slow 1500\nmain;other 1500\n");
        let new = profile("main;slow 2000\nmain;other 1000\n");
        let d = diff(&base, 0, &new, 0, DiffOptions::default());
        let table = d.render_table(5, Some(5.0));
        let slow_line = table.lines().find(|l| l.ends_with(" slow")).unwrap();
        assert!(slow_line.starts_with("REGRESSION"), "{table}");
        assert!(slow_line.contains("+16.67"), "{table}");
        let other = table.lines().find(|l| l.ends_with(" other")).unwrap();
        assert!(other.contains("-16.67") && !other.contains("REGRESSION"));
        let j = d.to_json(Some(5.0));
        assert_eq!(j["regressions"], json!(["slow"]));
        assert_eq!(j["functions"][0]["function"], "slow");
        assert_eq!(j["functions"][0]["regression"], true);
        assert_eq!(d.to_json(None)["regressions"], json!([]));
    }
}
