//! `/trace/ID`: a permanent link from a trace id to its flame graph, for the link patterns of a
//! trace viewer (Jaeger, Grafana Tempo): it redirects to the web UI with the query
//! `{trace_id="ID"}` over the last week (samples carry the label when pyrometer-otel published
//! the span; see the book's tracing page).

use axum::extract::Path;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};

use crate::api::error::ApiError;

/// How far back a trace link looks.
const LOOKBACK: &str = "now-7d";

/// The trace id in W3C form (32 lowercase hex digits), or why `text` is not one.
pub fn parse_trace_id(text: &str) -> Result<String, String> {
    if text.len() == 32 && text.bytes().all(|b| b.is_ascii_hexdigit()) {
        Ok(text.to_ascii_lowercase())
    } else {
        Err(format!(
            "a trace id is 32 hex digits (W3C trace context), not '{}'",
            text.chars().take(80).collect::<String>()
        ))
    }
}

/// The web UI's address for the flame graph of trace `id` (already checked).
pub fn ui_location(id: &str) -> String {
    format!("/?view=flame&query=%7Btrace_id%3D%22{id}%22%7D&from={LOOKBACK}&to=now")
}

pub async fn trace(Path(id): Path<String>) -> Response {
    match parse_trace_id(&id) {
        Ok(id) => (
            StatusCode::SEE_OTHER,
            [(header::LOCATION, ui_location(&id))],
        )
            .into_response(),
        Err(why) => ApiError::bad_request(why).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trace_ids_are_32_hex_digits() {
        let id = "0AF7651916CD43DD8448EB211C80319C";
        assert_eq!(parse_trace_id(id).unwrap(), id.to_ascii_lowercase());
        assert!(parse_trace_id("0af7651916cd43dd").is_err());
        assert!(parse_trace_id(&"g".repeat(32)).is_err());
        assert_eq!(
            ui_location("ab"),
            "/?view=flame&query=%7Btrace_id%3D%22ab%22%7D&from=now-7d&to=now"
        );
    }
}
