//! The rule model and the gate of the Wasm shells: what each action puts in the descriptor
//! and when it makes a rule not apply, the match conditions, the identifier's encoding, the
//! duration and cost forms, that every configuration error names its field, and the gate's
//! request path (shadow rules never deny, enforced rules decide all or nothing, the reply's
//! status, headers and body, and the options that shape it). Property tests: the parser
//! never panics, the encoding is injective, a missing header drops its rule, a shadow rule
//! never denies, and two limits admit the smaller.

use std::collections::HashMap;

use proptest::prelude::*;
use serde_json::{Value, json};
use strata_core::address::ClientAddress;
use strata_core::driver::{Decided, DecidedBy, Started, TableStore};
use strata_core::gate::{Gate, GateError, GateOptions, REPLY_HEADER_NAMES, Reply};
use strata_core::identity::{DIGEST_MARKER, MAX_IDENTIFIER_BYTES, identifier_for};
use strata_core::rules::{
    Applied, ListRequest, MAX_RULES, RequestError, RequestView, RuleError, RuleSet,
    normalized_path, parse_duration_ms, push_entry,
};
use strata_core::{CounterTable, FailureMode, TableConfig};
use support::driver;

use crate::support;

const T0: u64 = 28_333_334 * 60_000; // a minute boundary

// ---- A request --------------------------------------------------------------------------

/// A request as a shell would present it (header names in lower case): the core's
/// `ListRequest`, built by the methods below.
type Req = ListRequest;

fn get(path: &str) -> Req {
    ListRequest {
        method: "GET".into(),
        host: "api.example.com".into(),
        path: path.into(),
        headers: Vec::new(),
        peer: Some("192.0.2.1".into()),
    }
}

/// Builder steps (named apart from `RequestView`'s accessors).
trait Build {
    fn with_method(self, method: &str) -> Self;
    fn with_host(self, host: &str) -> Self;
    fn with_peer(self, peer: Option<&str>) -> Self;
    fn with_header(self, name: &str, value: &str) -> Self;
    fn with_bytes(self, name: &str, value: &[u8]) -> Self;
}

impl Build for Req {
    fn with_method(mut self, method: &str) -> Self {
        self.method = method.into();
        self
    }

    fn with_host(mut self, host: &str) -> Self {
        self.host = host.into();
        self
    }

    fn with_peer(mut self, peer: Option<&str>) -> Self {
        self.peer = peer.map(Into::into);
        self
    }

    fn with_header(self, name: &str, value: &str) -> Self {
        self.with_bytes(name, value.as_bytes())
    }

    fn with_bytes(mut self, name: &str, value: &[u8]) -> Self {
        self.headers
            .push((name.to_ascii_lowercase(), value.to_vec()));
        self
    }
}

// ---- Helpers ----------------------------------------------------------------------------

/// A rule in namespace `api`, 10 a minute, with `actions`, and `extra` fields merged in.
fn rule(actions: Value, extra: Value) -> Value {
    let mut r = json!({"namespace": "api", "limit": 10, "duration": 60_000, "actions": actions});
    if let (Value::Object(r), Value::Object(extra)) = (&mut r, extra) {
        r.extend(extra);
    }
    r
}

fn set(rules: &[Value]) -> RuleSet {
    let text = json!({ "rules": rules }).to_string();
    RuleSet::from_json(&text).unwrap_or_else(|e| panic!("{text}: {e}"))
}

fn one(actions: Value, extra: Value) -> RuleSet {
    set(&[rule(actions, extra)])
}

fn error(rules: &[Value]) -> RuleError {
    let text = json!({ "rules": rules }).to_string();
    match RuleSet::from_json(&text) {
        Ok(_) => panic!("{text} was accepted"),
        Err(e) => e,
    }
}

/// The identifiers of the rules `request` is subject to.
fn ids(rules: &RuleSet, request: &Req) -> Vec<String> {
    rules
        .apply(request)
        .unwrap()
        .into_iter()
        .map(|a| a.identifier)
        .collect()
}

fn header_action(header: &str, key: &str) -> Value {
    json!({"request_headers": {"header_name": header, "descriptor_key": key}})
}

fn generic(value: &str) -> Value {
    json!({"generic_key": {"descriptor_value": value}})
}

fn table() -> CounterTable {
    CounterTable::new(TableConfig::default(), 0x5eed)
}

fn gate(rules: &[Value], options: &str) -> Gate {
    Gate::from_json("ws", &json!({ "rules": rules }).to_string(), options).unwrap()
}

/// `request` through the shells' request path (the core's driver) on `table`, every gateway
/// call failed (decided from local memory, per the table's failure mode): what was decided,
/// and its reply.
fn run(gate: &Gate, table: &mut CounterTable, request: &Req, now: u64) -> (Decided, Reply) {
    let decided = try_run(gate, table, request, now).unwrap();
    let reply = decided.reply.clone();
    (decided, reply)
}

/// [`run`], or the client error the request is.
fn try_run(
    gate: &Gate,
    table: &mut CounterTable,
    request: &Req,
    now: u64,
) -> Result<Decided, RequestError> {
    let held = std::mem::replace(table, CounterTable::new(TableConfig::default(), 0));
    let mut store = TableStore {
        table: held,
        instance: "test".into(),
    };
    let decided = support::without_gateway(&mut driver(gate), &mut store, 1, request, now);
    *table = store.table;
    decided
}

fn header<'r>(reply: &'r Reply, name: &str) -> Option<&'r str> {
    reply
        .headers
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, v)| v.as_str())
}

// ---- Actions ----------------------------------------------------------------------------

#[test]
fn request_headers_makes_an_entry_or_drops_the_rule() {
    let rules = one(json!([header_action("X-User", "user")]), json!({}));
    assert_eq!(
        ids(&rules, &get("/").with_header("x-user", "u-1")),
        ["user=u-1"]
    );
    assert_eq!(ids(&rules, &get("/")), Vec::<String>::new());
    // An empty value is still a value.
    assert_eq!(ids(&rules, &get("/").with_header("x-user", "")), ["user="]);
}

#[test]
fn skip_if_absent_drops_only_its_entry() {
    let rules = one(
        json!([
            {"request_headers": {"header_name": "x-user", "descriptor_key": "user", "skip_if_absent": true}},
            generic("all"),
        ]),
        json!({}),
    );
    assert_eq!(
        ids(&rules, &get("/").with_header("x-user", "u-1")),
        ["user=u-1&generic_key=all"]
    );
    assert_eq!(ids(&rules, &get("/")), ["generic_key=all"]);

    // Every entry skipped: nothing to limit by, so the rule does not apply.
    let alone = one(
        json!([{"request_headers": {"header_name": "x-user", "descriptor_key": "user", "skip_if_absent": true}}]),
        json!({}),
    );
    assert!(alone.apply(&get("/")).unwrap().is_empty());
    assert_eq!(
        ids(&alone, &get("/").with_header("x-user", "u")),
        ["user=u"]
    );
}

#[test]
fn remote_address_is_the_peer_by_default_and_never_a_header_a_client_writes() {
    let rules = one(json!([{"remote_address": {}}]), json!({}));
    assert_eq!(rules.client_address(), &ClientAddress::Peer);
    let forged = get("/")
        .with_header("CF-Connecting-IP", "203.0.113.9")
        .with_header("X-Forwarded-For", "198.51.100.7, 10.0.0.1");
    assert_eq!(ids(&rules, &forged), ["remote_address=192.0.2.1"]);
    let v6 = get("/").with_peer(Some("[2001:db8::1]:443"));
    assert_eq!(ids(&rules, &v6), ["remote_address=2001:db8::1"]);
    let with_port = get("/").with_peer(Some("198.51.100.4:50000"));
    assert_eq!(ids(&rules, &with_port), ["remote_address=198.51.100.4"]);

    // No address, or one that is not an IP address: the rule does not apply, and it is said.
    for peer in [None, Some(""), Some("unix:/tmp/s"), Some("envoy-internal")] {
        let req = get("/").with_peer(peer);
        let applies = rules.applies(&req).unwrap();
        assert!(applies.limits.is_empty() && applies.unaddressed, "{peer:?}");
    }
    let other = one(json!([generic("g")]), json!({}));
    assert!(
        !other
            .applies(&get("/").with_peer(None))
            .unwrap()
            .unaddressed
    );
}

