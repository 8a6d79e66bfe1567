//! `GET /api/v1/diff`: `pyrometer diff BASE NEW` over two selections of the store, so "did
//! the last deploy make this job slower" needs no exported files. Each side is a label query
//! and a time range; a side parameter left out on the new side takes the base side's value, so
//! one query over two ranges and two queries over one range are both one short URL.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use pyrometer_diff::{Aggregate, DiffOptions};
use serde::Deserialize;

use crate::api::access::{Reader, off_runtime, run_query};
use crate::api::error::ApiError;
use crate::api::params::RangeParams;
use crate::api::state::AppState;
use crate::query::Selector;
use crate::render;
use crate::store::{Frame, LabelSet, Selection, Stacked, Store};

/// How folded output and the ingest path mark kernel frames.
const KERNEL_SUFFIX: &str = "_[k]";

/// Every parameter as text, checked here: axum's own rejection of a malformed value is plain
/// text, and this API answers JSON errors only.
#[derive(Deserialize, Default)]
pub struct DiffParams {
    base_query: Option<String>,
    base_from: Option<String>,
    base_to: Option<String>,
    new_query: Option<String>,
    new_from: Option<String>,
    new_to: Option<String>,
    #[serde(rename = "type")]
    sample_type: Option<String>,
    format: Option<String>,
    fail_above: Option<String>,
    inclusive: Option<String>,
    kernel: Option<String>,
    min_samples: Option<String>,
    alpha: Option<String>,
}

/// One side of the comparison, resolved.
struct Side {
    name: &'static str,
    query: String,
    selector: Selector,
    from_s: i64,
    /// Exclusive, one past the `to` the user gave (see [`RangeParams::range`]).
    to_s: i64,
}

impl Side {
    fn resolve(
        name: &'static str,
        query: Option<&String>,
        from: Option<&String>,
        to: Option<&String>,
    ) -> Result<Side, ApiError> {
        let query = query.cloned().unwrap_or_default();
        let selector = Selector::parse(&query)
            .map_err(|e| ApiError::bad_request(format!("{name}_query: {e}")))?;
        let range = RangeParams {
            from: from.cloned(),
            to: to.cloned(),
        };
        let (from_s, to_s) = range.range().map_err(|e| e.prefixed(name))?;
        Ok(Side {
            name,
            query,
            selector,
            from_s,
            to_s,
        })
    }

    fn describe(&self) -> serde_json::Value {
        serde_json::json!({ "query": self.query, "from": self.from_s, "to": self.to_s - 1 })
    }
}

/// A side's stacks of the compared type, with the samples each value stands for.
struct Selected {
    stacks: Vec<Stacked>,
    samples: Vec<u64>,
}

fn flag(name: &str, v: Option<&String>) -> Result<bool, ApiError> {
    match v.map(String::as_str) {
        None | Some("" | "0" | "false") => Ok(false),
        Some("1" | "true") => Ok(true),
        Some(other) => Err(ApiError::bad_request(format!(
            "{name}: '{other}' is not a boolean: use true or false"
        ))),
    }
}

fn options(p: &DiffParams) -> Result<(DiffOptions, Option<f64>), ApiError> {
    let mut o = DiffOptions {
        inclusive: flag("inclusive", p.inclusive.as_ref())?,
        kernel: flag("kernel", p.kernel.as_ref())?,
        ..DiffOptions::default()
    };
    if let Some(n) = p.min_samples.as_deref().filter(|s| !s.is_empty()) {
        o.min_samples = n.parse().map_err(|_| {
            ApiError::bad_request(format!("min_samples: '{n}' is not a sample count"))
        })?;
    }
    if let Some(a) = p.alpha.as_deref().filter(|s| !s.is_empty()) {
        o.alpha = match a.parse::<f64>() {
            Ok(v) if v > 0.0 && v < 1.0 => v,
            _ => {
                return Err(ApiError::bad_request(format!(
                    "alpha: '{a}' is not a p-value between 0 and 1, e.g. 0.001"
                )));
            }
        };
    }
    let fail_above = match p.fail_above.as_deref().filter(|s| !s.is_empty()) {
        None => None,
        Some(t) => match t.trim_end_matches('%').parse::<f64>() {
            Ok(v) if v.is_finite() && v >= 0.0 => Some(v),
            _ => {
                return Err(ApiError::bad_request(format!(
                    "fail_above: '{t}' is not a threshold: give percentage points, e.g. 5"
                )));
            }
        },
    };
    Ok((o, fail_above))
}

