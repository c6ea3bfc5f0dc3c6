//! Process plumbing shared by every pdserve binary: metric names, logging and
//! graceful shutdown.

pub mod metrics;
pub mod shutdown;
pub mod telemetry;
