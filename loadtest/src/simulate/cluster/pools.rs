//! The router's dispatch and each pool's schedule, event by event.

use pdserve_router::config::{Mode, Spill};
use pdserve_router::dispatch::placement::spills;
use pdserve_router::policy::RequestInfo;

use super::placement::extend_hashes;
use super::{Finished, Kind, Output, Phase, Running, Sim, DECODE, PREFILL};

impl Sim {
    /// The router: a decode worker with room for the reservation, then
    /// local prefill there or a prefill worker.
    pub(super) fn dispatch(&mut self, s: usize) {
        let prompt = std::mem::take(&mut self.seq_mut(s).req.prompt);
        let reserve = (prompt.len() + self.seq(s).req.max_tokens as usize) as u64;
        let budget = self.cfg.kv_cache_tokens as u64;
        if reserve > budget || prompt.is_empty() {
            self.seq_mut(s).req.prompt = prompt;
            return self.fail(s, "http_400");
        }
        let mut hashes = Vec::new();
        if self.cfg.kv.prefix_cache.is_on() {
            extend_hashes(&mut hashes, &prompt, self.block_tokens());
        }
        let placement = &mut self.placement[DECODE];
        placement.prepare(prompt.len(), &hashes);
        let base = RequestInfo {
            prompt_tokens: prompt.len() as u64,
            reserve_tokens: reserve,
            prompt: &prompt,
            known_cached: None,
        };
        let (decode, max_queue) = (&self.decode, self.cfg.max_queue.max(1));
        let chosen = placement.choose(base, self.cfg.decode_attempts, |w| {
            decode[w].used + reserve <= budget && decode[w].waiting.len() < max_queue
        });
        let seq = self.seq_mut(s);
        (seq.req.prompt, seq.hashes) = (prompt, hashes);
        match chosen {
            Some(w) => self.reserve(s, w, reserve),
            None => self.fail(s, "http_503"),
        }
    }

    fn reserve(&mut self, s: usize, w: usize, reserve: u64) {
        let cached = self.decode[w].cache.lookup(self.seq(s));
        self.decode[w].used += reserve;
        self.totals.decode_cache_hit_tokens += cached as u64;
        let prompt_len = {
            let seq = self.seq_mut(s);
            (seq.decode, seq.reserve, seq.cached, seq.prefilled) = (w, reserve, cached, cached);
            seq.req.prompt.len()
        };
        let uncached = prompt_len - cached;
        let local = match self.cfg.mode {
            Mode::Aggregated => true,
            Mode::Auto => {
                uncached < self.cfg.local_prefill_max_tokens
                    || self.prefill.is_empty()
                    || self.spills(w)
            }
            Mode::Disaggregated => false,
        };
        if local {
            self.totals.local_prefills += 1;
            self.intake(w, s);
        } else if self.send_to_prefill(s) {
            self.decode[w].importing += 1;
        } else {
            self.release(s);
            self.fail(s, "http_503");
        }
        self.sync_decode(w);
    }

    /// The router's spill rule: the least-loaded prefill worker's queued
    /// prompt tokens against those waiting for a local prefill on `w`.
    fn spills(&self, w: usize) -> bool {
        let Spill::Above(limit) = self.cfg.local_prefill_spill else {
            return false;
        };
        let Some(pool) = self.prefill.iter().map(|p| p.queued_tokens).min() else {
            return false;
        };
        let local = self.decode[w]
            .waiting
            .iter()
            .map(|&s| {
                let seq = self.seq(s);
                (seq.req.prompt.len() - seq.prefilled) as u64
            })
            .sum();
        spills(limit, pool, local)
    }

    /// Queues the prompt on a prefill worker; false when none takes it.
    fn send_to_prefill(&mut self, s: usize) -> bool {
        let seq = self.seq_mut(s);
        let (prompt, hashes) = (
            std::mem::take(&mut seq.req.prompt),
            std::mem::take(&mut seq.hashes),
        );
        let placement = &mut self.placement[PREFILL];
        placement.prepare(prompt.len(), &hashes);
        let base = RequestInfo {
            prompt_tokens: prompt.len() as u64,
            reserve_tokens: 0,
            prompt: &prompt,
            known_cached: None,
        };
        let (prefill, max_queue) = (&self.prefill, self.cfg.max_queue.max(1));
        let chosen = placement.choose(base, self.cfg.prefill_attempts, |p| {
            prefill[p].queue.len() < max_queue
        });
        let n = prompt.len() as u64;
        let seq = self.seq_mut(s);
        (seq.req.prompt, seq.hashes) = (prompt, hashes);
        let Some(p) = chosen else { return false };
        let worker = &mut self.prefill[p];
        worker.queue.push_back(s);
        worker.queued_tokens += n;
        self.totals.remote_prefills += 1;
        if worker.running.is_none() {
            self.start_prefill(p);
        }
        self.sync_prefill(p);
        true
    }

