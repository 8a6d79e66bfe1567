//! Every limit of a push, just within and just beyond, over real gRPC on both stores, with
//! the limits set small in a config file: a push at a limit is stored, one past it is refused
//! with the limit's key and value and counted on `/metrics` under that key; a stack past the
//! depth limit is stored cut at the root; samples of label sets past the tenant's
//! `max_label_sets` are refused and counted while the rest of the push is stored; a tenant
//! over its ingest rate is told to retry.

#[macro_use]
mod common;

use std::sync::Arc;

use common::hostile::{self, Pb, Profile};
use common::{Kind, call, enc, get_with, now_s, test_store};
use pyrometer_collector::api::AppState;
use pyrometer_collector::config::Config;
use pyrometer_proto::ingest::PUSH_PATH;
use pyrometer_proto::otlp::EXPORT_PATH;

for_each_store!(each_limit_within_and_beyond);

const CONFIG: &str = "
[limits]
max_samples = 20
max_sample_types = 3
max_stack_depth = 8
max_locations = 30
max_mappings = 4
max_functions = 30
max_strings = 60
max_string_bytes = 40
max_labels_per_sample = 4
max_label_name_bytes = 10
max_label_value_bytes = 12
max_dictionary_entries = 40
max_label_sets = 5
max_push_bytes = 4000
ingest_rate_mb = 0
";

/// A push of `samples` one-frame samples with `labels` labels each (of `name` and `value`
/// lengths), `types` sample types, `extra` more functions and locations, `mappings`
/// mappings, and each sample's `pid` label distinct when `distinct`.
struct Shape {
    samples: usize,
    types: usize,
    labels: usize,
    name: usize,
    value: usize,
    extra: usize,
    mappings: usize,
    depth: usize,
    distinct: bool,
}

const BASE: Shape = Shape {
    samples: 2,
    types: 1,
    labels: 1,
    name: 4,
    value: 4,
    extra: 0,
    mappings: 0,
    depth: 1,
    distinct: false,
};

fn build(s: &Shape, seq: u64, time_s: i64) -> Vec<u8> {
    let mut p = Profile::new();
    for t in 0..s.types {
        p.sample_type(&format!("t{t}"), "count");
    }
    for f in 0..(1 + s.extra) as u64 {
        p.function(f + 1, &format!("f{f}"));
        p.location(f + 1, f + 1, if f == 0 { s.depth } else { 1 });
    }
    for m in 0..s.mappings as u64 {
        p.pb.msg(3, Pb::default().int(1, m + 1));
    }
    for i in 0..s.samples {
        let mut labels = Vec::new();
        for l in 0..s.labels {
            let name = format!("{l}{}", "k".repeat(s.name.saturating_sub(1)));
            let value = if s.distinct {
                format!("{l}{i:0width$}", width = s.value - 1)
            } else {
                "v".repeat(s.value)
            };
            labels.push((p.s(&name), p.s(&value)));
        }
        let values = vec![1i64; s.types];
        p.sample(&[1], &values, &labels);
    }
    hostile::push("limits", seq, "n", &p.finish(time_s))
}

