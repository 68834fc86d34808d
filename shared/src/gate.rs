//! The rule layer of a Wasm shell (the Workers edge, the Envoy filter): rules applied to a
//! request ([`Gate::subjects`]), its limits keyed ([`Gate::group_limits`]), and the reply built
//! once its groups are decided ([`Pending::settled`], [`Pending::reply`]). A request runs
//! through [`crate::driver::Driver`], the one request path of the shells (and of the tests).
//!
//! Enforced limits are one all-or-nothing decision; shadow limits are another, so a shadow
//! rule never changes whether the request passes (it is counted and reported only). Each
//! group needs at most one origin call, and the two can be made at once.

use alloc::format;
use alloc::string::{String, ToString};
use alloc::vec::Vec;
use core::fmt;

use serde::{Deserialize, Serialize};

use crate::address::ClientAddress;
use crate::decision::{Decision, MultiDecision};
use crate::headers::{Field, HeaderLimit, HeaderValues, header_values};
use crate::identity::{WindowKeyRef, validate_workspace};
use crate::request::FailureMode;
use crate::rules::{RequestError, RequestView, RuleError, RuleSet};
use crate::table::{CounterTable, LimitRequest, TableCapacity, TableConfig};
use crate::window::WindowDuration;

/// How a shell answers, besides its rules. The JSON both shells take (unknown fields refused).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GateOptions {
    /// What a request whose decision needs the origin gets when the origin gives no answer:
    /// `local` (decide from memory), `allow` or `deny` ([`FailureMode`]). It takes effect
    /// through the table: make it with [`Gate::table`].
    pub failure_mode: FailureMode,
    /// Also send `X-RateLimit-Limit`, `-Remaining` and `-Reset`.
    pub legacy_headers: bool,
    /// Send the rate-limit headers on passed requests too (always on denials).
    pub headers_on_pass: bool,
    /// Say in a response header when the origin could not be reached.
    pub debug: bool,
    /// Where `remote_address` finds the client's address: `peer` (the runtime's address
    /// for the request), `none`, `x-forwarded-for`, or a header a proxy in front sets
    /// ([`ClientAddress`]).
    pub client_address: String,
    /// With `x-forwarded-for`: trusted proxies before the one that connects.
    pub xff_num_trusted_hops: u32,
    /// The most window keys the shell's table holds ([`TableCapacity`]).
    pub table_capacity: TableCapacity,
}

impl Default for GateOptions {
    fn default() -> Self {
        Self {
            failure_mode: FailureMode::Local,
            legacy_headers: false,
            headers_on_pass: true,
            debug: false,
            client_address: "peer".to_string(),
            xff_num_trusted_hops: 0,
            table_capacity: TableCapacity::default(),
        }
    }
}

impl GateOptions {
    /// The `client_address` source these options name.
    pub fn client_address(&self) -> Result<ClientAddress, RuleError> {
        ClientAddress::parse(&self.client_address, self.xff_num_trusted_hops).map_err(|message| {
            RuleError {
                field: String::new(),
                message,
            }
        })
    }

    /// Parses the options JSON; errors name the field.
    pub fn from_json(json: &str) -> Result<Self, RuleError> {
        let mut de = serde_json::Deserializer::from_str(json);
        let options: Self = serde_path_to_error::deserialize(&mut de).map_err(|e| {
            let path = e.path().to_string();
            RuleError {
                field: if path == "." { String::new() } else { path },
                message: e.into_inner().to_string(),
            }
        })?;
        de.end().map_err(|e| RuleError {
            field: String::new(),
            message: e.to_string(),
        })?;
        Ok(options)
    }
}

/// A shell's rules and options, validated once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gate {
    workspace: String,
    rules: RuleSet,
    options: GateOptions,
}

/// One limit a request is subject to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Subject {
    /// Policy name for headers and logs.
    pub name: String,
    /// Namespace of its counts.
    pub namespace: String,
    /// Identifier within the namespace.
    pub identifier: String,
    /// Allowed cost per window.
    pub limit: u64,
    /// The window.
    pub duration: WindowDuration,
    /// This request's cost.
    pub cost: u64,
    /// Counted and reported, never enforced.
    pub shadow: bool,
}

/// Where a group of limits stands.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Group {
    /// No limit in the group.
    Empty,
    /// Decided.
    Decided(MultiDecision),
}

/// The enforced group's index in [`Pending::decision`].
pub const ENFORCED: usize = 0;
/// The shadow group's index.
pub const SHADOW: usize = 1;

/// A request whose groups are decided, for [`Pending::reply`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pending {
    subjects: Vec<Subject>,
    groups: [Group; 2],
    /// Whether an origin call of this request failed.
    pub origin_failed: bool,
    /// Whether a `remote_address` rule was left out for want of a trusted client address.
    pub unaddressed: bool,
}

