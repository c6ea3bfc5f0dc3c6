#!/usr/bin/env python3
"""The live correction factors of one loaded run, applied to an engine profile.

    correct_profile.py --sum < METRICS_PAGES > SUMS_JSON
    correct_profile.py ENGINE_JSON BEFORE_JSON AFTER_JSON OUT_JSON

`--sum` adds up, over every worker's /metrics page on stdin, the series the
corrections read. BEFORE and AFTER are two such sums, around a run. The
corrections are measured over modelled time, with the model fitted from
ENGINE_JSON as the mock worker fits it (least squares, kept non-negative:
a negative intercept refits through the origin, a negative slope becomes a
constant):

- prefill: the mean seconds per prompt over a·tokens + b;
- decode: the mean step over c + d·batch.

OUT is ENGINE_JSON with its tokens-per-second figures divided by the
corrections (so every fitted term is multiplied by them) and a
`correction` field [prefill, decode]. A correction with nothing measured
is 1.
"""
import json
import re
import sys

SERIES = (
    "pdserve_prefill_seconds_sum", "pdserve_prefill_seconds_count", "pdserve_prompt_tokens_total",
    "pdserve_decode_step_seconds_sum", "pdserve_decode_step_seconds_count",
    "pdserve_decode_batch_size_sum", "pdserve_decode_batch_size_count",
)


def sums(lines):
    out = dict.fromkeys(SERIES, 0.0)
    for line in lines:
        m = re.match(r"^(\w+)(?:\{[^}]*\})? (\S+)$", line.strip())
        if m and m.group(1) in out:
            out[m.group(1)] += float(m.group(2))
    return out


def fit(points):
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    sxy = sum((x - mx) * (y - my) for x, y in points)
    origin = (sum(x * y for x, y in points) / sum(x * x for x, _ in points), 0.0)
    if sxx <= 1e-300:
        return origin
    slope = sxy / sxx
    intercept = my - slope * mx
    if slope >= 0 and intercept >= 0:
        return slope, intercept
    return origin if slope >= 0 else (0.0, my)


def line(figures):
    """(slope, intercept) of seconds against x from x → tokens/s figures."""
    return fit([(float(x), float(x) / tok_s) for x, tok_s in figures.items()])


def correct(engine_path, before_path, after_path, out_path):
    engine = json.load(open(engine_path))
    if isinstance(engine, list):
        engine = next(e for e in engine if e["weights"] == "native")
    before, after = json.load(open(before_path)), json.load(open(after_path))
    delta = {k: after[k] - before[k] for k in after}
    a, b = line(engine["prefill_tok_s"])
    d, c = line(engine["decode_tok_s"])
    prompts = delta["pdserve_prefill_seconds_count"]
    prefill = 1.0
    if prompts > 0:
        modelled = a * delta["pdserve_prompt_tokens_total"] + b * prompts
        prefill = delta["pdserve_prefill_seconds_sum"] / modelled
    steps = delta["pdserve_decode_step_seconds_count"]
    decode = 1.0
    if steps > 0 and delta["pdserve_decode_batch_size_count"] > 0:
        batch = delta["pdserve_decode_batch_size_sum"] / delta["pdserve_decode_batch_size_count"]
        decode = (delta["pdserve_decode_step_seconds_sum"] / steps) / (c + d * batch)
    out = dict(engine)
    out["prefill_tok_s"] = {k: v / prefill for k, v in engine["prefill_tok_s"].items()}
    out["decode_tok_s"] = {k: v / decode for k, v in engine["decode_tok_s"].items()}
    out["correction"] = [prefill, decode]
    json.dump(out, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    if sys.argv[1:] == ["--sum"]:
        print(json.dumps(sums(sys.stdin)))
    else:
        correct(*sys.argv[1:5])
