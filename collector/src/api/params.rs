//! Query parameters and lookups several endpoints share.

use std::time::SystemTime;

use axum::http::StatusCode;
use serde::Deserialize;

use crate::api::error::ApiError;
use crate::query::parse_time;

pub fn now_s() -> i64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// The stored `(name, unit)` of sample type `name`, or the error that says which types exist.
pub(crate) fn sample_type<'a>(
    types: &'a [(String, String)],
    name: &str,
) -> Result<&'a (String, String), ApiError> {
    types.iter().find(|(n, _)| n == name).ok_or_else(|| {
        if types.is_empty() {
            return ApiError::new(StatusCode::NOT_FOUND, "the store holds no profiles yet");
        }
        let have: Vec<&str> = types.iter().map(|(n, _)| n.as_str()).collect();
        ApiError::bad_request(format!(
            "unknown sample type '{name}': the store has {}",
            have.join(", ")
        ))
    })
}

#[derive(Deserialize, Default)]
pub struct RangeParams {
    pub(crate) from: Option<String>,
    pub(crate) to: Option<String>,
}

impl RangeParams {
    /// `[from, to)` in seconds; defaults to the last hour.
    pub(crate) fn range(&self) -> Result<(i64, i64), ApiError> {
        let now = now_s();
        let to = match &self.to {
            Some(t) if !t.is_empty() => parse_time(t, now).map_err(ApiError::bad_request)?,
            _ => now,
        };
        let from = match &self.from {
            Some(f) if !f.is_empty() => parse_time(f, now).map_err(ApiError::bad_request)?,
            _ => to - 3600,
        };
        if from >= to {
            return Err(ApiError::bad_request(format!(
                "empty time range: from ({from}) must be before to ({to})"
            )));
        }
        // `to` is inclusive for users (a batch taken "now" is shown); buckets start before it.
        Ok((from, to + 1))
    }
}

/// `a, b,c` as `["a", "b", "c"]`: the labels of a `by` parameter.
pub(crate) fn label_list(text: Option<&str>) -> Vec<String> {
    text.unwrap_or("")
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect()
}
