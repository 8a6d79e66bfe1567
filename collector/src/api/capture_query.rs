//! Captures by label (`--query '{ray_actor="Trainer"}'`): which nodes and processes the
//! agents' recent pushes show under the matchers, for one request per node. The store
//! answers from the label sets it holds, in the tenant's query slots like any read.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::http::StatusCode;

use crate::api::access::{Reader, run_query, store_error};
use crate::api::error::ApiError;
use crate::api::state::AppState;
use crate::query::Selector;
use crate::store::BUCKET_SECONDS;

/// How far back pushes count: a process that has not been sampled for this long is not
/// captured (an agent pushes every 10 s by default, an idle process is sampled rarely).
pub const RECENT_S: i64 = 120;
/// Nodes one query may reach: each node's capture counts against the tenant's concurrent
/// captures, so more could never run.
const MAX_NODES: usize = 16;

/// The processes, by node, whose samples of the last [`RECENT_S`] the selector of `query`
/// matches (within `node` when one is given); an error when there are none.
pub async fn resolve(
    state: &Arc<AppState>,
    tenant: &str,
    query: &str,
    node: Option<String>,
) -> Result<Vec<(String, Vec<u32>)>, ApiError> {
    let selector = Selector::parse(query)
        .map_err(|e| ApiError::bad_request(format!("--query {query}: {e}")))?;
    let now = crate::api::params::now_s();
    let (from, to) = (now - RECENT_S, now + BUCKET_SECONDS);
    let reader = Reader(tenant.to_string());
    let st = state.clone();
    let own = Reader(tenant.to_string());
    let wanted = node.clone();
    let found = run_query(state, &reader, move |store| {
        let matches = |l: &crate::store::LabelSet| {
            own.owns(l)
                && selector.matches(l)
                && wanted
                    .as_deref()
                    .is_none_or(|n| l.get("node").map(String::as_str) == Some(n))
        };
        let nodes = store
            .label_values("node", from, to, &matches)
            .map_err(|e| store_error(&st, e))?;
        let mut found = BTreeMap::new();
        for n in nodes.into_iter().filter(|n| !n.is_empty()) {
            let on_node = |l: &crate::store::LabelSet| matches(l) && l.get("node") == Some(&n);
            let pids: Vec<u32> = store
                .label_values("pid", from, to, &on_node)
                .map_err(|e| store_error(&st, e))?
                .iter()
                .filter_map(|p| p.parse().ok())
                .filter(|&p| p != 0)
                .collect();
            if !pids.is_empty() {
                found.insert(n, pids);
            }
        }
        Ok(found)
    })
    .await?;
    if found.is_empty() {
        let within = node.map(|n| format!(" on node '{n}'")).unwrap_or_default();
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!(
                "no process{within} matches {query} in the last {RECENT_S} s of the agents' \
                 pushes: check the labels (GET /api/v1/label/NAME/values)"
            ),
        ));
    }
    if found.len() > MAX_NODES {
        return Err(ApiError::bad_request(format!(
            "{query} matches processes on {} nodes, at most {MAX_NODES}: narrow it (e.g. with \
             node=\"…\")",
            found.len()
        )));
    }
    let max = pyrometer_proto::capture::MAX_PIDS;
    if let Some((n, pids)) = found.iter().find(|(_, p)| p.len() > max) {
        return Err(ApiError::bad_request(format!(
            "{query} matches {} processes on node '{n}', at most {max}: narrow it",
            pids.len()
        )));
    }
    Ok(found.into_iter().collect())
}
