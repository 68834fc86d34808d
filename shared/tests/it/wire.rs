//! The gateway API v1 wire types: shapes, defaults, and validation errors with their codes.

use strata_core::wire::{
    CellsResponse, DecideRequest, DecideResponse, DecideResult, ErrorCode, MAX_BATCH, MAX_COUNT,
    MAX_MULTI_LIMITS, MAX_SEQUENCE, MultiRequest, RatelimitRequest, RatelimitResponse, ReadRequest,
    RenewedLease, ReplayPace, ReplayRequest,
};
use strata_core::{Counts, Decision, PublishPolicy};

fn parse<T: serde::de::DeserializeOwned>(json: &str) -> T {
    serde_json::from_str(json).unwrap()
}

#[test]
fn cost_defaults_to_one_and_the_key_is_bound_to_the_callers_workspace() {
    let req: RatelimitRequest =
        parse(r#"{"namespace":"api","identifier":"user:{1}","limit":10,"duration":60000}"#);
    let limit = req.validate("acme").unwrap();
    assert_eq!(limit.cost, 1);
    assert_eq!(limit.key.workspace(), "acme");
    assert_eq!(limit.key.identifier(), "user:{1}");
    assert_eq!(limit.key.duration().as_ms(), 60_000);
}

#[test]
fn invalid_fields_are_named_in_a_400() {
    let cases = [
        (
            r#"{"namespace":"","identifier":"a","limit":1,"duration":60000}"#,
            "namespace: namespace must not be empty",
        ),
        (
            r#"{"namespace":"n","identifier":"a","limit":1,"duration":999}"#,
            "duration: duration must be between",
        ),
        (
            r#"{"namespace":"n","identifier":"a","limit":9007199254740992,"duration":1000}"#,
            "limit: must be at most",
        ),
        (
            r#"{"namespace":"n","identifier":"a","limit":1,"duration":1000,"cost":9007199254740992}"#,
            "cost: must be at most",
        ),
    ];
    for (json, message) in cases {
        let req: RatelimitRequest = parse(json);
        let err = req.validate("ws").unwrap_err();
        assert_eq!(err.code, ErrorCode::InvalidRequest);
        assert_eq!(err.code.status(), 400);
        assert!(err.message.starts_with(message), "{json}: {}", err.message);
    }
    let long = format!(
        r#"{{"namespace":"n","identifier":"{}","limit":1,"duration":1000}}"#,
        "x".repeat(256)
    );
    let err = parse::<RatelimitRequest>(&long).validate("ws").unwrap_err();
    assert_eq!(
        err.message,
        "identifier: identifier is 256 bytes, at most 255 are allowed"
    );
    let ok = parse::<RatelimitRequest>(&format!(
        r#"{{"namespace":"n","identifier":"{}","limit":{MAX_COUNT},"duration":2592000000}}"#,
        "é".repeat(127)
    ));
    assert!(
        ok.validate("ws").is_ok(),
        "255 bytes, the largest count and 30 days are in bounds"
    );
}

#[test]
fn malformed_json_is_a_parse_error_not_a_panic() {
    for json in [
        r#"{"namespace":"n","identifier":"a","limit":-1,"duration":1000}"#,
        r#"{"namespace":"n","identifier":"a","limit":1.5,"duration":1000}"#,
        r#"{"namespace":"n","limit":1,"duration":1000}"#,
        r#"{"namespace":"n","identifier":"a","limit":1,"duration":1000"#,
        r#"[]"#,
    ] {
        assert!(
            serde_json::from_str::<RatelimitRequest>(json).is_err(),
            "{json}"
        );
    }
}

#[test]
fn batches_are_bounded_with_413_and_empty_multi_is_400() {
    let one = r#"{"namespace":"n","identifier":"a","limit":1,"duration":1000}"#;
    let multi: MultiRequest = parse(&format!(
        r#"{{"limits":[{}]}}"#,
        vec![one; MAX_MULTI_LIMITS + 1].join(",")
    ));
    let err = multi.validate("ws").unwrap_err();
    assert_eq!(err.code, ErrorCode::PayloadTooLarge);
    assert_eq!(err.code.status(), 413);
    let multi: MultiRequest = parse(&format!(
        r#"{{"limits":[{}]}}"#,
        vec![one; MAX_MULTI_LIMITS].join(",")
    ));
    assert_eq!(multi.validate("ws").unwrap().len(), MAX_MULTI_LIMITS);
    let empty: MultiRequest = parse(r#"{"limits":[]}"#);
    assert_eq!(
        empty.validate("ws").unwrap_err().code,
        ErrorCode::InvalidRequest
    );

    let cell = r#"{"namespace":"n","identifier":"a","duration":1000,"sequence":5}"#;
    let read: ReadRequest = parse(&format!(
        r#"{{"cells":[{}]}}"#,
        vec![cell; MAX_BATCH + 1].join(",")
    ));
    assert_eq!(
        read.validate("ws").unwrap_err().code,
        ErrorCode::PayloadTooLarge
    );

    let event =
        r#"{"namespace":"n","identifier":"a","duration":1000,"sequence":5,"used":1,"limit":5}"#;
    let replay = |n: usize| -> ReplayRequest {
        parse(&format!(
            r#"{{"instance":"e1","events":[{}]}}"#,
            vec![event; n].join(",")
        ))
    };
    assert_eq!(replay(MAX_BATCH).validate("ws").unwrap().len(), MAX_BATCH);
    let err = replay(MAX_BATCH + 1).validate("ws").unwrap_err();
    assert_eq!(
        (err.code, err.code.status()),
        (ErrorCode::PayloadTooLarge, 413)
    );
    assert!(err.message.starts_with("events: "), "{}", err.message);

    let limit = r#"{"namespace":"n","identifier":"a","limit":1,"duration":1000}"#;
    let decide: DecideRequest = parse(&format!(
        r#"{{"instance":"e1","limits":[{}]}}"#,
        vec![limit; MAX_MULTI_LIMITS + 1].join(",")
    ));
    assert_eq!(
        decide.validate("ws").unwrap_err().code,
        ErrorCode::PayloadTooLarge
    );
    let empty: DecideRequest = parse(r#"{"instance":"e1","limits":[]}"#);
    assert_eq!(
        empty.validate("ws").unwrap_err().code,
        ErrorCode::InvalidRequest
    );
}

#[test]
fn errors_in_a_batch_name_their_index() {
    let multi: MultiRequest = parse(
        r#"{"limits":[{"namespace":"n","identifier":"a","limit":1,"duration":1000},
                      {"namespace":"n","identifier":"","limit":1,"duration":1000}]}"#,
    );
    assert_eq!(
        multi.validate("ws").unwrap_err().message,
        "limits[1].identifier: identifier must not be empty"
    );
    let replay: ReplayRequest = parse(
        r#"{"instance":"e1","events":[{"namespace":"n","identifier":"a","duration":1000,"sequence":5,"used":1,"limit":5},
                                      {"namespace":"n","identifier":"a","duration":1000,"sequence":18446744073709551615,"used":1,"limit":5}]}"#,
    );
    assert_eq!(
        replay.validate("ws").unwrap_err().message,
        format!("events[1].sequence: must be at most {MAX_SEQUENCE}, got 18446744073709551615")
    );
}

