//! Envoy's rate-limit service as Envoy's `ratelimit` filter calls it: a gRPC client for a
//! gateway process's `--rls-listen`, and the descriptor configuration the conformance table
//! runs through it.

use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use strata_gateway::rls::wire::{Entry, RateLimitDescriptor, RateLimitRequest};
use tonic::transport::Channel;

/// The domain [`conformance_config`] serves.
pub const DOMAIN: &str = "conformance";

/// A descriptor configuration for the conformance table: each `(key, limit)` an entry key
/// limited to `limit` a day (the HTTP rows' one-day windows).
pub fn conformance_config(limits: &[(&str, u64)]) -> String {
    let mut yaml = format!("domain: {DOMAIN}\ndescriptors:\n");
    for (key, limit) in limits {
        yaml.push_str(&format!(
            "  - key: {key}\n    rate_limit: {{unit: day, requests_per_unit: {limit}}}\n"
        ));
    }
    yaml
}

/// What [`RlsClient::sends`]'s calls answer.
pub type Admits = std::pin::Pin<Box<dyn Future<Output = Result<bool, String>> + Send>>;

/// A client of one rate-limit service.
#[derive(Clone)]
pub struct RlsClient {
    grpc: tonic::client::Grpc<Channel>,
}

impl RlsClient {
    /// A client of the service at `address` (`host:port`); the connection is made lazily.
    pub fn new(address: &str) -> Self {
        let channel = Channel::from_shared(format!("http://{address}"))
            .unwrap()
            .connect_lazy();
        Self {
            grpc: tonic::client::Grpc::new(channel),
        }
    }

    /// The conformance table's `send`: a call of the entry `key` = the key it is given
    /// ([`admits`](Self::admits)).
    pub fn sends(&self, key: &'static str) -> impl Fn(String) -> Admits + Clone + Send + 'static {
        let rls = self.clone();
        move |value: String| {
            let rls = rls.clone();
            Box::pin(async move { rls.admits(key, &value).await })
        }
    }

    /// One `ShouldRateLimit` call of one descriptor entry `key` = `value` in [`DOMAIN`]:
    /// whether it was let through (`OK`), or what went wrong.
    pub async fn admits(&self, key: &str, value: &str) -> Result<bool, String> {
        let request = RateLimitRequest {
            domain: DOMAIN.as_bytes().to_vec(),
            descriptors: vec![RateLimitDescriptor {
                entries: vec![Entry {
                    key: key.as_bytes().to_vec(),
                    value: value.as_bytes().to_vec(),
                }],
                ..RateLimitDescriptor::default()
            }],
            hits_addend: 0,
        };
        let mut grpc = self.grpc.clone();
        grpc.ready().await.map_err(|e| e.to_string())?;
        let codec = tonic_prost::ProstCodec::<RateLimitRequest, RateLimitResponse>::default();
        let path = tonic::codegen::http::uri::PathAndQuery::from_static(
            "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
        );
        let answer = grpc
            .unary(tonic::Request::new(request), path, codec)
            .await
            .map_err(|s| format!("{:?}: {}", s.code(), s.message()))?
            .into_inner();
        match Code::try_from(answer.overall_code) {
            Ok(Code::Ok) => Ok(true),
            Ok(Code::OverLimit) => Ok(false),
            other => Err(format!("overall code {other:?}")),
        }
    }
}
