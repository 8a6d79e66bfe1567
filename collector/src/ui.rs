//! The web UI's files, compiled into the binary so the collector serves its UI with no network
//! and no files beside it. The page (`ui/index.html`) loads the others from `/ui/`.

use axum::extract::Path;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};

/// `(path under /ui/, content type, content)`.
const ASSETS: &[(&str, &str, &str)] = &[
    ("style.css", CSS, include_str!("ui/style.css")),
    ("flame.js", JS, include_str!("ui/flame.js")),
    ("views.js", JS, include_str!("ui/views.js")),
    ("app.js", JS, include_str!("ui/app.js")),
    ("capture.js", JS, include_str!("ui/capture.js")),
    (
        "vendor/uPlot.iife.min.js",
        JS,
        include_str!("ui/vendor/uPlot.iife.min.js"),
    ),
    (
        "vendor/uPlot.min.css",
        CSS,
        include_str!("ui/vendor/uPlot.min.css"),
    ),
];

const JS: &str = "text/javascript; charset=utf-8";
const CSS: &str = "text/css; charset=utf-8";

pub async fn index() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        include_str!("ui/index.html"),
    )
}

pub async fn asset(Path(path): Path<String>) -> Response {
    match ASSETS.iter().find(|(p, _, _)| *p == path) {
        Some((_, content_type, body)) => (
            [
                (header::CONTENT_TYPE, *content_type),
                // Files change only with the binary; a restart after an upgrade must not
                // mix an old cached script with a new page.
                (header::CACHE_CONTROL, "no-cache"),
            ],
            *body,
        )
            .into_response(),
        None => (StatusCode::NOT_FOUND, "no such file").into_response(),
    }
}
