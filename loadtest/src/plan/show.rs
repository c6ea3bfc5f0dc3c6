//! The planner's table, its Pareto plot (text and SVG) and report.

use std::fmt::Write as _;
use std::path::Path;

use plotters::prelude::*;

use super::{plot_path, up_command, Plan, PlanArgs};

const PLOT_WIDTH: usize = 64;
const PLOT_HEIGHT: usize = 16;

fn ms(seconds: f64) -> String {
    format!("{:.0}", seconds * 1e3)
}

/// Every candidate, cheapest first: `*` on the Pareto front, `>` the plan.
pub fn table(plan: &Plan) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "| | P | D | chunk | batch | local ≤ | cost | attainment | goodput req/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | errors | meets |"
    );
    let _ = writeln!(
        out,
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|"
    );
    for (i, c) in plan.candidates.iter().enumerate() {
        let mark = match (plan.chosen == Some(i), c.pareto) {
            (true, _) => ">",
            (false, true) => "*",
            _ => "",
        };
        let _ = writeln!(
            out,
            "| {mark} | {} | {} | {} | {} | {} | {:.1} | {:.3} | {:.2} | {} | {} | {} | {} | {} | {} |",
            c.prefill_workers,
            c.decode_workers,
            c.knobs.chunk_tokens,
            c.knobs.max_batch,
            c.knobs.local_prefill_max_tokens,
            c.cost,
            c.slo_attainment,
            c.goodput,
            ms(c.ttft_p50),
            ms(c.ttft_p99),
            ms(c.tpot_p50),
            ms(c.tpot_p99),
            c.errors,
            if c.meets { "yes" } else { "no" },
        );
    }
    out
}

/// Attainment against cost as text: `.` a candidate, `*` the Pareto front,
/// `#` the plan, `-` the target attainment.
pub fn text_plot(plan: &Plan) -> String {
    let cs = &plan.candidates;
    let (lo, hi) = cs
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), c| {
            (lo.min(c.cost), hi.max(c.cost))
        });
    if !lo.is_finite() {
        return String::new();
    }
    let span = (hi - lo).max(1e-9);
    let col = |cost: f64| (((cost - lo) / span) * (PLOT_WIDTH - 1) as f64).round() as usize;
    let row = |a: f64| {
        let r = ((1.0 - a.clamp(0.0, 1.0)) * (PLOT_HEIGHT - 1) as f64).round() as usize;
        r.min(PLOT_HEIGHT - 1)
    };
    let mut grid = vec![vec![' '; PLOT_WIDTH]; PLOT_HEIGHT];
    let target = row(plan.space.attainment);
    grid[target].iter_mut().for_each(|c| *c = '-');
    let rank = |ch: char| match ch {
        '#' => 3,
        '*' => 2,
        '.' => 1,
        _ => 0,
    };
    for (i, c) in cs.iter().enumerate() {
        let ch = match (plan.chosen == Some(i), c.pareto) {
            (true, _) => '#',
            (false, true) => '*',
            _ => '.',
        };
        let cell = &mut grid[row(c.slo_attainment)][col(c.cost)];
        if rank(ch) > rank(*cell) {
            *cell = ch;
        }
    }
    let mut out = String::from("SLO attainment\n");
    for (r, line) in grid.iter().enumerate() {
        let label = match r {
            0 => "1.00".to_string(),
            r if r == target => format!("{:.2}", plan.space.attainment),
            r if r == PLOT_HEIGHT - 1 => "0.00".to_string(),
            _ => String::new(),
        };
        let _ = writeln!(out, "{label:>5} |{}", line.iter().collect::<String>());
    }
    let _ = writeln!(out, "      +{}", "-".repeat(PLOT_WIDTH));
    let _ = writeln!(
        out,
        "       {lo:<.1}{:>w$.1}  cost",
        hi,
        w = PLOT_WIDTH - format!("{lo:.1}").len()
    );
    out
}

