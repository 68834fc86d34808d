//! The scenarios: a topology (regions x gateways), one limit, the offered load over time, and the
//! faults injected, each printed with its parameters before it runs.

/// Which identifiers the requests name.
#[derive(Clone, Copy, Debug)]
pub enum Keys {
    /// One hot identifier.
    One,
    /// `n` identifiers drawn with Zipf's law of exponent `s` (rank 1 the most frequent).
    Zipf { n: u32, s: f64 },
}

/// Offered load from `from` to `to` seconds: `rate` requests per second in all, shared among the
/// regions by `shares` (a region's share spread evenly over its gateways).
#[derive(Clone, Debug)]
pub struct Phase {
    pub from: f64,
    pub to: f64,
    pub rate: f64,
    pub shares: Vec<f64>,
}

/// A fault injected at `at` seconds into the run.
#[derive(Clone, Copy, Debug)]
pub enum Fault {
    /// A region's Redis killed (SIGKILL; it keeps nothing on disk) and restarted `down` seconds
    /// later, empty.
    RedisKilled { region: usize, down: f64 },
    /// The global SQL store unavailable (every table locked) for `down` seconds.
    SqlDown { down: f64 },
}

/// One scenario.
#[derive(Clone, Debug)]
pub struct Scenario {
    pub name: &'static str,
    pub about: &'static str,
    pub regions: usize,
    pub gateways: usize,
    pub limit: u64,
    pub duration_ms: u64,
    pub keys: Keys,
    pub phases: Vec<Phase>,
    pub faults: Vec<(f64, Fault)>,
    /// How long the run lasts (traffic and observation), in seconds.
    pub seconds: f64,
    /// Start the traffic at a window boundary (a minute's costs up to a minute of waiting).
    pub aligned: bool,
    /// Poll each region's view of the hot cell every 100 ms, for the propagation delay.
    pub poll: bool,
}

impl Scenario {
    /// The limit's average rate, requests per second: `limit / duration`.
    pub fn limit_rate(&self) -> f64 {
        self.limit as f64 * 1_000.0 / self.duration_ms as f64
    }

    /// The parameters, one line.
    pub fn parameters(&self) -> String {
        let keys = match self.keys {
            Keys::One => "1 key".to_string(),
            Keys::Zipf { n, s } => format!("{n} keys (Zipf s={s})"),
        };
        let load: Vec<String> = self
            .phases
            .iter()
            .map(|p| {
                format!(
                    "{:.0}-{:.0} s: {:.2}x the limit's rate over {}",
                    p.from,
                    p.to,
                    p.rate / self.limit_rate(),
                    shares(&p.shares)
                )
            })
            .collect();
        let faults: Vec<String> = self
            .faults
            .iter()
            .map(|(at, f)| match f {
                Fault::RedisKilled { region, down } => {
                    format!("{at:.0} s: r{region}'s Redis killed for {down:.0} s")
                }
                Fault::SqlDown { down } => format!("{at:.0} s: SQL store down for {down:.0} s"),
            })
            .collect();
        format!(
            "{} region(s) x {} gateway(s), limit {} per {} s, {keys}, {:.0} s; load {}{}",
            self.regions,
            self.gateways,
            self.limit,
            self.duration_ms / 1_000,
            self.seconds,
            load.join("; "),
            if faults.is_empty() {
                String::new()
            } else {
                format!("; faults {}", faults.join(", "))
            }
        )
    }

    /// The same scenario with its traffic and observation `factor` as long (the quick run).
    pub fn scaled(mut self, factor: f64) -> Self {
        self.seconds *= factor;
        for p in &mut self.phases {
            p.from *= factor;
            p.to *= factor;
        }
        for (at, _) in &mut self.faults {
            *at *= factor;
        }
        self
    }
}

fn shares(shares: &[f64]) -> String {
    if shares.iter().all(|s| (s - shares[0]).abs() < 1e-9) {
        return format!("{} region(s) evenly", shares.len());
    }
    let named: Vec<String> = shares
        .iter()
        .enumerate()
        .filter(|(_, s)| **s > 0.0)
        .map(|(i, s)| format!("r{i} {:.1}%", s * 100.0))
        .collect();
    named.join(", ")
}

fn even(regions: usize) -> Vec<f64> {
    vec![1.0 / regions as f64; regions]
}

fn only(region: usize, regions: usize) -> Vec<f64> {
    (0..regions)
        .map(|r| if r == region { 1.0 } else { 0.0 })
        .collect()
}

/// A phase offering `x` times the limit's rate.
fn load(s: &Scenario, from: f64, to: f64, x: f64, shares: Vec<f64>) -> Phase {
    Phase {
        from,
        to,
        rate: x * s.limit_rate(),
        shares,
    }
}

fn base(name: &'static str, about: &'static str, regions: usize, gateways: usize) -> Scenario {
    Scenario {
        name,
        about,
        regions,
        gateways,
        limit: 1_000,
        duration_ms: 10_000,
        keys: Keys::One,
        phases: Vec::new(),
        faults: Vec::new(),
        seconds: 30.0,
        aligned: true,
        poll: false,
    }
}

fn with_load(mut s: Scenario, phases: &[(f64, f64, f64, Vec<f64>)]) -> Scenario {
    s.phases = phases
        .iter()
        .map(|(from, to, x, shares)| load(&s, *from, *to, *x, shares.clone()))
        .collect();
    s
}

