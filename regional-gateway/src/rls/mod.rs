//! Envoy's rate-limit service (`envoy.service.ratelimit.v3.RateLimitService`, gRPC), so stock
//! Envoy's `ratelimit` filter (and Istio, Gloo, Emissary, Contour that configure it) can use
//! the gateway with no Wasm.
//!
//! Each descriptor of a `ShouldRateLimit` call is looked up in the domain's configuration
//! ([`config`]); the ones under a limit are decided through the same limiter as the HTTP API,
//! all or nothing (a request is counted against every limit only if every limit passes), and
//! keyed by their entries encoded as the Wasm filter's rules encode a descriptor (namespace:
//! the domain), so both Envoy paths count one descriptor as one key. Keys and values are read
//! as bytes ([`wire`]), so a header that is not UTF-8 is limited like any other. Shadow
//! descriptors are decided beside the others, as a group of their own, and never deny. No call
//! a client shapes is answered with an error, which Envoy would let through under
//! `failure_mode_deny: false`.

pub mod config;
pub mod reload;
pub mod wire;

use std::sync::{Arc, Mutex, RwLock};

use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit as WireUnit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::google::protobuf::Duration as WireDuration;
use strata_core::headers::{Field, HeaderLimit, header_values};
use strata_core::identity::identifier_for;
use strata_core::rules::push_entry;
use strata_core::wire::{MAX_BODY_BYTES, MAX_COUNT, MAX_MULTI_LIMITS};
use strata_core::{Decision, LimitRequest, MultiDecision, WindowKeyRef};
use tonic::{Request, Response, Status};

use crate::Gateway;
use crate::config::RlsSettings;
use crate::metrics::RlsResult;
pub use config::{Limit, Rate, RlsConfig, RlsConfigError, Unit};
pub use wire::RlsServer;

/// Most descriptors in one call: as many as limits in one decision of the HTTP API.
pub const MAX_DESCRIPTORS: usize = MAX_MULTI_LIMITS;

/// What a call whose domain the configuration does not hold is answered (`--rls-unknown-domain`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum UnknownDomain {
    /// `OVER_LIMIT`: a domain mistyped in Envoy's filter denies, and is seen at once.
    #[default]
    Deny,
    /// `OK`: nothing limited, as envoyproxy/ratelimit answers it.
    Ok,
}

impl UnknownDomain {
    /// The setting's word.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Deny => "deny",
            Self::Ok => "ok",
        }
    }
}

impl std::str::FromStr for UnknownDomain {
    type Err = ();

    fn from_str(s: &str) -> Result<Self, ()> {
        match s {
            "deny" => Ok(Self::Deny),
            "ok" => Ok(Self::Ok),
            _ => Err(()),
        }
    }
}

/// The label of a limit a request carried, in metrics and headers (it has no place in the
/// configuration).
const REQUEST_LIMIT: &str = "request_limit";

/// The service over a gateway: the descriptors it decides by (swapped whole on a reload), the
/// answer to an unknown domain, and whether answers carry the IETF headers.
#[derive(Debug)]
pub struct RlsService {
    gateway: Arc<Gateway>,
    config: RwLock<Arc<RlsConfig>>,
    unknown_domain: UnknownDomain,
    ratelimit_headers: bool,
    /// Refusals repeat with every request of a misconfigured Envoy: one line per 10 s.
    refusals: Mutex<strata_core::driver::Quiet>,
}

impl RlsService {
    /// The service over `gateway`, as `settings` say.
    pub fn new(gateway: Arc<Gateway>, settings: &RlsSettings) -> Arc<Self> {
        Arc::new(Self {
            gateway,
            config: RwLock::new(settings.config.clone()),
            unknown_domain: settings.unknown_domain,
            ratelimit_headers: settings.ratelimit_headers,
            refusals: Mutex::default(),
        })
    }

    /// The gRPC server of `service`, bounded like the HTTP API (1 MiB a message).
    pub fn server(service: Arc<Self>) -> RlsServer {
        RlsServer::new(service, MAX_BODY_BYTES)
    }

