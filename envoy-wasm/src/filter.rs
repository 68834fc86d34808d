//! One VM's filter: proxy-wasm callbacks mapped to the core's [`Driver`] events, and what it
//! puts out mapped to host calls. A request is an event (its context id is its id); a call
//! answer and the tick are events; the calls the driver wants are dispatched here, and the
//! decisions it makes are handed back as [`Settle`]s, which the glue applies once the VM is
//! no longer borrowed (resuming or answering a stream can call back into the VM at once).
//! Nothing here panics: lookups use `get`, parse errors become failures the driver decides.

use std::collections::BTreeMap;
use std::time::Duration;

use strata_core::Reason;
use strata_core::driver::{Decided, Driver, DriverConfig, DriverStats, Started, Transmit};
use strata_core::memory::MemoryReport;
use strata_core::rules::{ListRequest, Reads, host_of, path_of};
use strata_core::wire::instance_id;

use crate::config::Config;
use crate::host::Host;
use crate::metrics::{Metric, Metrics};
use crate::shared::Slots;
use crate::store::{Homes, SlotReplay, VmState};

/// What the request callback tells Envoy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Go on to the upstream.
    Continue,
    /// Wait: for the gateway, or for the local reply in its [`Settle`].
    Pause,
}

/// What a stream gets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Go on (resume it, if it is paused).
    Continue,
    /// A local reply.
    Reply {
        /// The status.
        status: u32,
        /// Its headers.
        headers: Vec<(&'static str, String)>,
        /// Its body.
        body: String,
    },
}

/// A decision for HTTP context `context`, to apply with [`apply`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settle {
    /// The stream.
    pub context: u32,
    /// What it gets.
    pub action: Action,
}

