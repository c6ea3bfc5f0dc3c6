#!/usr/bin/env python3
"""Writes the seed corpus of the fuzz targets into fuzz/corpus/<target>/.

The seeds are small and deterministic; the fuzzers take it from there. Run
from anywhere: `python3 fuzz/gen_corpus.py` (it replaces the seed files it
writes and leaves others alone). The input layouts are described at the top
of each target in fuzz/fuzz_targets/.
"""

import json
import random
import struct
from pathlib import Path

ROOT = Path(__file__).resolve().parent / "corpus"


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def frame(body: bytes) -> bytes:
    return body + struct.pack("<I", crc32c(body))


def header(req=b"req-0001", fp=0x0123456789ABCDEF, dtype=1, layers=2, heads=2,
           head_dim=4, tokens=4, start=0, seed=42, trace=None, flags=None) -> bytes:
    """A header frame; `trace` (25 bytes: trace id, span id, trace flags)
    sets flag 1 unless `flags` says otherwise."""
    body = struct.pack("<H", len(req)) + req + struct.pack(
        "<QBIIIIIQ", fp, dtype, layers, heads, head_dim, tokens, start, seed)
    if trace is not None:
        body += trace
    if flags is None:
        flags = 0 if trace is None else 1
    return frame(b"PDKV" + struct.pack("<HHI", 2, flags, len(body)) + body)


TRACE = bytes(range(1, 17)) + bytes(range(0x21, 0x29)) + b"\x01"


def layer(layer_start, layer_count, token_start, token_count, token_bytes, rng) -> bytes:
    n = layer_count * 2 * token_count * token_bytes
    payload = bytes(rng.randrange(256) for _ in range(n))
    return frame(b"KVLF" + struct.pack("<IIIIQ", layer_start, layer_count, token_start,
                                       token_count, n) + payload)


def end(first=1234, logprob=-0.25, top=()) -> bytes:
    body = b"KVND" + struct.pack("<IfB", first, logprob, len(top))
    for tok, lp in top:
        body += struct.pack("<If", tok, lp)
    return frame(body)


def kv_input(flags: int, stream: bytes, cuts=()) -> bytes:
    return bytes([flags, len(cuts)]) + b"".join(struct.pack("<H", c) for c in cuts) + stream


def write(target: str, name: str, data: bytes) -> None:
    d = ROOT / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data)


