//! The run as an SVG line chart: requests admitted per second, per region and in all, against
//! the limit's average rate (limit / window), over the run.

use std::fmt::Write;

const W: f64 = 760.0;
const H: f64 = 320.0;
const LEFT: f64 = 56.0;
const RIGHT: f64 = 120.0;
const TOP: f64 = 44.0;
const BOTTOM: f64 = 40.0;
const COLORS: [&str; 10] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf",
];

/// A "nice" axis maximum at or above `v`: 1, 2 or 5 times a power of ten.
fn nice(v: f64) -> f64 {
    if v <= 0.0 {
        return 1.0;
    }
    let p = 10_f64.powf(v.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * p)
        .find(|c| *c >= v)
        .unwrap_or(10.0 * p)
}

fn polyline(out: &mut String, points: &[(f64, f64)], color: &str, width: f64, dash: &str) {
    let mut d = String::new();
    for (x, y) in points {
        let _ = write!(d, "{x:.1},{y:.1} ");
    }
    let _ = writeln!(
        out,
        r#"<polyline fill="none" stroke="{color}" stroke-width="{width}" {dash} points="{}"/>"#,
        d.trim_end()
    );
}

/// The chart of `per_second[region][second]`, titled `title` over `subtitle`, with the limit's
/// rate `limit_rate`.
pub fn chart(title: &str, subtitle: &str, per_second: &[Vec<u64>], limit_rate: f64) -> String {
    let seconds = per_second.first().map_or(0, Vec::len).max(2);
    let total: Vec<u64> = (0..seconds)
        .map(|i| per_second.iter().filter_map(|r| r.get(i)).sum())
        .collect();
    let peak = total.iter().copied().max().unwrap_or(0) as f64;
    let y_max = nice(peak.max(limit_rate * 1.2));
    let plot_w = W - LEFT - RIGHT;
    let plot_h = H - TOP - BOTTOM;
    let x = |i: usize| LEFT + plot_w * i as f64 / (seconds - 1) as f64;
    let y = |v: f64| TOP + plot_h * (1.0 - v / y_max);
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(out, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
    let _ = writeln!(
        out,
        r#"<text x="{LEFT}" y="16" font-size="13" font-weight="bold">{}</text><text x="{LEFT}" y="32" font-size="10">{}</text>"#,
        escape(title),
        escape(subtitle)
    );
    for k in 0..=4 {
        let v = y_max * f64::from(k) / 4.0;
        let yy = y(v);
        let _ = writeln!(
            out,
            r##"<line x1="{LEFT}" x2="{:.1}" y1="{yy:.1}" y2="{yy:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{v:.0}</text>"##,
            LEFT + plot_w,
            LEFT - 6.0,
            yy + 4.0
        );
    }
    let ticks = (seconds / 10).max(1);
    for i in (0..seconds).step_by(ticks) {
        let _ = writeln!(
            out,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{i}</text>"#,
            x(i),
            H - BOTTOM + 16.0
        );
    }
    let _ = writeln!(
        out,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">seconds into the run</text><text x="14" y="{:.1}" transform="rotate(-90 14 {:.1})" text-anchor="middle">admitted per second</text>"#,
        LEFT + plot_w / 2.0,
        H - 6.0,
        TOP + plot_h / 2.0,
        TOP + plot_h / 2.0
    );
    let series = |values: &[u64]| -> Vec<(f64, f64)> {
        values
            .iter()
            .enumerate()
            .map(|(i, v)| (x(i), y(*v as f64)))
            .collect()
    };
    let mut legend = vec![(
        "limit / window".to_string(),
        "#000",
        r#"stroke-dasharray="6 4""#,
    )];
    polyline(
        &mut out,
        &[(x(0), y(limit_rate)), (x(seconds - 1), y(limit_rate))],
        "#000",
        1.5,
        r#"stroke-dasharray="6 4""#,
    );
    if per_second.len() > 1 {
        for (r, values) in per_second.iter().enumerate() {
            let color = COLORS[r % COLORS.len()];
            polyline(&mut out, &series(values), color, 1.2, "");
            legend.push((format!("region r{r}"), color, ""));
        }
    }
    polyline(&mut out, &series(&total), "#111", 2.0, "");
    legend.push(("all regions".to_string(), "#111", ""));
    for (i, (name, color, dash)) in legend.iter().enumerate() {
        let ly = TOP + 8.0 + 16.0 * i as f64;
        let lx = W - RIGHT + 10.0;
        let _ = writeln!(
            out,
            r#"<line x1="{lx}" x2="{:.1}" y1="{ly:.1}" y2="{ly:.1}" stroke="{color}" stroke-width="2" {dash}/><text x="{:.1}" y="{:.1}">{name}</text>"#,
            lx + 18.0,
            lx + 22.0,
            ly + 4.0
        );
    }
    out.push_str("</svg>\n");
    out
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chart_is_well_formed_and_scaled() {
        let svg = chart("a <b> & c", "d", &[vec![0, 10, 20], vec![5, 5, 5]], 12.0);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("a &lt;b&gt; &amp; c"));
        // Two regions, the total and the limit: four lines.
        assert_eq!(svg.matches("<polyline").count(), 4);
        // The peak (25 in all) sets the axis: 50.
        assert!(svg.contains(">50</text>"));
        assert_eq!(nice(0.0), 1.0);
        assert_eq!(nice(120.0), 200.0);
        assert_eq!(nice(5_000.0), 5_000.0);
    }
}
