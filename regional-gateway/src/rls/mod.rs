//! Envoy's rate-limit service (`envoy.service.ratelimit.v3.RateLimitService`, gRPC), so stock
//! Envoy's `ratelimit` filter (and Istio, Gloo, Emissary, Contour that configure it) can use
//! the gateway with no Wasm.
//!
//! Each descriptor of a `ShouldRateLimit` call is looked up in the domain's configuration
//! ([`config`]); the ones under a limit are decided through the same limiter as the HTTP API,
//! all or nothing (a request is counted against every limit only if every limit passes), and
//! keyed by their entries encoded as the Wasm filter's rules encode a descriptor (namespace:
//! the domain), so both Envoy paths count one descriptor as one key. Shadow descriptors are
//! decided after the others and never deny.

pub mod config;

use std::sync::Arc;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit as WireUnit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration as WireDuration;
use strata_core::identity::identifier_for;
use strata_core::rules::push_entry;
use strata_core::wire::{MAX_BODY_BYTES, MAX_COUNT, MAX_MULTI_LIMITS};
use strata_core::{Decision, LimitRequest, WindowKeyRef};
use tonic::{Request, Response, Status};

use crate::Gateway;
use crate::metrics::RlsResult;
pub use config::{Limit, Rate, RlsConfig, RlsConfigError, Unit};

/// Most descriptors in one call: as many as limits in one decision of the HTTP API.
pub const MAX_DESCRIPTORS: usize = MAX_MULTI_LIMITS;

/// The gRPC service over a gateway.
#[derive(Debug, Clone)]
pub struct RlsService {
    gateway: Arc<Gateway>,
    config: Arc<RlsConfig>,
}

