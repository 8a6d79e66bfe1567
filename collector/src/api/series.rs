//! `GET /api/v1/series`: a selection's value over time, optionally one series per value of
//! some labels, for the web UI's chart (what happened at 14:05) and for scripts.
//!
//! The answer is a regular grid: `timestamps` are the starts of every step in the range and
//! each series has one value per timestamp (0 where nothing was sampled), so a chart library
//! can draw it as it is. Only the `limit` largest series are kept; the rest are summed into
//! one series marked `"other": true`, so a split by a label with thousands of values (pid)
//! stays small.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use crate::api::access::{Reader, off_runtime, run_query, store_error};
use crate::api::error::ApiError;
use crate::api::params::{RangeParams, label_list, sample_type};
use crate::api::state::AppState;
use crate::query::Selector;
use crate::store::{BUCKET_SECONDS, LabelSet, Point, Selection, add};

/// Steps a chart gets when the request names none: about one per 3 px of a wide chart.
const DEFAULT_POINTS: i64 = 300;
/// The most steps one answer may hold (bounded memory and response size).
const MAX_POINTS: i64 = 5000;
/// Series kept when the request names no limit, and the most it may ask for.
const DEFAULT_SERIES: usize = 10;
const MAX_SERIES: usize = 100;

#[derive(Deserialize, Default)]
pub struct SeriesParams {
    query: Option<String>,
    #[serde(flatten)]
    range: RangeParams,
    #[serde(rename = "type")]
    sample_type: Option<String>,
    by: Option<String>,
    step: Option<String>,
    limit: Option<String>,
}

/// The step width: the one asked for (a multiple of the store's bucket, at most
/// [`MAX_POINTS`] steps), or one giving about [`DEFAULT_POINTS`] steps.
fn step_of(asked: Option<&str>, from_s: i64, to_s: i64) -> Result<i64, ApiError> {
    let span = to_s - from_s;
    let Some(text) = asked.filter(|s| !s.is_empty()) else {
        let raw = (span + DEFAULT_POINTS - 1) / DEFAULT_POINTS;
        // Rounded up to whole buckets: a step narrower than a bucket would show empty steps
        // between the buckets.
        return Ok(((raw + BUCKET_SECONDS - 1) / BUCKET_SECONDS).max(1) * BUCKET_SECONDS);
    };
    let step: i64 = text.trim_end_matches('s').parse().map_err(|_| {
        ApiError::bad_request(format!(
            "step: '{text}' is not a number of seconds, e.g. 60"
        ))
    })?;
    if step <= 0 || step % BUCKET_SECONDS != 0 {
        return Err(ApiError::bad_request(format!(
            "step: {step} s is not a positive multiple of the store's {BUCKET_SECONDS} s buckets"
        )));
    }
    if span / step > MAX_POINTS {
        return Err(ApiError::bad_request(format!(
            "step: {step} s gives {} points over this range, more than {MAX_POINTS}: \
             use a step of at least {} s or a shorter range",
            span / step,
            (span / MAX_POINTS + BUCKET_SECONDS) / BUCKET_SECONDS * BUCKET_SECONDS
        )));
    }
    Ok(step)
}

fn limit_of(asked: Option<&str>) -> Result<usize, ApiError> {
    match asked.filter(|s| !s.is_empty()) {
        None => Ok(DEFAULT_SERIES),
        Some(t) => match t.parse::<usize>() {
            Ok(n) if (1..=MAX_SERIES).contains(&n) => Ok(n),
            _ => Err(ApiError::bad_request(format!(
                "limit: '{t}' is not a series count from 1 to {MAX_SERIES}"
            ))),
        },
    }
}

pub async fn series(
    State(state): State<Arc<AppState>>,
    reader: Reader,
    query: Result<Query<SeriesParams>, QueryRejection>,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    let result = match query {
        Ok(Query(p)) => series_inner(&state, &reader, p).await,
        Err(e) => Err(ApiError::bad_request(e.body_text())),
    };
    state
        .metrics
        .observe_query(started.elapsed(), result.is_ok());
    result
}