/// Everything one VM holds.
#[derive(Debug)]
pub struct Vm {
    config: Config,
    /// What the rules read of a request: the only headers fetched from Envoy.
    reads: Reads,
    driver: Driver,
    state: VmState,
    metrics: Metrics,
    /// The driver's counters as the host's counters hold them.
    flushed: DriverStats,
    /// The table and memory figures as the host's stats hold this VM's share of them.
    reported: MemoryReport,
    /// Envoy's token of each call in flight → the driver's call id.
    tokens: BTreeMap<u32, u64>,
    /// Headers to add in the response phase of passed requests.
    pass_headers: BTreeMap<u32, Vec<(&'static str, String)>>,
    /// Decisions for streams, for the glue to apply.
    settled: Vec<Settle>,
    /// Calls to dispatch from the root context, and the queue that wakes it for them.
    deferred: Vec<Transmit>,
    wake_queue: Option<u32>,
    wake_sent: bool,
}

/// The request as the rules read it: only the parts and headers they name (`reads`), one
/// host call each. Header values stay bytes; the pseudo-headers the matchers compare as text
/// are read lossily (a byte that is not UTF-8 matches no configured text).
fn envoy_request(host: &impl Host, reads: &Reads) -> ListRequest {
    let text = |wanted: bool, name: &str| -> String {
        let bytes = if wanted {
            host.request_header(name)
        } else {
            None
        };
        bytes.map_or_else(String::new, |b| String::from_utf8_lossy(&b).into_owned())
    };
    ListRequest {
        method: text(reads.method, ":method"),
        host: host_of(&text(reads.host, ":authority")).to_string(),
        path: path_of(&text(reads.path, ":path")).to_string(),
        peer: reads.peer.then(|| host.peer_address()).flatten(),
        headers: reads
            .headers
            .iter()
            .filter_map(|name| Some((name.clone(), host.request_header(name)?)))
            .collect(),
    }
}

/// Applies decisions to their streams, then makes `current` the host's context again.
pub fn apply(host: &impl Host, settled: Vec<Settle>, current: u32) {
    if settled.is_empty() {
        return;
    }
    for s in settled {
        if !host.set_context(s.context) {
            continue; // the stream is gone
        }
        match s.action {
            Action::Continue => host.resume(),
            Action::Reply {
                status,
                headers,
                body,
            } => {
                let mut headers: Vec<(&str, &str)> =
                    headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
                headers.push(("content-type", "application/json"));
                host.send_response(status, headers, body.as_bytes());
            }
        }
    }
    host.set_context(current);
}

/// A host stat and the figure it shows, read from `T`.
type Stat<T> = (Metric, fn(&T) -> u64);

/// Each host counter the driver's counts feed, and how it reads them.
const DRIVER_STATS: [Stat<DriverStats>; 18] = [
    (Metric::Ok, |s| s.ok),
    (Metric::RateLimited, |s| s.enforced.saturating_add(s.shadow)),
    (Metric::Enforced, |s| s.enforced),
    (Metric::Shadow, |s| s.shadow),
    (Metric::DecidedLocal, |s| s.decided_local),
    (Metric::DecidedOrigin, |s| s.decided_origin),
    (Metric::DecidedFallback, |s| s.decided_fallback),
    (Metric::DecidedAhead, |s| s.decided_ahead),
    (Metric::OriginCalls, |s| s.origin_calls),
    (Metric::ReasonCold, |s| s.origin_reason(Reason::Cold)),
    (Metric::ReasonStale, |s| s.origin_reason(Reason::Stale)),
    (Metric::ReasonStrict, |s| s.origin_reason(Reason::Strict)),
    (Metric::ReasonLease, |s| s.origin_reason(Reason::Lease)),
    (Metric::OriginFailures, |s| s.origin_failures),
    (Metric::Coalesced, |s| s.coalesced),
    (Metric::Replays, |s| s.replays),
    (Metric::ReplayFailures, |s| s.replay_failures),
    (Metric::Unaddressed, |s| s.unaddressed),
];

/// Each host stat a VM's memory report feeds, and how it reads it.
const MEMORY_STATS: [Stat<MemoryReport>; 6] = [
    (Metric::TableEvicted, |m| m.evicted),
    (Metric::ReplayDropped, |m| m.replay_dropped),
    (Metric::TableEntries, |m| m.entries),
    (Metric::TableCapacity, |m| m.capacity),
    (Metric::TableBytes, |m| m.table_bytes),
    (Metric::MemoryBytes, |m| m.linear_bytes),
];

/// Adds to each host stat the change in its figure from `was` to `now` (a gauge's may be
/// negative); a stat whose figure did not change costs no host call.
fn add_changes<T>(metrics: &Metrics, host: &impl Host, was: &T, now: &T, stats: &[Stat<T>]) {
    for (metric, figure) in stats {
        let change = i128::from(figure(now)) - i128::from(figure(was));
        if change != 0 {
            let by = i64::try_from(change).unwrap_or(if change > 0 { i64::MAX } else { i64::MIN });
            metrics.add(host, *metric, by);
        }
    }
}

impl Vm {
    /// A VM's state for `config`; defines its metrics.
    pub fn new(config: Config, host: &impl Host) -> Self {
        let metrics = Metrics::define(host, &config.stat_prefix);
        let vm_tag = host.random_u64();
        let vm_instance = instance_id(&config.region, "envoy", vm_tag);
        let slots = (config.shared_slots > 0).then(|| {
            let fresh = instance_id(&config.region, "envoy", host.random_u64());
            Slots::seed(host, config.shared_slots, &fresh)
        });
        let driver_config = DriverConfig {
            timeout_ms: config.timeout_ms,
            replay_interval_ms: config.replay_interval_ms,
            unaddressed_counter: format!("{}.unaddressed", config.stat_prefix),
        };
        // A slot's counts are claimed for as long as the batch taking them may be out.
        let claim_ms = driver_config.replay_timeout_ms();
        let driver = Driver::new(config.gate.clone(), driver_config);
        // Calls are dispatched from the root context: Envoy cancels a call with the context
        // that made it, and a stream goes away when its own request is done (or its client
        // hangs up) while others may still wait on that call. A stream's callback wakes the
        // root through this VM's queue (without one, the tick sends them).
        let wake_queue = host.register_queue(&format!("strata.wake.{vm_tag:016x}"));
        if wake_queue.is_none() {
            host.log(
                true,
                "strata: no shared queue to wake the root context; gateway calls wait for the tick",
            );
        }
        let state = VmState {
            table: config.gate.table(host.random_u64()),
            vm_instance,
            slots,
            vm_tag,
            replay_lease_ms: config.replay_interval_ms.saturating_mul(3),
            claim_ms,
            replay: SlotReplay::new(config.shared_slots),
        };
        Self {
            reads: config.gate.rules().reads(),
            driver,
            state,
            metrics,
            flushed: DriverStats::default(),
            reported: MemoryReport::default(),
            tokens: BTreeMap::new(),
            pass_headers: BTreeMap::new(),
            settled: Vec::new(),
            deferred: Vec::new(),
            wake_queue,
            wake_sent: false,
            config,
        }
    }

