//! Incremental stream decoder.

use super::frame::TOP_ENTRY_LEN;
use super::frame::{check_crc, parse_end, parse_end_prefix, parse_header, strip_crc};
use super::frame::{parse_header_prefix, parse_layer_prefix, LayerMeta};
use super::frame::{CRC_LEN, END_PREFIX_LEN, HEADER_PREFIX_LEN, LAYER_PREFIX_LEN, TAG_LEN};
use super::types::payload_len;
use super::{KvEvent, KvHeader, KvLimits, KvWireError, LayerFrame, END_TAG, LAYER_TAG};

/// What the decoder is reading. Each phase but the last two reads into a
/// buffer until it holds a given number of bytes, then [`KvStreamDecoder`]
/// takes a step.
#[derive(Debug, Clone)]
enum Phase {
    /// Header tag, version, flags, body_len.
    HeaderPrefix,
    /// The rest of the header frame; `total` is the whole frame's size.
    HeaderRest { total: usize },
    /// The tag of the next frame.
    Tag,
    /// A layer frame's fixed fields.
    LayerPrefix,
    /// A layer frame's payload, `len` bytes, into the payload buffer.
    LayerPayload { meta: LayerMeta, len: usize },
    /// A layer frame's CRC.
    LayerCrc { meta: LayerMeta },
    /// The end frame's fixed fields.
    EndPrefix,
    /// The rest of the end frame; `total` is the whole frame's size.
    EndRest { total: usize },
    /// The end frame was decoded.
    Done,
    /// An error occurred; the decoder stays failed.
    Failed(KvWireError),
}

/// Ordering state: which tokens and layers the stream has covered.
#[derive(Debug, Clone, Copy, Default)]
struct Progress {
    n_layers: u32,
    n_tokens: u32,
    /// K (or V) bytes of one token of one layer.
    token_bytes: u64,
    /// Tokens covered for all layers (completed chunks).
    tokens_done: u32,
    /// Next layer of the current chunk; `n_layers` when no chunk is open.
    layer_next: u32,
    chunk_start: u32,
    chunk_len: u32,
}

impl Progress {
    fn new(header: &KvHeader) -> Result<Self, KvWireError> {
        let token_bytes = header.token_bytes().ok_or_else(|| {
            KvWireError::invalid("n_kv_heads * head_dim", "K/V size overflows u64")
        })?;
        Ok(Self {
            n_layers: header.n_layers,
            n_tokens: header.n_tokens,
            tokens_done: header.start_token,
            token_bytes,
            layer_next: header.n_layers,
            ..Self::default()
        })
    }

    fn chunk_open(&self) -> bool {
        self.layer_next < self.n_layers
    }

    fn complete(&self) -> bool {
        !self.chunk_open() && self.tokens_done == self.n_tokens
    }

    /// Checks the ordering rule for a layer frame's fields.
    fn check_order(&self, m: &LayerMeta) -> Result<(), KvWireError> {
        for (field, count) in [
            ("layer_count", m.layer_count),
            ("token_count", m.token_count),
        ] {
            if count == 0 {
                return Err(KvWireError::invalid(field, "must be at least 1"));
            }
        }
        if self.chunk_open() {
            in_order(
                "token_start of the open chunk",
                self.chunk_start,
                m.token_start,
            )?;
            in_order(
                "token_count of the open chunk",
                self.chunk_len,
                m.token_count,
            )?;
            in_order(
                "layer_start (next layer of the chunk)",
                self.layer_next,
                m.layer_start,
            )?;
        } else {
            in_order(
                "token_start of a new chunk",
                self.tokens_done,
                m.token_start,
            )?;
            in_order("layer_start of a new chunk", 0, m.layer_start)?;
        }
        let ranges = [
            (
                "layer_start + layer_count",
                m.layer_start,
                m.layer_count,
                self.n_layers,
            ),
            (
                "token_start + token_count",
                m.token_start,
                m.token_count,
                self.n_tokens,
            ),
        ];
        for (field, start, count, limit) in ranges {
            let end = u64::from(start).saturating_add(u64::from(count));
            if end > u64::from(limit) {
                return Err(KvWireError::limit(field, end, limit));
            }
        }
        Ok(())
    }

    /// Checks a layer frame's fields and returns its payload length.
    fn check_layer(&self, m: &LayerMeta, limits: &KvLimits) -> Result<usize, KvWireError> {
        self.check_order(m)?;
        if m.payload_len > limits.max_frame_bytes {
            return Err(KvWireError::limit(
                "payload_len",
                m.payload_len,
                limits.max_frame_bytes,
            ));
        }
        let expected = payload_len(self.token_bytes, m.layer_count, m.token_count)
            .ok_or_else(|| KvWireError::invalid("payload_len", "frame size overflows u64"))?;
        if m.payload_len != expected {
            return Err(KvWireError::BadLength {
                field: "payload_len",
                expected,
                got: m.payload_len,
            });
        }
        usize::try_from(m.payload_len)
            .map_err(|_| KvWireError::limit("payload_len", m.payload_len, usize::MAX as u64))
    }