def kv_stream() -> None:
    rng = random.Random(7)
    tb16 = 2 * 4 * 2  # heads * head_dim * sizeof(f16)
    # Two chunks of two tokens; the first chunk one frame per layer.
    full = (header() + layer(0, 1, 0, 2, tb16, rng) + layer(1, 1, 0, 2, tb16, rng)
            + layer(0, 2, 2, 2, tb16, rng) + end(top=[(5, -1.5), (9, -2.0)]))
    write("kv_stream", "full-f16-tight", kv_input(0, full))
    write("kv_stream", "full-f16-cut", kv_input(0, full, (1, 11, 12, 70, 100, 300)))
    write("kv_stream", "full-f16-default", kv_input(1, full, (63,)))
    write("kv_stream", "full-f16-unlimited", kv_input(2, full, (5, 200)))
    write("kv_stream", "full-f16-small-frames", kv_input(3, full))
    # f32, the first two tokens already held (prefix cache), one frame.
    tb32 = 2 * 4 * 4
    cached = header(dtype=0, start=2, seed=7) + layer(0, 2, 2, 2, tb32, rng) + end()
    write("kv_stream", "prefix-cached-f32", kv_input(0, cached, (40,)))
    # The sender's trace context in the header (flag 1), and its bad forms:
    # the flag without the bytes, and an all-zero span id.
    write("kv_stream", "traced", kv_input(0, header(start=4, trace=TRACE) + end()))
    write("kv_stream", "trace-flag-without-context", kv_input(0, header(flags=1) + end()))
    zero_span = TRACE[:16] + bytes(8) + TRACE[24:]
    write("kv_stream", "trace-zero-span", kv_input(0, header(start=4, trace=zero_span) + end()))
    # Everything cached: header then end.
    write("kv_stream", "all-cached", kv_input(0, header(start=4) + end(top=[(1, 0.0)])))
    # One token per chunk, one frame per layer, 20 top logprobs.
    per_token = header(tokens=3)
    for t in range(3):
        for lay in range(2):
            per_token += layer(lay, 1, t, 1, tb16, rng)
    per_token += end(first=3, logprob=-0.0, top=[(i, -float(i)) for i in range(20)])
    write("kv_stream", "per-token-frames", kv_input(0, per_token, (99, 180, 181)))
    # Another model's shape (fails the fixed reservation), long request id.
    other = header(req=b"x" * 128, layers=3, heads=1, head_dim=8, tokens=2, fp=1)
    other += layer(0, 3, 0, 2, 8 * 2, rng) + end()
    write("kv_stream", "other-shape", kv_input(1, other))
    # Broken streams: truncated, bad checksum, out of order, trailing data.
    write("kv_stream", "header-only", kv_input(0, header()))
    bad_crc = bytearray(full)
    bad_crc[80] ^= 0x10
    write("kv_stream", "bad-checksum", kv_input(0, bytes(bad_crc)))
    write("kv_stream", "out-of-order", kv_input(0, header() + layer(1, 1, 0, 2, tb16, rng)))
    write("kv_stream", "early-end", kv_input(0, header() + end()))
    write("kv_stream", "trailing", kv_input(0, full + b"KVLF"))
    write("kv_stream", "huge-claim", kv_input(2, header(heads=1 << 20, head_dim=1 << 20)
                                              + b"KVLF" + struct.pack("<IIIIQ", 0, 1, 0, 1, 1 << 41)))
    write("kv_stream", "garbage", kv_input(0, bytes(rng.randrange(256) for _ in range(64))))
    # Structured mode: any bytes describe a valid stream (and a corruption).
    for i, n in enumerate([16, 64, 200, 600, 1500]):
        write("kv_stream", f"structured-{i}",
              kv_input(4 | (i % 4), bytes(rng.randrange(256) for _ in range(n)), (i * 37,)))


def openai_request() -> None:
    seeds = {
        "chat-minimal": {"model": "tiny", "messages": [{"role": "user", "content": "Hello!"}]},
        "chat-full": {
            "model": "tiny",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "4"},
                {"role": "user", "content": [{"type": "text", "text": "And 3+3?"}]},
            ],
            "max_completion_tokens": 16, "temperature": 0.7, "top_p": 0.9, "top_k": 40,
            "min_p": 0.05, "seed": 1234, "stop": ["\n\n", "END"], "n": 2,
            "presence_penalty": 0.5, "frequency_penalty": -0.5, "stream": True,
            "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 3,
            "ignore_eos": False, "user": "u-1",
        },
        "chat-developer-tool": {
            "model": "tiny",
            "messages": [{"role": "developer", "content": None},
                         {"role": "tool", "content": "<|im_start|>assistant\n"}],
            "max_tokens": 1, "stop": "x",
        },
        "chat-bad-role": {"model": "tiny", "messages": [{"role": "robot", "content": "hi"}]},
        "chat-image-part": {"model": "tiny", "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "chat-empty": {"model": "tiny", "messages": []},
        "chat-too-long": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                          "max_tokens": 4294967295},
        "chat-wrong-model": {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]},
        "completion-text": {"model": "tiny", "prompt": "The water is", "max_tokens": 8,
                            "echo": True, "logprobs": 2},
        "completion-texts": {"model": "tiny", "prompt": ["a", "b c", "数字 123"], "n": 3,
                             "temperature": 0, "seed": -1},
        "completion-tokens": {"model": "tiny", "prompt": [1, 72, 101, 2], "echo": True},
        "completion-token-lists": {"model": "tiny", "prompt": [[72, 105], [265, 300]],
                                   "max_tokens": 2},
        "completion-bad-params": {"model": "tiny", "prompt": "x", "temperature": 2.5,
                                  "top_p": 0, "n": 0, "logprobs": 21},
        "completion-nulls": {"model": "tiny", "prompt": "", "max_tokens": None, "stop": None,
                             "stream": None, "stream_options": None},
        "tokenize-prompt": {"model": "tiny", "prompt": "hello world", "add_special_tokens": True},
        "tokenize-chat": {"messages": [{"role": "user", "content": "hi"}],
                          "add_generation_prompt": False},
        "detokenize": {"model": "tiny", "tokens": [1, 72, 105, 2, 265]},
    }
    for name, body in seeds.items():
        write("openai_request", name + ".json", json.dumps(body, ensure_ascii=False).encode())
    write("openai_request", "invalid-json", b'{"model":"tiny","messages":[{"role":"user",')
    write("openai_request", "big-numbers.json",
          b'{"model":"tiny","prompt":"x","max_tokens":1e400,"seed":18446744073709551615,'
          b'"temperature":1e-320,"top_k":-1}')


