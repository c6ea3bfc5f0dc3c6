//! One sequence on the decode worker: its tokens, its KV and where it is.

use pdserve_engine::sampler::SeqSampler;
use pdserve_engine::SeqKv;
use pdserve_worker::decode::SeqStream;

/// A sequence the scheduler holds: waiting (its KV is being computed, or it
/// waits for a slot in the batch) or active (decoding).
pub(crate) struct Seq {
    pub stream: SeqStream,
    /// The prompt and every token sampled since; the last sampled one is
    /// not in the KV yet (it is fed to the next decode step).
    pub tokens: Vec<u32>,
    /// Sampling parameters, penalty counts and grammar state.
    pub sampler: SeqSampler,
    pub kv: SeqKv,
    /// Order of admission into the batch (the latest is preempted first).
    pub admitted: u64,
}

impl Seq {
    /// Tokens sampled so far.
    pub fn generated(&self) -> usize {
        self.stream.generated as usize
    }

    /// How many of `tokens` must be in the KV before the sequence can
    /// decode: the whole prompt for a new sequence (its first token is then
    /// sampled from the prefill), all but the last token for one that was
    /// preempted and is being recomputed.
    pub fn context_len(&self) -> usize {
        match self.generated() {
            0 => self.tokens.len(),
            _ => self.tokens.len() - 1,
        }
    }

    /// Whether its KV still lacks tokens (a prefill chunk is due).
    pub fn needs_prefill(&self) -> bool {
        self.kv.len() < self.context_len()
    }

    /// The token to feed to the next decode step, once the KV is complete.
    pub fn last(&self) -> Option<u32> {
        match (self.needs_prefill(), self.generated()) {
            (false, 1..) => self.tokens.last().copied(),
            _ => None,
        }
    }

    /// Prompt tokens still to prefill (for the queue metrics).
    pub fn pending_tokens(&self) -> usize {
        self.context_len().saturating_sub(self.kv.len())
    }
}
