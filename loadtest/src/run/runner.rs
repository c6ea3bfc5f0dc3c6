//! Driving load: open loop (requests arrive on a schedule, whatever the
//! server does) or closed loop (a fixed number of clients, each sending its
//! next request when the previous one ends), bounded in count and time.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use super::client::{converse, send, Target};
use super::stats::Record;
use super::workload::Item;

/// How load is offered in one slice of a run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Load {
    /// Arrivals at these times (seconds), from [`super::arrivals::schedule`].
    Open {
        rate: f64,
    },
    Closed {
        concurrency: usize,
    },
}

/// One slice: `target` gets `items` (until `duration`, if set).
pub struct Slice {
    /// This slice's number within the run.
    pub index: usize,
    pub target_index: usize,
    pub target: Target,
    /// The whole workload of the point, shared by all its slices.
    pub workload: Arc<[Item]>,
    /// Index in `workload` of this slice's first item; the slice may send
    /// every item from there on (see [`Slice::items`]).
    pub first_item: usize,
    /// Arrival offsets for open loop (at least as many as the items).
    pub arrivals: Vec<f64>,
    pub load: Load,
    /// Wall time the slice may start requests for; started ones are awaited.
    pub duration: Option<Duration>,
    /// Requests that start before this offset are warm-up.
    pub warmup: Duration,
    /// Open loop: in-flight requests at most (beyond, arrivals are recorded
    /// as `client_overload` errors rather than queued in the client).
    pub max_in_flight: usize,
}

impl Slice {
    /// The items this slice may send: the workload from `first_item` on.
    pub fn items(&self) -> &[Item] {
        &self.workload[self.first_item..]
    }
}

pub fn progress(total: u64, hidden: bool) -> ProgressBar {
    let pb = match hidden {
        true => ProgressBar::hidden(),
        false => ProgressBar::new(total),
    };
    pb.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} requests {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    pb
}

/// What every request task of a slice shares.
struct Shared {
    client: reqwest::Client,
    slice: Slice,
    run_start: Instant,
    slice_start: Instant,
    pb: ProgressBar,
    errors: AtomicUsize,
    records: std::sync::Mutex<Vec<Record>>,
}

impl Shared {
    fn new(client: &reqwest::Client, slice: Slice, run_start: Instant, pb: &ProgressBar) -> Self {
        Self {
            client: client.clone(),
            slice,
            run_start,
            slice_start: Instant::now(),
            pb: pb.clone(),
            errors: AtomicUsize::new(0),
            records: Default::default(),
        }
    }

    /// Sends the slice's item `i` (every turn of a conversation) and
    /// records the outcome.
    async fn one(&self, i: usize) {
        let s = &self.slice;
        let item = &s.items()[i];
        let sent = match item.turns.is_empty() {
            true => {
                let started = Instant::now();
                vec![(started, send(&self.client, &s.target, item).await)]
            }
            false => converse(&self.client, &s.target, item).await,
        };
        for (started, mut rec) in sent {
            rec.target = s.target_index;
            rec.slice = s.index;
            rec.item = s.first_item + i;
            rec.start = started.duration_since(self.run_start).as_secs_f64();
            rec.warmup = started.duration_since(self.slice_start) < s.warmup;
            self.push(rec);
        }
    }

    /// The record of item `i`, refused at `when` because too many were in flight.
    fn overload(&self, i: usize, when: Instant) -> Record {
        Record {
            target: self.slice.target_index,
            slice: self.slice.index,
            item: self.slice.first_item + i,
            start: when.duration_since(self.run_start).as_secs_f64(),
            error: Some("client_overload".into()),
            ..Default::default()
        }
    }

    fn push(&self, rec: Record) {
        if rec.error.is_some() {
            self.errors.fetch_add(1, Ordering::Relaxed);
        }
        self.pb.inc(1);
        self.pb
            .set_message(format!("{} errors", self.errors.load(Ordering::Relaxed)));
        self.records
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(rec);
    }

    fn expired(&self, at: Instant) -> bool {
        self.slice
            .duration
            .is_some_and(|d| at >= self.slice_start + d)
    }

    /// Every record so far, in order of start.
    fn take_records(&self) -> Vec<Record> {
        let mut records =
            std::mem::take(&mut *self.records.lock().unwrap_or_else(|p| p.into_inner()));
        records.sort_by(|a, b| a.start.total_cmp(&b.start));
        records
    }
}

/// Runs one slice; `run_start` is the origin of every record's `start`.
pub async fn run_slice(
    client: &reqwest::Client,
    slice: Slice,
    run_start: Instant,
    pb: &ProgressBar,
) -> Vec<Record> {
    let load = slice.load;
    let shared = Arc::new(Shared::new(client, slice, run_start, pb));
    let mut tasks = JoinSet::new();
    match load {
        Load::Open { .. } => open_loop(&shared, &mut tasks).await,
        Load::Closed { concurrency } => closed_loop(&shared, concurrency, &mut tasks),
    }
    while tasks.join_next().await.is_some() {}
    shared.take_records()
}

/// Starts a request at each arrival until the items or the slice's time run
/// out; an arrival beyond `max_in_flight` is recorded as `client_overload`.
async fn open_loop(shared: &Arc<Shared>, tasks: &mut JoinSet<()>) {
    let limit = Arc::new(Semaphore::new(shared.slice.max_in_flight.max(1)));
    let n = shared.slice.items().len().min(shared.slice.arrivals.len());
    for i in 0..n {
        let when = shared.slice_start + Duration::from_secs_f64(shared.slice.arrivals[i]);
        if shared.expired(when) {
            break;
        }
        tokio::time::sleep_until(when.into()).await;
        match limit.clone().try_acquire_owned() {
            Ok(permit) => {
                let sh = shared.clone();
                tasks.spawn(async move {
                    sh.one(i).await;
                    drop(permit);
                });
            }
            Err(_) => shared.push(shared.overload(i, when)),
        }
    }
}

/// Spawns `concurrency` clients, each sending the next unsent item when its
/// last request ends, until the items or the slice's time run out.
fn closed_loop(shared: &Arc<Shared>, concurrency: usize, tasks: &mut JoinSet<()>) {
    let next = Arc::new(AtomicUsize::new(0));
    for _ in 0..concurrency.max(1) {
        let (sh, next) = (shared.clone(), next.clone());
        tasks.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= sh.slice.items().len() || sh.expired(Instant::now()) {
                    break;
                }
                sh.one(i).await;
            }
        });
    }
}