/// One line on the plan (or on its absence).
pub fn verdict(plan: &Plan, args: &PlanArgs) -> String {
    match plan.chosen() {
        Some(c) => format!(
            "plan: {} prefill + {} decode workers (cost {:.1}), chunk {}, batch {}, local prefill ≤ {} tokens: attainment {:.3}, TTFT p99 {} ms, TPOT p99 {} ms\nstart it: {}",
            c.prefill_workers,
            c.decode_workers,
            c.cost,
            c.knobs.chunk_tokens,
            c.knobs.max_batch,
            c.knobs.local_prefill_max_tokens,
            c.slo_attainment,
            ms(c.ttft_p99),
            ms(c.tpot_p99),
            up_command(c, args.sim.cluster.mode),
        ),
        None => {
            let best = plan
                .candidates
                .iter()
                .max_by(|a, b| a.slo_attainment.total_cmp(&b.slo_attainment));
            match best {
                Some(b) => format!(
                    "plan: none meets {:.2} attainment; the best simulated, {} + {} workers, reaches {:.3}",
                    plan.space.attainment, b.prefill_workers, b.decode_workers, b.slo_attainment
                ),
                None => "plan: nothing was simulated".to_string(),
            }
        }
    }
}

pub fn print(plan: &Plan, args: &PlanArgs) {
    println!(
        "{} candidates simulated in {:.1} s at {} (SLOs: TTFT {} ms, TPOT {} ms, attainment {:.2})\n",
        plan.candidates.len(),
        plan.wall_seconds,
        plan.load,
        plan.slo_ttft_ms.map_or("-".into(), |v| format!("{v}")),
        plan.slo_tpot_ms.map_or("-".into(), |v| format!("{v}")),
        plan.space.attainment,
    );
    print!("{}", table(plan));
    println!("\n{}", text_plot(plan));
    println!("{}", verdict(plan, args));
}

fn svg(path: &Path, plan: &Plan) -> anyhow::Result<()> {
    let e = |e: &dyn std::fmt::Display| anyhow::anyhow!("{e}");
    let root = SVGBackend::new(path, (900, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let hi = plan.candidates.iter().map(|c| c.cost).fold(1.0, f64::max);
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("SLO attainment against cost ({})", plan.load),
            ("sans-serif", 22),
        )
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..hi * 1.05, 0.0..1.02)
        .map_err(|x| e(&x))?;
    chart
        .configure_mesh()
        .x_desc("cost (--prefill-cost · P + --decode-cost · D)")
        .y_desc("SLO attainment")
        .draw()
        .map_err(|x| e(&x))?;
    let all = plan.candidates.iter().map(|c| (c.cost, c.slo_attainment));
    chart
        .draw_series(all.map(|p| Circle::new(p, 3, BLUE.mix(0.4).filled())))
        .map_err(|x| e(&x))?
        .label("simulated");
    let front: Vec<(f64, f64)> = plan
        .candidates
        .iter()
        .filter(|c| c.pareto)
        .map(|c| (c.cost, c.slo_attainment))
        .collect();
    chart
        .draw_series(LineSeries::new(front, RED.stroke_width(2)))
        .map_err(|x| e(&x))?
        .label("Pareto front")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED.stroke_width(2)));
    let target = plan.space.attainment;
    chart
        .draw_series(LineSeries::new(
            [(0.0, target), (hi * 1.05, target)],
            BLACK.mix(0.5),
        ))
        .map_err(|x| e(&x))?
        .label("target attainment");
    if let Some(c) = plan.chosen() {
        chart
            .draw_series(std::iter::once(Cross::new(
                (c.cost, c.slo_attainment),
                8,
                GREEN.stroke_width(3),
            )))
            .map_err(|x| e(&x))?
            .label("plan");
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(|x| e(&x))?;
    root.present().map_err(|x| e(&x))?;
    Ok(())
}

/// `--report DIR`: `plan.md` (verdict, plot, table) and `pareto.svg`.
pub fn write_report(dir: &Path, plan: &Plan, args: &PlanArgs) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    svg(&plot_path(dir), plan)?;
    let md = format!(
        "# pdserve plan: {}\n\n{}\n\n![Pareto plot](pareto.svg)\n\n```text\n{}```\n\n{}",
        plan.load,
        verdict(plan, args),
        text_plot(plan),
        table(plan)
    );
    std::fs::write(dir.join("plan.md"), md)?;
    Ok(())
}

/// The candidates on the front, cheapest first.
#[cfg(test)]
pub fn front(plan: &Plan) -> Vec<&super::Candidate> {
    plan.candidates.iter().filter(|c| c.pareto).collect()
}
