//! `pdserve-loadtest`: load generation against OpenAI-compatible servers and
//! micro-benchmarks of pdserve's own components.

mod batch_bench;
mod chaos;
mod engine_bench;
mod kv_bench;
#[cfg(target_os = "linux")]
mod link;
mod plan;
mod run;
mod simulate;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(name = "pdserve-loadtest", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Load an OpenAI-compatible server (or several, side by side) and report
    /// latency percentiles, throughput and goodput.
    Run(Box<run::RunArgs>),
    /// Benchmark the engine in-process: prefill and batched-decode throughput.
    Engine(engine_bench::EngineArgs),
    /// Benchmark moving one sequence's KV: export, wire encode/decode, import.
    Kv(kv_bench::KvArgs),
    /// Drive a local cluster under load and inject faults (docs/chaos.md).
    Chaos(chaos::ChaosArgs),
    /// Benchmark several short prompts in one forward pass against one by one.
    PrefillBatch(batch_bench::BatchArgs),
    /// Offer `run`'s load to a simulated cluster (router, policies, both
    /// pools) driven by a latency model; the same report as `run`.
    Simulate(Box<simulate::SimArgs>),
    /// Search pool sizes (and chunk, batch cap, local-prefill threshold) for
    /// the cheapest simulated cluster that meets the SLOs at a load.
    Plan(Box<plan::PlanArgs>),
    /// Emulate a network link between two namespaces in user space (delay,
    /// rate, loss), for kernels without netem.
    #[cfg(target_os = "linux")]
    Link(link::LinkArgs),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Run(args) => {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?;
            runtime.block_on(run::run(*args)).map(|_| ())
        }
        Command::Chaos(args) => {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?;
            runtime.block_on(chaos::run(args))
        }
        Command::Engine(args) => engine_bench::run(args),
        Command::Kv(args) => kv_bench::run(args),
        Command::PrefillBatch(args) => batch_bench::run(args),
        Command::Simulate(args) => simulate::run(*args).map(|_| ()),
        Command::Plan(args) => plan::run(*args).map(|_| ()),
        #[cfg(target_os = "linux")]
        Command::Link(args) => link::run(args),
    }
}