    /// The tick period the VM wants: it enforces call deadlines and paces the replay.
    pub fn tick_period(&self) -> Duration {
        Duration::from_millis(
            self.config
                .timeout_ms
                .min(self.config.replay_interval_ms)
                .clamp(10, 1_000)
                / 2,
        )
    }

    /// Decisions made since the last take, for [`apply`] once the VM is released.
    pub fn take_settled(&mut self) -> Vec<Settle> {
        std::mem::take(&mut self.settled)
    }

    /// `on_http_request_headers` of HTTP context `context`.
    pub fn on_request(&mut self, host: &impl Host, context: u32) -> Verdict {
        let now = host.now_ms();
        let request = envoy_request(host, &self.reads);
        let mut homes = Homes {
            host,
            state: &mut self.state,
        };
        let started = self
            .driver
            .request(&mut homes, u64::from(context), &request, now);
        let verdict = match started {
            Ok(Started::Decided(d)) => match self.action(d) {
                Action::Continue => Verdict::Continue,
                reply => {
                    self.settled.push(Settle {
                        context,
                        action: reply,
                    });
                    Verdict::Pause
                }
            },
            Ok(Started::Waiting) => Verdict::Pause,
            Err(e) => {
                host.log(true, &format!("strata: refused a request: {e}"));
                let body = serde_json::json!({"error": {"code": "invalid_request", "message": e.to_string()}});
                self.settled.push(Settle {
                    context,
                    action: Action::Reply {
                        status: 400,
                        headers: Vec::new(),
                        body: body.to_string(),
                    },
                });
                Verdict::Pause
            }
        };
        self.after(host, now, false);
        verdict
    }

    /// The root context's queue woke it: dispatches the calls stream callbacks left.
    pub fn on_wake(&mut self, host: &impl Host) {
        if let Some(queue) = self.wake_queue {
            host.drain_queue(queue);
        }
        self.after(host, host.now_ms(), true);
    }

    /// `on_http_call_response` for `token` (every call is the root context's).
    pub fn on_call_response(&mut self, host: &impl Host, token: u32, body_size: usize) {
        let Some(call) = self.tokens.remove(&token) else {
            return;
        };
        let now = host.now_ms();
        let (status, body) = host.call_response(body_size);
        let mut homes = Homes {
            host,
            state: &mut self.state,
        };
        self.driver.answer(&mut homes, call, status, &body, now);
        self.after(host, now, true);
    }

    /// The root context's tick: calls past their deadline fail (a cluster with no healthy
    /// host may never answer), replay passes due go out.
    pub fn on_tick(&mut self, host: &impl Host) {
        let now = host.now_ms();
        let mut homes = Homes {
            host,
            state: &mut self.state,
        };
        self.driver.timeout(&mut homes, now);
        self.after(host, now, true);
        self.report_memory(host);
    }

    /// Brings the host's table and memory stats up to this VM's figures: its share of each
    /// gauge (a change, so Envoy shows the sum over the VMs) and of each counter. On the
    /// tick: they change with new keys, which take a gateway call anyway.
    fn report_memory(&mut self, host: &impl Host) {
        let now = MemoryReport::of(&self.state.table);
        let was = std::mem::replace(&mut self.reported, now);
        add_changes(&self.metrics, host, &was, &now, &MEMORY_STATS);
    }

    /// `on_http_response_headers`: the rate-limit headers of a passed request.
    pub fn on_response(&mut self, host: &impl Host, context: u32) {
        if let Some(headers) = self.pass_headers.remove(&context) {
            for (name, value) in headers {
                host.add_response_header(name, &value);
            }
        }
    }

    /// The HTTP context is gone (the client hung up): forget it. A call it made still
    /// settles the requests that joined it.
    pub fn on_done(&mut self, context: u32) {
        self.driver.cancel(u64::from(context));
        self.pass_headers.remove(&context);
    }

