//! Seeded, reproducible workloads: what each request asks for.
//!
//! Prompts are built from a list of common English words, each about one
//! token in byte-level BPE vocabularies, so a prompt of `n` words is close
//! to `n` tokens on any server; the exact count comes back in `usage`.

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::ValueEnum;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, LogNormal};
use serde::{Deserialize, Serialize};

/// One request of a workload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Item {
    pub prompt: String,
    /// Words in the prompt (≈ tokens).
    pub prompt_words: usize,
    pub max_tokens: u32,
    /// `chat`: the system message of the conversation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system: Option<String>,
    /// `chat`: the user's message of every turn (the first is `prompt`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub turns: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
pub enum Kind {
    /// Every prompt `--input-len` words, every output `--output-len` tokens.
    Fixed,
    /// Lengths uniform in `--input-range` and `--output-range`.
    Uniform,
    /// ShareGPT-like: log-normal prompt and output lengths around
    /// `--input-len` and `--output-len` (medians), clipped to the ranges.
    Sharegpt,
    /// Mostly short prompts (`--input-len`) with a fraction
    /// (`--long-fraction`) of long ones (`--long-len`): the case
    /// disaggregation exists for.
    Mixed,
    /// Every prompt starts with the same `--prefix-len` words.
    SharedPrefix,
    /// Multi-turn chat: each item is a conversation of `--turns` turns,
    /// each a user message of `--input-len` words answered in
    /// `--output-len` tokens, and each turn resends the whole history (the
    /// answers included). A system message of `--prefix-len` words, the
    /// same for every conversation, opens each one (0 for none). Needs the
    /// chat endpoint; every turn is one request in the report.
    Chat,
    /// Prompts and output lengths from `--workload-file` (JSONL of
    /// `{"prompt": "...", "max_tokens": N}`).
    File,
}

/// Workload settings.
#[derive(Debug, Clone, clap::Args, Serialize)]
pub struct WorkloadArgs {
    /// Workload shape.
    #[arg(long, env = "PDSERVE_LOADTEST_WORKLOAD", value_enum, default_value_t = Kind::Fixed)]
    pub workload: Kind,
    /// Prompt length in words (≈ tokens): fixed length, or the median.
    #[arg(long, env = "PDSERVE_LOADTEST_INPUT_LEN", default_value_t = 128)]
    pub input_len: usize,
    /// Output tokens (`max_tokens`): fixed length, or the median.
    #[arg(long, env = "PDSERVE_LOADTEST_OUTPUT_LEN", default_value_t = 64)]
    pub output_len: u32,
    /// Prompt length range `MIN:MAX` for `uniform` and `sharegpt`.
    #[arg(long, env = "PDSERVE_LOADTEST_INPUT_RANGE", default_value = "16:1024")]
    pub input_range: String,
    /// Output length range `MIN:MAX` for `uniform` and `sharegpt`.
    #[arg(long, env = "PDSERVE_LOADTEST_OUTPUT_RANGE", default_value = "8:256")]
    pub output_range: String,
    /// `mixed`: the share of long prompts.
    #[arg(long, env = "PDSERVE_LOADTEST_LONG_FRACTION", default_value_t = 0.1)]
    pub long_fraction: f64,
    /// `mixed`: the long prompts' length in words.
    #[arg(long, env = "PDSERVE_LOADTEST_LONG_LEN", default_value_t = 1536)]
    pub long_len: usize,
    /// `shared-prefix`: words shared by every prompt.
    #[arg(long, env = "PDSERVE_LOADTEST_PREFIX_LEN", default_value_t = 256)]
    pub prefix_len: usize,
    /// `chat`: turns per conversation.
    #[arg(long, env = "PDSERVE_LOADTEST_TURNS", default_value_t = 4)]
    pub turns: usize,
    /// `file`: a JSONL workload.
    #[arg(long, env = "PDSERVE_LOADTEST_WORKLOAD_FILE")]
    pub workload_file: Option<PathBuf>,
    /// Seed of the workload (and of the arrival process).
    #[arg(long, env = "PDSERVE_LOADTEST_SEED", default_value_t = 1)]
    pub seed: u64,
}