    fn start_prefill(&mut self, p: usize) {
        let Some(s) = self.prefill[p].queue.pop_front() else {
            return;
        };
        let (n, from) = {
            let seq = self.seq(s);
            (seq.req.prompt.len(), seq.cached)
        };
        let own = self.prefill[p].cache.lookup(self.seq(s));
        let compute = self.cfg.latency.prefill(n - own).as_secs_f64();
        // Rows from `from` on: cached ones at once, computed ones as they come.
        let sent = n - from;
        let last_chunk = match (n - own) % self.cfg.chunk_tokens.max(1) {
            0 => self.cfg.chunk_tokens.max(1),
            r => r,
        };
        self.totals.prefill_tokens_computed += (n - own) as u64;
        self.totals.kv_bytes_sent += sent as f64 * self.cfg.link.kv_bytes_per_token;
        self.prefill[p].running = Some(Running {
            seq: s,
            started: self.now,
            sent,
            last_chunk,
        });
        self.compute(compute, Kind::PrefillDone(p));
    }

    pub(super) fn prefill_done(&mut self, p: usize) {
        let Some(job) = self.prefill[p].running.take() else {
            return;
        };
        let s = job.seq;
        let seq = self.seqs[s].as_ref().expect("a live sequence");
        self.prefill[p].cache.insert(&seq.hashes);
        let n = seq.req.prompt.len() as u64;
        let computed = (job.started, self.now);
        let kv_at = self.cfg.link.arrival(computed, job.sent, job.last_chunk);
        self.prefill[p].queued_tokens -= n;
        self.schedule(kv_at, Kind::KvArrived(s));
        self.start_prefill(p);
        self.sync_prefill(p);
    }

    /// The decode worker takes the imported KV with the first token.
    pub(super) fn kv_arrived(&mut self, s: usize) {
        let w = self.seq(s).decode;
        let n = self.seq(s).req.prompt.len();
        self.seq_mut(s).prefilled = n;
        self.decode[w].importing -= 1;
        self.cache_prompt(w, s);
        if self.emit(s) {
            self.enqueue(w, s);
        }
        self.sync_decode(w);
    }

    /// A sequence's prompt counts as cached on its decode worker from the
    /// moment the worker takes it, as in the mock.
    fn cache_prompt(&mut self, w: usize, s: usize) {
        let seq = self.seqs[s].as_ref().expect("a live sequence");
        self.decode[w].cache.insert(&seq.hashes);
    }

    /// A locally prefilled sequence joins the decode worker's queue.
    fn intake(&mut self, w: usize, s: usize) {
        self.cache_prompt(w, s);
        self.enqueue(w, s);
    }

    fn enqueue(&mut self, w: usize, s: usize) {
        self.decode[w].waiting.push_back(s);
        if self.decode[w].phase == Phase::Idle {
            self.iterate(w);
        }
    }

    /// One token out for `s`; false (and `s` retired) once it is the last.
    fn emit(&mut self, s: usize) -> bool {
        let now = self.now;
        let keep_itl = self.cfg.keep_itl;
        let seq = self.seq_mut(s);
        match seq.first {
            None => seq.first = Some(now),
            Some(_) if keep_itl => seq.itl.push(now - seq.last),
            Some(_) => {}
        }
        seq.last = now;
        seq.started = true;
        seq.generated += 1;
        if seq.generated < seq.req.max_tokens {
            return true;
        }
        let w = seq.decode;
        let d = &mut self.decode[w];
        d.waiting.retain(|&x| x != s);
        self.finish(s);
        false
    }

    /// Starts the decode worker's next iteration: a local prefill chunk while
    /// the batch has room, else admission and a step.
    fn iterate(&mut self, w: usize) {
        let d = &self.decode[w];
        if d.active.len() < self.cfg.max_batch.max(1) {
            let next = d.waiting.iter().copied().find(|&s| !self.seq(s).started);
            if let Some(s) = next {
                let seq = self.seq(s);
                let chunk =
                    (seq.req.prompt.len() - seq.prefilled).min(self.cfg.chunk_tokens.max(1));
                let t = self.cfg.latency.prefill(chunk).as_secs_f64();
                self.decode[w].phase = Phase::Chunk(s, chunk);
                self.totals.local_tokens_computed += chunk as u64;
                return self.compute(t, Kind::ChunkDone(w));
            }
        }
        self.admit_and_step(w);
    }

