//! At the open-files limit, a failed connect is this process's problem, not
//! the worker's: the router recognises it (and answers 503 without marking
//! the worker down). Its own test binary: it lowers the process's limit.

use pdserve_runtime::net::is_fd_exhaustion;

#[tokio::test(flavor = "current_thread")]
async fn a_connect_at_the_fd_limit_is_told_apart_from_a_dead_peer() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/load", listener.local_addr().unwrap());
    let client = reqwest::Client::new();
    // A dead peer first: not fd exhaustion.
    let dead = client
        .get("http://127.0.0.1:9/load")
        .send()
        .await
        .unwrap_err();
    assert!(!is_fd_exhaustion(&dead), "{dead:?}");
    // Fill every descriptor under a lowered soft limit, then connect.
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain calls on a struct we own.
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
    let low = libc::rlimit {
        rlim_cur: 256.min(lim.rlim_max),
        rlim_max: lim.rlim_max,
    };
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &low) }, 0);
    let mut hold = Vec::new();
    while let Ok(f) = std::fs::File::open("/dev/null") {
        hold.push(f);
    }
    let err = client.get(&url).send().await.unwrap_err();
    drop(hold);
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) };
    assert!(is_fd_exhaustion(&err), "{err:?}");
}