impl RlsService {
    /// The service, as a tonic server bounded like the HTTP API (1 MiB a message).
    pub fn server(gateway: Arc<Gateway>, config: Arc<RlsConfig>) -> RateLimitServiceServer<Self> {
        RateLimitServiceServer::new(Self { gateway, config })
            .max_decoding_message_size(MAX_BODY_BYTES)
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

#[tonic::async_trait]
impl RateLimitService for RlsService {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let gw = &self.gateway;
        let authorization = request
            .metadata()
            .get("authorization")
            .map(|v| v.as_bytes());
        let workspace = gw.auth.workspace_of(authorization).map_err(|e| {
            gw.limiter.metrics.rls_call(RlsResult::Refused);
            Status::unauthenticated(e.to_string())
        })?;
        let call = request.get_ref();
        let resolved = self.resolve(call).inspect_err(|s| {
            gw.limiter.metrics.rls_call(RlsResult::Refused);
            tracing::debug!(domain = %call.domain, message = s.message(), "rate-limit call refused");
        })?;
        let domain = call.domain.as_str();
        let keyed: Vec<(usize, LimitRequest<'_>, bool)> = resolved
            .iter()
            .enumerate()
            .filter_map(|(i, r)| match r {
                Resolved::Limited {
                    identifier,
                    rate,
                    cost,
                } => Some((i, identifier, rate, *cost)),
                _ => None,
            })
            .map(|(i, identifier, rate, cost)| {
                WindowKeyRef::new(workspace, domain, identifier, rate.unit.duration())
                    .map(|key| {
                        let limit = u64::from(rate.requests_per_unit);
                        (i, LimitRequest { key, limit, cost }, rate.shadow)
                    })
                    .map_err(|e| Status::invalid_argument(format!("descriptors[{i}]: {e}")))
            })
            .collect::<Result<_, _>>()
            .inspect_err(|_| gw.limiter.metrics.rls_call(RlsResult::Refused))?;
        let mut decisions: Vec<Option<Decision>> = vec![None; resolved.len()];
        let enforced: Vec<LimitRequest<'_>> = keyed
            .iter()
            .filter(|(_, _, shadow)| !shadow)
            .map(|(_, l, _)| *l)
            .collect();
        let mut success = true;
        if !enforced.is_empty() {
            let multi = gw.limiter.decide_all(&enforced).await;
            success = multi.success;
            let slots = keyed.iter().filter(|(_, _, shadow)| !shadow);
            for ((i, _, _), d) in slots.zip(multi.decisions) {
                if let Some(slot) = decisions.get_mut(*i) {
                    *slot = Some(d);
                }
            }
        }
        // A shadow limit sees the request as enforcing it would have: counted when the request
        // passes, only checked when another limit denied it.
        for (i, limit, _) in keyed.iter().filter(|(_, _, shadow)| *shadow) {
            let cost = if success { limit.cost } else { 0 };
            let d = gw.limiter.decide(LimitRequest { cost, ..*limit }).await;
            if !d.success {
                gw.limiter.metrics.rls_shadow_over();
                tracing::debug!(%domain, identifier = limit.key.identifier(), "shadow limit over");
            }
            if let Some(slot) = decisions.get_mut(*i) {
                *slot = Some(d);
            }
        }
        gw.limiter.metrics.rls_call(if success {
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
        Ok(Response::new(RateLimitResponse {
            overall_code: if success { Code::Ok } else { Code::OverLimit } as i32,
            statuses,
            ..RateLimitResponse::default()
        }))
    }
}

impl RlsService {
    /// Each descriptor's limit and cost, or why the call is refused (nothing is counted then).
    fn resolve(&self, call: &RateLimitRequest) -> Result<Vec<Resolved>, Status> {
        if call.domain.is_empty() {
            return Err(Status::invalid_argument("domain must not be empty"));
        }
        if !self.config.has_domain(&call.domain) {
            // Answering OK would let a mistyped domain limit nothing, silently; Envoy counts
            // this as an error (`ratelimit.error`) and applies its `failure_mode_deny`.
            return Err(Status::not_found(format!(
                "domain `{}` is not in the rate-limit configuration",
                call.domain
            )));
        }
        if call.descriptors.is_empty() {
            return Err(Status::invalid_argument("descriptors must not be empty"));
        }
        if call.descriptors.len() > MAX_DESCRIPTORS {
            return Err(Status::invalid_argument(format!(
                "at most {MAX_DESCRIPTORS} descriptors a call, got {}",
                call.descriptors.len()
            )));
        }
        call.descriptors
            .iter()
            .enumerate()
            .map(|(i, d)| self.resolve_one(call, i, d))
            .collect()
    }

    fn resolve_one(
        &self,
        call: &RateLimitRequest,
        i: usize,
        d: &RateLimitDescriptor,
    ) -> Result<Resolved, Status> {
        let at = |field: &str, message: String| {
            Status::invalid_argument(format!("descriptors[{i}].{field}: {message}"))
        };
        if d.is_negative_hits {
            return Err(at(
                "is_negative_hits",
                "not supported: Strata's counts only grow (a G-Counter across regions)".into(),
            ));
        }
        // A descriptor's own hits_addend (0 only checks), else the call's (0 means 1).
        let cost = match &d.hits_addend {
            Some(h) => h.value,
            None => u64::from(call.hits_addend.max(1)),
        };
        if cost > MAX_COUNT {
            return Err(at(
                "hits_addend",
                format!("must be at most {MAX_COUNT}, got {cost}"),
            ));
        }
        let entries = d.entries.iter().map(|e| (e.key.as_str(), e.value.as_str()));
        let rate = match &d.limit {
            // A limit the request carries (Envoy's `limit` action, from dynamic metadata).
            Some(o) => {
                let unit = Unit::from_wire(o.unit).ok_or_else(|| {
                    at(
                        "limit.unit",
                        format!("{} is not a unit Strata windows (second to month)", o.unit),
                    )
                })?;
                Rate {
                    name: String::new(),
                    requests_per_unit: o.requests_per_unit,
                    unit,
                    shadow: false,
                }
            }
            None => match self.config.limit_for(&call.domain, entries.clone()) {
                None => return Ok(Resolved::Free),
                Some(Limit::Unlimited) => return Ok(Resolved::Unlimited),
                Some(Limit::Limited(rate)) => rate.clone(),
            },
        };
        if d.entries.is_empty() {
            return Err(at("entries", "must not be empty under a limit".into()));
        }
        let mut text = String::new();
        for (key, value) in entries {
            push_entry(&mut text, key, value.as_bytes());
        }
        Ok(Resolved::Limited {
            identifier: identifier_for(text),
            rate,
            cost,
        })
    }
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