    /// The descriptors in force.
    pub fn config(&self) -> Arc<RlsConfig> {
        match self.config.read() {
            Ok(c) => c.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Puts `config` in force for the calls that come after.
    pub fn replace_config(&self, config: Arc<RlsConfig>) {
        match self.config.write() {
            Ok(mut c) => *c = config,
            Err(poisoned) => *poisoned.into_inner() = config,
        }
    }
}

/// One descriptor of a call, resolved against the configuration.
enum Resolved {
    /// No limit applies: `OK`, nothing counted.
    Free,
    /// `unlimited: true`.
    Unlimited,
    /// Decided against a limit.
    Limited {
        identifier: String,
        rate: Rate,
        cost: u64,
    },
}

/// Why a call cannot be decided as sent. It is answered all the same (an error status would
/// be Envoy's `failure_mode_deny`, which the recommended `false` turns into a pass): an unknown
/// domain per `--rls-unknown-domain`, anything else `OVER_LIMIT`; nothing is counted.
enum Refusal {
    UnknownDomain,
    Malformed(String),
}

impl RlsService {
    /// Decides a `ShouldRateLimit` call: every enforced descriptor all or nothing, the shadow
    /// ones beside them as a group of their own (counted when they pass, never denying), both
    /// at once, so the answer comes within one `--origin-timeout` however many descriptors
    /// the call holds.
    pub async fn should_rate_limit(
        &self,
        request: Request<wire::RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let gw = &self.gateway;
        let authorization = request
            .metadata()
            .get("authorization")
            .map(|v| v.as_bytes());
        // Envoy's own configuration sends the token, never a client: an error is right here.
        let workspace = gw.auth.workspace_of(authorization).map_err(|e| {
            gw.limiter.metrics.rls_call(RlsResult::Refused);
            Status::unauthenticated(e.to_string())
        })?;
        let call = request.get_ref();
        let config = self.config();
        let (domain, resolved) = match resolve(&config, call) {
            Ok(r) => r,
            Err(refusal) => return Ok(Response::new(self.refuse(call, refusal))),
        };
        let mut groups: [Vec<(usize, LimitRequest<'_>)>; 2] = [Vec::new(), Vec::new()];
        for (i, r) in resolved.iter().enumerate() {
            let Resolved::Limited {
                identifier,
                rate,
                cost,
            } = r
            else {
                continue;
            };
            let key = match WindowKeyRef::new(workspace, domain, identifier, rate.unit.duration()) {
                Ok(key) => key,
                Err(e) => {
                    let refusal = Refusal::Malformed(format!("descriptors[{i}]: {e}"));
                    return Ok(Response::new(self.refuse(call, refusal)));
                }
            };
            let limit = u64::from(rate.requests_per_unit);
            let group = usize::from(rate.shadow);
            if let Some(g) = groups.get_mut(group) {
                g.push((
                    i,
                    LimitRequest {
                        key,
                        limit,
                        cost: *cost,
                    },
                ));
            }
        }
        let [enforced, shadow] = &groups;
        let (enforced_decided, shadow_decided) =
            tokio::join!(self.decide(enforced), self.decide(shadow));
        let success = enforced_decided.as_ref().is_none_or(|m| m.success);
        let mut decisions: Vec<Option<Decision>> = vec![None; resolved.len()];
        for (group, decided) in [(enforced, enforced_decided), (shadow, shadow_decided)] {
            let Some(decided) = decided else { continue };
            for ((i, _), d) in group.iter().zip(decided.decisions) {
                if let Some(slot) = decisions.get_mut(*i) {
                    *slot = Some(d);
                }
            }
        }
        let metrics = &gw.limiter.metrics;
        for (r, d) in resolved.iter().zip(&decisions) {
            let (Resolved::Limited { rate, .. }, Some(d)) = (r, d) else {
                continue;
            };
            let outcome = match (d.success, rate.shadow) {
                (true, _) => "ok",
                (false, false) => "over_limit",
                (false, true) => {
                    metrics.rls_shadow_over();
                    "shadow_over_limit"
                }
            };
            metrics.rls_descriptor(domain, rate.label(), outcome);
        }
        metrics.rls_call(if success {
            RlsResult::Ok
        } else {
            RlsResult::OverLimit
        });
        let now = gw.limiter.clock.now_ms();
        let statuses = resolved
            .iter()
            .zip(&decisions)
            .map(|(r, d)| status(r, d.as_ref(), now))
            .collect();
        let response_headers_to_add = if self.ratelimit_headers {
            ietf_headers(&resolved, &decisions, now)
        } else {
            Vec::new()
        };
        Ok(Response::new(RateLimitResponse {
            overall_code: if success { Code::Ok } else { Code::OverLimit } as i32,
            statuses,
            response_headers_to_add,
            ..RateLimitResponse::default()
        }))
    }

    /// One group's decision, all or nothing; `None` for a group with no limit.
    async fn decide(&self, group: &[(usize, LimitRequest<'_>)]) -> Option<MultiDecision> {
        if group.is_empty() {
            return None;
        }
        let limits: Vec<LimitRequest<'_>> = group.iter().map(|(_, l)| *l).collect();
        Some(self.gateway.limiter.decide_all(&limits).await)
    }

    /// The answer to a call that cannot be decided as sent, logged with why (once per 10 s
    /// with how many more there were: they repeat with every request).
    fn refuse(&self, call: &wire::RateLimitRequest, refusal: Refusal) -> RateLimitResponse {
        self.gateway.limiter.metrics.rls_call(RlsResult::Refused);
        let domain = String::from_utf8_lossy(&call.domain);
        let (code, message) = match refusal {
            Refusal::UnknownDomain => (
                match self.unknown_domain {
                    UnknownDomain::Deny => Code::OverLimit,
                    UnknownDomain::Ok => Code::Ok,
                },
                format!(
                    "rate-limit call for domain `{domain}`, which --rls-config does not hold: answered per --rls-unknown-domain ({})",
                    self.unknown_domain.as_str()
                ),
            ),
            Refusal::Malformed(why) => (
                Code::OverLimit,
                format!(
                    "rate-limit call for domain `{domain}` cannot be decided as sent ({why}): answered OVER_LIMIT"
                ),
            ),
        };
        let now = self.gateway.limiter.clock.now_ms();
        let line = match self.refusals.lock() {
            Ok(mut quiet) => quiet.line(now, message),
            Err(poisoned) => poisoned.into_inner().line(now, message),
        };
        if let Some(line) = line {
            tracing::warn!("{}", line.message);
        }
        RateLimitResponse {
            overall_code: code as i32,
            ..RateLimitResponse::default()
        }
    }
}

/// The call's domain and each descriptor's limit and cost, or why it cannot be decided.
fn resolve<'c>(
    config: &RlsConfig,
    call: &'c wire::RateLimitRequest,
) -> Result<(&'c str, Vec<Resolved>), Refusal> {
    let domain = std::str::from_utf8(&call.domain).map_err(|_| Refusal::UnknownDomain)?;
    if !config.has_domain(domain) {
        return Err(Refusal::UnknownDomain);
    }
    if call.descriptors.len() > MAX_DESCRIPTORS {
        return Err(Refusal::Malformed(format!(
            "at most {MAX_DESCRIPTORS} descriptors a call, got {}",
            call.descriptors.len()
        )));
    }
    let resolved = call
        .descriptors
        .iter()
        .enumerate()
        .map(|(i, d)| {
            resolve_one(config, domain, call.hits_addend, d)
                .map_err(|m| Refusal::Malformed(format!("descriptors[{i}].{m}")))
        })
        .collect::<Result<_, _>>()?;
    Ok((domain, resolved))
}

/// One descriptor's limit and cost, or the field (and why) it cannot be decided by.
fn resolve_one(
    config: &RlsConfig,
    domain: &str,
    call_hits: u32,
    d: &wire::RateLimitDescriptor,
) -> Result<Resolved, String> {
    if d.is_negative_hits {
        // A refund (Envoy's `apply_on_stream_done`): counts only grow (a G-Counter across
        // regions), so it returns nothing, and answers OK.
        return Ok(Resolved::Free);
    }
    // A descriptor's own hits_addend (0 only checks), else the call's (0 means 1). A cost
    // beyond any count is the largest count: still more than any limit, so denied.
    let cost = match &d.hits_addend {
        Some(h) => h.value,
        None => u64::from(call_hits.max(1)),
    }
    .min(MAX_COUNT);
    let entries = d
        .entries
        .iter()
        .map(|e| (e.key.as_slice(), e.value.as_slice()));
    let rate = match &d.limit {
        // A limit the request carries (Envoy's `limit` action, from dynamic metadata).
        Some(o) => {
            let unit = Unit::from_wire(o.unit).ok_or_else(|| {
                format!(
                    "limit.unit: {} is not a unit Strata windows (second to month)",
                    o.unit
                )
            })?;
            Rate {
                name: String::new(),
                requests_per_unit: o.requests_per_unit,
                unit,
                shadow: false,
                descriptor: String::new(),
            }
        }
        None => match config.limit_for(domain, entries.clone()) {
            None => return Ok(Resolved::Free),
            Some(Limit::Unlimited) => return Ok(Resolved::Unlimited),
            Some(Limit::Limited(rate)) => rate.clone(),
        },
    };
    if d.entries.is_empty() {
        return Err("entries: must not be empty under a limit".into());
    }
    let mut text = String::new();
    for (key, value) in entries {
        push_entry(&mut text, key, value);
    }
    Ok(Resolved::Limited {
        identifier: identifier_for(text),
        rate,
        cost,
    })
}

impl Rate {
    /// What metrics and headers call this limit: its place in the configuration, or
    /// [`REQUEST_LIMIT`].
    fn label(&self) -> &str {
        if self.descriptor.is_empty() {
            REQUEST_LIMIT
        } else {
            &self.descriptor
        }
    }
}

/// `RateLimit-Policy`, `RateLimit` and, on a denial, `Retry-After` for the enforced limits of a
/// call, as the HTTP API writes them (the core's [`header_values`]): each policy named by its
/// `rate_limit.name`, else its place in the configuration. Envoy adds them to the response.
fn ietf_headers(
    resolved: &[Resolved],
    decisions: &[Option<Decision>],
    now_ms: u64,
) -> Vec<HeaderValue> {
    let limits: Vec<HeaderLimit<'_>> = resolved
        .iter()
        .zip(decisions)
        .filter_map(|(r, d)| match (r, d) {
            (Resolved::Limited { rate, .. }, Some(decision)) if !rate.shadow => Some(HeaderLimit {
                policy: if rate.name.is_empty() {
                    rate.label()
                } else {
                    &rate.name
                },
                duration: rate.unit.duration(),
                decision,
            }),
            _ => None,
        })
        .collect();
    if limits.is_empty() {
        return Vec::new();
    }
    let values = header_values(&limits, now_ms);
    [Field::Policy, Field::RateLimit, Field::RetryAfter]
        .into_iter()
        .filter_map(|f| {
            values.get(f).map(|v| HeaderValue {
                key: f.name().to_string(),
                value: v.to_string(),
                raw_value: Vec::new(),
            })
        })
        .collect()
}

/// A descriptor's status as envoyproxy/ratelimit answers it: no limit is `OK` with none; an
/// unlimited one `OK` with the most remaining; a limited one its limit, what is left and, as
/// Envoy's `X-RateLimit-Reset` reads it, the seconds until a request can pass again (when
/// denied) or the window ends.
fn status(resolved: &Resolved, decision: Option<&Decision>, now_ms: u64) -> DescriptorStatus {
    let (rate, d) = match (resolved, decision) {
        (Resolved::Limited { rate, .. }, Some(d)) => (rate, d),
        (Resolved::Unlimited, _) => {
            return DescriptorStatus {
                code: Code::Ok as i32,
                limit_remaining: u32::MAX,
                ..DescriptorStatus::default()
            };
        }
        _ => {
            return DescriptorStatus {
                code: Code::Ok as i32,
                ..DescriptorStatus::default()
            };
        }
    };
    let code = if d.success || rate.shadow {
        Code::Ok
    } else {
        Code::OverLimit
    };
    let until_ms = match d.retry_after_ms {
        Some(ms) if !d.success => ms,
        _ => d.reset_ms.saturating_sub(now_ms),
    };
    DescriptorStatus {
        code: code as i32,
        current_limit: Some(RateLimit {
            name: rate.name.clone(),
            requests_per_unit: rate.requests_per_unit,
            unit: wire_unit(rate.unit) as i32,
        }),
        limit_remaining: u32::try_from(d.remaining).unwrap_or(u32::MAX),
        duration_until_reset: Some(WireDuration {
            seconds: i64::try_from(until_ms.div_ceil(1_000)).unwrap_or(i64::MAX),
            nanos: 0,
        }),
        quota: None,
    }
}

fn wire_unit(unit: Unit) -> WireUnit {
    match unit {
        Unit::Second => WireUnit::Second,
        Unit::Minute => WireUnit::Minute,
        Unit::Hour => WireUnit::Hour,
        Unit::Day => WireUnit::Day,
        Unit::Week => WireUnit::Week,
        Unit::Month => WireUnit::Month,
    }
}
