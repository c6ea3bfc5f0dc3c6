//! The router's request path: a request body (the whole input, as JSON
//! bytes) parsed as the router parses it (`serde_json::from_slice` into the
//! `pdserve_protocol::openai` request types), then validated into sampling
//! parameters and prompts of token ids by the router's `Frontend`
//! (`prepare_chat`, `prepare_completion`, and what `/tokenize` and
//! `/detokenize` call), over the tiny test model.
//!
//! Every body is tried as each of the four request types, so the seed
//! corpus is plain JSON bodies, usable with curl as they are.
//!
//! Checked on every input: no panic; no single allocation above 64 MiB; a
//! parsed request serializes to JSON that parses back to the same request
//! (but for floats, whose last digit may round differently); an accepted
//! request has parameters in their documented ranges, non-empty prompts of
//! in-vocabulary ids that fit the context window with their `max_tokens`,
//! the chat template's tokens for a chat, the prompt's text for `echo`.

#![no_main]

use libfuzzer_sys::fuzz_target;
use pdserve_fuzz::{cap_allocations, frontend, MODEL_NAME};
use pdserve_protocol::openai::{
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, PromptInput, TokenizeRequest,
};
use pdserve_router::frontend::{Frontend, Prepared};
use pdserve_router::params::LogprobMode;
use pdserve_text::sampling::MAX_TOP_LOGPROBS;
use pdserve_text::stop::StopOutput;
use serde::de::DeserializeOwned;
use serde::Serialize;

fuzz_target!(|data: &[u8]| {
    let f = frontend();
    cap_allocations(64 << 20);
    if let Some(req) = parse::<ChatCompletionRequest>(data) {
        let again: ChatCompletionRequest = reparse(&req);
        assert_eq!(
            (&again.model, &again.messages, &again.params.stop),
            (&req.model, &req.messages, &req.params.stop)
        );
        if let Ok(p) = f.prepare_chat(&req) {
            check_prepared(f, &p);
            assert_eq!(p.prompts.len(), 1);
            let tokens = f.chat_tokens(&req.messages, true).expect("accepted once");
            assert_eq!(p.prompts[0].tokens, tokens);
            assert!(p.prompts[0].echo.is_none());
            let top = req.top_logprobs.unwrap_or(0) as u32;
            match req.logprobs.unwrap_or(false) {
                true => assert_eq!(p.params.logprobs, LogprobMode::Chat(top)),
                false => assert_eq!(p.params.logprobs, LogprobMode::None),
            }
        }
    }
    if let Some(req) = parse::<CompletionRequest>(data) {
        let again: CompletionRequest = reparse(&req);
        assert_eq!(
            (&again.model, &again.prompt, &again.params.stop),
            (&req.model, &req.prompt, &req.params.stop)
        );
        if let Ok(p) = f.prepare_completion(&req) {
            check_prepared(f, &p);
            let count = match &req.prompt {
                PromptInput::Text(_) | PromptInput::Tokens(_) => 1,
                PromptInput::Texts(v) => v.len(),
                PromptInput::TokenLists(v) => v.len(),
            };
            assert_eq!(p.prompts.len(), count);
            for plan in &p.prompts {
                match req.echo.unwrap_or(false) {
                    true => {
                        let text = f.detokenize(&plan.tokens).expect("in-vocabulary ids");
                        assert_eq!(plan.echo.as_ref(), Some(&text));
                    }
                    false => assert!(plan.echo.is_none()),
                }
            }
            if let PromptInput::Text(t) = &req.prompt {
                // Byte-level BPE loses nothing (the tiny model adds no BOS).
                assert_eq!(&f.detokenize(&p.prompts[0].tokens).unwrap(), t);
            }
            match req.logprobs {
                Some(k) => assert_eq!(p.params.logprobs, LogprobMode::Completion(k as u32)),
                None => assert_eq!(p.params.logprobs, LogprobMode::None),
            }
        }
    }
    if let Some(req) = parse::<TokenizeRequest>(data) {
        let _: TokenizeRequest = reparse(&req);
        let tokens = match &req {
            TokenizeRequest::Prompt {
                prompt,
                add_special_tokens,
                ..
            } => f.tokenize(prompt, add_special_tokens.unwrap_or(true)),
            TokenizeRequest::Chat {
                messages,
                add_generation_prompt,
                ..
            } => f.chat_tokens(messages, add_generation_prompt.unwrap_or(true)),
        };
        if let Ok(tokens) = tokens {
            assert!(tokens.iter().all(|&t| (t as usize) < f.vocab_size));
            if let TokenizeRequest::Prompt { prompt, .. } = &req {
                assert_eq!(&f.detokenize(&tokens).unwrap(), prompt);
            }
        }
    }
    if let Some(req) = parse::<DetokenizeRequest>(data) {
        let _: DetokenizeRequest = reparse(&req);
        let valid = req.tokens.iter().all(|&t| (t as usize) < f.vocab_size);
        assert_eq!(f.detokenize(&req.tokens).is_ok(), valid);
    }
});

