//! Conversions between the engine's types and their wire forms in `pdserve-protocol`.

use pdserve_protocol::internal::{ErrorBody, ErrorKind};
use pdserve_protocol::kvwire;

use crate::error::EngineError;
use crate::kv::{KvDtype, KvError};

impl From<kvwire::KvDtype> for KvDtype {
    fn from(d: kvwire::KvDtype) -> Self {
        match d {
            kvwire::KvDtype::F32 => Self::F32,
            kvwire::KvDtype::F16 => Self::F16,
        }
    }
}

impl From<KvDtype> for kvwire::KvDtype {
    fn from(d: KvDtype) -> Self {
        match d {
            KvDtype::F32 => Self::F32,
            KvDtype::F16 => Self::F16,
        }
    }
}

impl From<&KvError> for ErrorBody {
    /// A full budget is retryable (another worker, or later, may do); any
    /// other KV error is the request's or the stream's fault.
    fn from(e: &KvError) -> Self {
        let kind = ErrorKind::from_name(e.kind());
        match e {
            KvError::Exhausted { .. } => Self::retryable(kind, e.to_string()),
            _ => Self::fatal(kind, e.to_string()),
        }
    }
}

impl From<&EngineError> for ErrorBody {
    /// The caller's fault (invalid input; a KV request that cannot fit) is
    /// fatal; a failure of the engine itself (a tensor operation, the model
    /// or tokenizer at run time) is retryable on another worker.
    fn from(e: &EngineError) -> Self {
        match e {
            EngineError::InvalidInput(_) => Self::fatal(ErrorKind::InvalidInput, e.to_string()),
            EngineError::Kv(kv) => Self::from(kv),
            _ => Self::retryable(ErrorKind::from_name(e.kind()), e.to_string()),
        }
    }
}

impl crate::Model {
    /// The model with a KV cache of `cache`, as the KV stream sees it.
    pub fn kv_shape(&self, cache: KvDtype) -> kvwire::KvShape {
        let layout = self.kv_layout();
        kvwire::KvShape {
            fingerprint: self.kv_fingerprint(cache),
            n_layers: layout.n_layers as u32,
            n_kv_heads: layout.n_kv_heads as u32,
            head_dim: layout.head_dim as u32,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdserve_protocol::internal::ErrorClass;

    #[test]
    fn engine_failures_are_retryable_and_the_callers_faults_fatal() {
        let tensor = EngineError::Candle(candle_core::Error::Msg("boom".into()));
        assert_eq!(ErrorBody::from(&tensor).class, ErrorClass::Retryable);
        let input = EngineError::InvalidInput("token 99999".into());
        assert_eq!(ErrorBody::from(&input).class, ErrorClass::Fatal);
        let full = EngineError::Kv(KvError::CapacityExceeded {
            needed: 10,
            capacity: 5,
        });
        assert_eq!(ErrorBody::from(&full).class, ErrorClass::Fatal);
    }
}