    pub(super) fn chunk_done(&mut self, w: usize) {
        let Phase::Chunk(s, chunk) = self.decode[w].phase else {
            return;
        };
        let done = {
            let seq = self.seq_mut(s);
            seq.prefilled += chunk;
            seq.prefilled >= seq.req.prompt.len()
        };
        if done {
            self.emit(s);
        }
        self.admit_and_step(w);
        self.sync_decode(w);
    }

    fn admit_and_step(&mut self, w: usize) {
        let max = self.cfg.max_batch.max(1);
        let d = &mut self.decode[w];
        let mut i = 0;
        while d.active.len() < max && i < d.waiting.len() {
            let s = d.waiting[i];
            match self.seqs[s].as_ref().is_some_and(|q| q.started) {
                true => {
                    d.waiting.remove(i);
                    d.active.push(s);
                }
                false => i += 1,
            }
        }
        let d = &self.decode[w];
        if d.active.is_empty() {
            self.decode[w].phase = Phase::Idle;
            return;
        }
        let ctx: u64 = d.active.iter().map(|&s| self.seq(s).position()).sum();
        let t = self.cfg.latency.step(d.active.len(), ctx).as_secs_f64() + self.cfg.step_overhead;
        self.decode[w].phase = Phase::Step;
        self.totals.decode_steps += 1;
        self.compute(t, Kind::StepDone(w));
    }

    pub(super) fn step_done(&mut self, w: usize) {
        let mut batch = std::mem::take(&mut self.decode[w].active);
        batch.retain(|&s| self.emit(s));
        let d = &mut self.decode[w];
        d.active = batch;
        d.phase = Phase::Idle;
        if !(d.active.is_empty() && d.waiting.is_empty()) {
            self.iterate(w);
        }
        self.sync_decode(w);
    }

    /// Gives the sequence's KV reservation back.
    fn release(&mut self, s: usize) {
        let (w, reserve) = {
            let seq = self.seq(s);
            (seq.decode, seq.reserve)
        };
        self.decode[w].used -= reserve;
        self.seq_mut(s).reserve = 0;
    }

    fn finish(&mut self, s: usize) {
        self.release(s);
        let mut seq = self.seqs[s].take().expect("a live sequence");
        self.free.push(s);
        let prompt_tokens = seq.req.prompt.len() as u32;
        if self.cfg.cache_generated && self.cfg.kv.prefix_cache.is_on() {
            // The prompt and its answer, as the next turn will resend them.
            let mut all = std::mem::take(&mut seq.req.prompt);
            all.extend(super::super::answer(seq.req.id, seq.generated));
            extend_hashes(&mut seq.hashes, &all, self.block_tokens());
            self.decode[seq.decode].cache.insert(&seq.hashes);
        }
        self.out.push_back(Output::Done(Finished {
            id: seq.req.id,
            start: seq.start,
            first: seq.first,
            end: self.now,
            prompt_tokens,
            completion_tokens: seq.generated,
            cached_tokens: seq.cached as u32,
            itl: seq.itl,
            error: None,
        }));
    }

    fn fail(&mut self, s: usize, class: &'static str) {
        let seq = self.seqs[s].take().expect("a live sequence");
        self.free.push(s);
        self.out.push_back(Output::Done(Finished {
            id: seq.req.id,
            start: seq.start,
            first: None,
            end: self.now,
            prompt_tokens: seq.req.prompt.len() as u32,
            completion_tokens: 0,
            cached_tokens: 0,
            itl: Vec::new(),
            error: Some(class),
        }));
    }

    /// The load report the prefill worker would send now.
    fn sync_prefill(&mut self, p: usize) {
        let w = &self.prefill[p];
        let load = &mut self.placement[PREFILL].view_mut(p).load;
        load.queued_requests = w.queue.len() as u64;
        load.queued_tokens = w.queued_tokens;
        load.active_sequences = w.queue.len() as u64 + u64::from(w.running.is_some());
    }

    /// The load report the decode worker would send now.
    pub(super) fn sync_decode(&mut self, w: usize) {
        let d = &self.decode[w];
        let queued: u64 = d
            .waiting
            .iter()
            .filter_map(|&s| self.seqs[s].as_ref())
            .map(|q| (q.req.prompt.len() - q.prefilled.min(q.req.prompt.len())) as u64)
            .sum();
        let load = &mut self.placement[DECODE].view_mut(w).load;
        load.queued_requests = d.waiting.len() as u64;
        load.queued_tokens = queued;
        load.active_sequences = (d.active.len() + d.waiting.len() + d.importing) as u64;
        load.kv_used_tokens = d.used;
        load.kv_free_tokens = (self.cfg.kv_cache_tokens as u64).saturating_sub(d.used);
    }
}
