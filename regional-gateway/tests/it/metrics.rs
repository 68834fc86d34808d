//! `/metrics` keeps the series operators' dashboards query: every name, label set and
//! histogram bucket the gateway exported before it moved to `prometheus-client`, in a valid
//! OpenMetrics page.

use crate::common;

use std::collections::BTreeSet;

/// One sample line as `name{label="v",...}` with its labels sorted and bucket bounds read as
/// numbers (`le="1"` and `le="1.0"` are the same bound to Prometheus).
fn series(line: &str) -> String {
    let (head, _value) = line.rsplit_once(' ').unwrap();
    let Some((name, labels)) = head.split_once('{') else {
        return head.to_string();
    };
    let mut labels: Vec<String> = labels
        .trim_end_matches('}')
        .split(',')
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap();
            let v = v.trim_matches('"');
            match (k, v.parse::<f64>()) {
                ("le", Ok(bound)) => format!("le={bound}"),
                _ => format!("{k}={v}"),
            }
        })
        .collect();
    labels.sort();
    format!("{name}{{{}}}", labels.join(","))
}

/// The bucket bounds of the gateway's histograms in seconds.
const SECONDS_BUCKETS: [&str; 12] = [
    "0.0005", "0.001", "0.0025", "0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1", "inf",
];

/// What the hand-written exposition exported (before `prometheus-client`).
fn expected() -> BTreeSet<String> {
    let mut all = BTreeSet::new();
    for source in ["local", "origin", "fallback"] {
        for outcome in ["allowed", "denied"] {
            all.insert(format!(
                "strata_decisions_total{{outcome={outcome},source={source}}}"
            ));
        }
    }
    for reason in ["cold", "stale", "strict", "lease"] {
        all.insert(format!("strata_origin_reasons_total{{reason={reason}}}"));
    }
    for le in [
        "0", "1", "2", "5", "10", "20", "50", "100", "1000", "10000", "inf",
    ] {
        all.insert(format!("strata_lease_size_bucket{{le={le}}}"));
    }
    all.insert("strata_lease_size_sum".into());
    all.insert("strata_lease_size_count".into());
    for op in ["read", "replay", "decide", "ping"] {
        for result in ["ok", "timeout", "circuit_open", "backend", "rejected"] {
            all.insert(format!(
                "strata_origin_calls_total{{op={op},result={result}}}"
            ));
        }
        for le in SECONDS_BUCKETS {
            all.insert(format!(
                "strata_origin_call_seconds_bucket{{le={le},op={op}}}"
            ));
        }
        all.insert(format!("strata_origin_call_seconds_sum{{op={op}}}"));
        all.insert(format!("strata_origin_call_seconds_count{{op={op}}}"));
    }
    for le in SECONDS_BUCKETS {
        all.insert(format!("strata_replay_pass_seconds_bucket{{le={le}}}"));
    }
    all.insert("strata_replay_pass_seconds_sum".into());
    all.insert("strata_replay_pass_seconds_count".into());
    for name in [
        "strata_replay_cells_total",
        "strata_lease_renewals_total",
        "strata_replay_dropped_total",
        "strata_replay_failed_batches_total",
        "strata_replay_queue_cells",
        "strata_local_windows",
        "strata_local_evictions_total",
        "strata_origin_breaker_open",
        "strata_origin_up",
        "strata_global_writes_total",
        "strata_global_write_errors_total",
        "strata_global_rows_written_total",
        "strata_global_sync_rows_applied_total",
        "strata_global_syncs_total",
        "strata_global_sync_errors_total",
        "strata_global_entries_created_total",
        "strata_global_rows_last_poll",
        "strata_global_unpublished_dropped_total",
        "strata_global_breaker_open",
        "strata_global_regions",
        "strata_global_alone",
    ] {
        all.insert(name.to_string());
    }
    all
}

#[tokio::test]
async fn every_series_dashboards_query_is_exported_in_valid_openmetrics() {
    let g = common::embedded(&[]).await;
    g.limit(None, "m", 5).await;
    let m = g.get("/metrics").await;
    assert_eq!(m.status, 200);
    assert_eq!(
        m.headers["content-type"],
        "application/openmetrics-text; version=1.0.0; charset=utf-8"
    );
    assert!(m.text.ends_with("# EOF\n"), "OpenMetrics ends with # EOF");
    let exported: BTreeSet<String> = m
        .text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(series)
        .collect();
    let missing: Vec<_> = expected().difference(&exported).cloned().collect();
    assert!(missing.is_empty(), "no longer exported: {missing:?}");
    // Each family is declared once, with its type, before its samples.
    for (family, kind) in [
        ("strata_decisions", "counter"),
        ("strata_lease_size", "histogram"),
        ("strata_origin_call_seconds", "histogram"),
        ("strata_replay_pass_seconds", "histogram"),
        ("strata_replay_queue_cells", "gauge"),
        ("strata_global_writes", "counter"),
    ] {
        let declared = format!("# TYPE {family} {kind}");
        assert_eq!(m.text.matches(&declared).count(), 1, "{declared}");
    }
    let value = |series: &str| common::metric_sum(&m.text, |l| l.starts_with(series));
    assert_eq!(
        value("strata_decisions_total{source=\"origin\",outcome=\"allowed\"}"),
        1.0
    );
    assert_eq!(value("strata_local_windows "), 1.0, "sampled at the scrape");
    assert_eq!(
        value("strata_origin_call_seconds_count{op=\"decide\"}"),
        1.0
    );
}
