//! Running one batch on the model thread: every member's header, the
//! forward passes (several whole prompts as segments of one pass, or one
//! prompt in chunks), each layer's rows framed to the member's own upload,
//! and each member's first token and end frame. A member that is cancelled
//! or whose upload fails drops out; the others go on.
//!
//! Only what is missing is computed and sent. A member takes the leading
//! blocks of its prompt that this worker's prefix cache holds (`own`
//! tokens) and computes the rest; the decode worker already holds the
//! first `job.cached_tokens` (`from`), so the stream starts there: cached
//! rows `from..own` are sent from the cache first, computed rows below
//! `from` are not sent at all.

use std::ops::{ControlFlow, Range};

use bytes::Bytes;
use pdserve_engine::sampler::SeqSampler;
use pdserve_engine::{EngineError, Segment, SeqKv};
use pdserve_protocol::internal::{ErrorBody, ErrorKind, PrefillJob};
use pdserve_protocol::kvwire::{self, KvHeader, KvTrailer};
use pdserve_worker::prefill::{cancelled, Computed, PrefillTask as Task};
use tokio::time::Instant;

use crate::engine::Worker;

/// One forward pass: which members take part, and which of their prompt tokens.
type Pass = Vec<(usize, Range<usize>)>;

/// A member's progress through the batch.
#[derive(Default)]
struct Member {
    kv: Option<SeqKv>,
    /// Leading prompt tokens taken from this worker's prefix cache.
    own: usize,
    sent: u64,
    failed: Option<ErrorBody>,
    /// The logits after the member's last prompt token.
    logits: Option<Vec<f32>>,
}

impl Member {
    fn live(&self) -> bool {
        self.failed.is_none() && self.kv.is_some()
    }
}

/// Takes the KV of the members of `pass` that are still wanted, marking
/// the ones cancelled since the last pass; returns who they are and their KV.
fn take_live(tasks: &[Task], members: &mut [Member], pass: &Pass) -> (Pass, Vec<SeqKv>) {
    let (mut owners, mut kvs) = (Vec::new(), Vec::new());
    for (i, range) in pass {
        let m = &mut members[*i];
        if m.failed.is_none() && tasks[*i].cancel.is_cancelled() {
            m.failed = Some(cancelled());
        }
        if m.failed.is_some() {
            continue;
        }
        if let Some(kv) = m.kv.take() {
            owners.push((*i, range.clone()));
            kvs.push(kv);
        }
    }
    (owners, kvs)
}

/// Splits the live members' uncached prompt tokens into forward passes:
/// several members share one pass with all of theirs; one member alone
/// runs in chunks.
fn plan(todo: &Pass, chunk: usize) -> Vec<Pass> {
    match todo.as_slice() {
        [] => Vec::new(),
        [(i, r)] => r
            .clone()
            .step_by(chunk.max(1))
            .map(|s| vec![(*i, s..(s + chunk.max(1)).min(r.end))])
            .collect(),
        _ => vec![todo.clone()],
    }
}

impl Worker {
    /// Prefills every task of the batch; one result per task, in order.
    pub(crate) fn prefill(&self, tasks: &[Task]) -> Vec<Result<Computed, ErrorBody>> {
        let started = Instant::now();
        let mut members: Vec<Member> = tasks.iter().map(|t| self.open(t)).collect();
        let todo: Pass = (0..tasks.len())
            .filter(|&i| members[i].live())
            .map(|i| (i, members[i].own..tasks[i].job.prompt_tokens.len()))
            .collect();
        if !todo.is_empty() {
            self.metrics.batch_size.observe(todo.len() as f64);
        }
        for pass in plan(&todo, self.cfg.chunk_tokens) {
            self.pass(tasks, &mut members, &pass);
        }
        let results: Vec<_> = tasks
            .iter()
            .zip(&mut members)
            .map(|(t, m)| self.finish(t, m, started))
            .collect();
        let tokens: usize = todo.iter().map(|(_, r)| r.len()).sum();
        self.record(tokens, started.elapsed().as_secs_f64());
        results
    }