#[test]
fn replay_and_read_validate_to_cells() {
    let replay: ReplayRequest = parse(
        r#"{"instance":"e1","events":[{"namespace":"n","identifier":"a","duration":1000,"sequence":1700000000,"used":3,"limit":5},
                                      {"namespace":"n","identifier":"b","duration":1000,"sequence":1700000000,"used":0,"limit":5,"release":1700000006000}]}"#,
    );
    let events = replay.validate("ws").unwrap();
    assert_eq!(events[0].cell.sequence, 1_700_000_000);
    assert_eq!(events[0].cell.key.identifier(), "a");
    assert_eq!(
        (events[0].used, events[0].limit, events[0].release),
        (3, 5, 0),
        "release defaults to none"
    );
    assert_eq!(
        (events[1].cell.key.identifier(), events[1].release),
        ("b", 1_700_000_006_000)
    );
    let read: ReadRequest = parse(r#"{"cells":[]}"#);
    assert!(read.validate("ws").unwrap().is_empty());
}

#[test]
fn replay_requires_a_plain_instance_id_and_a_bounded_used() {
    let event =
        r#"{"namespace":"n","identifier":"a","duration":1000,"sequence":5,"used":1,"limit":5}"#;
    let missing = serde_json::from_str::<ReplayRequest>(&format!(r#"{{"events":[{event}]}}"#))
        .unwrap_err()
        .to_string();
    assert!(missing.contains("instance"), "{missing}");
    for (instance, ok) in [("edge-7f3a_01", true), ("", false), ("a/b", false)] {
        let req: ReplayRequest = parse(&format!(
            r#"{{"instance":"{instance}","events":[{event}]}}"#
        ));
        let result = req.validate("ws");
        assert_eq!(result.is_ok(), ok, "{instance:?}");
        if let Err(e) = result {
            assert!(e.message.starts_with("instance: "), "{}", e.message);
        }
    }
    let too_much: ReplayRequest = parse(
        r#"{"instance":"e1","events":[{"namespace":"n","identifier":"a","duration":1000,"sequence":5,"used":9007199254740992,"limit":5}]}"#,
    );
    let err = too_much.validate("ws").unwrap_err();
    assert_eq!(err.code, ErrorCode::InvalidRequest);
    assert!(
        err.message.starts_with("events[0].used: must be at most"),
        "{}",
        err.message
    );
}

#[test]
fn decide_requires_a_plain_instance_id_and_reads_the_lease_fields() {
    let limit = r#"{"namespace":"n","identifier":"a","limit":1,"duration":1000,"cost":1}"#;
    for (instance, ok) in [
        ("edge-7f3a_01", true),
        ("", false),
        ("has space", false),
        (&"x".repeat(65), false),
    ] {
        let req: DecideRequest = parse(&format!(
            r#"{{"instance":"{instance}","limits":[{limit}]}}"#
        ));
        assert_eq!(req.validate("ws").is_ok(), ok, "{instance:?}");
    }
    // Defaults: cost 1, no sequence (the origin's), nothing used, no lease asked.
    let req: DecideRequest = parse(
        r#"{"instance":"e1","limits":[{"namespace":"n","identifier":"a","limit":9,"duration":1000}]}"#,
    );
    let limits = req.validate("ws").unwrap();
    assert_eq!(
        (
            limits[0].limit.cost,
            limits[0].sequence,
            limits[0].used,
            limits[0].want
        ),
        (1, None, [0, 0], 0)
    );
    let req: DecideRequest = parse(
        r#"{"instance":"e1","limits":[{"namespace":"n","identifier":"a","limit":9,"duration":1000,
            "sequence":1700000000,"used":4,"used_previous":7,"decided":1,"decided_previous":2,"want":8}]}"#,
    );
    let limits = req.validate("ws").unwrap();
    assert_eq!(
        (
            limits[0].sequence,
            limits[0].used,
            limits[0].decided,
            limits[0].want
        ),
        (Some(1_700_000_000), [4, 7], [1, 2], 8)
    );
    for field in [
        "used",
        "used_previous",
        "decided",
        "decided_previous",
        "want",
    ] {
        let too_much: DecideRequest = parse(&format!(
            r#"{{"instance":"e1","limits":[{limit},{{"namespace":"n","identifier":"a","limit":9,"duration":1000,"{field}":9007199254740992}}]}}"#
        ));
        let err = too_much.validate("ws").unwrap_err();
        assert_eq!(err.code, ErrorCode::InvalidRequest);
        assert!(
            err.message
                .starts_with(&format!("limits[1].{field}: must be at most {MAX_COUNT}")),
            "{field}: {}",
            err.message
        );
        let at_most: DecideRequest = parse(&format!(
            r#"{{"instance":"e1","limits":[{{"namespace":"n","identifier":"a","limit":9,"duration":1000,"{field}":{MAX_COUNT}}}]}}"#
        ));
        assert!(at_most.validate("ws").is_ok(), "{field} at {MAX_COUNT}");
    }
    let far: DecideRequest = parse(
        r#"{"instance":"e1","limits":[{"namespace":"n","identifier":"a","limit":9,"duration":1000,"sequence":18446744073709551615}]}"#,
    );
    assert_eq!(
        far.validate("ws").unwrap_err().message,
        format!("limits[0].sequence: must be at most {MAX_SEQUENCE}, got 18446744073709551615")
    );
    let missing = serde_json::from_str::<DecideRequest>(&format!(r#"{{"limits":[{limit}]}}"#))
        .unwrap_err()
        .to_string();
    assert!(missing.contains("instance"), "{missing}");
}

#[test]
fn responses_have_the_contract_shape() {
    let d = Decision {
        success: true,
        limit: 10,
        remaining: 7,
        reset_ms: 60_000,
        retry_after_ms: Some(0),
    };
    let json = serde_json::to_string(&RatelimitResponse::from(&d)).unwrap();
    assert_eq!(
        json,
        r#"{"success":true,"limit":10,"remaining":7,"reset":60000}"#
    );
    let cells = CellsResponse {
        cells: vec![Counts {
            regional: 4,
            global: 2,
        }],
        renewed: Vec::new(),
        pace: None,
    };
    assert_eq!(
        serde_json::to_string(&cells).unwrap(),
        r#"{"cells":[{"regional":4,"global":2}]}"#
    );
    let renewed = CellsResponse {
        renewed: vec![RenewedLease {
            event: 0,
            lease_id: 12,
            lease_ms: 5_000,
        }],
        ..cells
    };
    let json = serde_json::to_string(&renewed).unwrap();
    assert_eq!(
        json,
        r#"{"cells":[{"regional":4,"global":2}],"renewed":[{"event":0,"lease_id":12,"lease_ms":5000}]}"#
    );
    assert_eq!(
        serde_json::from_str::<CellsResponse>(&json).unwrap(),
        renewed
    );
    let paced = CellsResponse {
        renewed: Vec::new(),
        pace: Some(ReplayPace::new(
            false,
            PublishPolicy::from_fraction(0.05).unwrap(),
            500,
        )),
        ..renewed.clone()
    };
    let json = serde_json::to_string(&paced).unwrap();
    assert_eq!(
        json,
        r#"{"cells":[{"regional":4,"global":2}],"pace":{"alone":false,"publish_floor_ppm":50000,"flush_ms":500}}"#
    );
    let back = serde_json::from_str::<CellsResponse>(&json).unwrap();
    assert_eq!(back, paced);
    assert_eq!(
        back.pace.and_then(|p| p.publish()),
        PublishPolicy::from_fraction(0.05).ok()
    );
    let alone = r#"{"cells":[],"pace":{"alone":true,"publish_floor_ppm":200000}}"#;
    let alone = serde_json::from_str::<CellsResponse>(alone).unwrap();
    assert_eq!(alone.pace.map(|p| p.publish()), Some(None));
    let decided = DecideResponse {
        success: true,
        sequence: 7,
        results: vec![DecideResult {
            success: true,
            limit: 10,
            remaining: 4,
            reset: 8_000,
            sequence: 7,
            current: Counts {
                regional: 5,
                global: 1,
            },
            previous: Counts::default(),
            used: 2,
            lease: 3,
            lease_id: 7,
            lease_ms: 5_000,
            covers: true,
        }],
    };
    let json = serde_json::to_string(&decided).unwrap();
    assert_eq!(
        json,
        r#"{"success":true,"sequence":7,"results":[{"success":true,"limit":10,"remaining":4,"reset":8000,"sequence":7,"current":{"regional":5,"global":1},"previous":{"regional":0,"global":0},"used":2,"lease":3,"lease_id":7,"lease_ms":5000,"covers":true}]}"#
    );
    assert_eq!(
        serde_json::from_str::<DecideResponse>(&json).unwrap(),
        decided
    );
    // An origin that predates covering leases lends plain ones.
    let older = json.replace(r#","covers":true"#, "");
    let older = serde_json::from_str::<DecideResponse>(&older).unwrap();
    assert!(!older.results[0].covers);
    let err = strata_core::wire::WireError::new(ErrorCode::Unauthorized, "missing bearer token");
    assert_eq!(
        serde_json::to_string(&err.body()).unwrap(),
        r#"{"error":{"code":"unauthorized","message":"missing bearer token"}}"#
    );
}

#[test]
fn origin_requests_have_the_contract_shape() {
    use strata_core::wire::{DecideLimitRequest, ReplayEvent};
    let decide = DecideRequest {
        instance: "e1".into(),
        limits: vec![DecideLimitRequest {
            namespace: "n".into(),
            identifier: "a".into(),
            limit: 10,
            duration: 1_000,
            cost: 1,
            sequence: Some(7),
            used: 4,
            used_previous: 2,
            decided: 0,
            decided_previous: 3,
            want: 8,
            release: 0,
            call: 0,
            undo_from: 0,
        }],
        shares: true,
    };
    let json = serde_json::to_string(&decide).unwrap();
    assert_eq!(
        json,
        r#"{"instance":"e1","limits":[{"namespace":"n","identifier":"a","limit":10,"duration":1000,"cost":1,"sequence":7,"used":4,"used_previous":2,"decided_previous":3,"want":8}],"shares":true}"#
    );
    assert_eq!(
        serde_json::from_str::<DecideRequest>(&json).unwrap(),
        decide
    );
    // A caller that predates covering leases is lent plain ones.
    let older = json.replace(r#","shares":true"#, "");
    assert!(
        !serde_json::from_str::<DecideRequest>(&older)
            .unwrap()
            .shares
    );
    let event = |release, renew| ReplayEvent {
        namespace: "n".into(),
        identifier: "a".into(),
        duration: 1_000,
        sequence: 7,
        used: 3,
        limit: 10,
        release,
        acked: 0,
        renew,
        undo_from: 0,
    };
    let replay = ReplayRequest {
        instance: "e1".into(),
        events: vec![event(0, 0), event(9, 0), event(0, 4)],
    };
    let json = serde_json::to_string(&replay).unwrap();
    assert_eq!(
        json,
        r#"{"instance":"e1","events":[{"namespace":"n","identifier":"a","duration":1000,"sequence":7,"used":3,"limit":10},{"namespace":"n","identifier":"a","duration":1000,"sequence":7,"used":3,"limit":10,"release":9},{"namespace":"n","identifier":"a","duration":1000,"sequence":7,"used":3,"limit":10,"renew":4}]}"#,
        "release and renew are written only when set"
    );
    assert_eq!(
        serde_json::from_str::<ReplayRequest>(&json).unwrap(),
        replay
    );
}

#[test]
fn integers_may_be_written_as_integral_floats_and_nothing_looser() {
    // JSON Schema's integer: `1000.0` is 1000. A fraction, a sign or an inexact float is not.
    let r: RatelimitRequest =
        parse(r#"{"namespace":"n","identifier":"a","limit":5.0,"duration":1000.0,"cost":2e0}"#);
    assert_eq!((r.limit, r.duration, r.cost), (5, 1_000, 2));
    let d: DecideRequest = parse(
        r#"{"instance":"e1","limits":[{"namespace":"n","identifier":"a","limit":9,"duration":1000,"sequence":7.0,"want":3.0}]}"#,
    );
    assert_eq!((d.limits[0].sequence, d.limits[0].want), (Some(7), 3));
    let null: DecideRequest = parse(
        r#"{"instance":"e1","limits":[{"namespace":"n","identifier":"a","limit":9,"duration":1000,"sequence":null}]}"#,
    );
    assert_eq!(null.limits[0].sequence, None);
    for bad in [
        "1.5",
        "-1",
        "-1.0",
        "9007199254740994.0",
        "1e300",
        "\"5\"",
        "true",
    ] {
        let json = format!(r#"{{"namespace":"n","identifier":"a","limit":{bad},"duration":1000}}"#);
        let err = serde_json::from_str::<RatelimitRequest>(&json).unwrap_err();
        assert!(
            err.to_string().contains("expected a non-negative integer"),
            "{bad}: {err}"
        );
    }
}

#[test]
fn a_sequence_past_the_longest_windows_range_is_refused() {
    let at = |sequence: u64| {
        parse::<ReadRequest>(&format!(
            r#"{{"cells":[{{"namespace":"n","identifier":"a","duration":1000,"sequence":{sequence}}}]}}"#
        ))
    };
    assert!(at(MAX_SEQUENCE).validate("ws").is_ok());
    let err = at(MAX_SEQUENCE + 1).validate("ws").unwrap_err();
    assert_eq!(err.code, ErrorCode::InvalidRequest);
    assert!(
        err.message
            .starts_with("cells[0].sequence: must be at most"),
        "{}",
        err.message
    );
    // The window after the last allowed one still starts within u64 milliseconds.
    let longest = strata_core::window::MAX_DURATION_MS;
    assert!((MAX_SEQUENCE + 2).checked_mul(longest).is_some());
}
