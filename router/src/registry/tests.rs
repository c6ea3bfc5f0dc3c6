//! The registry's unit tests.

use super::*;

fn ready(tokens: u64) -> LoadReport {
    LoadReport {
        queued_tokens: tokens,
        ready: true,
        ..Default::default()
    }
}

fn reg(pool: Pool, url: &str, fp: u64) -> WorkerRegistration {
    WorkerRegistration {
        pool,
        url: url.into(),
        model_fingerprint: fp,
        weights: "q8_0".into(),
        worker_id: None,
    }
}

#[test]
fn workers_take_work_only_once_ready() {
    let r = Registry::default();
    r.register(&reg(Pool::Prefill, "http://p1", 1)).unwrap();
    assert!(r.candidates(Pool::Prefill, None).is_empty());
    assert!(r.heartbeat(&Heartbeat {
        url: "http://p1".into(),
        load: ready(5),
    }));
    assert_eq!(r.candidates(Pool::Prefill, None).len(), 1);
    assert!(r.candidates(Pool::Decode, None).is_empty());
    assert!(
        r.candidates(Pool::Prefill, Some(2)).is_empty(),
        "fingerprints must match"
    );
    r.mark_down("http://p1");
    assert!(r.candidates(Pool::Prefill, None).is_empty());
    // Reports during its quarantine do not bring it back...
    r.record_load("http://p1", ready(0));
    assert!(r.candidates(Pool::Prefill, None).is_empty());
    // ...the first one after it does.
    std::thread::sleep(Duration::from_millis(600));
    r.record_load("http://p1", LoadReport::default());
    assert_eq!(r.counts(Pool::Prefill)[2], (Health::Draining, 1));
}

#[test]
fn one_slow_poll_is_not_an_outage() {
    let r = Registry::default();
    r.add_static(Pool::Decode, "http://d");
    r.record_load("http://d", ready(0));
    r.poll_failed("http://d");
    r.poll_failed("http://d");
    assert_eq!(r.candidates(Pool::Decode, None).len(), 1);
    r.record_load("http://d", ready(0));
    (0..POLL_FAILURES_DOWN).for_each(|_| r.poll_failed("http://d"));
    assert!(r.candidates(Pool::Decode, None).is_empty());
}

#[test]
fn a_slow_start_is_not_quarantined() {
    let r = Registry::default();
    r.add_static(Pool::Decode, "http://d");
    // Still loading its model: its polls fail, for as long as it takes.
    for _ in 0..5 {
        (0..POLL_FAILURES_DOWN).for_each(|_| r.poll_failed("http://d"));
    }
    assert!(r.candidates(Pool::Decode, None).is_empty());
    // Its first good report brings it in at once...
    r.record_load("http://d", ready(0));
    assert_eq!(r.candidates(Pool::Decode, None).len(), 1);
    // ...and from then on a failure is an outage, with its backoff.
    r.mark_down("http://d");
    r.record_load("http://d", ready(0));
    assert!(r.candidates(Pool::Decode, None).is_empty());
}

#[test]
fn unknown_heartbeats_ask_for_registration() {
    let r = Registry::default();
    assert!(!r.heartbeat(&Heartbeat {
        url: "http://x".into(),
        load: ready(0),
    }));
}

#[test]
fn silent_registered_workers_expire_and_static_ones_go_down() {
    let r = Registry::default();
    r.register(&reg(Pool::Decode, "http://d1", 1)).unwrap();
    r.add_static(Pool::Decode, "http://d2/");
    r.record_load("http://d2", ready(0));
    r.expire(Duration::ZERO, Duration::ZERO);
    std::thread::sleep(Duration::from_millis(2));
    r.expire(Duration::from_millis(1), Duration::from_millis(1));
    assert_eq!(r.pollable(), vec!["http://d2".to_string()]);
    assert_eq!(r.counts(Pool::Decode)[3], (Health::Down, 1));
}

#[test]
fn polled_workers_have_their_own_silence_limit() {
    let r = Registry::default();
    r.add_static(Pool::Decode, "http://d");
    r.record_load("http://d", ready(0));
    std::thread::sleep(Duration::from_millis(2));
    // Silent past the heartbeat limit, within the polled one: still in.
    r.expire(Duration::from_millis(1), Duration::from_secs(3600));
    assert_eq!(r.candidates(Pool::Decode, None).len(), 1);
    r.expire(Duration::from_secs(3600), Duration::from_millis(1));
    assert!(r.candidates(Pool::Decode, None).is_empty());
}

#[test]
fn dns_sync_adds_and_removes_only_dns_workers() {
    let r = Registry::default();
    r.add_static(Pool::Prefill, "http://s");
    r.sync_dns(Pool::Prefill, &["http://a".into(), "http://b".into()]);
    r.sync_dns(Pool::Prefill, &["http://b".into()]);
    let mut urls = r.pollable();
    urls.sort();
    assert_eq!(urls, vec!["http://b", "http://s"]);
}