async fn series_inner(
    state: &Arc<AppState>,
    reader: &Reader,
    p: SeriesParams,
) -> Result<Response, ApiError> {
    let selector =
        Selector::parse(p.query.as_deref().unwrap_or("")).map_err(ApiError::bad_request)?;
    let (from_s, to_s) = p.range.range()?;
    let step = step_of(p.step.as_deref(), from_s, to_s)?;
    let limit = limit_of(p.limit.as_deref())?;
    let by = label_list(p.by.as_deref());
    let wanted = p.sample_type.unwrap_or_else(|| "samples".into());
    let (tenant, st) = (reader.0.clone(), state.clone());
    let (ty, points) = run_query(state, reader, move |store| {
        let types = store.sample_types().map_err(|e| store_error(&st, e))?;
        let ty = sample_type(&types, &wanted)?.clone();
        let own = Reader(tenant);
        let matcher = |l: &LabelSet| own.owns(l) && selector.matches(l);
        let points = store
            .series(
                &Selection {
                    from_s,
                    to_s,
                    sample_type: &ty.0,
                    labels: &matcher,
                },
                step,
            )
            .map_err(|e| store_error(&st, e))?;
        Ok::<_, ApiError>((ty, points))
    })
    .await?;

    off_runtime(move || answer(&ty, from_s, to_s, step, limit, &by, &points)).await
}

/// The series of `points` on the grid of `[from_s, to_s)` in `step`s, the `limit` largest
/// kept and the rest summed, as JSON.
fn answer(
    ty: &(String, String),
    from_s: i64,
    to_s: i64,
    step: i64,
    limit: usize,
    by: &[String],
    points: &[Point],
) -> Response {
    let grid = Grid::new(from_s, to_s, step);
    let groups = group(points, by, &grid);
    let total = groups.iter().fold(0i64, |t, g| t.saturating_add(g.total));
    let (kept, rest) = keep_largest(groups, limit);
    let mut series: Vec<serde_json::Value> = kept
        .into_iter()
        .map(|g| {
            let values = g.dense(grid.len);
            serde_json::json!({ "labels": g.labels, "total": g.total, "values": values })
        })
        .collect();
    if let Some(other) = rest {
        series.push(serde_json::json!({
            "labels": {}, "other": true, "total": other.total, "values": other.dense(grid.len)
        }));
    }
    let body = serde_json::json!({
        "type": ty.0, "unit": ty.1, "from": from_s, "to": to_s - 1, "step": step, "by": by,
        "total": total, "timestamps": grid.timestamps(), "series": series,
    });
    axum::Json(body).into_response()
}

/// The steps of `[from_s, to_s)`: starts at multiples of `step`, the first one holding `from_s`.
struct Grid {
    first: i64,
    step: i64,
    len: usize,
}

impl Grid {
    fn new(from_s: i64, to_s: i64, step: i64) -> Grid {
        let first = from_s - from_s.rem_euclid(step);
        let len = ((to_s - first + step - 1) / step).max(0) as usize;
        Grid { first, step, len }
    }

    fn index(&self, time_s: i64) -> Option<usize> {
        let i = (time_s - self.first).div_euclid(self.step);
        usize::try_from(i).ok().filter(|&i| i < self.len)
    }

    fn timestamps(&self) -> Vec<i64> {
        (0..self.len as i64)
            .map(|i| self.first + i * self.step)
            .collect()
    }
}

/// One series while it is summed: its values by step, only where it has some, so memory
/// follows the points the store returned, never groups × steps.
struct Group {
    labels: BTreeMap<String, String>,
    total: i64,
    values: Vec<(usize, i64)>,
}

impl Group {
    /// The values on the grid: 0 where nothing was sampled.
    fn dense(&self, len: usize) -> Vec<i64> {
        let mut out = vec![0; len];
        for &(i, v) in &self.values {
            add(&mut out[i], v);
        }
        out
    }
}

