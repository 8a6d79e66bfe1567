//! Comparing two profiles function by function, for CI regression gates (`pyrometer diff`).
//!
//! Totals are normalized away: each function's *self* share (samples where it is the leaf)
//! and *inclusive* share (samples with it anywhere on the stack, counted once per sample
//! however deep it recurses) are fractions of their own profile's total, so a candidate that
//! ran longer or at another frequency compares fairly.
//!
//! Whether a change is real or sampling noise is decided by a two-proportion z-test on
//! sample counts: with `x1` of `n1` base samples and `x2` of `n2` new samples in a function,
//! `p = (x1 + x2) / (n1 + n2)`, `z = (x2/n2 - x1/n1) / sqrt(p (1 - p) (1/n1 + 1/n2))`, and
//! the two-sided p-value is `erfc(|z| / sqrt 2)`. The test treats samples as independent
//! draws, which sampling a thread at a fixed rate approximates well. A regression is a
//! function whose share grew by more than the threshold in percentage points, with a
//! p-value below `alpha`, and at least `min_samples` samples in the new profile.
//!
//! Kernel frames are charged to the user-space frame that entered the kernel unless
//! `kernel` is set: a function whose syscalls got slower still grows, while the time a shared
//! runner's scheduler and interrupts add (sampled in `irqentry_exit_to_user_mode` and the
//! like, in proportion to the load) spreads over every function instead of showing up as a
//! kernel function that "regressed". Stacks with no user frame keep their kernel frames.

use std::collections::{HashMap, HashSet};

use serde_json::{Value, json};

use crate::model::{FrameKind, Profile};
use crate::output::folded::frame_name;

/// How a diff decides what is a regression.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DiffOptions {
    /// Judge inclusive shares instead of self shares.
    pub inclusive: bool,
    /// Two-sided significance level of the z-test.
    pub alpha: f64,
    /// Fewest samples a function needs in the new profile to be called a regression.
    pub min_samples: u64,
    /// Judge kernel functions on their own instead of charging them to their user caller.
    pub kernel: bool,
}

impl Default for DiffOptions {
    fn default() -> Self {
        Self {
            inclusive: false,
            alpha: 0.001,
            min_samples: 20,
            kernel: false,
        }
    }
}

/// One side of a function's comparison.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Side {
    /// Value of the compared type where the function is the leaf, and anywhere on the stack.
    pub self_value: i64,
    pub inclusive_value: i64,
    /// The same, in samples (what the z-test counts).
    pub self_samples: u64,
    pub inclusive_samples: u64,
}

/// One function in both profiles.
#[derive(Debug, Clone, PartialEq)]
pub struct FunctionDiff {
    pub name: String,
    pub base: Side,
    pub new: Side,
    /// Shares in percent of each profile's total.
    pub base_self_pct: f64,
    pub new_self_pct: f64,
    pub base_inclusive_pct: f64,
    pub new_inclusive_pct: f64,
    /// z and two-sided p of the judged share (self, or inclusive with `--inclusive`).
    pub z: f64,
    pub p_value: f64,
}

impl FunctionDiff {
    pub fn self_delta(&self) -> f64 {
        self.new_self_pct - self.base_self_pct
    }

    pub fn inclusive_delta(&self) -> f64 {
        self.new_inclusive_pct - self.base_inclusive_pct
    }

    /// The change of the share the options judge, in percentage points.
    pub fn delta(&self, inclusive: bool) -> f64 {
        if inclusive {
            self.inclusive_delta()
        } else {
            self.self_delta()
        }
    }
}

/// Totals of one profile.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Totals {
    pub value: i64,
    pub samples: u64,
}

/// The comparison of two profiles, functions sorted by judged change, largest growth first.
#[derive(Debug, Clone, PartialEq)]
pub struct Diff {
    pub base: Totals,
    pub new: Totals,
    pub functions: Vec<FunctionDiff>,
    pub options: DiffOptions,
}