fn single(name: &'static str, about: &'static str, x: f64) -> Scenario {
    let mut s = base(name, about, 1, 1);
    s.seconds = 20.0;
    with_load(s, &[(0.0, 20.0, x, even(1))])
}

/// `regions` regions of one gateway each, a limit of `limit` a minute, `seconds` long, each
/// region's view of the hot cell polled (for the propagation delay); not aligned to a window.
fn per_minute(
    name: &'static str,
    about: &'static str,
    regions: usize,
    limit: u64,
    seconds: f64,
) -> Scenario {
    let mut s = base(name, about, regions, 1);
    s.limit = limit;
    s.duration_ms = 60_000;
    s.seconds = seconds;
    s.aligned = false;
    s.poll = true;
    s
}

/// Ten regions, each offered `per_region` of the limit per window, evenly spread.
fn ten(name: &'static str, about: &'static str, per_region: f64) -> Scenario {
    let s = per_minute(name, about, 10, 1_000, 90.0);
    with_load(s, &[(0.0, 90.0, per_region * 10.0, even(10))])
}

/// Every scenario, in the order `all` runs them.
pub fn all() -> Vec<Scenario> {
    let mut v = vec![
        single(
            "single-0.9x",
            "one region, one gateway, one hot key at 0.9x its limit",
            0.9,
        ),
        single(
            "single-1x",
            "one region, one gateway, one hot key at its limit",
            1.0,
        ),
        single(
            "single-10x",
            "one region, one gateway, one hot key at 10x its limit",
            10.0,
        ),
        with_load(
            base(
                "five-paced",
                "one region, five gateways, traffic spread across them, paced at the limit",
                1,
                5,
            ),
            &[(0.0, 30.0, 1.0, even(1))],
        ),
    ];
    let mut burst = base(
        "five-burst",
        "one region, five gateways, a burst of 20x the limit within one second",
        1,
        5,
    );
    burst.limit = 100;
    burst.seconds = 12.0;
    // 20 x 100 requests in one second: 200x the limit's rate over a 10 s window.
    v.push(with_load(burst, &[(0.5, 1.5, 200.0, even(1))]));

    let moving = per_minute(
        "two-moving",
        "two regions, traffic concentrated in one, then moving to the other",
        2,
        600,
        90.0,
    );
    v.push(with_load(
        moving,
        &[(0.0, 40.0, 2.0, only(0, 2)), (40.0, 90.0, 2.0, only(1, 2))],
    ));

    let split = per_minute(
        "two-split-10x",
        "two regions, 10x the limit split evenly between them",
        2,
        600,
        90.0,
    );
    v.push(with_load(split, &[(0.0, 90.0, 10.0, even(2))]));

    v.push(ten(
        "ten-under-floor",
        "ten regions, traffic spread evenly, each region just under the publish floor (19% of the limit per window)",
        0.19,
    ));
    v.push(ten(
        "ten-2x-floor",
        "ten regions, traffic spread evenly, each region at twice the publish floor (40% of the limit per window)",
        0.40,
    ));

    // One hot region at 3x the limit beside nine quiet ones each just under its share of the
    // floor (2% of the limit per window with ten regions): the shared floor's worst case,
    // unless the hot region's row makes the quiet ones publish (published elsewhere).
    let mut shares = vec![0.019 / 3.019; 10];
    shares[0] = 3.0 / 3.019;
    let hot = per_minute(
        "ten-hot-one",
        "ten regions, one hot at 3x the limit, nine quiet each just under its share of the floor",
        10,
        1_000,
        90.0,
    );
    v.push(with_load(hot, &[(0.0, 90.0, 3.0 + 9.0 * 0.019, shares)]));

    let mut many = base(
        "many-keys",
        "one region, two gateways, 100,000 identifiers drawn by Zipf's law: memory and store load",
        1,
        2,
    );
    many.limit = 100;
    many.keys = Keys::Zipf { n: 100_000, s: 1.1 };
    many.seconds = 20.0;
    // 2,000 requests per second in all.
    v.push(with_load(many, &[(0.0, 20.0, 200.0, even(1))]));

    let mut redis = base(
        "fault-redis",
        "one region, two gateways at 1.5x the limit; the region's Redis killed and restarted empty",
        1,
        2,
    );
    redis.seconds = 40.0;
    redis.faults.push((
        12.0,
        Fault::RedisKilled {
            region: 0,
            down: 5.0,
        },
    ));
    v.push(with_load(redis, &[(0.0, 40.0, 1.5, even(1))]));

    let mut sql = per_minute(
        "fault-sql",
        "two regions at 1.5x the limit split evenly; the SQL store down for 20 s while the count grows",
        2,
        600,
        80.0,
    );
    // From a window's start, so the outage falls while the regions' counts are still growing
    // (the limit is reached about 40 s in).
    sql.aligned = true;
    sql.faults.push((15.0, Fault::SqlDown { down: 20.0 }));
    v.push(with_load(sql, &[(0.0, 80.0, 1.5, even(2))]));
    v
}

/// The scenarios of the quick run (the test command's): reduced durations.
pub const QUICK: [&str; 3] = ["five-burst", "five-paced", "two-split-10x"];

/// The scenario named `name`, scaled for the quick run if `quick`.
pub fn named(name: &str, quick: bool) -> Option<Scenario> {
    let s = all().into_iter().find(|s| s.name == name)?;
    Some(if quick && s.name != "five-burst" {
        s.scaled(0.5)
    } else {
        s
    })
}