#[test]
fn assignments_count_until_a_later_report_or_dropped() {
    let r = Arc::new(Registry::default());
    r.add_static(Pool::Decode, "http://d");
    r.record_load("http://d", ready(0));
    let assigned = |r: &Registry| r.candidates(Pool::Decode, None)[0].assigned_tokens;
    let a = r.assign("http://d", 100);
    let b = r.assign("http://d", 30);
    assert_eq!(assigned(&r), 130);
    a.acknowledged(4);
    let report = |seq| LoadReport {
        report_seq: seq,
        ..ready(0)
    };
    r.record_load("http://d", report(4));
    assert_eq!(
        assigned(&r),
        130,
        "report 4 may predate the acknowledgement"
    );
    r.record_load("http://d", report(5));
    assert_eq!(assigned(&r), 30, "report 5 counts it: not twice");
    drop(a);
    assert_eq!(assigned(&r), 30);
    drop(b);
    assert_eq!(assigned(&r), 0);
}

#[test]
fn the_prefix_digest_is_kept_per_worker_and_dropped_when_no_longer_sent() {
    use pdserve_protocol::prefix::block_hashes;
    let r = Registry::default();
    r.add_static(Pool::Decode, "http://d");
    let prompt: Vec<u32> = (0..40).collect();
    let hashes = block_hashes(&prompt, 16, 3);
    let with = |d: Option<PrefixDigest>| LoadReport {
        prefix_cache: d,
        ..ready(0)
    };
    r.record_load(
        "http://d",
        with(Some(PrefixDigest::new(16, 3, hashes.clone()))),
    );
    let view = r.candidates(Pool::Decode, None).remove(0);
    assert!(
        view.load.prefix_cache.is_none(),
        "the raw digest is not copied around"
    );
    assert_eq!(view.prefix.unwrap().leading_blocks(&hashes), 2);
    let bad = PrefixDigest {
        block_tokens: 16,
        seed: 3,
        blocks: "xyz".into(),
    };
    r.record_load("http://d", with(Some(bad)));
    assert!(r.candidates(Pool::Decode, None)[0].prefix.is_none());
    r.record_load("http://d", with(Some(PrefixDigest::new(16, 3, hashes))));
    r.record_load("http://d", with(None));
    assert!(r.candidates(Pool::Decode, None)[0].prefix.is_none());
}

#[test]
fn a_registration_cannot_take_over_another_workers_url_or_id() {
    let r = Registry::default();
    let with_id = |pool, url: &str, id: &str| WorkerRegistration {
        worker_id: Some(id.into()),
        ..reg(pool, url, 1)
    };
    r.register(&with_id(Pool::Decode, "http://d1:1", "a"))
        .unwrap();
    // The same worker again (a router restart, a lost answer): fine.
    r.register(&with_id(Pool::Decode, "http://d1:1", "a"))
        .unwrap();
    // Its id from another URL, or its URL under another id or pool: no.
    assert!(r
        .register(&with_id(Pool::Decode, "http://evil:1", "a"))
        .is_err());
    assert!(r
        .register(&with_id(Pool::Decode, "http://d1:1", "b"))
        .is_err());
    assert!(r
        .register(&with_id(Pool::Prefill, "http://d1:1", "a"))
        .is_err());
    r.add_static(Pool::Prefill, "http://p1:1");
    assert!(r
        .register(&with_id(Pool::Decode, "http://p1:1", "c"))
        .is_err());
    // A deregistration removes registered workers, never listed ones.
    r.deregister("http://p1:1");
    r.deregister("http://d1:1");
    let urls: Vec<String> = r.list().into_iter().map(|(u, _, _)| u).collect();
    assert_eq!(urls, vec!["http://p1:1".to_string()]);
}

#[test]
fn reported_numbers_are_clamped_and_sums_saturate() {
    let r = Registry::default();
    for url in ["http://a:1", "http://b:1"] {
        r.add_static(Pool::Decode, url);
        let load = LoadReport {
            kv_free_tokens: u64::MAX,
            tokens_per_second: f64::NAN,
            ready: true,
            ..Default::default()
        };
        assert!(r.record_load(url, load));
    }
    let sum = r.pool_load(Pool::Decode);
    assert_eq!(
        sum.kv_free_tokens,
        2 * pdserve_protocol::internal::MAX_REPORTED
    );
    assert_eq!(sum.tokens_per_second, 0.0);
}

#[test]
fn a_worker_is_lost_when_down_or_expired_but_not_when_it_deregisters() {
    let r = Registry::default();
    let hb = |url: &str| Heartbeat {
        url: url.into(),
        load: ready(0),
    };
    for url in ["http://d1", "http://d2", "http://d3"] {
        r.register(&reg(Pool::Decode, url, 1)).unwrap();
        assert!(r.heartbeat(&hb(url)));
        assert!(!r.is_lost(url));
        assert!(r.heard_within(url, Duration::from_secs(5)));
    }
    r.mark_down("http://d1");
    assert!(r.is_lost("http://d1"), "marked down");
    // A worker that deregisters to drain keeps its streams.
    r.deregister("http://d2");
    assert!(!r.is_lost("http://d2"));
    assert!(!r.heard_within("http://d2", Duration::from_secs(5)));
    // One that stops heartbeating is removed, and lost...
    std::thread::sleep(Duration::from_millis(5));
    r.expire(Duration::from_millis(1), Duration::from_millis(1));
    assert!(r.is_lost("http://d3"));
    assert!(!r.heard_within("http://d3", Duration::from_secs(5)));
    // ...until it registers again.
    r.register(&reg(Pool::Decode, "http://d3", 1)).unwrap();
    assert!(!r.is_lost("http://d3"));
}
