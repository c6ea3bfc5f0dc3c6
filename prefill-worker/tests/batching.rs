//! Several short prompts in one forward pass: each job gets exactly the KV
//! and first token it would get alone, and a member that fails or is
//! cancelled drops out without affecting the others.

mod common;

use std::sync::Arc;

use bytes::Bytes;
use common::*;
use pdserve_prefill::EngineHandle;
use pdserve_protocol::internal::{ErrorKind, PrefillJob};
use pdserve_testkit::tiny::TinyModelSpec;
use pdserve_worker::prefill::{PrefillBackend, PrefillMetrics};

struct Bench {
    engine: EngineHandle,
    metrics: Arc<PrefillMetrics>,
    _tiny: Tiny,
}

fn start(batch_tokens: usize) -> Bench {
    let tiny = tiny(&TinyModelSpec::default());
    let cfg = engine_config(16, batch_tokens);
    let metrics = Arc::new(PrefillMetrics::new());
    let engine = EngineHandle::spawn(
        tiny.model.clone(),
        tiny.model
            .kv_pool(8192, 16, false, pdserve_engine::DEFAULT_KV_DTYPE),
        cfg,
        metrics.clone(),
    );
    Bench {
        engine,
        metrics,
        _tiny: tiny,
    }
}

fn jobs(lens: &[usize]) -> Vec<PrefillJob> {
    lens.iter()
        .enumerate()
        .map(|(i, &n)| job(&format!("j{i}"), prompt(n, i as u32), "http://unused"))
        .collect()
}

/// Each job's frames and first token when it runs alone.
async fn alone(b: &Bench, jobs: &[PrefillJob]) -> Vec<(Vec<Bytes>, u32)> {
    let mut out = Vec::new();
    for j in jobs {
        let (t, ends) = task(j.clone(), UNCAPPED);
        b.engine.submit(t).unwrap();
        let (frames, reply) = ends.finish().await;
        out.push((frames, reply.unwrap().first_token));
    }
    out
}

fn batch_sizes(b: &Bench) -> (u64, f64) {
    let h = &b.metrics.batch_size;
    (h.get_sample_count(), h.get_sample_sum())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_jobs_get_exactly_the_kv_and_first_token_they_get_alone() {
    let b = start(64);
    let jobs = jobs(&[9, 14, 5, 11]);
    let reference = alone(&b, &jobs).await;
    assert_eq!(batch_sizes(&b), (4, 4.0), "alone: four batches of one");
    // Paused, the model thread takes the first job and waits: the others queue.
    let paused = b.engine.pause();
    let ends: Vec<TaskEnds> = jobs
        .iter()
        .map(|j| {
            let (t, e) = task(j.clone(), UNCAPPED);
            b.engine.submit(t).unwrap();
            e
        })
        .collect();
    drop(paused);
    for (e, (frames, first)) in ends.into_iter().zip(reference) {
        let (got, reply) = e.finish().await;
        assert_eq!(reply.unwrap().first_token, first);
        assert_eq!(got.len(), frames.len());
        assert!(got == frames, "the KV stream differs from the job's alone");
    }
    // Then the four queued jobs in one forward pass.
    assert_eq!(batch_sizes(&b), (5, 8.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_or_cancelled_member_does_not_affect_the_others() {
    let b = start(64);
    let jobs = jobs(&[9, 14, 5, 11]);
    let reference = alone(&b, &jobs).await;
    let paused = b.engine.pause();
    // j1's upload is gone before the batch runs; j2 is cancelled while queued.
    let mut ends: Vec<TaskEnds> = jobs
        .iter()
        .map(|j| {
            let (t, e) = task(j.clone(), UNCAPPED);
            b.engine.submit(t).unwrap();
            e
        })
        .collect();
    ends[2].cancel.cancel();
    let failing = ends.remove(1);
    drop(failing.frames);
    drop(paused);
    let err = within(failing.reply).await.unwrap().unwrap_err();
    assert_eq!(err.kind, ErrorKind::KvUploadFailed, "{err:?}");
    let reference = [&reference[0], &reference[2], &reference[3]];
    let mut results = Vec::new();
    for (e, (frames, first)) in ends.into_iter().zip(reference) {
        let (got, reply) = e.finish().await;
        results.push(reply.map(|c| (c.first_token == *first, got == *frames)));
    }
    assert_eq!(results[0], Ok((true, true)), "j0 as alone");
    assert_eq!(results[1].as_ref().unwrap_err().kind, ErrorKind::Cancelled);
    assert_eq!(results[2], Ok((true, true)), "j3 as alone");
    // j0 and j3 went into the forward pass together: j1 failed on its
    // header, before the pass, and j2 was cancelled.
    assert_eq!(batch_sizes(&b), (4 + 1, 4.0 + 2.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_over_the_budget_runs_alone_and_order_is_kept() {
    let b = start(32);
    let paused = b.engine.pause();
    let ends: Vec<TaskEnds> = jobs(&[10, 40, 10, 12])
        .into_iter()
        .map(|j| {
            let (t, e) = task(j, UNCAPPED);
            b.engine.submit(t).unwrap();
            e
        })
        .collect();
    drop(paused);
    for e in ends {
        e.finish().await.1.unwrap();
    }
    // [10] (the 40 does not fit), [40] alone in chunks, [10, 12].
    assert_eq!(batch_sizes(&b), (3, 4.0));
}
