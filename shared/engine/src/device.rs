//! Device selection: `cpu`, or `cuda[:N]` when built with the `cuda` feature.

use candle_core::Device;

use crate::error::{EngineError, Result};

/// Parses a device name into a candle device.
pub fn parse_device(name: &str) -> Result<Device> {
    let name = name.trim().to_ascii_lowercase();
    if name == "cpu" {
        return Ok(Device::Cpu);
    }
    let ordinal = match name.strip_prefix("cuda") {
        Some("") => 0,
        Some(rest) => rest
            .strip_prefix(':')
            .and_then(|n| n.parse::<usize>().ok())
            .ok_or_else(|| EngineError::InvalidInput(format!("bad device `{name}`")))?,
        None => {
            return Err(EngineError::InvalidInput(format!(
                "unknown device `{name}` (expected cpu or cuda[:N])"
            )))
        }
    };
    cuda(ordinal)
}

#[cfg(feature = "cuda")]
fn cuda(ordinal: usize) -> Result<Device> {
    Ok(Device::new_cuda(ordinal)?)
}

#[cfg(not(feature = "cuda"))]
fn cuda(_ordinal: usize) -> Result<Device> {
    Err(EngineError::unsupported(
        "this build has no CUDA support (rebuild with the `cuda` feature)",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_cpu_and_rejects_nonsense() {
        assert!(parse_device("CPU").unwrap().is_cpu());
        assert!(parse_device("tpu").is_err());
        assert!(parse_device("cuda:x").is_err());
        #[cfg(not(feature = "cuda"))]
        assert!(matches!(
            parse_device("cuda:0"),
            Err(EngineError::Text(pdserve_text::TextError::Unsupported(_)))
        ));
    }
}
