//! Workers that share a machine's cores (`--cores`): each worker's compute
//! (a prefill, a local prefill chunk, a decode step) runs at
//! `min(1, cores / busy)` of its full speed while `busy` workers compute at
//! once (processor sharing, as the kernel time-slices single-threaded
//! workers). Pinned (`--pin-workers`), a worker shares only its own core:
//! `1 / busy` of it, `busy` counting the workers computing on that core.
//! Without `--cores` every worker has cores of its own.
//!
//! The work in progress is kept here with what is left of it in seconds at
//! full speed; one event, the next completion, is scheduled at a time, and
//! a change in the number of busy workers moves it (the old one is left in
//! the queue and ignored: its generation is stale).

use super::Kind;

/// One worker's compute in progress.
#[derive(Debug, Clone, Copy)]
struct Work {
    /// What happens when it is done.
    done: Kind,
    /// Seconds it still needs at full speed.
    left: f64,
    /// The core its worker is pinned to (pinned cores only).
    core: usize,
}

/// The shared cores and the work running on them.
#[derive(Debug)]
pub(super) struct SharedCores {
    cores: f64,
    pinned: bool,
    running: Vec<Work>,
    /// When `running` was last brought up to date.
    at: f64,
    /// The generation of the one completion event that is valid.
    generation: u64,
}

/// Work left below this many seconds is done (rounding).
const EPS: f64 = 1e-12;

impl SharedCores {
    /// `cores` shared by every worker, or with `pinned` each worker on one
    /// of them (see [`SharedCores::start`]).
    pub(super) fn new(cores: f64, pinned: bool) -> Self {
        Self {
            cores,
            pinned,
            running: Vec::new(),
            at: 0.0,
            generation: 0,
        }
    }

    /// Each running piece of work's share of a core, in `running`'s order.
    fn speeds(&self) -> Vec<f64> {
        if !self.pinned {
            let share = (self.cores / self.running.len().max(1) as f64).min(1.0);
            return vec![share; self.running.len()];
        }
        let mut on_core = vec![0usize; self.core_count()];
        for w in &self.running {
            on_core[w.core] += 1;
        }
        let share = |w: &Work| 1.0 / on_core[w.core].max(1) as f64;
        self.running.iter().map(share).collect()
    }

    /// Whole cores to pin workers to.
    fn core_count(&self) -> usize {
        (self.cores.ceil() as usize).max(1)
    }

    /// Charges the time since the last update to the running work.
    fn advance(&mut self, now: f64) {
        let dt = (now - self.at).max(0.0);
        let speeds = self.speeds();
        for (w, speed) in self.running.iter_mut().zip(speeds) {
            w.left -= dt * speed;
        }
        self.at = now;
    }

    /// Starts `secs` of full-speed work at `now` that ends with `done`, by
    /// the worker in `slot` (pinned: to core `slot % cores`).
    pub(super) fn start(&mut self, now: f64, secs: f64, done: Kind, slot: usize) {
        self.advance(now);
        self.running.push(Work {
            done,
            left: secs.max(0.0),
            core: slot % self.core_count(),
        });
    }

    /// Whether a completion event of `generation` is the valid one.
    pub(super) fn is_current(&self, generation: u64) -> bool {
        generation == self.generation
    }

    /// The work done by `now`, taken out of the running set.
    pub(super) fn finished(&mut self, now: f64) -> Vec<Kind> {
        self.advance(now);
        let mut done = Vec::new();
        self.running.retain(|w| match w.left <= EPS {
            true => {
                done.push(w.done);
                false
            }
            false => true,
        });
        done
    }

    /// The next completion as `(time, generation)` to schedule, if any work
    /// runs; every earlier completion event becomes stale.
    pub(super) fn next_completion(&mut self, now: f64) -> Option<(f64, u64)> {
        self.advance(now);
        self.generation += 1;
        let speeds = self.speeds();
        let soonest = (self.running.iter().zip(speeds))
            .map(|(w, speed)| w.left.max(0.0) / speed)
            .reduce(f64::min)?;
        Some((now + soonest, self.generation))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs the cores to idle; returns each piece's `(done, end time)`.
    fn drain(c: &mut SharedCores, mut now: f64) -> Vec<(Kind, f64)> {
        let mut out = Vec::new();
        while let Some((t, g)) = c.next_completion(now) {
            assert!(c.is_current(g));
            now = t;
            out.extend(c.finished(now).into_iter().map(|k| (k, now)));
        }
        out
    }

    #[test]
    fn two_pieces_on_one_core_share_it_and_the_second_speeds_up_alone() {
        let mut c = SharedCores::new(1.0, false);
        c.start(0.0, 1.0, Kind::StepDone(0), 0);
        c.start(0.0, 3.0, Kind::StepDone(1), 0);
        // Both at half speed until 2.0 (1 s of work each); then the second
        // alone needs 2 s more.
        let ends = drain(&mut c, 0.0);
        assert_eq!(ends.len(), 2);
        assert!((ends[0].1 - 2.0).abs() < 1e-9, "{ends:?}");
        assert!((ends[1].1 - 4.0).abs() < 1e-9, "{ends:?}");
    }

    #[test]
    fn no_slower_than_alone_while_there_are_enough_cores() {
        let mut c = SharedCores::new(2.0, false);
        c.start(0.0, 1.0, Kind::PrefillDone(0), 0);
        c.start(0.0, 1.0, Kind::StepDone(0), 0);
        let ends = drain(&mut c, 0.0);
        assert!(ends.iter().all(|(_, t)| (t - 1.0).abs() < 1e-9), "{ends:?}");
    }

    #[test]
    fn pinned_workers_share_only_their_own_core() {
        // Slots 0 and 2 on core 0, slot 1 on core 1, of two cores.
        let mut c = SharedCores::new(2.0, true);
        c.start(0.0, 1.0, Kind::StepDone(0), 0);
        c.start(0.0, 1.0, Kind::StepDone(1), 1);
        c.start(0.0, 1.0, Kind::PrefillDone(0), 2);
        let ends = drain(&mut c, 0.0);
        let at = |k: Kind| ends.iter().find(|(d, _)| *d == k).unwrap().1;
        assert!((at(Kind::StepDone(1)) - 1.0).abs() < 1e-9, "{ends:?}");
        assert!((at(Kind::StepDone(0)) - 2.0).abs() < 1e-9, "{ends:?}");
        assert!((at(Kind::PrefillDone(0)) - 2.0).abs() < 1e-9, "{ends:?}");
    }

    #[test]
    fn work_started_later_slows_what_runs_and_stale_events_are_known() {
        let mut c = SharedCores::new(1.0, false);
        c.start(0.0, 2.0, Kind::StepDone(0), 0);
        let (first, g1) = c.next_completion(0.0).unwrap();
        assert!((first - 2.0).abs() < 1e-9);
        // At 1.0 a second piece of 0.5 s arrives: both at half speed.
        c.start(1.0, 0.5, Kind::StepDone(1), 0);
        let (t, g2) = c.next_completion(1.0).unwrap();
        assert!(!c.is_current(g1) && c.is_current(g2));
        assert!((t - 2.0).abs() < 1e-9, "the short one ends at 2.0: {t}");
        assert_eq!(c.finished(t), vec![Kind::StepDone(1)]);
        // The first had 1 s left at 1.0 and did 0.5 s by 2.0: 0.5 s more alone.
        let ends = drain(&mut c, t);
        assert!((ends[0].1 - 2.5).abs() < 1e-9, "{ends:?}");
    }
}
