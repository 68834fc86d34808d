//! A process's CPU time from `/proc/<pid>/stat`: the end-to-end benchmarks' and the lab's one
//! reader (the lab includes this file by path).

use std::time::Duration;

/// Clock ticks a second (`getconf CLK_TCK`; 100 if it cannot say).
pub fn clock_ticks() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

/// User + system CPU ticks of process `pid`, all its threads; 0 once it is gone.
pub fn cpu_ticks(pid: u32) -> u64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0;
    };
    // Fields after the command name (which may hold spaces): state is field 3, utime 14.
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return 0;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |n: usize| {
        fields
            .get(n - 3)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    field(14) + field(15)
}

/// [`cpu_ticks`] in seconds.
pub fn cpu_time(pid: u32) -> Duration {
    #[allow(clippy::cast_precision_loss)] // ticks of a process's lifetime
    Duration::from_secs_f64(cpu_ticks(pid) as f64 / clock_ticks())
}
