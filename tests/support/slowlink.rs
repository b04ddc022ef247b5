//! A TCP relay in front of the upstream whose latency a test can change
//! while requests flow: "the upstream got slow" without touching the
//! upstream or the requests.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// The relay; stops accepting when dropped.
pub struct SlowLink {
    pub addr: SocketAddr,
    delay_ms: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

impl SlowLink {
    pub async fn start(target: SocketAddr) -> SlowLink {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let delay_ms = Arc::new(AtomicU64::new(0));
        let delay = delay_ms.clone();
        let task = tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let delay = delay.clone();
                tokio::spawn(async move {
                    if let Ok(outbound) = TcpStream::connect(target).await {
                        relay(inbound, outbound, delay).await;
                    }
                });
            }
        });
        SlowLink {
            addr,
            delay_ms,
            task,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every chunk of every response is held back this long from now on.
    pub fn set_delay(&self, d: Duration) {
        self.delay_ms.store(d.as_millis() as u64, Ordering::Relaxed);
    }
}

impl Drop for SlowLink {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn relay(inbound: TcpStream, outbound: TcpStream, delay: Arc<AtomicU64>) {
    let _ = inbound.set_nodelay(true);
    let _ = outbound.set_nodelay(true);
    let (mut in_r, mut in_w) = inbound.into_split();
    let (mut out_r, mut out_w) = outbound.into_split();
    let requests = async {
        let _ = tokio::io::copy(&mut in_r, &mut out_w).await;
        let _ = out_w.shutdown().await;
    };
    let responses = async {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match out_r.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let d = delay.load(Ordering::Relaxed);
            if d > 0 {
                tokio::time::sleep(Duration::from_millis(d)).await;
            }
            if in_w.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = in_w.shutdown().await;
    };
    // Either side closing ends the pair (a killed proxy resets its side).
    tokio::select! {
        () = requests => {}
        () = responses => {}
    }
}
