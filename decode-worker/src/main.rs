use std::sync::Arc;

use clap::Parser;
use pdserve_decode::{build, Args};
use pdserve_engine::Tokenizer;

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // Before any thread exists: the thread pools read these at first use.
    pdserve_engine::threads::set_env(args.model.threads);
    pdserve_runtime::telemetry::init(&args.server.telemetry, "pdserve-decode");
    pdserve_runtime::run(serve(args))
}

async fn serve(args: Args) -> anyhow::Result<()> {
    tracing::info!(?args, "starting the decode worker");
    let margs = args.model.clone();
    let model = Arc::new(tokio::task::spawn_blocking(move || margs.load()).await??);
    let eos = Tokenizer::from_gguf_file(&args.model.path)?.eos_token_id();
    let (listener, url) = args.server.bind(args.port).await?;
    let server = build(model.clone(), eos, &args, url);
    let fingerprint = model.kv_fingerprint(args.decode.kv.kv_cache_dtype.into());
    let service = server.service(fingerprint, &args.model.weights.to_string());
    pdserve_worker::serve(listener, service, &args.server).await?;
    Ok(())
}
