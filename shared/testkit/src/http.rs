//! Talking to a server under test over loopback.

use std::time::{Duration, Instant};

use pdserve_protocol::internal::LoadReport;
use serde_json::Value;

/// A listener on a free port of 127.0.0.1, and its base URL.
pub async fn bind() -> (tokio::net::TcpListener, String) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    (listener, url)
}

/// Serves `app` on `listener` in the background.
pub fn serve_on(listener: tokio::net::TcpListener, app: axum::Router) {
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
}

/// Serves `app` on a free port of 127.0.0.1; returns its base URL.
pub async fn serve(app: axum::Router) -> String {
    let (listener, url) = bind().await;
    serve_on(listener, app);
    url
}

/// Waits (at most 10 s) until `url`'s `/ready` answers 200.
pub async fn wait_ready(url: &str) {
    wait_until(Duration::from_secs(10), || async {
        let r = reqwest::get(format!("{url}/ready")).await;
        r.is_ok_and(|r| r.status() == 200)
    })
    .await;
}

/// POSTs `body` as JSON to `url` + `path`.
pub async fn post(url: &str, path: &str, body: &impl serde::Serialize) -> reqwest::Response {
    reqwest::Client::new()
        .post(format!("{url}{path}"))
        .json(body)
        .send()
        .await
        .unwrap()
}

/// POSTs and returns (status, JSON body).
pub async fn post_json(url: &str, path: &str, body: &impl serde::Serialize) -> (u16, Value) {
    let r = post(url, path, body).await;
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

/// `GET url + path`, which must answer.
pub async fn get(url: &str, path: &str) -> reqwest::Response {
    reqwest::get(format!("{url}{path}")).await.unwrap()
}

/// A worker's `GET /load`.
pub async fn load(url: &str) -> LoadReport {
    get(url, "/load").await.json().await.unwrap()
}

/// A server's `GET /metrics` page.
pub async fn metrics(url: &str) -> String {
    get(url, "/metrics").await.text().await.unwrap()
}

/// The value of `series` (name and labels, exactly as rendered) in a
/// metrics page; 0 when the labelled series has not been touched yet. The
/// metric itself must be on the page: a misspelt name fails the test.
pub fn metric(page: &str, series: &str) -> f64 {
    let name = series.split('{').next().unwrap_or(series);
    let family = ["_bucket", "_sum", "_count"]
        .iter()
        .find_map(|s| name.strip_suffix(s))
        .unwrap_or(name);
    assert!(
        page.contains(&format!("# TYPE {name} ")) || page.contains(&format!("# TYPE {family} ")),
        "no metric {name} on the page:\n{page}"
    );
    let prefix = format!("{series} ");
    page.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map_or(0.0, |v| v.parse().unwrap())
}

/// [`metric`] of a server's `/metrics`.
pub async fn fetch_metric(url: &str, series: &str) -> f64 {
    metric(&metrics(url).await, series)
}

/// Polls `f` until it is true; panics after `within`.
pub async fn wait_until<F, Fut>(within: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let until = Instant::now() + within;
    while !f().await {
        assert!(
            Instant::now() < until,
            "condition not met within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Calls `check` until it returns true, at most for `within`; says whether it did.
pub async fn eventually<F, Fut>(within: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let until = tokio::time::Instant::now() + within;
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    while tokio::time::Instant::now() < until {
        if check().await {
            return true;
        }
        tick.tick().await;
    }
    false
}
