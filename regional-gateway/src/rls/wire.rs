//! The request side of `envoy.service.ratelimit.v3.RateLimitService` as bytes, and the gRPC
//! service that decodes it.
//!
//! The protos declare the domain and each entry's key and value `string`, which a decoder must
//! refuse unless they are UTF-8; but Envoy fills an entry with the raw bytes of a request header,
//! and a service that refused the message would be an error to Envoy, which `failure_mode_deny:
//! false` lets through unlimited. `string` and `bytes` are the same on the wire, so these
//! messages read them as bytes, and the core spells what is not UTF-8 as `%XX`
//! ([`strata_core::rules::push_entry`]), as the Wasm filter does. Answers keep envoy-types'
//! messages: everything in them is the service's own.

use std::sync::Arc;
use std::task::{Context, Poll};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use envoy_types::pb::google::protobuf::UInt64Value;
use tonic::codegen::{Body, BoxFuture, Service, StdError, http};
use tonic::server::{Grpc, NamedService, UnaryService};
use tonic::{Code, Status};

use super::RlsService;

/// `envoy.service.ratelimit.v3.RateLimitRequest`, its text fields as bytes.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RateLimitRequest {
    /// The filter's `domain`.
    #[prost(bytes = "vec", tag = "1")]
    pub domain: Vec<u8>,
    /// One descriptor per `rate_limits` entry that applied to the request.
    #[prost(message, repeated, tag = "2")]
    pub descriptors: Vec<RateLimitDescriptor>,
    /// The cost of every descriptor without its own (0 is 1).
    #[prost(uint32, tag = "3")]
    pub hits_addend: u32,
}

/// `envoy.extensions.common.ratelimit.v3.RateLimitDescriptor`, its entries as bytes.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RateLimitDescriptor {
    /// The descriptor's `(key, value)` entries, in order.
    #[prost(message, repeated, tag = "1")]
    pub entries: Vec<Entry>,
    /// A limit the request carries instead of the configuration's.
    #[prost(message, optional, tag = "2")]
    pub limit: Option<RateLimitOverride>,
    /// This descriptor's own cost.
    #[prost(message, optional, tag = "3")]
    pub hits_addend: Option<UInt64Value>,
    /// A refund of an earlier cost (Envoy's `apply_on_stream_done`).
    #[prost(bool, tag = "4")]
    pub is_negative_hits: bool,
}

/// One `(key, value)` entry of a descriptor, as Envoy sends its bytes.
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct Entry {
    /// The descriptor key (`descriptor_key` of an action).
    #[prost(bytes = "vec", tag = "1")]
    pub key: Vec<u8>,
    /// The value: for a `request_headers` action, the header's bytes.
    #[prost(bytes = "vec", tag = "2")]
    pub value: Vec<u8>,
}

const SERVICE: &str = "envoy.service.ratelimit.v3.RateLimitService";
const SHOULD_RATE_LIMIT: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// The gRPC service: `ShouldRateLimit` decoded as [`RateLimitRequest`], every other method
/// `UNIMPLEMENTED`.
#[derive(Debug, Clone)]
pub struct RlsServer {
    service: Arc<RlsService>,
    max_message_bytes: usize,
}

impl RlsServer {
    /// `service`, taking messages of at most `max_message_bytes`.
    pub fn new(service: Arc<RlsService>, max_message_bytes: usize) -> Self {
        Self {
            service,
            max_message_bytes,
        }
    }
}

impl NamedService for RlsServer {
    const NAME: &'static str = SERVICE;
}

struct ShouldRateLimit(Arc<RlsService>);

impl UnaryService<RateLimitRequest> for ShouldRateLimit {
    type Response = RateLimitResponse;
    type Future = BoxFuture<tonic::Response<RateLimitResponse>, Status>;

    fn call(&mut self, request: tonic::Request<RateLimitRequest>) -> Self::Future {
        let service = self.0.clone();
        Box::pin(async move { service.should_rate_limit(request).await })
    }
}

impl<B> Service<http::Request<B>> for RlsServer
where
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        if request.uri().path() != SHOULD_RATE_LIMIT {
            let unimplemented = Status::new(Code::Unimplemented, "only ShouldRateLimit is served");
            return Box::pin(async move { Ok(unimplemented.into_http()) });
        }
        let method = ShouldRateLimit(self.service.clone());
        let max = self.max_message_bytes;
        Box::pin(async move {
            let codec = tonic_prost::ProstCodec::<RateLimitResponse, RateLimitRequest>::default();
            let mut grpc = Grpc::new(codec).apply_max_message_size_config(Some(max), None);
            Ok(grpc.unary(method, request).await)
        })
    }
}