/// Per-function values of one profile, plus its totals.
struct Aggregate {
    functions: HashMap<String, Side>,
    totals: Totals,
}

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
    let names: Vec<String> = profile.frames.iter().map(frame_name).collect();
    let is_kernel = |f: u32| profile.frames.get(f).kind == FrameKind::Kernel;
    let count_of = sample_count_fn(profile, type_index);
    let mut functions: HashMap<String, Side> = HashMap::new();
    let mut totals = Totals::default();
    let mut seen: HashSet<&str> = HashSet::new();
    for sample in &profile.samples {
        let value = sample.values[type_index];
        let n = count_of(&sample.values);
        if value <= 0 && n == 0 {
            continue;
        }
        totals.value += value;
        totals.samples += n;
        let mut stack: &[u32] = profile.stacks.get(sample.stack);
        if !kernel && let Some(user) = stack.iter().position(|&f| !is_kernel(f)) {
            stack = &stack[user..];
        }
        seen.clear();
        for (depth, &f) in stack.iter().enumerate() {
            let name = names[f as usize].as_str();
            let first = seen.insert(name);
            let side = functions.entry(name.to_string()).or_default();
            if depth == 0 {
                side.self_value += value;
                side.self_samples += n;
            }
            // Recursion: a function deep in its own stack still counts once per sample.
            if first {
                side.inclusive_value += value;
                side.inclusive_samples += n;
            }
        }
    }
    Aggregate { functions, totals }
}

fn pct(part: i64, total: i64) -> f64 {
    if total <= 0 {
        0.0
    } else {
        100.0 * part as f64 / total as f64
    }
}

/// The two-proportion z statistic of `x1/n1` growing to `x2/n2` (0 when undefined).
pub fn z_statistic(x1: u64, n1: u64, x2: u64, n2: u64) -> f64 {
    if n1 == 0 || n2 == 0 {
        return 0.0;
    }
    let (x1, n1, x2, n2) = (x1 as f64, n1 as f64, x2 as f64, n2 as f64);
    let pooled = (x1 + x2) / (n1 + n2);
    let se = (pooled * (1.0 - pooled) * (1.0 / n1 + 1.0 / n2)).sqrt();
    if se == 0.0 || !se.is_finite() {
        return 0.0;
    }
    (x2 / n2 - x1 / n1) / se
}

/// Complementary error function, relative error below 1.2e-7 (Numerical Recipes' `erfcc`
/// Chebyshev fit), enough for p-values compared against levels such as 0.001.
pub fn erfc(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98
                                + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let r = t * poly.exp();
    if x >= 0.0 { r } else { 2.0 - r }
}

/// Two-sided p-value of a standard normal statistic.
pub fn two_sided_p(z: f64) -> f64 {
    erfc(z.abs() / std::f64::consts::SQRT_2).min(1.0)
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
    let mut names: Vec<&String> = a.functions.keys().chain(b.functions.keys()).collect();
    names.sort();
    names.dedup();
    let mut functions: Vec<FunctionDiff> = names
        .into_iter()
        .map(|name| {
            let base = a.functions.get(name).copied().unwrap_or_default();
            let new = b.functions.get(name).copied().unwrap_or_default();
            let (x1, x2) = if options.inclusive {
                (base.inclusive_samples, new.inclusive_samples)
            } else {
                (base.self_samples, new.self_samples)
            };
            let z = z_statistic(x1, a.totals.samples, x2, b.totals.samples);
            FunctionDiff {
                name: name.clone(),
                base,
                new,
                base_self_pct: pct(base.self_value, a.totals.value),
                new_self_pct: pct(new.self_value, b.totals.value),
                base_inclusive_pct: pct(base.inclusive_value, a.totals.value),
                new_inclusive_pct: pct(new.inclusive_value, b.totals.value),
                z,
                p_value: two_sided_p(z),
            }
        })
        .collect();
    functions.sort_by(|x, y| {
        y.delta(options.inclusive)
            .total_cmp(&x.delta(options.inclusive))
            .then_with(|| x.name.cmp(&y.name))
    });
    Diff {
        base: a.totals,
        new: b.totals,
        functions,
        options,
    }
}

impl Diff {
    /// Whether `f` grew by more than `threshold_pts` significantly, with enough samples.
    pub fn is_regression(&self, f: &FunctionDiff, threshold_pts: f64) -> bool {
        let new_samples = if self.options.inclusive {
            f.new.inclusive_samples
        } else {
            f.new.self_samples
        };
        f.delta(self.options.inclusive) > threshold_pts
            && f.z > 0.0
            && f.p_value < self.options.alpha
            && new_samples >= self.options.min_samples
    }

    /// The functions that regressed, largest growth first.
    pub fn regressions(&self, threshold_pts: f64) -> Vec<&FunctionDiff> {
        self.functions
            .iter()
            .filter(|f| self.is_regression(f, threshold_pts))
            .collect()
    }

    /// The `n` functions that grew most (positive change only).
    pub fn top_growth(&self, n: usize) -> impl Iterator<Item = &FunctionDiff> {
        let inclusive = self.options.inclusive;
        self.functions
            .iter()
            .filter(move |f| f.delta(inclusive) > 0.0)
            .take(n)
    }