    /// Checks the job is still wanted, reserves its KV (taking what the
    /// prefix cache holds), sends its header and the cached rows the decode
    /// worker lacks.
    fn open(&self, task: &Task) -> Member {
        let mut m = Member::default();
        match self.try_open(task) {
            Ok((kv, sent)) => (m.own, m.kv, m.sent) = (kv.len(), Some(kv), sent),
            Err(e) => m.failed = Some(e),
        }
        m
    }

    fn try_open(&self, task: &Task) -> Result<(SeqKv, u64), ErrorBody> {
        if task.cancel.is_cancelled() {
            let msg = "the job was cancelled while queued";
            return Err(ErrorBody::fatal(ErrorKind::Cancelled, msg));
        }
        let prompt = &task.job.prompt_tokens;
        let mut kv = self.pool.sequence();
        let own = kv.attach_prefix(prompt);
        kv.reserve_to(prompt.len())
            .map_err(|e| ErrorBody::from(&e))?;
        let header = self.header(&task.job);
        let frame = kvwire::encode_header(&header).map_err(ErrorBody::from)?;
        let mut sent = self.send(task, frame.into())?;
        let from = header.start_token as usize;
        if own > from {
            for layer in 0..self.model.config().n_layers {
                sent += self.send(task, self.frame(&kv, layer, from, own - from)?)?;
            }
        }
        Ok((kv, sent))
    }

    /// One forward pass over the live members of `pass`, streaming each
    /// member's new rows of every layer to its own upload. It stops between
    /// layers once no member is left to stream to.
    fn pass(&self, tasks: &[Task], members: &mut [Member], pass: &Pass) {
        let (owners, mut kvs) = take_live(tasks, members, pass);
        if owners.is_empty() {
            return;
        }
        let mut segs: Vec<Segment> = kvs
            .iter_mut()
            .zip(&owners)
            .map(|(kv, (i, r))| Segment {
                kv,
                tokens: &tasks[*i].job.prompt_tokens[r.clone()],
            })
            .collect();
        let mut on_layer = |layer: usize, segs: &[Segment<'_>]| {
            let mut live = false;
            for (seg, (i, r)) in segs.iter().zip(&owners) {
                let m = &mut members[*i];
                if m.failed.is_some() {
                    continue;
                }
                match self.stream_layer(&tasks[*i], seg.kv, layer, r) {
                    Ok(n) => (m.sent, live) = (m.sent + n, true),
                    Err(e) => m.failed = Some(e),
                }
            }
            match live {
                true => ControlFlow::Continue(()),
                false => ControlFlow::Break(()),
            }
        };
        let result = self.model.forward(&mut segs, &mut on_layer);
        drop(segs);
        for (row, ((i, r), kv)) in owners.into_iter().zip(kvs).enumerate() {
            let m = &mut members[i];
            m.kv = Some(kv);
            match &result {
                Ok(logits) if r.end == tasks[i].job.prompt_tokens.len() => {
                    m.logits = Some(logits.row(row).to_vec());
                }
                Ok(_) | Err(EngineError::Interrupted { .. }) => {}
                Err(e) => {
                    m.failed.get_or_insert(ErrorBody::from(e));
                }
            }
        }
    }

    /// Frames and sends the rows `range` of `layer` that the decode worker
    /// lacks, unless the job was cancelled.
    fn stream_layer(
        &self,
        task: &Task,
        kv: &SeqKv,
        layer: usize,
        range: &Range<usize>,
    ) -> Result<u64, ErrorBody> {
        if task.cancel.is_cancelled() {
            return Err(cancelled());
        }
        let start = range.start.max(task.job.cached_tokens as usize);
        if start >= range.end {
            return Ok(0);
        }
        let frame = self.frame(kv, layer, start, range.end - start)?;
        self.send(task, frame)
    }

