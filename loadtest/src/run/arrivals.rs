//! Arrival processes for open-loop load: Poisson (exponential gaps) or
//! bursty (gamma gaps with shape < 1, same mean rate).

use rand::rngs::StdRng;
use rand::SeedableRng;
use rand_distr::{Distribution, Gamma};

/// Arrival times (seconds from the start) of `n` requests at `rate` per
/// second. `burstiness` is the gamma shape: 1 is Poisson, below 1 burstier,
/// above 1 more regular.
pub fn schedule(rate: f64, burstiness: f64, seed: u64, n: usize) -> anyhow::Result<Vec<f64>> {
    anyhow::ensure!(rate > 0.0 && rate.is_finite(), "--rate must be positive");
    anyhow::ensure!(burstiness > 0.0, "--burstiness must be positive");
    let gaps = Gamma::new(burstiness, 1.0 / (rate * burstiness))?;
    let mut rng = StdRng::seed_from_u64(seed ^ 0xA11_CE5);
    let mut t = 0.0;
    Ok((0..n)
        .map(|_| {
            let at = t;
            t += gaps.sample(&mut rng);
            at
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gaps(times: &[f64]) -> (f64, f64) {
        let g: Vec<f64> = times.windows(2).map(|w| w[1] - w[0]).collect();
        let mean = g.iter().sum::<f64>() / g.len() as f64;
        let var = g.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / g.len() as f64;
        (mean, var.sqrt() / mean)
    }

    #[test]
    fn poisson_arrivals_have_the_requested_rate() {
        let t = schedule(8.0, 1.0, 7, 20_000).unwrap();
        let (mean, cv) = gaps(&t);
        assert!((mean * 8.0 - 1.0).abs() < 0.03, "mean gap {mean}");
        assert!(
            (cv - 1.0).abs() < 0.05,
            "exponential gaps have cv 1, got {cv}"
        );
        assert_eq!(t[0], 0.0);
    }

    #[test]
    fn bursty_arrivals_keep_the_rate_with_more_spread() {
        let t = schedule(4.0, 0.25, 7, 40_000).unwrap();
        let (mean, cv) = gaps(&t);
        assert!((mean * 4.0 - 1.0).abs() < 0.05, "mean gap {mean}");
        // Gamma(k) gaps have cv 1/sqrt(k) = 2.
        assert!((cv - 2.0).abs() < 0.2, "cv {cv}");
        assert_eq!(
            schedule(4.0, 0.25, 7, 100).unwrap(),
            schedule(4.0, 0.25, 7, 100).unwrap()
        );
        assert!(schedule(0.0, 1.0, 1, 1).is_err());
    }
}
