//! The process's one listening connection on the key channel.
//!
//! Owners that complete or release a key on a waiting route, and operators
//! that release one, send `NOTIFY` on [`CHANNEL`] with
//! the key's id. Each process keeps one direct connection (`listen_url`: a
//! pooler in transaction mode would silently drop notifications) that
//! LISTENs and hands every id to `on_change`; after each (re)connection it
//! calls `on_reconnect`, since changes may have been missed meanwhile.
//!
//! A frozen server keeps an idle connection open without a word, so a
//! listener would never learn that it hears nothing any more (after a
//! failover, say). The connection is therefore pinged every few seconds,
//! bounded by `store.timeout`; a ping that fails or times out reconnects.

use std::time::Duration;

use tokio_postgres::AsyncMessage;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::{describe_db_error, sql::CHANNEL, Store};
use crate::backoff::Backoff;

/// How often the listening connection proves it is alive.
const PING_EVERY: Duration = Duration::from_secs(3);

/// Listens until `stop` is cancelled, reconnecting with backoff.
pub async fn listen(
    store: Store,
    on_change: impl Fn(&str) + Send,
    on_reconnect: impl Fn() + Send,
    stop: CancellationToken,
) {
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
    loop {
        match store.connect_dedicated().await {
            Ok((client, mut connection)) => {
                let pump = async {
                    loop {
                        match std::future::poll_fn(|cx| connection.poll_message(cx)).await {
                            Some(Ok(AsyncMessage::Notification(n))) => on_change(n.payload()),
                            Some(Ok(_)) => {}
                            Some(Err(e)) => return describe_db_error(&e),
                            None => return "connection closed".to_string(),
                        }
                    }
                };
                let subscribed = async {
                    if let Err(e) = client.batch_execute(&format!("LISTEN {CHANNEL}")).await {
                        return format!("LISTEN failed: {}", describe_db_error(&e));
                    }
                    info!("listening for key changes");
                    on_reconnect();
                    backoff.reset();
                    loop {
                        tokio::time::sleep(PING_EVERY).await;
                        match tokio::time::timeout(store.timeout(), client.simple_query("")).await {
                            Ok(Ok(_)) => {}
                            Ok(Err(e)) => return format!("ping failed: {}", describe_db_error(&e)),
                            Err(_) => {
                                return format!("no answer to a ping within {:?}", store.timeout())
                            }
                        }
                    }
                };
                tokio::select! {
                    reason = pump => warn!(%reason, "key listener lost its connection; reconnecting"),
                    reason = subscribed => warn!(%reason, "key listener gives up its connection; reconnecting"),
                    () = stop.cancelled() => return,
                }
                // Changes may be missed until the next LISTEN.
                on_reconnect();
            }
            Err(e) => warn!(error = %e, retry_in = ?backoff.peek(), "key listener cannot connect"),
        }
        tokio::select! {
            () = backoff.wait() => {}
            () = stop.cancelled() => return,
        }
    }
}