pub async fn diff(
    State(state): State<Arc<AppState>>,
    reader: Reader,
    query: Result<Query<DiffParams>, QueryRejection>,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    let result = match query {
        Ok(Query(p)) => diff_inner(&state, &reader, p).await,
        // e.g. a parameter given twice.
        Err(e) => Err(ApiError::bad_request(e.body_text())),
    };
    state
        .metrics
        .observe_query(started.elapsed(), result.is_ok());
    result
}

async fn diff_inner(
    state: &Arc<AppState>,
    reader: &Reader,
    p: DiffParams,
) -> Result<Response, ApiError> {
    let base = Side::resolve(
        "base",
        p.base_query.as_ref(),
        p.base_from.as_ref(),
        p.base_to.as_ref(),
    )?;
    let new = Side::resolve(
        "new",
        p.new_query.as_ref().or(p.base_query.as_ref()),
        p.new_from.as_ref().or(p.base_from.as_ref()),
        p.new_to.as_ref().or(p.base_to.as_ref()),
    )?;
    let format = p.format.clone().unwrap_or_else(|| "json".into());
    if !matches!(format.as_str(), "json" | "svg") {
        return Err(ApiError::bad_request(format!(
            "unknown format '{format}': use json or svg"
        )));
    }
    let (options, fail_above) = options(&p)?;
    let wanted = p.sample_type.clone().unwrap_or_else(|| "samples".into());

    let st = state.clone();
    let tenant = reader.0.clone();
    let (ty, base, new, sides) = run_query(state, reader, move |store| {
        let types = store
            .sample_types()
            .map_err(|e| ApiError::store(&st.metrics, e))?;
        let ty = crate::api::params::sample_type(&types, &wanted)?.clone();
        // The z-test counts samples; a type that is not itself a count (cpu time) takes its
        // counts from `samples` of the same stacks, as `pyrometer diff` does with a profile's
        // count type.
        let counts_from_samples =
            ty.1 != "count" && types.iter().any(|(n, u)| n == "samples" && u == "count");
        let own = Reader(tenant);
        let selected = [&base, &new].map(|side| {
            let matcher = |l: &LabelSet| own.owns(l) && side.selector.matches(l);
            select(&st, store, &matcher, side, &ty.0, counts_from_samples)
        });
        let [b, n] = selected;
        Ok((ty, b?, n?, (base, new)))
    })
    .await?;
    off_runtime(move || answer(&ty, base, new, sides, &format, options, fail_above)).await?
}

/// The comparison of the two sides' stacks in `format`.
fn answer(
    ty: &(String, String),
    base: Selected,
    new: Selected,
    sides: (Side, Side),
    format: &str,
    options: DiffOptions,
    fail_above: Option<f64>,
) -> Result<Response, ApiError> {
    let (base_side, new_side) = sides;
    for (side, sel) in [(&base_side, &base), (&new_side, &new)] {
        if sel.stacks.iter().all(|s| s.value <= 0) {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                format!(
                    "the {} side ({} from {} to {}) has no {} samples",
                    side.name,
                    if side.query.is_empty() {
                        "{}"
                    } else {
                        &side.query
                    },
                    side.from_s,
                    side.to_s - 1,
                    ty.0
                ),
            ));
        }
    }

    if format == "svg" {
        let title = format!(
            "pyrometer diff: {} → {} UTC",
            label(&base_side),
            label(&new_side)
        );
        let mut opt = inferno::flamegraph::Options::default();
        opt.title = title;
        opt.count_name = if ty.1 == "count" {
            ty.0.clone()
        } else {
            ty.1.clone()
        };
        opt.hash = true;
        let before = render::folded_code_text(&base.stacks);
        let after = render::folded_code_text(&new.stacks);
        let mut svg = Vec::new();
        pyrometer_diff::write_differential_svg(&before, &after, &mut opt, &mut svg)
            .map_err(ApiError::internal)?;
        return Ok(([(header::CONTENT_TYPE, "image/svg+xml")], svg).into_response());
    }

    let d = pyrometer_diff::compare(
        &aggregate(&base, options.kernel),
        &aggregate(&new, options.kernel),
        options,
    );
    if fail_above.is_some() {
        // As `pyrometer diff --fail-above`: too few samples cannot pass or fail a gate.
        for (side, totals) in [(&base_side, d.base), (&new_side, d.new)] {
            if totals.samples < options.min_samples {
                return Err(ApiError::bad_request(format!(
                    "the {} side has {} samples, fewer than min_samples {}: widen its time range",
                    side.name, totals.samples, options.min_samples
                )));
            }
        }
    }
    let mut body = d.to_json(fail_above);
    body["type"] = ty.0.clone().into();
    body["unit"] = ty.1.clone().into();
    for (key, side) in [("base", &base_side), ("new", &new_side)] {
        if let (Some(obj), serde_json::Value::Object(sel)) =
            (body[key].as_object_mut(), side.describe())
        {
            obj.extend(sel);
        }
    }
    Ok(axum::Json(body).into_response())
}