    /// Records a verified layer frame.
    fn advance(&mut self, m: &LayerMeta) {
        if !self.chunk_open() {
            self.chunk_start = m.token_start;
            self.chunk_len = m.token_count;
        }
        self.layer_next = m.layer_start.saturating_add(m.layer_count);
        if !self.chunk_open() {
            self.tokens_done = self.chunk_start.saturating_add(self.chunk_len);
        }
    }
}

/// Fails with [`KvWireError::OutOfOrder`] unless `got == expected`.
fn in_order(what: &'static str, expected: u32, got: u32) -> Result<(), KvWireError> {
    if got == expected {
        Ok(())
    } else {
        Err(KvWireError::OutOfOrder {
            what,
            expected: u64::from(expected),
            got: u64::from(got),
        })
    }
}

/// Moves bytes from `input` into `buf` until it holds `need` bytes; returns
/// whether it does. Never reserves beyond `need`.
fn fill(buf: &mut Vec<u8>, need: usize, input: &mut &[u8]) -> bool {
    let take = need.saturating_sub(buf.len()).min(input.len());
    if let Some((head, rest)) = input.split_at_checked(take) {
        let len = buf.len();
        if buf.capacity().saturating_sub(len) < take {
            let target = len
                .saturating_mul(2)
                .max(len.saturating_add(take))
                .min(need);
            buf.reserve_exact(target.saturating_sub(len));
        }
        buf.extend_from_slice(head);
        *input = rest;
    }
    buf.len() >= need
}

/// Incremental decoder of a KV stream.
///
/// Feed it the stream's bytes in pieces of any size with
/// [`push`](Self::push); it returns the frames completed by each piece. It
/// buffers at most the current frame, whose size it validates against the
/// header and the [`KvLimits`] before reserving memory for it. After an
/// error it stays failed: every later call returns the same error (events
/// decoded earlier in the failing call are dropped).
#[derive(Debug, Clone)]
pub struct KvStreamDecoder {
    limits: KvLimits,
    phase: Phase,
    /// Bytes of the current frame outside a layer payload.
    scratch: Vec<u8>,
    /// The current layer frame's payload.
    payload: Vec<u8>,
    header: Option<KvHeader>,
    progress: Progress,
}

impl KvStreamDecoder {
    /// A decoder awaiting a header, enforcing `limits`.
    pub fn new(limits: KvLimits) -> Self {
        Self {
            limits,
            phase: Phase::HeaderPrefix,
            scratch: Vec::new(),
            payload: Vec::new(),
            header: None,
            progress: Progress::default(),
        }
    }

    /// Consumes the next piece of the stream and returns the frames it
    /// completed, in order.
    pub fn push(&mut self, bytes: &[u8]) -> Result<Vec<KvEvent>, KvWireError> {
        let mut events = Vec::new();
        match self.run(bytes, &mut events) {
            Ok(()) => Ok(events),
            Err(err) => {
                self.phase = Phase::Failed(err.clone());
                self.scratch = Vec::new();
                self.payload = Vec::new();
                Err(err)
            }
        }
    }

    /// The decoded header, once its frame has been verified.
    pub fn header(&self) -> Option<&KvHeader> {
        self.header.as_ref()
    }

    /// Whether the end frame has been decoded.
    pub fn is_complete(&self) -> bool {
        matches!(self.phase, Phase::Done)
    }

    /// Call when the input ends: `Ok` only if the end frame was decoded;
    /// the decoder's error if it failed; [`KvWireError::Truncated`] otherwise.
    pub fn finish(&self) -> Result<(), KvWireError> {
        match &self.phase {
            Phase::Done => Ok(()),
            Phase::Failed(err) => Err(err.clone()),
            _ => Err(KvWireError::Truncated),
        }
    }

    /// Bytes currently reserved for buffering the frame being read
    /// (bounded by that frame's validated size).
    pub fn buffered_capacity(&self) -> usize {
        self.scratch
            .capacity()
            .saturating_add(self.payload.capacity())
    }

    /// Feeds `input` through the phases until it is used up.
    fn run(&mut self, mut input: &[u8], events: &mut Vec<KvEvent>) -> Result<(), KvWireError> {
        loop {
            let filled = match &self.phase {
                Phase::Failed(err) => return Err(err.clone()),
                Phase::Done if input.is_empty() => return Ok(()),
                Phase::Done => return Err(KvWireError::TrailingData),
                Phase::LayerPayload { len, .. } => fill(&mut self.payload, *len, &mut input),
                phase => fill(&mut self.scratch, scratch_need(phase), &mut input),
            };
            if !filled {
                return Ok(());
            }
            self.step(events)?;
        }
    }