/// One series per distinct value of the `by` labels (a missing label groups as ""), sorted
/// by those values.
fn group(points: &[Point], by: &[String], grid: &Grid) -> Vec<Group> {
    let mut groups: HashMap<Vec<&str>, Group> = HashMap::new();
    for p in points {
        let Some(i) = grid.index(p.time_s) else {
            continue;
        };
        let key: Vec<&str> = by
            .iter()
            .map(|b| p.labels.get(b).map_or("", String::as_str))
            .collect();
        let g = groups.entry(key).or_insert_with_key(|key| Group {
            labels: by
                .iter()
                .zip(key)
                .map(|(b, v)| (b.clone(), v.to_string()))
                .collect(),
            total: 0,
            values: Vec::new(),
        });
        g.values.push((i, p.value));
        add(&mut g.total, p.value);
    }
    let mut out: Vec<Group> = groups.into_values().collect();
    out.sort_by(|a, b| a.labels.cmp(&b.labels));
    out
}

/// The `limit` groups with the largest totals (in their label order), and the sum of the
/// rest if there is any.
fn keep_largest(mut groups: Vec<Group>, limit: usize) -> (Vec<Group>, Option<Group>) {
    if groups.len() <= limit {
        return (groups, None);
    }
    let mut order: Vec<usize> = (0..groups.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(groups[i].total));
    let mut keep = vec![false; groups.len()];
    for &i in &order[..limit] {
        keep[i] = true;
    }
    let mut other = Group {
        labels: BTreeMap::new(),
        total: 0,
        values: Vec::new(),
    };
    let mut kept = Vec::with_capacity(limit);
    for (g, keep) in groups.drain(..).zip(keep) {
        if keep {
            kept.push(g);
        } else {
            add(&mut other.total, g.total);
            other.values.extend(g.values);
        }
    }
    (kept, Some(other))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(node: &str, time_s: i64, value: i64) -> Point {
        Point {
            labels: Arc::new([("node".to_string(), node.to_string())].into()),
            time_s,
            value,
        }
    }

    #[test]
    fn steps() {
        assert_eq!(step_of(None, 0, 3600).unwrap(), 20);
        assert_eq!(step_of(None, 0, 60).unwrap(), 10);
        assert_eq!(step_of(Some("60"), 0, 3600).unwrap(), 60);
        assert_eq!(step_of(Some("60s"), 0, 3600).unwrap(), 60);
        for bad in ["0", "15", "-10", "x"] {
            assert!(step_of(Some(bad), 0, 3600).is_err(), "{bad}");
        }
        // A week in 10 s steps is too many points; the error names a step that works.
        let e = step_of(Some("10"), 0, 7 * 86400).unwrap_err();
        assert!(e.message().contains("at least 130 s"), "{}", e.message());
        assert!(step_of(Some("130"), 0, 7 * 86400).is_ok());
    }

    #[test]
    fn grid_groups_and_other() {
        let grid = Grid::new(95, 131, 10);
        assert_eq!(grid.timestamps(), [90, 100, 110, 120, 130]);
        let points = [
            point("n1", 90, 1),
            point("n1", 110, 2),
            point("n2", 110, 10),
            point("n3", 130, 4),
            point("n3", 140, 99),
        ];
        let groups = group(&points, &["node".to_string()], &grid);
        let values: Vec<Vec<i64>> = groups.iter().map(|g| g.dense(grid.len)).collect();
        assert_eq!(
            values,
            [
                vec![1, 0, 2, 0, 0],
                vec![0, 0, 10, 0, 0],
                vec![0, 0, 0, 0, 4]
            ]
        );
        let (kept, other) = keep_largest(groups, 2);
        let names: Vec<&str> = kept.iter().map(|g| g.labels["node"].as_str()).collect();
        assert_eq!(names, ["n2", "n3"]);
        let other = other.unwrap();
        assert_eq!(
            (other.total, other.dense(grid.len)),
            (3, vec![1, 0, 2, 0, 0])
        );
        let all = group(&points, &[], &grid);
        assert_eq!(all.len(), 1);
        assert_eq!(all[0].dense(grid.len), [1, 0, 12, 0, 4]);
    }
}