    /// The `n` functions that shrank most.
    pub fn top_shrinkage(&self, n: usize) -> impl Iterator<Item = &FunctionDiff> {
        let inclusive = self.options.inclusive;
        self.functions
            .iter()
            .rev()
            .filter(move |f| f.delta(inclusive) < 0.0)
            .take(n)
    }

    /// The table `pyrometer diff` prints: top `n` regressions, then top `n` improvements.
    pub fn render_table(&self, n: usize, threshold_pts: Option<f64>) -> String {
        let mut out = String::new();
        let judged = if self.options.inclusive {
            "inclusive"
        } else {
            "self"
        };
        out.push_str(&format!(
            "base: {} samples, new: {} samples; shares in % of each total, change judged on {judged} share\n",
            self.base.samples, self.new.samples
        ));
        for (title, rows) in [
            ("grew", self.top_growth(n).collect::<Vec<_>>()),
            ("shrank", self.top_shrinkage(n).collect::<Vec<_>>()),
        ] {
            out.push_str(&format!(
                "\n{title:<10} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>7}  function\n",
                "self old", "self new", "Δ self", "incl old", "incl new", "Δ incl", "z"
            ));
            if rows.is_empty() {
                out.push_str("           (none)\n");
            }
            for f in rows {
                let flag = match threshold_pts {
                    Some(t) if self.is_regression(f, t) => "REGRESSION",
                    _ => "",
                };
                out.push_str(&format!(
                    "{flag:<10} {:>7.2}% {:>7.2}% {:>+8.2} {:>7.2}% {:>7.2}% {:>+8.2} {:>7.1}  {}\n",
                    f.base_self_pct,
                    f.new_self_pct,
                    f.self_delta(),
                    f.base_inclusive_pct,
                    f.new_inclusive_pct,
                    f.inclusive_delta(),
                    f.z,
                    f.name
                ));
            }
        }
        out
    }

    /// The machine-readable form (`--format json`): every function, with its verdict.
    pub fn to_json(&self, threshold_pts: Option<f64>) -> Value {
        let functions: Vec<Value> = self
            .functions
            .iter()
            .map(|f| {
                json!({
                    "function": f.name,
                    "base_self_pct": f.base_self_pct,
                    "new_self_pct": f.new_self_pct,
                    "self_delta_pts": f.self_delta(),
                    "base_inclusive_pct": f.base_inclusive_pct,
                    "new_inclusive_pct": f.new_inclusive_pct,
                    "inclusive_delta_pts": f.inclusive_delta(),
                    "base_self_samples": f.base.self_samples,
                    "new_self_samples": f.new.self_samples,
                    "base_inclusive_samples": f.base.inclusive_samples,
                    "new_inclusive_samples": f.new.inclusive_samples,
                    "z": f.z,
                    "p_value": f.p_value,
                    "regression": threshold_pts.is_some_and(|t| self.is_regression(f, t)),
                })
            })
            .collect();
        let regressions: Vec<&str> = threshold_pts
            .map(|t| {
                self.regressions(t)
                    .iter()
                    .map(|f| f.name.as_str())
                    .collect()
            })
            .unwrap_or_default();
        json!({
            "base": { "samples": self.base.samples, "total": self.base.value },
            "new": { "samples": self.new.samples, "total": self.new.value },
            "judged": if self.options.inclusive { "inclusive" } else { "self" },
            "test": "two-proportion z-test, two-sided",
            "alpha": self.options.alpha,
            "min_samples": self.options.min_samples,
            "kernel": self.options.kernel,
            "fail_above_pts": threshold_pts,
            "regressions": regressions,
            "functions": functions,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::input::read_folded;

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
    fn z_test_and_p_values() {
        assert_eq!(z_statistic(0, 0, 1, 1), 0.0);
        assert_eq!(z_statistic(0, 10, 0, 10), 0.0);
        assert_eq!(z_statistic(10, 10, 10, 10), 0.0);
        // 40/100 vs 60/100: pooled 0.5, se = sqrt(0.25 * 0.02) = 0.0707, z = 2.828.
        assert!((z_statistic(40, 100, 60, 100) - 2.828_427).abs() < 1e-5);
        assert!((z_statistic(60, 100, 40, 100) + 2.828_427).abs() < 1e-5);
        for (z, p) in [
            (0.0, 1.0),
            (1.959_964, 0.05),
            (2.575_829, 0.01),
            (3.290_527, 0.001),
        ] {
            assert!(
                (two_sided_p(z) - p).abs() < 1e-6,
                "p({z}) = {}",
                two_sided_p(z)
            );
        }
        assert!((erfc(-1.0) - 1.842_700_79).abs() < 1e-6);
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