    /// Acts on a completely buffered phase and moves to the next one.
    fn step(&mut self, events: &mut Vec<KvEvent>) -> Result<(), KvWireError> {
        self.phase = match std::mem::replace(&mut self.phase, Phase::Done) {
            Phase::HeaderPrefix => {
                let (body_len, _) = parse_header_prefix(&self.scratch)?;
                Phase::HeaderRest {
                    total: body_len.saturating_add(HEADER_PREFIX_LEN + CRC_LEN),
                }
            }
            Phase::HeaderRest { .. } => self.finish_header(events)?,
            Phase::Tag => self.on_tag()?,
            Phase::LayerPrefix => {
                let meta = parse_layer_prefix(&self.scratch)?;
                let len = self.progress.check_layer(&meta, &self.limits)?;
                self.payload = Vec::new();
                Phase::LayerPayload { meta, len }
            }
            Phase::LayerPayload { meta, .. } => Phase::LayerCrc { meta },
            Phase::LayerCrc { meta } => self.finish_layer(meta, events)?,
            Phase::EndPrefix => {
                let n_top = parse_end_prefix(&self.scratch)?;
                Phase::EndRest {
                    total: n_top
                        .saturating_mul(TOP_ENTRY_LEN)
                        .saturating_add(END_PREFIX_LEN + CRC_LEN),
                }
            }
            Phase::EndRest { .. } => {
                let trailer = parse_end(strip_crc("end", &self.scratch)?)?;
                events.push(KvEvent::End(trailer));
                self.scratch = Vec::new();
                Phase::Done
            }
            Phase::Done => Phase::Done,
            Phase::Failed(err) => return Err(err),
        };
        Ok(())
    }

    /// Verifies and decodes the buffered header frame.
    fn finish_header(&mut self, events: &mut Vec<KvEvent>) -> Result<Phase, KvWireError> {
        let header = parse_header(strip_crc("header", &self.scratch)?)?;
        header.validate(&self.limits)?;
        self.progress = Progress::new(&header)?;
        events.push(KvEvent::Header(header.clone()));
        self.header = Some(header);
        self.scratch.clear();
        Ok(Phase::Tag)
    }

    /// Dispatches on the buffered tag of the next frame.
    fn on_tag(&self) -> Result<Phase, KvWireError> {
        let tag = self
            .scratch
            .first_chunk::<TAG_LEN>()
            .copied()
            .unwrap_or_default();
        let complete = self.progress.complete();
        match tag {
            LAYER_TAG if !complete => Ok(Phase::LayerPrefix),
            END_TAG if complete => Ok(Phase::EndPrefix),
            END_TAG => Err(KvWireError::OutOfOrder {
                what: "tokens covered for all layers before the end frame",
                expected: u64::from(self.progress.n_tokens),
                got: u64::from(self.progress.tokens_done),
            }),
            _ if complete => Err(KvWireError::UnexpectedTag {
                expected: "KVND (all tokens are covered)",
                got: tag,
            }),
            _ => Err(KvWireError::UnexpectedTag {
                expected: "KVLF or KVND",
                got: tag,
            }),
        }
    }

    /// Verifies the buffered layer frame and emits it.
    fn finish_layer(
        &mut self,
        meta: LayerMeta,
        events: &mut Vec<KvEvent>,
    ) -> Result<Phase, KvWireError> {
        let (prefix, stored) = self
            .scratch
            .split_at_checked(LAYER_PREFIX_LEN)
            .ok_or(KvWireError::Truncated)?;
        check_crc("layer", &[prefix, &self.payload], stored)?;
        self.progress.advance(&meta);
        events.push(KvEvent::Layers(LayerFrame {
            layer_start: meta.layer_start,
            layer_count: meta.layer_count,
            token_start: meta.token_start,
            token_count: meta.token_count,
            payload: std::mem::take(&mut self.payload),
        }));
        self.scratch.clear();
        Ok(Phase::Tag)
    }
}

/// How many bytes `phase` needs in the scratch buffer.
fn scratch_need(phase: &Phase) -> usize {
    match phase {
        Phase::HeaderPrefix => HEADER_PREFIX_LEN,
        Phase::HeaderRest { total } | Phase::EndRest { total } => *total,
        Phase::Tag => TAG_LEN,
        Phase::LayerPrefix => LAYER_PREFIX_LEN,
        Phase::LayerCrc { .. } => LAYER_PREFIX_LEN + CRC_LEN,
        Phase::EndPrefix => END_PREFIX_LEN,
        Phase::LayerPayload { .. } | Phase::Done | Phase::Failed(_) => 0,
    }
}