/// The limits a request is subject to under a gate's rules ([`Gate::subjects`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Subjects {
    /// Each limit, in rule order.
    pub limits: Vec<Subject>,
    /// Whether a `remote_address` rule was left out for want of a trusted client address.
    pub unaddressed: bool,
}

/// `Strata-Shadow`: the `RateLimit` value of the shadow rules, which never deny.
pub const SHADOW_HEADER: &str = "strata-shadow";
/// `Strata-Origin: unavailable` (with `debug`): the failure mode decided the reply.
pub const ORIGIN_HEADER: &str = "strata-origin";

/// Every name a [`Reply`]'s headers can have, lower case: a shell that learns the list once
/// can name a header by its index instead of copying its name out on every reply.
pub const REPLY_HEADER_NAMES: [&str; Field::ALL.len() + 2] = {
    let mut names = [""; Field::ALL.len() + 2];
    let mut i = 0;
    while i < Field::ALL.len() {
        names[i] = Field::ALL[i].name();
        i += 1;
    }
    names[i] = SHADOW_HEADER;
    names[i + 1] = ORIGIN_HEADER;
    names
};

/// What the shell answers the client, or adds to the upstream's answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    /// Whether the request goes on to the upstream.
    pub allowed: bool,
    /// `429` on a denial, `200` otherwise (the upstream's status replaces it).
    pub status: u16,
    /// Response headers to set, on a denial or (when configured) on a pass.
    pub headers: Vec<(&'static str, String)>,
    /// The JSON body of a denial.
    pub body: Option<String>,
    /// Names of shadow rules that would have denied the request (for the log).
    pub shadow_denied: Vec<String>,
}

/// A gate that cannot be built.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GateError {
    /// The rules JSON.
    Rules(RuleError),
    /// The options JSON.
    Options(RuleError),
    /// The workspace name.
    Workspace(String),
}

impl fmt::Display for GateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GateError::Rules(e) => write!(f, "invalid rules: {e}"),
            GateError::Options(e) => write!(f, "invalid options: {e}"),
            GateError::Workspace(e) => write!(f, "invalid workspace: {e}"),
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for GateError {}

impl Gate {
    /// A gate from the rules and options JSON. `workspace` names the local table's counters
    /// (the gateway binds the real one to the shell's token).
    pub fn from_json(workspace: &str, rules: &str, options: &str) -> Result<Self, GateError> {
        validate_workspace(workspace).map_err(|e| GateError::Workspace(e.to_string()))?;
        let options = if options.trim().is_empty() {
            GateOptions::default()
        } else {
            GateOptions::from_json(options).map_err(GateError::Options)?
        };
        let source = options.client_address().map_err(GateError::Options)?;
        Ok(Self {
            workspace: workspace.to_string(),
            rules: RuleSet::from_json(rules)
                .map_err(GateError::Rules)?
                .with_client_address(source),
            options,
        })
    }

    /// The rules.
    pub fn rules(&self) -> &RuleSet {
        &self.rules
    }

    /// The options.
    pub fn options(&self) -> &GateOptions {
        &self.options
    }

    /// The table this gate's requests are decided on, as the options say: its capacity, and
    /// the failure mode, so a failed call, and the calls held off after one, decide as
    /// configured. `seed` keys its hash (randomness from the host).
    pub fn table(&self, seed: u64) -> CounterTable {
        let mut config = TableConfig {
            capacity: self.options.table_capacity.get(),
            ..TableConfig::default()
        };
        config.origin.failure_mode = self.options.failure_mode;
        // A lease in use far from the limit rides the replay to its renewal, as in the
        // gateway, instead of making a request wait for a decision when it runs out.
        config.renew_leases = true;
        CounterTable::new(config, seed)
    }

    /// The limits `request` is subject to under the rules.
    pub fn subjects(&self, request: &impl RequestView) -> Result<Subjects, RequestError> {
        let rules = self.rules.rules();
        let applies = self.rules.applies(request)?;
        let limits = applies
            .limits
            .into_iter()
            .filter_map(|a| {
                let rule = rules.get(a.rule)?;
                Some(Subject {
                    name: rule.name.clone(),
                    namespace: rule.namespace.clone(),
                    identifier: a.identifier,
                    limit: rule.limit,
                    duration: rule.duration,
                    cost: a.cost,
                    shadow: rule.shadow,
                })
            })
            .collect();
        Ok(Subjects {
            limits,
            unaddressed: applies.unaddressed,
        })
    }