#[test]
fn remote_address_reads_only_the_configured_source() {
    let with = |source: &str, hops: u32| {
        one(json!([{"remote_address": {}}]), json!({}))
            .with_client_address(ClientAddress::parse(source, hops).unwrap())
    };
    let req = get("/")
        .with_header("cf-connecting-ip", " 203.0.113.9 ")
        .with_header("x-forwarded-for", "6.6.6.6, 198.51.100.7,10.0.0.1");

    let cf = with("CF-Connecting-IP", 0);
    assert_eq!(ids(&cf, &req), ["remote_address=203.0.113.9"]);
    assert_eq!(cf.reads().headers, ["cf-connecting-ip"]);
    assert!(!cf.reads().peer);
    let bad = get("/").with_header("cf-connecting-ip", "6.6.6.6, 7.7.7.7");
    assert!(
        cf.applies(&bad).unwrap().unaddressed,
        "one address, or none"
    );
    assert!(
        cf.applies(&get("/")).unwrap().unaddressed,
        "no peer fallback"
    );

    // X-Forwarded-For counts from the right: the last entry is the connecting proxy's.
    assert_eq!(
        ids(&with("x-forwarded-for", 0), &req),
        ["remote_address=10.0.0.1"]
    );
    assert_eq!(
        ids(&with("x-forwarded-for", 1), &req),
        ["remote_address=198.51.100.7"]
    );
    assert_eq!(
        ids(&with("x-forwarded-for", 2), &req),
        ["remote_address=6.6.6.6"]
    );
    let short = with("x-forwarded-for", 3);
    assert!(
        short.applies(&req).unwrap().unaddressed,
        "fewer entries than hops"
    );
    let junk = get("/").with_header("x-forwarded-for", "10.0.0.1, not-an-ip");
    assert!(
        with("x-forwarded-for", 0)
            .applies(&junk)
            .unwrap()
            .unaddressed
    );

    let none = with("none", 0);
    assert!(none.applies(&req).unwrap().unaddressed);
    assert_eq!(none.reads(), strata_core::rules::Reads::default());
}