/// The router's parse of a body.
fn parse<T: DeserializeOwned>(body: &[u8]) -> Option<T> {
    serde_json::from_slice(body).ok()
}

/// `req` serialized and parsed again.
fn reparse<T: Serialize + DeserializeOwned>(req: &T) -> T {
    let json = serde_json::to_vec(req).expect("a request serializes");
    match serde_json::from_slice(&json) {
        Ok(r) => r,
        Err(e) => panic!("{e}: {}", String::from_utf8_lossy(&json)),
    }
}

/// Invariants of an accepted request.
fn check_prepared(f: &Frontend, p: &Prepared) {
    assert!(!p.prompts.is_empty());
    let s = &p.params.sampling;
    let ranges = [
        (s.temperature, 0.0, 2.0),
        (s.top_p, 0.0, 1.0),
        (s.min_p, 0.0, 1.0),
        (s.presence_penalty, -2.0, 2.0),
        (s.frequency_penalty, -2.0, 2.0),
    ];
    for (v, lo, hi) in ranges {
        assert!(
            v.is_finite() && (lo..=hi).contains(&v),
            "{v} not in {lo}..={hi}"
        );
    }
    assert!(s.top_p > 0.0);
    assert!(s.top_k.is_none_or(|k| k >= 1));
    assert!(s.top_logprobs as usize <= MAX_TOP_LOGPROBS);
    assert!((1..=f.limits.max_n).contains(&p.params.n));
    assert!(p.params.stream || !p.params.include_usage);
    assert!(p.params.max_tokens.is_none_or(|m| m >= 1));
    for plan in &p.prompts {
        assert!(!plan.tokens.is_empty());
        assert!(plan.tokens.iter().all(|&t| (t as usize) < f.vocab_size));
        assert!(plan.max_tokens >= 1);
        assert!(plan.tokens.len() + plan.max_tokens as usize <= f.context_length);
        if let Some(m) = p.params.max_tokens {
            assert_eq!(plan.max_tokens, m);
        }
    }
    for i in 0..p.params.n {
        let c = p.params.for_choice(i, 7);
        assert_eq!(c.max_tokens, 7);
        if i == 0 || p.params.seeded {
            assert_eq!(c.seed, s.seed.wrapping_add(u64::from(i)));
        }
    }
    // The stop matcher the request built runs on its own prompt's text.
    let mut stop = p.params.stop.clone();
    let text = f
        .detokenize(&p.prompts[0].tokens)
        .expect("in-vocabulary ids");
    match stop.push(&text) {
        StopOutput::Continue(out) => assert!(text.starts_with(&out)),
        StopOutput::Stopped { text: out, .. } => assert!(text.starts_with(&out)),
    }
    assert_eq!(MODEL_NAME, f.model_name);
}