    /// Samples the member's first token and sends the end frame.
    fn finish(&self, task: &Task, m: &mut Member, started: Instant) -> Result<Computed, ErrorBody> {
        if let Some(e) = m.failed.take() {
            return Err(e);
        }
        let Some(logits) = m.logits.take() else {
            return Err(ErrorBody::retryable(
                ErrorKind::EngineFailed,
                "the forward pass produced no logits",
            ));
        };
        let n = task.job.prompt_tokens.len();
        let prompt = &task.job.prompt_tokens;
        let grammars = self.cfg.grammars.as_ref();
        let first = SeqSampler::new(&task.job.sampling, prompt, grammars)
            .and_then(|mut s| s.sample(&logits, n as u64))
            .map_err(|e| ErrorBody::fatal(ErrorKind::Sampling, e.to_string()))?;
        let trailer = KvTrailer {
            first_token: first.token,
            first_logprob: first.logprob,
            top_logprobs: first.top_logprobs,
        };
        m.sent += self.send(
            task,
            kvwire::encode_end(&trailer)
                .map_err(ErrorBody::from)?
                .into(),
        )?;
        let secs = started.elapsed().as_secs_f64();
        self.metrics.prompt_done(n - m.own, secs);
        Ok(Computed {
            finished_at: Instant::now(),
            first_token: first.token,
            queue_seconds: 0.0,
            compute_seconds: secs,
            bytes: m.sent,
        })
    }

    /// Utilisation and throughput of a batch that computed `tokens` prompt tokens.
    fn record(&self, tokens: usize, secs: f64) {
        if tokens == 0 {
            return;
        }
        let flops = 2.0 * self.model.config().matmul_macs_per_token() as f64 * tokens as f64;
        self.metrics
            .mfu
            .set(flops / secs.max(1e-9) / self.cfg.peak_flops.max(1.0));
        self.stats.record_rate(tokens, secs);
    }

    /// The stream's header: it starts after the tokens the decode worker holds.
    fn header(&self, job: &PrefillJob) -> KvHeader {
        let tokens = (job.cached_tokens, job.prompt_tokens.len() as u32);
        let dtype = self.cfg.kv_dtype.into();
        self.model.kv_shape(self.pool.config().dtype).header(
            &job.request_id,
            tokens,
            job.sampling.seed,
            dtype,
        )
    }

    fn frame(
        &self,
        kv: &SeqKv,
        layer: usize,
        start: usize,
        tokens: usize,
    ) -> Result<Bytes, ErrorBody> {
        let (mut k, mut v) = (Vec::new(), Vec::new());
        kv.export_rows(layer, self.cfg.kv_dtype, start, tokens, &mut k, &mut v)
            .map_err(|e| ErrorBody::from(&e))?;
        let mut out = Vec::with_capacity(k.len() + v.len() + 64);
        kvwire::encode_layer_parts(
            layer as u32,
            start as u32,
            tokens as u32,
            &[(&k, &v)],
            &mut out,
        )
        .map_err(ErrorBody::from)?;
        Ok(Bytes::from(out))
    }

    /// Hands a frame to the upload. It never waits: a decode worker that
    /// reads slower than the job's KV buffer allows fails this job only.
    fn send(&self, task: &Task, frame: Bytes) -> Result<u64, ErrorBody> {
        let n = frame.len() as u64;
        task.frames.send(frame)?;
        self.metrics.kv_transfer_bytes.inc_by(n);
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn several_members_share_one_pass_and_one_runs_in_chunks() {
        assert_eq!(plan(&vec![], 4), Vec::<Pass>::new());
        assert_eq!(
            plan(&vec![(2, 0..10)], 4),
            vec![vec![(2, 0..4)], vec![(2, 4..8)], vec![(2, 8..10)]]
        );
        assert_eq!(plan(&vec![(0, 0..3)], 4), vec![vec![(0, 0..3)]]);
        // A cached prefix is not computed again.
        assert_eq!(
            plan(&vec![(1, 8..14)], 4),
            vec![vec![(1, 8..12)], vec![(1, 12..14)]]
        );
        let many = vec![(0, 0..3), (2, 4..9)];
        assert_eq!(plan(&many, 4), vec![many.clone()]);
    }
}