/// How the SVG title names a side: its query and range, to the minute in UTC, the end's
/// date only when it differs from the start's (the title has one line of room).
fn label(side: &Side) -> String {
    let q = if side.query.is_empty() {
        "{}"
    } else {
        &side.query
    };
    let (from, to) = (utc(side.from_s), utc(side.to_s - 1));
    let to = match to.split_once(' ') {
        Some((day, time)) if from.starts_with(day) => time.to_string(),
        _ => to,
    };
    format!("{q} {from}–{to}")
}

/// `YYYY-MM-DD HH:MM` of Unix seconds (the proleptic Gregorian calendar, by Howard Hinnant's
/// days-to-civil algorithm; no date crate for one title).
fn utc(secs: i64) -> String {
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}",
        rem / 3600,
        rem / 60 % 60
    )
}

fn select(
    state: &AppState,
    store: &dyn Store,
    matcher: &(dyn Fn(&LabelSet) -> bool + Sync),
    side: &Side,
    sample_type: &str,
    counts_from_samples: bool,
) -> Result<Selected, ApiError> {
    let of_type = |sample_type: &str| {
        store
            .select(&Selection {
                from_s: side.from_s,
                to_s: side.to_s,
                sample_type,
                labels: matcher,
            })
            .map_err(|e| ApiError::store(&state.metrics, e))
    };
    let stacks = of_type(sample_type)?;
    let samples = if counts_from_samples {
        let counts = of_type("samples")?;
        let by_key: HashMap<(&LabelSet, &Vec<Frame>), i64> = counts
            .iter()
            .map(|c| ((c.labels.as_ref(), c.stack.as_ref()), c.value))
            .collect();
        stacks
            .iter()
            .map(|s| {
                let n = by_key.get(&(s.labels.as_ref(), s.stack.as_ref()));
                n.map_or(0, |&n| u64::try_from(n).unwrap_or(0))
            })
            .collect()
    } else {
        stacks
            .iter()
            .map(|s| u64::try_from(s.value).unwrap_or(0))
            .collect()
    };
    Ok(Selected { stacks, samples })
}

fn aggregate(sel: &Selected, kernel: bool) -> Aggregate {
    let mut out = Aggregate::new(kernel);
    let mut frames: Vec<(&str, bool)> = Vec::new();
    for (s, &n) in sel.stacks.iter().zip(&sel.samples) {
        frames.clear();
        // The store keeps stacks root first; the engine reads them leaf first.
        frames.extend(
            s.stack
                .iter()
                .rev()
                .map(|f| (&**f, f.ends_with(KERNEL_SUFFIX))),
        );
        out.add(&frames, s.value, n);
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn utc_dates() {
        assert_eq!(super::utc(0), "1970-01-01 00:00");
        assert_eq!(super::utc(951_782_400), "2000-02-29 00:00");
        assert_eq!(super::utc(1_796_274_525), "2026-12-03 05:08");
        assert_eq!(super::utc(-1), "1969-12-31 23:59");
    }
}
