//! `GET /`: a page to chat with the model and watch the server work, for a person with a
//! browser and nothing else installed.
//!
//! The page is one self-contained HTML file ([`PAGE`], `page.html`) compiled into the binary:
//! no build step, no CDN, nothing fetched but the server's own endpoints. It streams replies
//! from `/v1/chat/completions`, names the model from `/v1/models`, and reads the Prometheus
//! text at `/metrics` every second (parsed in the page: the numbers it shows are the ones a
//! scraper sees, with no second format to keep in step).
//!
//! `/` is open even when the server has API keys: the page holds nothing secret, and it asks
//! for the key (kept in the tab's `sessionStorage`) and sends it as `Authorization: Bearer`,
//! as any other client does. `/metrics` is open anyway, so the live panel works without a key.

use axum::http::header;
use axum::response::IntoResponse;

/// The page, as served.
pub const PAGE: &str = include_str!("page.html");

/// What the page may do, enforced by the browser: run its own inline script and style, talk to
/// this server only, and not be framed (so no other site can overlay it to steal clicks or
/// the key typed into it).
const CSP: &str = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
                   connect-src 'self'; img-src 'self' data:; base-uri 'none'; \
                   form-action 'none'; frame-ancestors 'none'";

pub async fn page() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            // The page changes with the binary; a browser must not keep an old one.
            (header::CACHE_CONTROL, "no-cache"),
            (header::CONTENT_SECURITY_POLICY, CSP),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::REFERRER_POLICY, "no-referrer"),
        ],
        PAGE,
    )
}
