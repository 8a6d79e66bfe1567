//! Comparing two profiles function by function: the engine of `pyrometer diff` (CI regression
//! gates) and of the collector's `/api/v1/diff`. It sees a profile only as stacks of named
//! frames with a value and a sample count, so both callers feed it without sharing a model.
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
use std::io::Write;

use serde_json::{Value, json};

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

/// Per-function values of one profile, plus its totals; fed one stack at a time.
#[derive(Debug, Clone, Default)]
pub struct Aggregate {
    functions: HashMap<String, Side>,
    totals: Totals,
    kernel: bool,
}

impl Aggregate {
    /// `kernel`: judge kernel frames on their own (see [`DiffOptions::kernel`]); pass the
    /// options' value, or the kernel-charging rule differs between the two sides.
    pub fn new(kernel: bool) -> Self {
        Self {
            kernel,
            ..Self::default()
        }
    }

    /// Adds one stack, given leaf first as (frame name, is kernel code), with its value of the
    /// compared type and the number of samples that value stands for.
    pub fn add(&mut self, leaf_first: &[(&str, bool)], value: i64, samples: u64) {
        if value <= 0 && samples == 0 {
            return;
        }
        self.totals.value += value;
        self.totals.samples += samples;
        let mut stack = leaf_first;
        if !self.kernel
            && let Some(user) = stack.iter().position(|&(_, kernel)| !kernel)
        {
            stack = &stack[user..];
        }
        let mut seen: HashSet<&str> = HashSet::with_capacity(stack.len());
        for (depth, &(name, _)) in stack.iter().enumerate() {
            let first = seen.insert(name);
            let side = match self.functions.get_mut(name) {
                Some(side) => side,
                None => self.functions.entry(name.to_string()).or_default(),
            };
            if depth == 0 {
                side.self_value += value;
                side.self_samples += samples;
            }
            // Recursion: a function deep in its own stack still counts once per sample.
            if first {
                side.inclusive_value += value;
                side.inclusive_samples += samples;
            }
        }
    }

    pub fn totals(&self) -> Totals {
        self.totals
    }
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

/// Compares two aggregates (built with `options.kernel`).
pub fn compare(a: &Aggregate, b: &Aggregate, options: DiffOptions) -> Diff {
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

/// A differential flame graph (inferno's, after Brendan Gregg's) from two folded texts
/// (`a;b;c 42` lines): the shape of `after`, each frame coloured by how its count changed from
/// `before` — red grew, blue shrank, the deeper the hue the larger the change — and the change
/// in its tooltip. Totals are normalized first, so a longer run of the same code looks
/// unchanged. `opt` carries the caller's title, palette and count name.
pub fn write_differential_svg(
    before: &str,
    after: &str,
    opt: &mut inferno::flamegraph::Options<'_>,
    out: &mut dyn Write,
) -> std::io::Result<()> {
    let mut merged = Vec::new();
    let diff_opt = inferno::differential::Options {
        normalize: true,
        strip_hex: false,
    };
    inferno::differential::from_readers(
        diff_opt,
        before.as_bytes(),
        after.as_bytes(),
        &mut merged,
    )?;
    let merged = String::from_utf8_lossy(&merged);
    inferno::flamegraph::from_lines(opt, merged.lines(), out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An aggregate from folded lines (`root;...;leaf N`, kernel frames suffixed `_[k]`).
    fn agg(text: &str, kernel: bool) -> Aggregate {
        let mut a = Aggregate::new(kernel);
        for line in text.lines() {
            let (stack, n) = line.rsplit_once(' ').unwrap();
            let n: i64 = n.parse().unwrap();
            let frames: Vec<(&str, bool)> = stack
                .split(';')
                .rev()
                .map(|f| (f, f.ends_with("_[k]")))
                .collect();
            a.add(&frames, n, n as u64);
        }
        a
    }

    #[test]
    fn aggregates_self_inclusive_and_kernel_charging() {
        let a = agg("main;f;f;g 10\nmain;h;read_[k] 30\n", false);
        assert_eq!(
            a.totals(),
            Totals {
                value: 40,
                samples: 40
            }
        );
        let d = compare(&a, &a, DiffOptions::default());
        let f = d.functions.iter().find(|x| x.name == "f").unwrap();
        assert_eq!((f.base.inclusive_samples, f.base.self_samples), (10, 0));
        // The kernel frame is charged to its user caller.
        assert!(d.functions.iter().all(|x| x.name != "read_[k]"));
        let h = d.functions.iter().find(|x| x.name == "h").unwrap();
        assert_eq!(h.base_self_pct, 75.0);
        let k = agg("main;h;read_[k] 30\n", true);
        let d = compare(
            &k,
            &k,
            DiffOptions {
                kernel: true,
                ..DiffOptions::default()
            },
        );
        assert!(
            d.functions
                .iter()
                .any(|x| x.name == "read_[k]" && x.base_self_pct == 100.0)
        );
    }

    #[test]
    fn differential_svg_colours_growth() {
        let mut opt = inferno::flamegraph::Options::default();
        opt.hash = true;
        let mut out = Vec::new();
        write_differential_svg(
            "main;a 10\nmain;b 10\n",
            "main;a 30\nmain;b 10\n",
            &mut opt,
            &mut out,
        )
        .unwrap();
        let svg = String::from_utf8(out).unwrap();
        assert!(
            svg.contains("<title>a (30 samples, 75.00%; +25.00%)</title>"),
            "{svg}"
        );
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
}