async fn each_limit_within_and_beyond(kind: Kind) {
    let dir =
        std::env::temp_dir().join(format!("pyrometer-limits-{kind:?}-{}", std::process::id()));
    let guard = tokio::task::spawn_blocking(move || test_store(kind, &dir))
        .await
        .unwrap();
    let config = Config::parse(CONFIG).unwrap();
    let state = Arc::new(AppState::new(guard.store.clone()).with_config(config));
    let addr = common::serve(state.clone()).await;
    let now = now_s();
    let mut seq = 0;
    let cases: Vec<(&str, Shape, Shape)> = vec![
        (
            "max_samples",
            Shape {
                samples: 20,
                ..BASE
            },
            Shape {
                samples: 21,
                ..BASE
            },
        ),
        (
            "max_sample_types",
            Shape { types: 3, ..BASE },
            Shape { types: 4, ..BASE },
        ),
        (
            "max_labels_per_sample",
            Shape { labels: 4, ..BASE },
            Shape { labels: 5, ..BASE },
        ),
        (
            "max_label_name_bytes",
            Shape { name: 10, ..BASE },
            Shape { name: 11, ..BASE },
        ),
        (
            "max_label_value_bytes",
            Shape { value: 12, ..BASE },
            Shape { value: 13, ..BASE },
        ),
        (
            "max_locations",
            Shape { extra: 29, ..BASE },
            Shape { extra: 30, ..BASE },
        ),
        (
            "max_mappings",
            Shape {
                mappings: 4,
                ..BASE
            },
            Shape {
                mappings: 5,
                ..BASE
            },
        ),
        (
            "max_string_bytes",
            Shape {
                value: 12,
                name: 10,
                ..BASE
            },
            Shape { value: 41, ..BASE },
        ),
        (
            "max_strings",
            Shape {
                samples: 20,
                labels: 2,
                value: 3,
                distinct: true,
                ..BASE
            },
            Shape {
                samples: 20,
                labels: 3,
                value: 3,
                distinct: true,
                ..BASE
            },
        ),
    ];
    for (key, within, beyond) in cases {
        seq += 1;
        let ok = call(addr, None, PUSH_PATH, build(&within, seq, now)).await;
        assert!(ok.is_ok(), "{key}: within the limit: {ok:?}");
        seq += 1;
        let e = call(addr, None, PUSH_PATH, build(&beyond, seq, now))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{key}: {e:?}");
        assert!(e.message().contains(key), "{key}: {}", e.message());
        assert_eq!(state.metrics.pushes_refused.get(key), 1, "{key}");
    }
    // A push over max_push_bytes is refused before it is read.
    let e = call(addr, None, PUSH_PATH, vec![0x0a; 4001])
        .await
        .unwrap_err();
    assert!(e.message().contains("4000"), "{e:?}");
    // A stack past the depth limit is stored with its leaf-most frames under a marker.
    seq += 1;
    call(
        addr,
        None,
        PUSH_PATH,
        build(&Shape { depth: 9, ..BASE }, seq, now),
    )
    .await
    .unwrap();
    let q = enc(r#"{node="n"}"#);
    let (_, folded) = get_with(
        addr,
        &format!("/api/v1/profile?format=folded&type=t0&query={q}"),
        None,
    )
    .await;
    assert!(
        folded
            .lines()
            .any(|l| l.starts_with(&format!("[truncated]{}", ";f0".repeat(7)))),
        "{folded}"
    );
    // Label sets: the store held one so far (every push above had the same labels but the
    // max_strings ones); up to five, samples of new ones beyond are refused, counted, and
    // the rest of the push is stored.
    seq += 1;
    let before = state
        .metrics
        .label_sets_refused
        .load(std::sync::atomic::Ordering::Relaxed);
    call(
        addr,
        None,
        PUSH_PATH,
        build(
            &Shape {
                samples: 10,
                distinct: true,
                value: 3,
                ..BASE
            },
            seq,
            now,
        ),
    )
    .await
    .unwrap();
    let refused = state
        .metrics
        .label_sets_refused
        .load(std::sync::atomic::Ordering::Relaxed)
        - before;
    assert!(refused >= 5, "{refused} samples refused");
    let (_, values) = get_with(addr, "/api/v1/label/0kkk/values", None).await;
    let values: serde_json::Value = serde_json::from_str(&values).unwrap();
    assert!(values["values"].as_array().unwrap().len() <= 5, "{values}");
    // OTLP: a dictionary's stack table within and beyond max_dictionary_entries.
    call(addr, None, EXPORT_PATH, hostile::otlp_long_stack(40, now))
        .await
        .unwrap();
    let e = call(addr, None, EXPORT_PATH, hostile::otlp_long_stack(41, now))
        .await
        .unwrap_err();
    assert!(e.message().contains("max_dictionary_entries"), "{e:?}");
    assert_eq!(
        state.metrics.pushes_refused.get("max_dictionary_entries"),
        1
    );
}