const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there",
    "been", "if", "more", "when", "will", "would", "who", "so", "no", "time", "people", "year",
    "world", "city", "water", "house", "story", "river", "light", "music", "table", "garden",
];

pub fn parse_range(s: &str) -> anyhow::Result<(u64, u64)> {
    let (a, b) = s.split_once(':').context("a range is MIN:MAX")?;
    let (a, b): (u64, u64) = (a.trim().parse()?, b.trim().parse()?);
    if a == 0 || a > b {
        bail!("range {s:?}: need 1 <= MIN <= MAX");
    }
    Ok((a, b))
}

fn text(rng: &mut StdRng, words: usize) -> String {
    let mut out = String::with_capacity(words * 6);
    for i in 0..words {
        if i > 0 {
            out.push(' ');
        }
        out.push_str(WORDS[rng.random_range(0..WORDS.len())]);
    }
    out
}

fn lognormal(rng: &mut StdRng, median: f64, range: (u64, u64)) -> u64 {
    // sigma 0.8: roughly ShareGPT's spread of prompt and answer lengths.
    let d = LogNormal::new(median.max(1.0).ln(), 0.8).expect("valid parameters");
    (d.sample(rng).round() as u64).clamp(range.0, range.1)
}

/// Builds `n` items (a file workload is cycled to `n`).
pub fn build(args: &WorkloadArgs, n: usize) -> anyhow::Result<Vec<Item>> {
    let mut rng = StdRng::seed_from_u64(args.seed);
    let input = parse_range(&args.input_range)?;
    let output = parse_range(&args.output_range)?;
    if args.workload == Kind::File {
        return from_file(args, n);
    }
    let prefix = text(&mut rng, args.prefix_len);
    let mut items = Vec::with_capacity(n);
    for _ in 0..n {
        let (words, max_tokens) = match args.workload {
            Kind::Fixed | Kind::SharedPrefix | Kind::Chat => {
                (args.input_len, args.output_len as u64)
            }
            Kind::Uniform => (
                rng.random_range(input.0..=input.1) as usize,
                rng.random_range(output.0..=output.1),
            ),
            Kind::Sharegpt => (
                lognormal(&mut rng, args.input_len as f64, input) as usize,
                lognormal(&mut rng, args.output_len as f64, output),
            ),
            Kind::Mixed => match rng.random_bool(args.long_fraction.clamp(0.0, 1.0)) {
                true => (args.long_len, args.output_len as u64),
                false => (args.input_len, args.output_len as u64),
            },
            Kind::File => unreachable!("handled above"),
        };
        let body = text(&mut rng, words.max(1));
        let (prompt, prompt_words) = match args.workload {
            Kind::SharedPrefix => (format!("{prefix} {body}"), args.prefix_len + words),
            _ => (body, words),
        };
        let (system, turns) = match args.workload {
            Kind::Chat => {
                let rest = (1..args.turns.max(1)).map(|_| text(&mut rng, words.max(1)));
                let turns = std::iter::once(prompt.clone()).chain(rest).collect();
                ((args.prefix_len > 0).then(|| prefix.clone()), turns)
            }
            _ => (None, Vec::new()),
        };
        items.push(Item {
            prompt,
            prompt_words,
            max_tokens: max_tokens.max(1) as u32,
            system,
            turns,
        });
    }
    Ok(items)
}

#[derive(Deserialize)]
struct FileItem {
    prompt: String,
    max_tokens: u32,
}

