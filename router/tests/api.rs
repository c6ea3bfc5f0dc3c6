//! The public API against a real cluster on the tiny model: object shapes,
//! streaming, parameters.

mod common;

use common::*;
use serde_json::{json, Value};

fn check_envelope(v: &Value, object: &str) {
    assert_eq!(v["object"], object, "{v}");
    assert!(v["id"].as_str().unwrap().len() > 8, "{v}");
    assert!(v["created"].as_u64().unwrap() > 1_600_000_000, "{v}");
    assert_eq!(v["model"], MODEL);
    assert!(v["system_fingerprint"]
        .as_str()
        .unwrap()
        .starts_with("pdserve"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_and_completions_have_the_openai_shapes() {
    let c = cluster(Opts::default()).await;
    let (status, v) = post_json(
        &c.url,
        "/v1/chat/completions",
        &chat_body("Hello there", json!({})),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    check_envelope(&v, "chat.completion");
    let choice = &v["choices"][0];
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["message"]["role"], "assistant");
    assert!(choice["message"]["content"].is_string());
    assert!(["stop", "length"].contains(&choice["finish_reason"].as_str().unwrap()));
    let u = &v["usage"];
    assert!(u["prompt_tokens"].as_u64().unwrap() > 3);
    assert_eq!(
        u["total_tokens"].as_u64().unwrap(),
        u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap()
    );

    let (status, v) = post_json(
        &c.url,
        "/v1/completions",
        &completion_body("Once upon", json!({"ignore_eos": true})),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    check_envelope(&v, "text_completion");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_matches_non_streaming_and_ends_with_done() {
    let c = cluster(Opts::default()).await;
    let extra = json!({"ignore_eos": true, "max_tokens": 12});
    let (_, whole) = post_json(
        &c.url,
        "/v1/chat/completions",
        &chat_body("Tell me", extra.clone()),
    )
    .await;
    let mut body = chat_body("Tell me", extra);
    body["stream"] = json!(true);
    let (events, done) = sse_events(post(&c.url, "/v1/chat/completions", &body).await).await;
    assert!(done);
    for e in &events {
        check_envelope(e, "chat.completion.chunk");
        assert!(e.get("usage").is_none(), "usage only when asked: {e}");
    }
    assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(
        events.last().unwrap()["choices"][0]["finish_reason"],
        "length"
    );
    assert_eq!(
        streamed_text(&events, 0),
        whole["choices"][0]["message"]["content"].as_str().unwrap()
    );

    let mut body = completion_body(
        "Once",
        json!({"stream": true, "max_tokens": 5, "ignore_eos": true}),
    );
    let (events, done) = sse_events(post(&c.url, "/v1/completions", &body).await).await;
    assert!(done);
    events
        .iter()
        .for_each(|e| check_envelope(e, "text_completion"));
    body["stream"] = json!(false);
    let (_, whole) = post_json(&c.url, "/v1/completions", &body).await;
    assert_eq!(
        streamed_text(&events, 0),
        whole["choices"][0]["text"].as_str().unwrap()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn include_usage_adds_a_final_chunk_with_empty_choices() {
    let c = cluster(Opts::default()).await;
    let body = chat_body(
        "Hi",
        json!({"stream": true, "stream_options": {"include_usage": true}, "max_tokens": 4, "ignore_eos": true}),
    );
    let (events, done) = sse_events(post(&c.url, "/v1/chat/completions", &body).await).await;
    assert!(done);
    let (last, rest) = events.split_last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], 4);
    assert!(last["usage"]["prompt_tokens"].as_u64().unwrap() > 0);
    assert!(rest
        .iter()
        .all(|e| e["usage"].is_null() && e.get("usage").is_some()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_each_have_their_index() {
    let c = cluster(Opts::default()).await;
    let extra = json!({"n": 2, "temperature": 1.0, "seed": 5, "ignore_eos": true, "max_tokens": 6});
    let (status, v) = post_json(
        &c.url,
        "/v1/chat/completions",
        &chat_body("Hi", extra.clone()),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    assert_eq!(
        (choices[0]["index"].clone(), choices[1]["index"].clone()),
        (json!(0), json!(1))
    );
    assert_eq!(v["usage"]["completion_tokens"], 12);
    let mut body = chat_body("Hi", extra);
    body["stream"] = json!(true);
    let (events, _) = sse_events(post(&c.url, "/v1/chat/completions", &body).await).await;
    for i in 0..2 {
        assert_eq!(
            streamed_text(&events, i),
            choices[i as usize]["message"]["content"].as_str().unwrap()
        );
        let finishes = events
            .iter()
            .filter(|e| {
                e["choices"][0]["index"] == i && e["choices"][0]["finish_reason"].is_string()
            })
            .count();
        assert_eq!(finishes, 1, "choice {i} finishes once");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeds_make_sampling_reproducible() {
    let c = cluster(Opts::default()).await;
    let run = |seed: u64| {
        let body = completion_body(
            "The",
            json!({"temperature": 1.0, "seed": seed, "max_tokens": 16, "ignore_eos": true}),
        );
        let url = c.url.clone();
        async move {
            post_json(&url, "/v1/completions", &body).await.1["choices"][0]["text"]
                .as_str()
                .unwrap()
                .to_string()
        }
    };
    let a = run(11).await;
    assert_eq!(a, run(11).await);
    let others = [run(12).await, run(13).await, run(14).await];
    assert!(
        others.iter().any(|o| *o != a),
        "different seeds should differ: {a:?} {others:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_tokens_one_gives_one_token() {
    let c = cluster(Opts::default()).await;
    let (_, v) = post_json(
        &c.url,
        "/v1/completions",
        &completion_body("A", json!({"max_tokens": 1, "ignore_eos": true})),
    )
    .await;
    assert_eq!(v["usage"]["completion_tokens"], 1);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_sequences_are_cut_across_token_boundaries() {
    let c = cluster(Opts::default()).await;
    let extra = json!({"max_tokens": 24, "ignore_eos": true, "logprobs": 0});
    let (_, v) = post_json(
        &c.url,
        "/v1/completions",
        &completion_body("Stop", extra.clone()),
    )
    .await;
    let tokens: Vec<String> = v["choices"][0]["logprobs"]["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap().to_string())
        .collect();
    let text = v["choices"][0]["text"].as_str().unwrap().to_string();
    // A stop made of the end of one token and the start of the next.
    let i = (3..tokens.len() - 1)
        .find(|&i| {
            let (a, b) = (&tokens[i], &tokens[i + 1]);
            a.is_ascii() && b.is_ascii() && !a.is_empty() && !b.is_empty()
        })
        .expect("two adjacent ASCII tokens");
    let stop = format!(
        "{}{}",
        &tokens[i][tokens[i].len() - 1..],
        &tokens[i + 1][..1]
    );
    let expected = &text[..text.find(&stop).unwrap()];
    for stream in [false, true] {
        let mut body = completion_body("Stop", extra.clone());
        body["stop"] = json!([stop.clone(), "never-appears"]);
        body["stream"] = json!(stream);
        let (got, finish) = match stream {
            false => {
                let (_, v) = post_json(&c.url, "/v1/completions", &body).await;
                (
                    v["choices"][0]["text"].as_str().unwrap().to_string(),
                    v["choices"][0]["finish_reason"].clone(),
                )
            }
            true => {
                let (events, _) = sse_events(post(&c.url, "/v1/completions", &body).await).await;
                let finish = events.last().unwrap()["choices"][0]["finish_reason"].clone();
                (streamed_text(&events, 0), finish)
            }
        };
        assert_eq!(got, expected, "stop {stop:?} (stream {stream})");
        assert_eq!(finish, "stop");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_have_both_endpoint_shapes() {
    let c = cluster(Opts::default()).await;
    let extra = json!({"logprobs": true, "top_logprobs": 3, "max_tokens": 5, "ignore_eos": true});
    let (_, v) = post_json(&c.url, "/v1/chat/completions", &chat_body("Hi", extra)).await;
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 5);
    for t in content {
        assert!(t["logprob"].as_f64().unwrap() <= 0.0);
        assert!(t["token"].is_string() && t["bytes"].is_array());
        let top = t["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        // Greedy: the chosen token is the most likely one.
        assert_eq!(top[0]["logprob"], t["logprob"]);
    }
    let (_, v) = post_json(
        &c.url,
        "/v1/completions",
        &completion_body(
            "Hi",
            json!({"logprobs": 2, "max_tokens": 4, "ignore_eos": true}),
        ),
    )
    .await;
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 4);
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), 4);
    // Keyed by token text: two alternatives that decode to the same text
    // (bytes of an unfinished character) share a key.
    for top in lp["top_logprobs"].as_array().unwrap() {
        let n = top.as_object().unwrap().len();
        assert!((1..=2).contains(&n), "{lp}");
    }
    assert_eq!(lp["text_offset"][0], 0);
    let (_, v) = post_json(&c.url, "/v1/completions", &completion_body("Hi", json!({}))).await;
    assert!(v["choices"][0]["logprobs"].is_null());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_take_token_ids_lists_and_echo() {
    let c = cluster(Opts::default()).await;
    let (status, v) = post_json(
        &c.url,
        "/v1/completions",
        &completion_body("", json!({"prompt": [[5, 6, 7], [8, 9]], "max_tokens": 2})),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"].as_array().unwrap().len(), 2);
    assert_eq!(v["usage"]["prompt_tokens"], 5);
    let (_, v) = post_json(
        &c.url,
        "/v1/completions",
        &completion_body("Echo me", json!({"echo": true, "max_tokens": 2})),
    )
    .await;
    assert!(v["choices"][0]["text"]
        .as_str()
        .unwrap()
        .starts_with("Echo me"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_detokenize_and_models() {
    let c = cluster(Opts::default()).await;
    let (status, v) = post_json(&c.url, "/tokenize", &json!({"prompt": "hello world"})).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        v["count"].as_u64().unwrap() as usize,
        v["tokens"].as_array().unwrap().len()
    );
    assert_eq!(v["max_model_len"], 512);
    let (_, back) = post_json(&c.url, "/detokenize", &json!({"tokens": v["tokens"]})).await;
    assert_eq!(back["prompt"], "hello world");
    let (_, chat) = post_json(
        &c.url,
        "/tokenize",
        &json!({"messages": [{"role": "user", "content": "hello world"}]}),
    )
    .await;
    assert!(
        chat["count"].as_u64().unwrap() > v["count"].as_u64().unwrap(),
        "the template adds tokens"
    );
    let models: Value = reqwest::get(format!("{}/v1/models", c.url))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], MODEL);
    let metrics = pdserve_testkit::http::metrics(&c.url).await;
    assert!(
        metrics.contains("pdserve_workers{pool=\"decode\",state=\"ready\"} 1"),
        "{metrics}"
    );
}

/// A long system prompt's tokens are kept after its second request and
/// found on the third; the prompt tokenizes the same every time, and
/// `/metrics` counts the hit. With `--tokenizer-cache-mb 0` nothing is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recurring_system_prompt_is_tokenized_once_kept() {
    let system = "Answer briefly and cite the rules 1-9. ".repeat(8);
    let body = |question: &str| {
        json!({"messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ]})
    };
    for (cache_mb, hits) in [("64", 1.0), ("0", 0.0)] {
        let c = cluster(Opts {
            router_args: &["--tokenizer-cache-mb", cache_mb],
            ..Opts::default()
        })
        .await;
        let mut counts = Vec::new();
        for question in ["one?", "two?", "one?"] {
            let (status, v) = post_json(&c.url, "/tokenize", &body(question)).await;
            assert_eq!(status, 200, "{v}");
            counts.push(v["tokens"].clone());
        }
        assert_eq!(counts[0], counts[2], "the same prompt, the same tokens");
        assert!(counts[0].as_array().unwrap().len() > 300);
        let series = "pdserve_tokenizer_cache_hits_total";
        let metrics = pdserve_testkit::http::metrics(&c.url).await;
        let found = pdserve_testkit::http::metric(&metrics, series);
        assert_eq!(found, hits, "--tokenizer-cache-mb {cache_mb}: {metrics}");
    }
}
