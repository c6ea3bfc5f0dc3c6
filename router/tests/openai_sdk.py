"""Conformance of pdserve's router with the official `openai` Python SDK.

Usage: openai_sdk.py BASE_URL MODEL   (BASE_URL ends in /v1)
Run by router/tests/processes.rs against a local cluster on the real model.
"""
import sys

import openai

base_url, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base_url, api_key="not-needed", max_retries=0, timeout=120)
question = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]

# Streaming chat, with usage in a final chunk.
stream = client.chat.completions.create(
    model=model, messages=question, max_tokens=20, temperature=0,
    stream=True, stream_options={"include_usage": True},
)
text, roles, usage, finishes = "", [], None, []
for chunk in stream:
    assert chunk.object == "chat.completion.chunk", chunk
    if chunk.usage is not None:
        usage = chunk.usage
        assert chunk.choices == [], chunk
    for c in chunk.choices:
        if c.delta.role:
            roles.append(c.delta.role)
        if c.delta.content:
            text += c.delta.content
        if c.finish_reason:
            finishes.append(c.finish_reason)
assert "Paris" in text, text
assert roles == ["assistant"], roles
assert finishes in (["stop"], ["length"]), finishes
assert usage is not None and usage.completion_tokens > 0, usage
assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens, usage
print("streaming chat:", repr(text), usage)

# Non-streaming completions.
r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=5, temperature=0)
assert r.object == "text_completion", r
assert "Paris" in r.choices[0].text, r
assert r.usage.completion_tokens <= 5, r.usage
print("completion:", repr(r.choices[0].text))

# Non-streaming chat: two choices, logprobs, a stop sequence.
r = client.chat.completions.create(
    model=model, messages=question, max_tokens=12, temperature=0.7, seed=3, n=2,
    logprobs=True, top_logprobs=2, stop=["\n"],
)
assert [c.index for c in r.choices] == [0, 1], r
for c in r.choices:
    assert c.message.role == "assistant"
    assert "\n" not in c.message.content, c.message.content
    assert c.logprobs is not None and len(c.logprobs.content) >= 1
    assert all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
print("chat n=2:", [c.message.content for c in r.choices])

# Models.
assert [m.id for m in client.models.list()] == [model]

# Errors come back as the SDK's typed exceptions.
try:
    client.chat.completions.create(model="no-such-model", messages=question)
    raise AssertionError("an unknown model must fail")
except openai.NotFoundError as e:
    assert e.status_code == 404 and e.code == "model_not_found", e
try:
    client.chat.completions.create(model=model, messages=question, temperature=7)
    raise AssertionError("temperature 7 must fail")
except openai.BadRequestError as e:
    assert e.status_code == 400 and e.param == "temperature", e
print("all openai SDK checks passed")