#[test]
fn client_address_settings_are_checked() {
    for (source, hops, want) in [
        ("peer", 0, Ok(ClientAddress::Peer)),
        ("NONE", 0, Ok(ClientAddress::None)),
        (
            "x-forwarded-for",
            2,
            Ok(ClientAddress::ForwardedFor { trusted_hops: 2 }),
        ),
        (
            "X-Real-IP",
            0,
            Ok(ClientAddress::Header("x-real-ip".into())),
        ),
        ("x-forwarded-for", 17, Err("xff_num_trusted_hops")),
        ("peer", 1, Err("xff_num_trusted_hops")),
        ("cf-connecting-ip", 1, Err("xff_num_trusted_hops")),
        ("", 0, Err("client_address")),
        ("x real ip", 0, Err("client_address")),
    ] {
        match (ClientAddress::parse(source, hops), want) {
            (Ok(got), Ok(want)) => assert_eq!(got, want),
            (Err(e), Err(field)) => assert!(e.starts_with(field), "{source}: {e}"),
            (got, want) => panic!("{source} {hops}: {got:?}, expected {want:?}"),
        }
    }
    let e = Gate::from_json("ws", r#"{"rules": []}"#, r#"{"client_address": "x y"}"#).unwrap_err();
    assert!(e.to_string().contains("client_address"), "{e}");
    let g = Gate::from_json(
        "ws",
        &json!({"rules": [rule(json!([{"remote_address": {}}]), json!({}))]}).to_string(),
        r#"{"client_address": "x-forwarded-for", "xff_num_trusted_hops": 1}"#,
    )
    .unwrap();
    let req = get("/").with_header("x-forwarded-for", "203.0.113.5, 10.0.0.1");
    let subjects = g.subjects(&req).unwrap();
    assert_eq!(subjects.limits[0].identifier, "remote_address=203.0.113.5");
    let subjects = g.subjects(&get("/")).unwrap();
    assert!(subjects.unaddressed && subjects.limits.is_empty());
    let (decided, reply) = run(&g, &mut table(), &get("/"), T0);
    assert!(reply.allowed && !decided.limited);
}

#[test]
fn generic_key_has_a_default_key() {
    let rules = set(&[
        rule(json!([generic("everyone")]), json!({"name": "a"})),
        rule(
            json!([{"generic_key": {"descriptor_key": "tier", "descriptor_value": "free"}}]),
            json!({"name": "b"}),
        ),
    ]);
    assert_eq!(
        ids(&rules, &get("/")),
        ["generic_key=everyone", "tier=free"]
    );
}

#[test]
fn header_value_match_makes_its_entry_only_as_expected() {
    let matcher = json!([{"name": "User-Agent", "prefix_match": "bot/"}]);
    let rules = set(&[
        rule(
            json!([{"header_value_match": {"descriptor_value": "bot", "headers": matcher}}]),
            json!({"name": "bots"}),
        ),
        rule(
            json!([{"header_value_match": {
                "descriptor_key": "kind", "descriptor_value": "human",
                "expect_match": false, "headers": matcher,
            }}]),
            json!({"name": "humans"}),
        ),
    ]);
    let bot = rules
        .apply(&get("/").with_header("user-agent", "bot/1.0"))
        .unwrap();
    assert_eq!(bot.len(), 1);
    assert_eq!(
        (bot[0].rule, bot[0].identifier.as_str()),
        (0, "header_match=bot")
    );

    let human = rules
        .apply(&get("/").with_header("user-agent", "curl/8"))
        .unwrap();
    assert_eq!(human.len(), 1);
    assert_eq!(
        (human[0].rule, human[0].identifier.as_str()),
        (1, "kind=human")
    );

    // No user agent at all: the prefix does not match, so the "not a bot" rule applies.
    assert_eq!(ids(&rules, &get("/")), ["kind=human"]);
}

#[test]
fn actions_are_joined_in_order() {
    let rules = one(
        json!([
            generic("g"),
            {"remote_address": {}},
            header_action("x-key", "key"),
        ]),
        json!({}),
    );
    assert_eq!(
        ids(&rules, &get("/").with_header("x-key", "k1")),
        ["generic_key=g&remote_address=192.0.2.1&key=k1"]
    );
}

// ---- Match ------------------------------------------------------------------------------

#[test]
fn methods_match_whatever_case_the_config_uses() {
    let rules = one(
        json!([generic("m")]),
        json!({"match": {"methods": ["get", "Post"]}}),
    );
    assert_eq!(ids(&rules, &get("/")).len(), 1);
    assert_eq!(ids(&rules, &get("/").with_method("POST")).len(), 1);
    assert!(ids(&rules, &get("/").with_method("DELETE")).is_empty());
    assert_eq!(rules.rules()[0].matcher.methods, ["GET", "POST"]);
}

#[test]
fn hosts_match_whatever_the_case() {
    let rules = one(
        json!([generic("h")]),
        json!({"match": {"hosts": ["API.Example.com", "other.example"]}}),
    );
    assert_eq!(ids(&rules, &get("/")).len(), 1);
    assert_eq!(ids(&rules, &get("/").with_host("API.EXAMPLE.COM")).len(), 1);
    assert_eq!(ids(&rules, &get("/").with_host("other.example")).len(), 1);
    assert!(ids(&rules, &get("/").with_host("www.example.com")).is_empty());
    assert!(ids(&rules, &get("/").with_host("api.example.com.evil")).is_empty());
}

#[test]
fn path_prefix_matches_the_start_of_the_path() {
    let rules = one(
        json!([generic("p")]),
        json!({"match": {"path_prefix": "/v1/"}}),
    );
    assert_eq!(ids(&rules, &get("/v1/users")).len(), 1);
    assert_eq!(ids(&rules, &get("/v1/")).len(), 1);
    assert!(ids(&rules, &get("/v1")).is_empty());
    assert!(ids(&rules, &get("/v2/users")).is_empty());
    assert!(ids(&rules, &get("/api/v1/")).is_empty());
}

#[test]
fn header_matchers_exact_prefix_present_and_inverted() {
    let only = |matcher: Value| {
        one(
            json!([generic("x")]),
            json!({"match": {"headers": [matcher]}}),
        )
    };
    let applies = |rules: &RuleSet, req: &Req| !rules.apply(req).unwrap().is_empty();
    let plain = get("/");
    let with = |v: &str| get("/").with_header("x-tier", v);

    let exact = only(json!({"name": "X-Tier", "exact_match": "gold"}));
    assert!(applies(&exact, &with("gold")));
    assert!(!applies(&exact, &with("golden")));
    assert!(!applies(&exact, &with("Gold")));
    assert!(!applies(&exact, &plain));

    let prefix = only(json!({"name": "x-tier", "prefix_match": "gol"}));
    assert!(applies(&prefix, &with("gold")));
    assert!(applies(&prefix, &with("golden")));
    assert!(!applies(&prefix, &with("silver")));
    assert!(!applies(&prefix, &plain));

    let present = only(json!({"name": "x-tier", "present_match": true}));
    assert!(applies(&present, &with("")));
    assert!(!applies(&present, &plain));
    let bare = only(json!({"name": "x-tier"})); // no test given: present
    assert!(applies(&bare, &with("any")));
    assert!(!applies(&bare, &plain));
    let absent = only(json!({"name": "x-tier", "present_match": false}));
    assert!(!applies(&absent, &with("any")));
    assert!(applies(&absent, &plain));

    let not_gold = only(json!({"name": "x-tier", "exact_match": "gold", "invert_match": true}));
    assert!(!applies(&not_gold, &with("gold")));
    assert!(applies(&not_gold, &with("silver")));
    assert!(applies(&not_gold, &plain));
    let not_present = only(json!({"name": "x-tier", "invert_match": true}));
    assert!(!applies(&not_present, &with("gold")));
    assert!(applies(&not_present, &plain));
}

#[test]
fn every_condition_must_hold_and_rules_apply_in_order() {
    let rules = set(&[
        rule(
            json!([generic("writes")]),
            json!({"name": "writes", "match": {
                "methods": ["POST"], "path_prefix": "/v1/",
                "headers": [{"name": "x-tier", "exact_match": "free"}],
            }}),
        ),
        rule(json!([generic("all")]), json!({"name": "all"})),
    ]);
    let full = get("/v1/x")
        .with_method("POST")
        .with_header("x-tier", "free");
    let applied = rules.apply(&full).unwrap();
    assert_eq!(applied.iter().map(|a| a.rule).collect::<Vec<_>>(), [0, 1]);
    for partial in [
        get("/v1/x").with_header("x-tier", "free"),
        get("/v2/x")
            .with_method("POST")
            .with_header("x-tier", "free"),
        get("/v1/x")
            .with_method("POST")
            .with_header("x-tier", "paid"),
    ] {
        let applied = rules.apply(&partial).unwrap();
        assert_eq!(
            applied,
            [Applied {
                rule: 1,
                identifier: "generic_key=all".into(),
                cost: 1
            }]
        );
    }
}

// ---- The identifier ---------------------------------------------------------------------

#[test]
fn separators_are_percent_encoded_in_keys_and_values() {
    let rules = one(
        json!([header_action("x-a", "k&=%"), header_action("x-b", "b")]),
        json!({}),
    );
    let req = get("/")
        .with_header("x-a", "x=1&b=y%2")
        .with_header("x-b", "%26");
    assert_eq!(ids(&rules, &req), ["k%26%3D%25=x%3D1%26b%3Dy%252&b=%2526"]);

    // A value that spells a second entry does not pass for one.
    let forged = get("/").with_header("x-a", "1&b=2").with_header("x-b", "3");
    let honest = get("/").with_header("x-a", "1").with_header("x-b", "2&b=3");
    assert_ne!(ids(&rules, &forged), ids(&rules, &honest));

    // Other characters are kept as they are.
    let plain = get("/")
        .with_header("x-a", "é:/ ?#+")
        .with_header("x-b", "\"");
    assert_eq!(ids(&rules, &plain), ["k%26%3D%25=é:/ ?#+&b=\""]);
}

#[test]
fn header_values_are_bytes_and_text_rules_read_them_as_bytes() {
    let rules = set(&[
        rule(
            json!([header_action("x-user", "user")]),
            json!({"name": "users", "cost": {"header": "x-cost", "max": 9}}),
        ),
        rule(
            json!([{"remote_address": {}}]),
            json!({"name": "ip", "namespace": "ip"}),
        ),
        rule(
            json!([generic("gold")]),
            json!({"name": "gold", "namespace": "gold",
                "match": {"headers": [{"name": "x-tier", "prefix_match": "gold"}]}}),
        ),
    ]);
    let req = get("/")
        .with_bytes("x-user", b"\xffk\xc3")
        .with_peer(Some("192.0.2.1"))
        .with_bytes("x-tier", b"gold\xff");
    assert_eq!(
        ids(&rules, &req),
        [
            "user=%FFk%C3",
            "remote_address=192.0.2.1",
            "generic_key=gold"
        ],
        "bytes keyed as %XX; a prefix of bytes"
    );
    let err = rules
        .apply(
            &get("/")
                .with_header("x-user", "u")
                .with_bytes("x-cost", b"\xb3"),
        )
        .unwrap_err();
    assert_eq!(err.rule, "users");
    assert!(err.message.contains("whole number"), "{err}");
    let exact = one(
        json!([generic("e")]),
        json!({"match": {"headers": [{"name": "x-tier", "exact_match": "é"}]}}),
    );
    assert_eq!(
        ids(&exact, &get("/").with_bytes("x-tier", "é".as_bytes())).len(),
        1
    );
    assert!(ids(&exact, &get("/").with_bytes("x-tier", b"\xe9")).is_empty());
}

#[test]
fn reads_names_every_part_and_header_the_rules_look_at_once() {
    let rules = set(&[
        rule(
            json!([header_action("X-User", "user"), {"remote_address": {}}]),
            json!({"name": "a", "cost": {"header": "x-cost", "max": 9},
                "match": {"methods": ["GET"], "headers": [{"name": "x-user", "present_match": true}]}}),
        ),
        rule(
            json!([{"header_value_match": {"descriptor_value": "v",
                "headers": [{"name": "x-tier", "exact_match": "gold"}]}}]),
            json!({"name": "b", "match": {"path_prefix": "/api"}}),
        ),
    ]);
    let reads = rules.reads();
    assert!(reads.method && reads.path && reads.peer && !reads.host);
    assert_eq!(reads.headers, ["x-user", "x-cost", "x-tier"]);
    let generic_only = one(json!([generic("all")]), json!({})).reads();
    assert_eq!(generic_only, strata_core::rules::Reads::default());
}

#[test]
fn a_descriptor_of_any_length_is_keyed_by_its_digest_past_255_bytes() {
    let rules = one(
        json!([header_action("x-user", "user")]),
        json!({"name": "users"}),
    );
    // "user=" is 5 bytes: 250 more is exactly the bound, kept as it is.
    let fits = "u".repeat(250);
    assert_eq!(
        ids(&rules, &get("/").with_header("x-user", &fits)),
        [format!("user={fits}")]
    );
    let key = |value: &str| ids(&rules, &get("/").with_header("x-user", value)).remove(0);
    let long = "u".repeat(251);
    let digest = key(&long);
    assert!(digest.len() <= 200, "{}", digest.len());
    assert!(
        digest.starts_with("user=uuu"),
        "the start stays readable: {digest}"
    );
    assert!(digest.contains(DIGEST_MARKER));
    assert_eq!(digest, key(&long), "the same descriptor, the same key");

    // 4,000 bytes differing in the last one: two keys. Bytes that are not UTF-8 too.
    let mut a = "t".repeat(3_999);
    let mut b = a.clone();
    a.push('a');
    b.push('b');
    assert_ne!(key(&a), key(&b));
    assert_eq!(key(&a).len(), digest.len());
    let raw = |bytes: &[u8]| ids(&rules, &get("/").with_bytes("x-user", bytes)).remove(0);
    assert_ne!(raw(&[0xff; 300]), raw(&[0xfe; 300]));

    // The marker never appears in a descriptor that fits, so none can pose as a digest.
    let posing = format!("x{DIGEST_MARKER}{}", &digest[digest.len() - 64..]);
    assert_eq!(key(&posing), format!("user={}", posing.replace('%', "%25")));

    // The gate begins it like any key.
    let g = gate(
        &[rule(
            json!([header_action("x-user", "user")]),
            json!({"name": "users"}),
        )],
        "",
    );
    let request = get("/").with_header("x-user", &a);
    assert_eq!(g.subjects(&request).unwrap().limits[0].identifier, key(&a));
    let (decided, reply) = run(&g, &mut table(), &request, T0);
    assert!(reply.allowed && decided.limited);
}

#[test]
fn identifier_for_digests_long_text_and_text_that_holds_the_marker() {
    assert_eq!(identifier_for("k".into()), "k");
    let fits = "é".repeat(127); // 254 bytes
    assert_eq!(identifier_for(fits.clone()), fits);
    let long = "é".repeat(128); // 256 bytes: cut at a character, 128 bytes kept
    let d = identifier_for(long.clone());
    assert_eq!(d.len(), 128 + DIGEST_MARKER.len() + 64);
    assert!(d.starts_with(&"é".repeat(64)));
    let odd = format!("a{}", "é".repeat(128)); // the 128th byte splits a character
    let d = identifier_for(odd);
    assert!(d.starts_with(&format!("a{}", "é".repeat(63))) && d.len() == 127 + 8 + 64);
    let posing = format!("k{DIGEST_MARKER}00");
    let d = identifier_for(posing.clone());
    assert_ne!(d, posing);
    assert!(d.ends_with(|c: char| c.is_ascii_hexdigit()) && d.len() == posing.len() + 8 + 64);
}

// ---- Duration and cost ------------------------------------------------------------------

#[test]
fn durations_are_milliseconds_or_text() {
    for (duration, ms) in [
        (json!(60_000), 60_000),
        (json!(1_000), 1_000),
        (json!("60s"), 60_000),
        (json!("5m"), 300_000),
        (json!("1h"), 3_600_000),
        (json!("1d"), 86_400_000),
        (json!("1500ms"), 1_500),
        (json!("2000"), 2_000),
        (json!(" 10 s "), 10_000),
    ] {
        let rules = one(json!([generic("d")]), json!({ "duration": duration }));
        assert_eq!(rules.rules()[0].duration.as_ms(), ms, "{duration}");
    }
    assert_eq!(parse_duration_ms("60s"), Some(60_000));
    assert_eq!(parse_duration_ms("5m"), Some(300_000));
    assert_eq!(parse_duration_ms("1h"), Some(3_600_000));
    for bad in [
        "",
        "s",
        "1.5s",
        "-1s",
        "+1s",
        "1 y",
        "1S",
        "1hh",
        "99999999999999999999999s",
        "18446744073709551615h",
    ] {
        assert_eq!(parse_duration_ms(bad), None, "{bad:?}");
    }
}

#[test]
fn cost_is_one_a_constant_or_read_from_a_header() {
    let cost =
        |rules: &RuleSet, req: &Req| -> Result<u64, RequestError> { Ok(rules.apply(req)?[0].cost) };
    let default = one(json!([generic("c")]), json!({}));
    assert_eq!(cost(&default, &get("/")), Ok(1));
    let constant = one(json!([generic("c")]), json!({"cost": 3}));
    assert_eq!(cost(&constant, &get("/")), Ok(3));

    let header = one(
        json!([generic("c")]),
        json!({"name": "tokens", "cost": {"header": "X-Cost", "max": 10}}),
    );
    assert_eq!(cost(&header, &get("/")), Ok(1), "absent: default 1");
    assert_eq!(cost(&header, &get("/").with_header("x-cost", "7")), Ok(7));
    assert_eq!(
        cost(&header, &get("/").with_header("x-cost", "010")),
        Ok(10)
    );
    assert_eq!(cost(&header, &get("/").with_header("x-cost", "0")), Ok(0));

    let above = cost(&header, &get("/").with_header("x-cost", "11")).unwrap_err();
    assert_eq!(above.rule, "tokens");
    assert!(
        above.message.contains("11") && above.message.contains("10"),
        "{above}"
    );
    for junk in [
        "abc",
        "-1",
        "1.5",
        "",
        "18446744073709551616",
        "+3",
        " 7 ",
        "7 ",
        "0x3",
        "3.0",
        "1e1",
        "٣",
    ] {
        let e = cost(&header, &get("/").with_header("x-cost", junk)).unwrap_err();
        assert_eq!(e.rule, "tokens", "{junk:?}");
        assert!(e.message.contains("x-cost"), "{e}");
    }

    let with_default = one(
        json!([generic("c")]),
        json!({"cost": {"header": "x-cost", "default": 4, "max": 10}}),
    );
    assert_eq!(cost(&with_default, &get("/")), Ok(4));

    // Through the gate: a client error, nothing begun.
    let g = gate(
        &[rule(
            json!([generic("c")]),
            json!({"name": "tokens", "cost": {"header": "x-cost", "max": 10}}),
        )],
        "",
    );
    let mut t = table();
    let e = try_run(&g, &mut t, &get("/").with_header("x-cost", "99"), T0).unwrap_err();
    assert_eq!(e.rule, "tokens");
    assert!(t.is_empty());
}

#[test]
fn the_rule_model_keeps_what_was_configured() {
    let rules = set(&[rule(
        json!([generic("x")]),
        json!({"name": "n", "namespace": "ns", "limit": 42, "shadow": true}),
    )]);
    let r = &rules.rules()[0];
    assert_eq!((r.name.as_str(), r.namespace.as_str()), ("n", "ns"));
    assert_eq!((r.limit, r.shadow), (42, true));
    // The name defaults to the namespace.
    assert_eq!(one(json!([generic("x")]), json!({})).rules()[0].name, "api");
    assert!(set(&[]).rules().is_empty());
}

// ---- Validation -------------------------------------------------------------------------

/// Asserts the set is refused at `field`, with a message that mentions `cause`.
fn refused(rules: &[Value], field: &str, cause: &str) -> RuleError {
    let e = error(rules);
    assert_eq!(e.field, field, "{e}");
    assert!(!e.message.is_empty());
    assert!(
        e.message.to_lowercase().contains(&cause.to_lowercase()),
        "{field}: {:?} does not mention {cause:?}",
        e.message
    );
    assert!(e.to_string().starts_with(&format!("{field}: ")) || field.is_empty());
    e
}

#[test]
fn unknown_fields_are_refused_where_they_are() {
    refused(
        &[rule(json!([generic("x")]), json!({"limt": 5}))],
        "rules[0].limt",
        "unknown field",
    );
    refused(
        &[rule(json!([generic("x")]), json!({"match": {"path": "/"}}))],
        "rules[0].match.path",
        "unknown field",
    );
    refused(
        &[rule(
            json!([{"request_headers": {"header_name": "a", "descriptor_key": "a", "skip": true}}]),
            json!({}),
        )],
        "rules[0].actions[0].request_headers.skip",
        "unknown field",
    );
    refused(
        &[rule(json!([{"rate_limit_key": {}}]), json!({}))],
        "rules[0].actions[0]",
        "unknown variant",
    );
    let top = RuleSet::from_json(r#"{"rules": [], "version": 2}"#).unwrap_err();
    assert!(top.to_string().contains("version"), "{top}");
}

#[test]
fn wrong_types_name_the_field() {
    refused(
        &[rule(json!([generic("x")]), json!({"limit": "x"}))],
        "rules[0].limit",
        "invalid type",
    );
    refused(
        &[rule(json!([generic("x")]), json!({"limit": -1}))],
        "rules[0].limit",
        "invalid value",
    );
    refused(
        &[rule(json!([generic("x")]), json!({"shadow": "yes"}))],
        "rules[0].shadow",
        "invalid type",
    );
    refused(
        &[
            rule(json!([generic("x")]), json!({"name": "a"})),
            rule(
                json!([generic("x")]),
                json!({"name": "b", "match": {"methods": "GET"}}),
            ),
        ],
        "rules[1].match.methods",
        "invalid type",
    );
    let e = error(&[rule(json!([generic("x")]), json!({"duration": true}))]);
    assert_eq!(e.field, "rules[0].duration");
    let e = error(&[rule(json!([generic("x")]), json!({"cost": -2}))]);
    assert_eq!(e.field, "rules[0].cost");
    let missing =
        RuleSet::from_json(r#"{"rules": [{"namespace": "a", "duration": 1000, "actions": []}]}"#)
            .unwrap_err();
    assert!(missing.message.contains("limit"), "{missing}");
    assert!(missing.field.starts_with("rules[0]"), "{missing}");
    let not_json = RuleSet::from_json("{\"rules\": [").unwrap_err();
    assert!(!not_json.message.is_empty());
    let trailing = RuleSet::from_json(r#"{"rules": []} {}"#).unwrap_err();
    assert_eq!(trailing.field, "");
    assert!(trailing.message.contains("trailing"), "{trailing}");
}

#[test]
fn rule_values_are_validated() {
    refused(
        &[rule(json!([]), json!({}))],
        "rules[0].actions",
        "at least one",
    );
    let nine: Vec<Value> = (0..9).map(|i| generic(&format!("g{i}"))).collect();
    refused(
        &[rule(json!(nine), json!({}))],
        "rules[0].actions",
        "at most 8",
    );
    refused(
        &[rule(json!([header_action("X User", "user")]), json!({}))],
        "rules[0].actions[0].request_headers.header_name",
        "X User",
    );
    refused(
        &[rule(json!([header_action("", "user")]), json!({}))],
        "rules[0].actions[0].request_headers.header_name",
        "not a header name",
    );
    refused(
        &[rule(json!([header_action("x-user", "")]), json!({}))],
        "rules[0].actions[0].request_headers.descriptor_key",
        "empty",
    );
    refused(
        &[rule(json!([generic("")]), json!({}))],
        "rules[0].actions[0].generic_key.descriptor_value",
        "empty",
    );
    refused(
        &[rule(
            json!([generic("a"), {"header_value_match": {"descriptor_value": "v", "headers": []}}]),
            json!({}),
        )],
        "rules[0].actions[1].header_value_match.headers",
        "at least one",
    );
    refused(
        &[rule(
            json!([{"header_value_match": {"descriptor_value": "v", "headers": [{"name": "a:b"}]}}]),
            json!({}),
        )],
        "rules[0].actions[0].header_value_match.headers[0].name",
        "a:b",
    );
    for duration in [json!(999), json!(0), json!("500ms"), json!("31d")] {
        refused(
            &[rule(json!([generic("x")]), json!({ "duration": duration }))],
            "rules[0].duration",
            "between",
        );
    }
    refused(
        &[rule(json!([generic("x")]), json!({"duration": "a minute"}))],
        "rules[0].duration",
        "60s",
    );
    refused(
        &[rule(json!([generic("x")]), json!({"namespace": ""}))],
        "rules[0].namespace",
        "1 to 255",
    );
    refused(
        &[rule(
            json!([generic("x")]),
            json!({"name": "n".repeat(256)}),
        )],
        "rules[0].name",
        "1 to 255",
    );
    refused(
        &[rule(
            json!([generic("x")]),
            json!({"cost": {"header": "x-cost", "default": 11, "max": 10}}),
        )],
        "rules[0].cost.default",
        "above cost.max",
    );
    refused(
        &[rule(
            json!([generic("x")]),
            json!({"cost": {"header": "x cost", "max": 10}}),
        )],
        "rules[0].cost.header",
        "x cost",
    );
    refused(
        &[rule(
            json!([generic("x")]),
            json!({"match": {"methods": ["GET", "GE T"]}}),
        )],
        "rules[0].match.methods[1]",
        "GE T",
    );
    refused(
        &[rule(
            json!([generic("x")]),
            json!({"match": {"hosts": ["a.example/x"]}}),
        )],
        "rules[0].match.hosts[0]",
        "host",
    );
    refused(
        &[rule(
            json!([generic("x")]),
            json!({"match": {"path_prefix": "v1/"}}),
        )],
        "rules[0].match.path_prefix",
        "/",
    );
    refused(
        &[rule(
            json!([generic("x")]),
            json!({"match": {"headers": [{"name": "x-a", "present_match": true},
                                         {"name": "x-b", "exact_match": "a", "prefix_match": "a"}]}}),
        )],
        "rules[0].match.headers[1]",
        "one of",
    );
}

#[test]
fn rule_names_must_differ() {
    refused(
        &[
            rule(json!([generic("x")]), json!({"name": "a"})),
            rule(json!([generic("y")]), json!({"name": "b"})),
            rule(json!([generic("z")]), json!({"name": "a"})),
        ],
        "rules[2].name",
        "\"a\"",
    );
    // Names default to the namespace, so two unnamed rules of one namespace collide.
    refused(
        &[
            rule(json!([generic("x")]), json!({})),
            rule(json!([generic("y")]), json!({})),
        ],
        "rules[1].name",
        "api",
    );
    // A name may equal another rule's namespace as long as the names differ.
    set(&[
        rule(json!([generic("x")]), json!({})),
        rule(json!([generic("y")]), json!({"name": "api-2"})),
    ]);
}

#[test]
fn at_most_32_rules() {
    let many = |n: usize| -> Vec<Value> {
        (0..n)
            .map(|i| rule(json!([generic("x")]), json!({"name": format!("r{i}")})))
            .collect()
    };
    assert_eq!(set(&many(MAX_RULES)).rules().len(), 32);
    let e = refused(&many(MAX_RULES + 1), "rules", "at most 32");
    assert!(e.message.contains("33"), "{e}");
}

// ---- The gate ---------------------------------------------------------------------------

#[test]
fn gate_options_parse_and_name_their_fields() {
    let o = GateOptions::from_json(r#"{"failure_mode":"deny","legacy_headers":true}"#).unwrap();
    assert_eq!(o.failure_mode, FailureMode::Deny);
    assert!(o.legacy_headers);
    assert!(o.headers_on_pass, "headers on passes by default");
    assert!(!o.debug);
    assert_eq!(
        GateOptions::from_json("{}").unwrap(),
        GateOptions::default()
    );
    assert_eq!(GateOptions::default().failure_mode, FailureMode::Local);

    let unknown = GateOptions::from_json(r#"{"failure_mode":"allow","verbose":true}"#).unwrap_err();
    assert!(unknown.to_string().contains("verbose"), "{unknown}");
    assert!(unknown.message.contains("unknown field"), "{unknown}");

    let variant = GateOptions::from_json(r#"{"failure_mode":"sometimes"}"#).unwrap_err();
    assert_eq!(variant.field, "failure_mode");
    assert!(variant.message.contains("sometimes"), "{variant}");

    let typed = GateOptions::from_json(r#"{"legacy_headers":"yes"}"#).unwrap_err();
    assert_eq!(typed.field, "legacy_headers");
}

#[test]
fn gate_errors_say_which_input_is_wrong() {
    let rules = json!({"rules": [rule(json!([generic("x")]), json!({}))]}).to_string();
    assert!(Gate::from_json("ws", &rules, "").is_ok());
    assert!(Gate::from_json("ws", &rules, "  ").is_ok());
    assert!(matches!(
        Gate::from_json("", &rules, ""),
        Err(GateError::Workspace(_))
    ));
    match Gate::from_json("ws", r#"{"rules": [{"limit": "x"}]}"#, "") {
        Err(GateError::Rules(e)) => assert_eq!(e.field, "rules[0].limit"),
        other => panic!("{other:?}"),
    }
    match Gate::from_json("ws", &rules, r#"{"failure_mode": 1}"#) {
        Err(e @ GateError::Options(_)) => {
            assert!(e.to_string().contains("failure_mode"), "{e}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_request_no_rule_applies_to_passes_without_headers() {
    let g = gate(
        &[rule(
            json!([generic("x")]),
            json!({"match": {"path_prefix": "/v1/"}}),
        )],
        "",
    );
    let mut t = table();
    let (decided, reply) = run(&g, &mut t, &get("/health"), T0);
    assert!(!decided.limited && decided.by == DecidedBy::Local);
    assert!(reply.allowed);
    assert_eq!(reply.status, 200);
    assert!(reply.headers.is_empty() && reply.body.is_none());
    assert!(t.is_empty());
}

#[test]
fn a_cold_request_calls_the_origin_once_per_group() {
    let g = gate(
        &[
            rule(json!([generic("a")]), json!({"name": "a"})),
            rule(
                json!([generic("b")]),
                json!({"name": "b", "namespace": "b"}),
            ),
            rule(
                json!([generic("s")]),
                json!({"name": "s", "namespace": "s", "shadow": true}),
            ),
        ],
        "",
    );
    let mut store = TableStore {
        table: table(),
        instance: "test".into(),
    };
    let mut driver = driver(&g);
    let started = driver.request(&mut store, 1, &get("/"), T0).unwrap();
    assert_eq!(started, Started::Waiting);
    let calls: Vec<usize> = std::iter::from_fn(|| driver.poll_transmit())
        .map(|t| {
            let call: serde_json::Value = serde_json::from_str(&t.body).unwrap();
            call["limits"].as_array().unwrap().len()
        })
        .collect();
    assert_eq!(
        calls,
        [2, 1],
        "the enforced group's call, then the shadow group's"
    );
    assert!(
        driver.poll_decision().is_none(),
        "undecided until its calls are"
    );
    let names: Vec<(String, bool)> = g
        .subjects(&get("/"))
        .unwrap()
        .limits
        .iter()
        .map(|s| (s.name.clone(), s.shadow))
        .collect();
    let names: Vec<(&str, bool)> = names.iter().map(|(n, s)| (n.as_str(), *s)).collect();
    assert_eq!(names, [("a", false), ("b", false), ("s", true)]);
}

#[test]
fn legacy_headers_only_when_configured() {
    let rules = [rule(
        json!([generic("x")]),
        json!({"name": "api", "limit": 1}),
    )];
    for legacy in [false, true] {
        let g = gate(&rules, &json!({ "legacy_headers": legacy }).to_string());
        let mut t = table();
        let (_, pass) = run(&g, &mut t, &get("/"), T0);
        assert!(pass.allowed);
        assert_eq!(header(&pass, "ratelimit-policy"), Some("\"api\";q=1;w=60"));
        assert_eq!(header(&pass, "ratelimit"), Some("\"api\";r=0;t=60"));
        assert_eq!(header(&pass, "retry-after"), None);
        let (_, deny) = run(&g, &mut t, &get("/"), T0 + 1);
        assert!(!deny.allowed);
        for reply in [&pass, &deny] {
            for name in [
                "x-ratelimit-limit",
                "x-ratelimit-remaining",
                "x-ratelimit-reset",
            ] {
                assert_eq!(header(reply, name).is_some(), legacy, "{name}");
            }
        }
        if legacy {
            assert_eq!(header(&pass, "x-ratelimit-limit"), Some("1"));
            assert_eq!(header(&pass, "x-ratelimit-remaining"), Some("0"));
            let reset = (T0 + 60_000) / 1_000;
            assert_eq!(
                header(&pass, "x-ratelimit-reset"),
                Some(reset.to_string().as_str())
            );
        }
    }
}

#[test]
fn headers_on_pass_off_leaves_passes_bare_but_not_denials() {
    let g = gate(
        &[rule(json!([generic("x")]), json!({"limit": 1}))],
        r#"{"headers_on_pass": false}"#,
    );
    let mut t = table();
    let (_, pass) = run(&g, &mut t, &get("/"), T0);
    assert!(pass.allowed);
    assert!(pass.headers.is_empty(), "{:?}", pass.headers);
    let (_, deny) = run(&g, &mut t, &get("/"), T0 + 1);
    assert!(!deny.allowed);
    assert!(header(&deny, "ratelimit").is_some());
    assert!(header(&deny, "retry-after").is_some());
}

#[test]
fn debug_says_when_the_origin_was_unreachable() {
    let rules = [rule(json!([generic("x")]), json!({}))];
    for debug in [false, true] {
        let g = gate(&rules, &json!({ "debug": debug }).to_string());
        let (decided, reply) = run(&g, &mut table(), &get("/"), T0);
        assert_eq!(decided.by, DecidedBy::Fallback);
        assert_eq!(
            header(&reply, "strata-origin") == Some("unavailable"),
            debug
        );
    }
}

#[test]
fn every_header_a_reply_sets_is_one_of_the_names_a_shell_learns_once() {
    let rules = [
        rule(json!([generic("x")]), json!({"name": "api", "limit": 1})),
        rule(
            json!([generic("y")]),
            json!({"name": "trial", "namespace": "trial", "limit": 1, "shadow": true}),
        ),
    ];
    let g = gate(&rules, r#"{"legacy_headers": true, "debug": true}"#);
    let mut t = table();
    let (_, pass) = run(&g, &mut t, &get("/"), T0);
    let (_, deny) = run(&g, &mut t, &get("/"), T0 + 1);
    assert!(pass.allowed && !deny.allowed);
    let mut seen: Vec<&str> = pass
        .headers
        .iter()
        .chain(&deny.headers)
        .map(|(n, _)| *n)
        .collect();
    seen.sort_unstable();
    seen.dedup();
    let mut names = REPLY_HEADER_NAMES.to_vec();
    names.sort_unstable();
    assert_eq!(
        seen, names,
        "every name is set by some reply, and none other"
    );
}

#[test]
fn failure_modes_allow_and_deny() {
    for (mode, allowed) in [("allow", true), ("deny", false)] {
        let options = json!({"failure_mode": mode, "debug": true}).to_string();
        let g = gate(&[rule(json!([generic("x")]), json!({}))], &options);
        let mut t = g.table(7);
        let (decided, reply) = run(&g, &mut t, &get("/"), T0);
        assert_eq!(decided.by, DecidedBy::Fallback);
        assert_eq!(reply.allowed, allowed);
        assert_eq!(reply.status, if allowed { 200 } else { 429 });
        // Moments later the key still needs the origin, which failed: no call, the same
        // answer, and it says the origin was unavailable.
        let mut store = TableStore {
            table: t,
            instance: "test".into(),
        };
        let mut driver = driver(&g);
        let again = driver.request(&mut store, 2, &get("/"), T0 + 1).unwrap();
        let Started::Decided(again) = again else {
            panic!("{mode}: a call within the retry delay");
        };
        let reply = again.reply;
        assert_eq!((reply.allowed, mode), (allowed, mode));
        assert_eq!(header(&reply, "strata-origin"), Some("unavailable"));
    }
}

/// A shadow rule on an enforced rule's namespace and window would count on the same keys, so
/// every request would be added to the enforced count a second time: refused.
#[test]
fn a_shadow_rule_may_not_share_an_enforced_rules_counters() {
    let enforced = rule(
        json!([generic("all")]),
        json!({"name": "enforced", "limit": 4}),
    );
    let e = refused(
        &[
            enforced.clone(),
            rule(
                json!([generic("all")]),
                json!({"name": "trial", "limit": 100, "shadow": true}),
            ),
        ],
        "rules[1].namespace",
        "namespace of its own",
    );
    assert!(e.message.contains("\"enforced\""), "{e}");
    // Either order.
    refused(
        &[
            rule(
                json!([generic("all")]),
                json!({"name": "trial", "shadow": true}),
            ),
            enforced.clone(),
        ],
        "rules[0].namespace",
        "namespace of its own",
    );
    // Another window is another key; two shadow rules may share theirs.
    set(&[
        enforced.clone(),
        rule(
            json!([generic("all")]),
            json!({"name": "hourly", "duration": "1h", "shadow": true}),
        ),
    ]);
    set(&[
        rule(json!([generic("a")]), json!({"name": "s1", "shadow": true})),
        rule(json!([generic("b")]), json!({"name": "s2", "shadow": true})),
    ]);

    // In a namespace of its own, the shadow rule leaves the enforced count alone.
    let g = gate(
        &[
            enforced,
            rule(
                json!([generic("all")]),
                json!({"name": "trial", "namespace": "trial", "limit": 2, "shadow": true}),
            ),
        ],
        "",
    );
    let mut t = table();
    let replies: Vec<Reply> = (0..10)
        .map(|i| run(&g, &mut t, &get("/"), T0 + i).1)
        .collect();
    assert_eq!(replies.iter().filter(|r| r.allowed).count(), 4);
    assert_eq!(
        replies
            .iter()
            .filter(|r| !r.shadow_denied.is_empty())
            .count(),
        8
    );
}

// ---- Properties -------------------------------------------------------------------------

/// Field names of the rule JSON, and a few others.
fn field() -> impl Strategy<Value = &'static str> {
    let mut names = support::RULE_FIELDS.to_vec();
    names.push("x");
    prop::sample::select(names)
}

/// JSON values shaped like rules: their field names, plausible and edge values, nesting.
fn json_value() -> impl Strategy<Value = Value> {
    let number = prop_oneof![
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        (0_u64..100_000).prop_map(Value::from),
        any::<f64>()
            .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
    ];
    let text = prop_oneof![
        prop::sample::select(vec![
            "60s", "5m", "1h", "999", "x-user", "GET", "/v1/", "", "api", "a b", "%&=",
        ])
        .prop_map(|s| Value::String(s.into())),
        ".{0,40}".prop_map(Value::String),
    ];
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        number,
        text
    ];
    leaf.prop_recursive(5, 64, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((field(), inner), 0..8).prop_map(|kv| {
                Value::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
            }),
        ]
    })
}

/// A valid rule with fields replaced, removed or added at random.
fn mutated_rule() -> impl Strategy<Value = Value> {
    let edits = prop::collection::vec((field(), prop::option::of(json_value())), 0..4);
    (0_usize..4, edits).prop_map(|(base, edits)| {
        let mut r = match base {
            0 => rule(json!([generic("x")]), json!({})),
            1 => rule(
                json!([{"request_headers": {"header_name": "x-user", "descriptor_key": "u"}}, {"remote_address": {}}]),
                json!({"cost": {"header": "x-cost", "max": 5}, "match": {"methods": ["GET"]}}),
            ),
            2 => rule(
                json!([{"header_value_match": {"descriptor_value": "v", "headers": [{"name": "x-a", "prefix_match": "p"}]}}]),
                json!({"duration": "1h", "shadow": true}),
            ),
            _ => json!({}),
        };
        if let Value::Object(map) = &mut r {
            for (k, v) in edits {
                match v {
                    Some(v) => map.insert(k.to_string(), v),
                    None => map.remove(k),
                };
            }
        }
        r
    })
}

/// Requests with a few headers the rules above read.
fn request() -> impl Strategy<Value = Req> {
    let name = prop::sample::select(vec![
        "x-user",
        "x-cost",
        "x-a",
        "x-tier",
        "cf-connecting-ip",
        "x-forwarded-for",
        "user-agent",
    ]);
    let value = prop_oneof![
        "[a-z0-9&=%, ]{0,12}".prop_map(String::into_bytes),
        Just(b"5".to_vec()),
        Just(b"1000".to_vec()),
        ".{0,300}".prop_map(String::into_bytes),
        prop::collection::vec(any::<u8>(), 0..40),
    ];
    (
        prop::sample::select(vec!["GET", "POST", "DELETE"]),
        prop::sample::select(vec!["api.example.com", "other.example"]),
        "/[a-z0-9/]{0,10}",
        prop::collection::vec((name, value), 0..5),
        prop::option::of(Just("192.0.2.1")),
    )
        .prop_map(|(method, host, path, headers, peer)| Req {
            method: method.into(),
            host: host.into(),
            path,
            headers: headers
                .into_iter()
                .map(|(n, v)| (n.to_string(), v))
                .collect(),
            peer: peer.map(Into::into),
        })
}

/// Pieces of header values, each with a look-alike: a separator and its encoding, a byte that
/// is not UTF-8 and its spelling in a key, or a piece that is its own.
const PIECES: [(&[u8], &[u8]); 11] = [
    (b"&", b"%26"),
    (b"=", b"%3D"),
    (b"%", b"%25"),
    (b"b=", b"b%3D"),
    (b"&b=", b"%26b%3D"),
    (b"a", b"a"),
    (b"2", b"2"),
    ("é ".as_bytes(), "é ".as_bytes()),
    (b"\xff", b"%FF"),
    (b"\xc3", b"%C3"),
    (b"\xe9", "é".as_bytes()),
];

/// Two header values as pieces: which piece, and which of its two spellings.
type Spelled = Vec<(usize, bool)>;

fn spelled() -> impl Strategy<Value = Spelled> {
    prop::collection::vec((0..PIECES.len(), any::<bool>()), 0..5)
}

fn spell(pieces: &Spelled) -> Vec<u8> {
    pieces
        .iter()
        .flat_map(|&(i, alt)| if alt { PIECES[i].1 } else { PIECES[i].0 })
        .copied()
        .collect()
}

/// A second spelling of the same pieces, each piece's spelling drawn again.
fn respell(pieces: &Spelled, alts: &[bool]) -> Spelled {
    pieces
        .iter()
        .zip(alts.iter().chain(std::iter::repeat(&false)))
        .map(|(&(i, _), &alt)| (i, alt))
        .collect()
}

/// Parses `text`; whatever parses is applied to `requests`: no panic, bounded identifiers.
fn parse_and_apply(text: &str, requests: &[Req]) {
    if let Ok(rules) = RuleSet::from_json(text) {
        assert!(rules.rules().len() <= MAX_RULES);
        for req in requests {
            if let Ok(applied) = rules.apply(req) {
                for a in applied {
                    assert!(a.rule < rules.rules().len());
                    assert!(!a.identifier.is_empty() && a.identifier.len() <= MAX_IDENTIFIER_BYTES);
                }
            }
        }
    }
}

/// A descriptor's entries as the gateway's rate-limit service gets them from Envoy: keys and
/// values of any bytes, made of the look-alike pieces.
fn entries() -> impl Strategy<Value = Vec<(Spelled, Spelled)>> {
    prop::collection::vec((spelled(), spelled()), 0..4)
}

fn encode_entries(entries: &[(Spelled, Spelled)]) -> String {
    let mut out = String::new();
    for (key, value) in entries {
        push_entry(&mut out, &spell(key), &spell(value));
    }
    out
}

/// The path a rule's `path_prefix` meets is the normalized one: a client cannot step around a
/// prefix with doubled slashes, escapes of plain characters or dot segments.
#[test]
fn paths_are_matched_normalized() {
    for (path, want) in [
        ("/login", "/login"),
        ("//login", "/login"),
        ("/%6Cogin", "/login"),
        ("/%6cogin", "/login"),
        ("/x/../login", "/login"),
        ("/X/../x", "/x"),
        ("/./login/./", "/login/"),
        ("/%2e%2e/login", "/login"),
        ("/a/%2Flogin", "/a/login"),
        ("/a/b/..", "/a/"),
        ("/..", "/"),
        ("/", "/"),
        ("/caf%c3%a9", "/caf%C3%A9"),
        ("/50%", "/50%"),
        ("/%+5", "/%+5"),
        ("/é//x", "/é/x"),
    ] {
        assert_eq!(normalized_path(path), want, "{path}");
    }
    let rules = one(
        json!([generic("login")]),
        json!({"match": {"path_prefix": "/login"}}),
    );
    for path in ["/login", "//login", "/%6Cogin", "/x/../login", "/./login"] {
        assert_eq!(
            rules.apply(&get(path)).unwrap().len(),
            1,
            "{path} meets /login"
        );
    }
    assert!(rules.apply(&get("/logout")).unwrap().is_empty());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Normalizing twice changes nothing, and a normalized path has no doubled slash and no
    /// dot segment.
    #[test]
    fn normalized_paths_are_normal(pieces in prop::collection::vec(
        prop_oneof![Just("/"), Just("."), Just(".."), Just("%2e"), Just("%2F"), Just("%6C"),
                    Just("a"), Just("é"), Just("%"), Just("%zz")], 0..12)) {
        let path = format!("/{}", pieces.concat());
        let once = normalized_path(&path).into_owned();
        let twice = normalized_path(&once).into_owned();
        prop_assert_eq!(&twice, &once);
        prop_assert!(!once.contains("//"), "{}", once);
        prop_assert!(!once.split('/').any(|s| s == "." || s == ".."), "{}", once);
    }

    /// Two descriptors share an encoding only when every key and value byte is the same: a
    /// key or value that is not UTF-8 is spelt `%XX`, never confused with the text `%XX`.
    #[test]
    fn descriptor_entries_of_any_bytes_encode_apart(a in entries(), b in entries()) {
        let bytes = |e: &[(Spelled, Spelled)]| -> Vec<(Vec<u8>, Vec<u8>)> {
            e.iter().map(|(k, v)| (spell(k), spell(v))).collect()
        };
        prop_assert_eq!(
            bytes(&a) == bytes(&b),
            encode_entries(&a) == encode_entries(&b),
            "{:?} / {:?}", encode_entries(&a), encode_entries(&b)
        );
    }

    #[test]
    fn from_json_never_panics_on_strings(text in ".{0,200}") {
        parse_and_apply(&text, &[]);
    }

    #[test]
    fn from_json_never_panics_on_json(
        v in json_value(),
        rules in prop::collection::vec(prop_oneof![mutated_rule(), json_value()], 0..4),
        requests in prop::collection::vec(request(), 0..4),
    ) {
        parse_and_apply(&v.to_string(), &requests);
        parse_and_apply(&json!({ "rules": rules }).to_string(), &requests);
    }

    #[test]
    fn the_encoding_is_injective(
        a in spelled(),
        b in spelled(),
        other in (spelled(), spelled()),
        alts in prop::collection::vec(any::<bool>(), 10),
        mode in 0_u8..4,
    ) {
        // The second request: the first again, its pieces spelled anew (a separator where
        // the first had its encoding, or the reverse), values of its own, or an entry
        // separator moved from one value to the other (`A`, `X&b=Y` against `A&b=X`, `Y`).
        let (a, b, c, d) = match mode {
            0 => (spell(&a), spell(&b), spell(&a), spell(&b)),
            1 => (spell(&a), spell(&b), spell(&respell(&a, &alts[..5])), spell(&respell(&b, &alts[5..]))),
            2 => (spell(&a), spell(&b), spell(&other.0), spell(&other.1)),
            _ => {
                let (a, x, y) = (spell(&a), spell(&b), spell(&other.0));
                (a.clone(), [&x[..], b"&b=", &y].concat(), [&a[..], b"&b=", &x].concat(), y)
            }
        };
        let rules = one(json!([header_action("x-a", "a"), header_action("x-b", "b")]), json!({}));
        let first = ids(&rules, &get("/").with_bytes("x-a", &a).with_bytes("x-b", &b));
        let second = ids(&rules, &get("/").with_bytes("x-a", &c).with_bytes("x-b", &d));
        prop_assert_eq!(first.len(), 1);
        prop_assert_eq!(second.len(), 1);
        prop_assert_eq!(first == second, (&a, &b) == (&c, &d), "{:?} {:?}", first, second);
    }

    #[test]
    fn a_request_without_the_header_never_gets_the_rule(req in request()) {
        let rules = set(&[
            rule(
                json!([generic("g"), {"request_headers": {"header_name": "X-User", "descriptor_key": "user"}}]),
                json!({"name": "users"}),
            ),
            rule(json!([generic("all")]), json!({"name": "all"})),
        ]);
        let has = RequestView::header(&req, "x-user").is_some();
        match rules.apply(&req) {
            Ok(applied) => {
                let rules: Vec<usize> = applied.iter().map(|a| a.rule).collect();
                prop_assert_eq!(rules, if has { vec![0, 1] } else { vec![1] });
            }
            Err(e) => prop_assert!(false, "no request is refused here: {}", e),
        }
    }

    #[test]
    fn a_shadow_rule_never_denies(
        limit in 1_u64..5,
        enforced in any::<bool>(),
        requests in prop::collection::vec((0_usize..3, 0_u64..200), 1..40),
    ) {
        let mut rules = vec![rule(
            json!([{"remote_address": {}}]),
            json!({"name": "per-client", "namespace": "trial", "limit": limit, "shadow": true}),
        )];
        if enforced {
            rules.push(rule(json!([generic("all")]), json!({"name": "all", "limit": 1_000})));
        }
        let g = gate(&rules, "");
        let mut t = table();
        let mut now = T0;
        let mut counts: HashMap<usize, u64> = HashMap::new();
        let mut sent: HashMap<usize, u64> = HashMap::new();
        let mut denials = 0_u64;
        for (client, dt) in requests {
            now += dt;
            let peer = format!("203.0.113.{client}");
            let req = get("/").with_peer(Some(&peer));
            let (_, reply) = run(&g, &mut t, &req, now);
            prop_assert!(reply.allowed);
            prop_assert_eq!(reply.status, 200);
            prop_assert!(reply.body.is_none());
            // Exactly what a one-window local count says: `limit` per client, then denials.
            *sent.entry(client).or_default() += 1;
            let seen = counts.entry(client).or_default();
            let denied = *seen >= limit;
            if !denied {
                *seen += 1;
            }
            denials += u64::from(denied);
            prop_assert_eq!(reply.shadow_denied.clone(), if denied { vec!["per-client".to_string()] } else { vec![] });
            let shadow = header(&reply, "strata-shadow").unwrap();
            prop_assert!(shadow.starts_with("\"per-client\";r="), "{}", shadow);
            if denied {
                prop_assert!(shadow.starts_with("\"per-client\";r=0;"), "{}", shadow);
            }
            // The shadow rule never shows in the enforced headers.
            prop_assert_eq!(header(&reply, "ratelimit-policy").is_some(), enforced);
            prop_assert!(header(&reply, "ratelimit-policy").is_none_or(|p| !p.contains("per-client")));
            prop_assert_eq!(header(&reply, "retry-after"), None);
        }
        // Every request of a client past its `limit` was a shadow denial, and only those.
        let over: u64 = sent.values().map(|&n| n.saturating_sub(limit)).sum();
        prop_assert_eq!(denials, over);
    }

    #[test]
    fn two_limits_admit_the_smaller(
        a in 1_u64..8,
        b in 1_u64..8,
        gaps in prop::collection::vec(0_u64..500, 18),
    ) {
        let g = gate(
            &[
                rule(json!([generic("all")]), json!({"name": "a", "namespace": "a", "limit": a})),
                rule(json!([{"remote_address": {}}]), json!({"name": "b", "namespace": "b", "limit": b})),
            ],
            "",
        );
        let mut t = table();
        let mut now = T0;
        let mut allowed = 0;
        for dt in gaps {
            now += dt;
            let (_, reply) = run(&g, &mut t, &get("/"), now);
            // Passes first, then only denials: nothing is counted by a denied request.
            prop_assert_eq!(reply.allowed, allowed < a.min(b), "request after {} passes", allowed);
            prop_assert!(reply.shadow_denied.is_empty());
            let policy = header(&reply, "ratelimit-policy").unwrap();
            prop_assert_eq!(policy, format!("\"a\";q={a};w=60, \"b\";q={b};w=60"));
            prop_assert!(header(&reply, "ratelimit").is_some());
            if reply.allowed {
                allowed += 1;
                prop_assert_eq!(reply.status, 200);
                prop_assert!(reply.body.is_none());
                prop_assert_eq!(header(&reply, "retry-after"), None);
            } else {
                prop_assert_eq!(reply.status, 429);
                let retry: u64 = header(&reply, "retry-after").unwrap().parse().unwrap();
                prop_assert!(retry >= 1);
                let body: Value = serde_json::from_str(reply.body.as_deref().unwrap()).unwrap();
                prop_assert_eq!(&body["error"]["code"], "rate_limited");
                // The limits that denied: the smaller, or both when they are equal.
                let denied = match a.cmp(&b) {
                    std::cmp::Ordering::Less => "a",
                    std::cmp::Ordering::Greater => "b",
                    std::cmp::Ordering::Equal => "a, b",
                };
                let message = format!("rate limit exceeded: {denied}");
                prop_assert_eq!(body["error"]["message"].as_str(), Some(message.as_str()));
                prop_assert_eq!(body["retry_after"].as_u64(), Some(retry));
            }
        }
        prop_assert_eq!(allowed, a.min(b));
    }
}

/// `table_capacity` is one option of both Wasm shells: the table a gate makes holds what it
/// says (the default when unset), and a value out of bounds or not a whole number is refused
/// naming the field.
#[test]
fn table_capacity_sizes_the_gates_table_and_is_refused_out_of_bounds() {
    use strata_core::table::{MAX_SHELL_CAPACITY, MIN_CAPACITY, SHELL_CAPACITY};
    let rules = r#"{"rules": []}"#;
    let capacity =
        |options: &str| Gate::from_json("ws", rules, options).map(|g| g.table(1).config().capacity);
    assert_eq!(capacity(""), Ok(SHELL_CAPACITY));
    assert_eq!(capacity(r#"{"table_capacity": 5000}"#), Ok(5_000));
    assert_eq!(
        capacity(&format!(r#"{{"table_capacity": {MIN_CAPACITY}}}"#)),
        Ok(MIN_CAPACITY)
    );
    for bad in [
        "0".to_string(),
        (MIN_CAPACITY - 1).to_string(),
        (MAX_SHELL_CAPACITY + 1).to_string(),
        "-5".into(),
        "1.5".into(),
        r#""many""#.into(),
    ] {
        let e = capacity(&format!(r#"{{"table_capacity": {bad}}}"#)).unwrap_err();
        assert!(e.to_string().contains("table_capacity"), "{bad}: {e}");
    }
    let e = capacity(r#"{"table_capacity": 10}"#).unwrap_err();
    assert!(e.to_string().contains("from 64 to 1000000"), "{e}");
}