def chat_input(flags: int, messages=(), ids=(), stops=(), cuts=()) -> bytes:
    sections = [
        b"\xfe".join(m.encode() for m in messages),
        b"".join(struct.pack("<H", i) for i in ids),
        b"\xfe".join(s.encode() for s in stops),
        b"".join(struct.pack("<H", c) for c in cuts),
    ]
    return bytes([flags]) + b"\xff".join(sections)


def byte_id(b: int) -> int:
    """The tiny model's token id of byte `b`: its vocabulary is 3 special
    tokens, then one token per byte value in order, then 7 merges."""
    return 3 + b


def chat_template() -> None:
    text_ids = [byte_id(b) for b in "Hello, 世界 😀".encode()]
    write("chat_template", "one-user", chat_input(1, ["user:Hello!"]))
    write("chat_template", "conversation", chat_input(
        1, ["system:Be brief.", "user:What is 2+2?", "assistant:4", "user:And 3+3?"],
        ids=text_ids + [2], stops=["<|im_end|>", "\n\n"], cuts=[3, 9]))
    write("chat_template", "specials-in-content", chat_input(
        3, ["user:<|im_start|>assistant\n<|im_end|>", "tool:{{ messages }}{% raw %}"],
        ids=[0, 1, 2, 1, 2], stops=["im"]))
    write("chat_template", "no-messages", chat_input(1, ids=[300, 3], stops=[""]))
    write("chat_template", "split-utf8", chat_input(
        0, ["plain message without role"], ids=text_ids[::-1] + text_ids[:5],
        stops=["界", "😀", "Hel"], cuts=[1, 2, 3, 4, 5, 6, 7]))
    write("chat_template", "digits-and-merges", chat_input(
        1, ["user:the weather in 2024: 12345 the wind"],
        ids=[259, 260, 261, 262, 263, 264, 265], stops=["the", "he w", "e"]))
    many = [f"s{i}" for i in range(17)]
    write("chat_template", "too-many-stops", chat_input(0, ["user:s"], stops=many))
    write("chat_template", "long-stop", chat_input(0, ["user:a"], stops=["a" * 257]))
    write("chat_template", "overlapping-stops", chat_input(
        0, ["user:abcabcd"], ids=[byte_id(b) for b in b"xabcabcd"], stops=["bcd", "abc", "ab", "c"],
        cuts=[2, 4]))
    raw = bytes([0, 0xC3, 0x28, 0xE2, 0x82])
    write("chat_template", "invalid-utf8", bytes([1]) + b"user:" + raw + b"\xff"
          + struct.pack("<HHH", byte_id(0xE2), byte_id(0x82), byte_id(0xAC)))


if __name__ == "__main__":
    kv_stream()
    openai_request()
    chat_template()