fn from_file(args: &WorkloadArgs, n: usize) -> anyhow::Result<Vec<Item>> {
    let path = args
        .workload_file
        .as_ref()
        .context("--workload file needs --workload-file")?;
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let items: Vec<Item> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(i, l)| {
            let f: FileItem = serde_json::from_str(l).with_context(|| format!("line {}", i + 1))?;
            Ok(Item {
                prompt_words: f.prompt.split_whitespace().count(),
                prompt: f.prompt,
                max_tokens: f.max_tokens.max(1),
                system: None,
                turns: Vec::new(),
            })
        })
        .collect::<anyhow::Result<_>>()?;
    if items.is_empty() {
        bail!("{} has no requests", path.display());
    }
    Ok(items.iter().cycle().take(n).cloned().collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        w: WorkloadArgs,
    }

    fn args(extra: &[&str]) -> WorkloadArgs {
        let mut argv = vec!["t"];
        argv.extend_from_slice(extra);
        T::parse_from(argv).w
    }

    #[test]
    fn workloads_are_reproducible_and_have_their_shape() {
        let a = args(&["--workload", "sharegpt", "--seed", "3"]);
        assert_eq!(build(&a, 50).unwrap(), build(&a, 50).unwrap());
        let fixed = build(&args(&["--input-len", "10", "--output-len", "7"]), 5).unwrap();
        assert!(fixed
            .iter()
            .all(|i| i.prompt.split(' ').count() == 10 && i.max_tokens == 7));
        let mixed = build(
            &args(&[
                "--workload",
                "mixed",
                "--long-fraction",
                "0.25",
                "--long-len",
                "500",
                "--input-len",
                "20",
            ]),
            400,
        )
        .unwrap();
        let long = mixed.iter().filter(|i| i.prompt_words == 500).count();
        assert!((60..140).contains(&long), "{long} long prompts of 400");
        let shared = build(
            &args(&[
                "--workload",
                "shared-prefix",
                "--prefix-len",
                "30",
                "--input-len",
                "5",
            ]),
            3,
        )
        .unwrap();
        let head = |i: &Item| i.prompt.split(' ').take(30).collect::<Vec<_>>().join(" ");
        assert_eq!(head(&shared[0]), head(&shared[2]));
        assert_ne!(shared[0].prompt, shared[2].prompt);
        let uni = build(
            &args(&[
                "--workload",
                "uniform",
                "--input-range",
                "5:9",
                "--output-range",
                "2:3",
            ]),
            100,
        )
        .unwrap();
        assert!(uni
            .iter()
            .all(|i| (5..=9).contains(&i.prompt_words) && (2..=3).contains(&i.max_tokens)));
    }

    #[test]
    fn chat_items_are_conversations_with_a_shared_system_message() {
        let a = args(&["--workload", "chat", "--turns", "3", "--prefix-len", "20"]);
        let items = build(&a, 2).unwrap();
        assert!(items
            .iter()
            .all(|i| i.turns.len() == 3 && i.turns[0] == i.prompt));
        assert_eq!(items[0].system, items[1].system);
        assert_eq!(items[0].system.as_ref().unwrap().split(' ').count(), 20);
        assert_ne!(items[0].turns[1], items[1].turns[1]);
        let none = build(&args(&["--workload", "chat", "--prefix-len", "0"]), 1).unwrap();
        assert_eq!((none[0].system.as_ref(), none[0].turns.len()), (None, 4));
    }

    #[test]
    fn ranges_are_checked() {
        assert_eq!(parse_range("2:5").unwrap(), (2, 5));
        assert!(parse_range("5:2").is_err());
        assert!(parse_range("0:2").is_err());
        assert!(parse_range("7").is_err());
    }

    #[test]
    fn file_workloads_cycle() {
        let dir = std::env::temp_dir().join(format!("pdserve-wl-{}", std::process::id()));
        std::fs::write(
            &dir,
            "{\"prompt\":\"a b c\",\"max_tokens\":4}\n{\"prompt\":\"d\",\"max_tokens\":2}\n",
        )
        .unwrap();
        let a = args(&[
            "--workload",
            "file",
            "--workload-file",
            dir.to_str().unwrap(),
        ]);
        let items = build(&a, 3).unwrap();
        std::fs::remove_file(&dir).ok();
        assert_eq!(
            items.iter().map(|i| i.max_tokens).collect::<Vec<_>>(),
            vec![4, 2, 4]
        );
        assert_eq!(items[0].prompt_words, 3);
    }
}