    /// The limits of one group of `subjects` (the `shadow` ones, or the enforced ones), keyed
    /// in the gate's workspace, in order.
    pub fn group_limits<'s>(
        &'s self,
        subjects: &'s [Subject],
        shadow: bool,
    ) -> Result<Vec<LimitRequest<'s>>, RequestError> {
        subjects
            .iter()
            .filter(|s| s.shadow == shadow)
            .map(|s| self.limit_of(s))
            .collect()
    }

    /// Whether every limit of `subjects` has a key (what [`group_limits`](Self::group_limits)
    /// would refuse), without building them: checked before a request counts anywhere.
    pub fn check_keys(&self, subjects: &[Subject]) -> Result<(), RequestError> {
        subjects.iter().try_for_each(|s| self.limit_of(s).map(drop))
    }

    /// One subject as a limit, keyed in the gate's workspace.
    fn limit_of<'s>(&'s self, s: &'s Subject) -> Result<LimitRequest<'s>, RequestError> {
        let key = WindowKeyRef::new(&self.workspace, &s.namespace, &s.identifier, s.duration)
            .map_err(|e| RequestError {
                rule: s.name.clone(),
                message: e.to_string(),
            })?;
        Ok(LimitRequest {
            key,
            limit: s.limit,
            cost: s.cost,
        })
    }
}

impl Pending {
    /// A request whose groups are decided (`None`: a group without limits), for the reply.
    pub fn settled(
        subjects: Vec<Subject>,
        groups: [Option<MultiDecision>; 2],
        origin_failed: bool,
        unaddressed: bool,
    ) -> Self {
        let group = |d: Option<MultiDecision>| d.map_or(Group::Empty, Group::Decided);
        let [enforced, shadow] = groups;
        Self {
            subjects,
            groups: [group(enforced), group(shadow)],
            origin_failed,
            unaddressed,
        }
    }

    /// The limits the request is subject to.
    pub fn subjects(&self) -> &[Subject] {
        &self.subjects
    }

    /// The decision of group `g`, once decided.
    pub fn decision(&self, g: usize) -> Option<&MultiDecision> {
        match self.groups.get(g) {
            Some(Group::Decided(d)) => Some(d),
            _ => None,
        }
    }

    /// Whether the request passes: every enforced limit allowed it.
    pub fn allowed(&self) -> bool {
        match &self.groups[ENFORCED] {
            Group::Empty => true,
            Group::Decided(d) => d.success,
        }
    }

    /// The reply: status, headers and body.
    pub fn reply(&self, options: &GateOptions, now_ms: u64) -> Reply {
        let allowed = self.allowed();
        let enforced = self.header_limits(false);
        let shadow = self.header_limits(true);
        let mut headers = Vec::new();
        if !enforced.is_empty() && (!allowed || options.headers_on_pass) {
            let h = header_values(&enforced, now_ms);
            push_headers(&mut headers, &h, options.legacy_headers);
        }
        if !shadow.is_empty() {
            let h = header_values(&shadow, now_ms);
            if let Some(v) = h.get(Field::RateLimit) {
                headers.push((SHADOW_HEADER, v.to_string()));
            }
        }
        if options.debug && self.origin_failed {
            headers.push((ORIGIN_HEADER, "unavailable".to_string()));
        }
        let shadow_denied = shadow
            .iter()
            .filter(|l| !l.decision.success)
            .map(|l| l.policy.to_string())
            .collect();
        let body = (!allowed).then(|| {
            let denied: Vec<&str> = enforced
                .iter()
                .filter(|l| !l.decision.success)
                .map(|l| l.policy)
                .collect();
            let retry = enforced
                .iter()
                .filter(|l| !l.decision.success)
                .filter_map(|l| l.decision.retry_after_ms)
                .max();
            serde_json::json!({
                "error": {
                    "code": "rate_limited",
                    "message": format!("rate limit exceeded: {}", denied.join(", ")),
                },
                "retry_after": retry.map(crate::headers::ceil_seconds),
            })
            .to_string()
        });
        Reply {
            allowed,
            status: if allowed { 200 } else { 429 },
            headers,
            body,
            shadow_denied,
        }
    }

    /// The policy, window and decision of each limit of one group, in request order.
    fn header_limits(&self, shadow: bool) -> Vec<HeaderLimit<'_>> {
        let g = if shadow { SHADOW } else { ENFORCED };
        let Some(Group::Decided(d)) = self.groups.get(g) else {
            return Vec::new();
        };
        self.subjects
            .iter()
            .filter(|s| s.shadow == shadow)
            .zip(&d.decisions)
            .map(|(s, decision): (&Subject, &Decision)| HeaderLimit {
                policy: &s.name,
                duration: s.duration,
                decision,
            })
            .collect()
    }
}

fn push_headers(out: &mut Vec<(&'static str, String)>, h: &HeaderValues, legacy: bool) {
    for (field, value) in h.fields() {
        if field.is_sent(legacy) {
            out.push((field.name(), value.to_string()));
        }
    }
}