    /// After an event: dispatches the calls the driver wants, from the root context (a
    /// stream's callback leaves them and wakes it; a wake-up that cannot be sent leaves them
    /// for the tick), collects its decisions, logs its lines and brings the host's counters up
    /// to its own (a warm pass's wait for the root's events: [`Self::flush_metrics`]).
    fn after(&mut self, host: &impl Host, now: u64, root: bool) {
        self.deferred
            .extend(std::iter::from_fn(|| self.driver.poll_transmit()));
        if root {
            self.wake_sent = false;
            while !self.deferred.is_empty() {
                // A call the host refuses fails at once, and what that decides may want
                // another call.
                for t in std::mem::take(&mut self.deferred) {
                    self.dispatch(host, t, now);
                }
                self.deferred
                    .extend(std::iter::from_fn(|| self.driver.poll_transmit()));
            }
        } else if !self.deferred.is_empty() && !self.wake_sent {
            self.wake_sent = self.wake_queue.is_some_and(|q| host.enqueue(q));
        }
        while let Some(d) = self.driver.poll_decision() {
            let context = u32::try_from(d.request).unwrap_or(u32::MAX);
            let action = self.action(d);
            self.settled.push(Settle { context, action });
        }
        while let Some(line) = self.driver.poll_log() {
            host.log(line.warn, &format!("strata: {}", line.message));
        }
        self.flush_metrics(host, root);
    }

    /// Sends one call (one the host refuses is a failure the driver decides at once).
    fn dispatch(&mut self, host: &impl Host, t: Transmit, now: u64) {
        let headers = self.call_headers(t.path);
        // What is left of its time, however long it waited for the root context.
        let left = t
            .timeout_ms
            .saturating_sub(now.saturating_sub(t.at_ms))
            .max(1);
        let timeout = Duration::from_millis(left);
        match host.dispatch(&self.config.cluster, headers, t.body.as_bytes(), timeout) {
            Ok(token) => {
                self.tokens.insert(token, t.call);
            }
            Err(e) => {
                let mut homes = Homes {
                    host,
                    state: &mut self.state,
                };
                let why = format!("cannot dispatch to {}: {e}", self.config.cluster);
                self.driver.fail(&mut homes, t.call, &why, now);
            }
        }
    }

    /// What a decided request's stream gets; a pass's headers wait for its response.
    fn action(&mut self, d: Decided) -> Action {
        let reply = d.reply;
        if reply.allowed {
            if !reply.headers.is_empty() {
                let context = u32::try_from(d.request).unwrap_or(u32::MAX);
                self.pass_headers.insert(context, reply.headers);
            }
            return Action::Continue;
        }
        Action::Reply {
            status: u32::from(reply.status),
            headers: reply.headers,
            body: reply.body.unwrap_or_default(),
        }
    }

    /// Adds to each host counter what the driver counted since the last flush. A warm pass
    /// changes only `ok` and `decided.local` (and `requests`, which no host counter shows):
    /// two host calls a request would make, so outside the root context's events (its tick, every half
    /// of the smaller of `timeout_ms` and `replay_interval_ms`; a call's answer) they wait,
    /// and anything else (a denial, a call, a fallback) goes out at once with them.
    fn flush_metrics(&mut self, host: &impl Host, root: bool) {
        let now = self.driver.stats();
        let warm_passes_only = DriverStats {
            requests: self.flushed.requests,
            ok: self.flushed.ok,
            decided_local: self.flushed.decided_local,
            ..now
        } == self.flushed;
        if !root && warm_passes_only {
            return;
        }
        let was = std::mem::replace(&mut self.flushed, now);
        add_changes(&self.metrics, host, &was, &now, &DRIVER_STATS);
    }

    fn call_headers(&self, path: &'static str) -> Vec<(&str, &str)> {
        let mut headers = vec![
            (":method", "POST"),
            (":path", path),
            (":authority", self.config.authority.as_str()),
            (":scheme", "http"),
            ("content-type", "application/json"),
        ];
        if let Some(auth) = &self.config.authorization {
            headers.push(("authorization", auth.as_str()));
        }
        headers
    }
}
