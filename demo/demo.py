"""The idemproxy demo: one charge, retried by real clients, against a slow
legacy service, directly and through idemproxy.

Run it with `scripts/dev demo` (which finds or starts PostgreSQL, builds
the binaries and installs the pinned clients of demo/requirements.txt in a
private virtual environment); this file is what that command runs:

    python demo/demo.py --bin-dir target/debug --database-url postgres://... [--short]

The legacy service is the repository's sample upstream started with
`--delay-ms` (every charge takes that long) and `--charges` (it answers a
Stripe-shaped Charge). It executes every request it receives and counts
executions per Idempotency-Key. Each client creates one charge with a
client timeout shorter than the service's delay and retries the way its
library does, with one Idempotency-Key per intent:

* the Stripe Python SDK (max_network_retries; it mints the key itself and
  retries timeouts, 409 and 5xx),
* urllib3's Retry with POST allowed, 409 and 5xx retried, Retry-After
  honoured, and a key minted before the first attempt,
* curl --retry with --retry-all-errors and a key minted before the first
  attempt.

Each client runs directly against the service, through idemproxy (a retry
that lands while the original still runs gets 409 + Retry-After), and
through idemproxy on a route with `wait` (the retry waits for the original
and gets its replay). One more row kills idemproxy mid-call and starts it
again: the retry takes the claim over once the lease has run out and is
forwarded with `Idempotency-Attempt: 2`.

The table goes to standard output, progress to standard error. The exit
status is 1 when a count is not what idemproxy promises: directly, more
than one execution per charge; through idemproxy, exactly one; after the
kill, exactly two, the second one marked attempt 2. Times are reported,
never asserted.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import stripe
import urllib3
from urllib3.util.retry import Retry


@dataclass(frozen=True)
class Params:
    """The knobs of one run."""

    delay_ms: int
    timeout_s: float
    retries: int
    lease: str


FULL = Params(delay_ms=2500, timeout_s=1.0, retries=8, lease="3s")
# CI: the same story in about a third of the time. The counts it asserts
# do not depend on the times.
SHORT = Params(delay_ms=1500, timeout_s=0.5, retries=6, lease="2s")

AMOUNT = 2000


def log(msg: str) -> None:
    print(f"demo: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# Processes: the legacy service and idemproxy.


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_for(what: str, check, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    last = None
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except OSError as e:
            last = e
        time.sleep(0.05)
    raise SystemExit(f"demo: error: {what} did not happen within {within:.0f} s ({last})")


class Service:
    """The slow, counting legacy service (sample-upstream --delay-ms --charges)."""

    def __init__(self, bin_dir: Path, delay_ms: int, logs: Path):
        self.log = open(logs / "legacy-service.log", "wb")
        self.proc = subprocess.Popen(
            [
                str(bin_dir / "sample-upstream"),
                "--listen",
                "127.0.0.1:0",
                "--delay-ms",
                str(delay_ms),
                "--charges",
            ],
            stdout=subprocess.PIPE,
            stderr=self.log,
            env={**os.environ, "RUST_LOG": "warn"},
        )
        line = self.proc.stdout.readline().decode().strip()
        if not line.startswith("listening on http://"):
            raise SystemExit(f"demo: error: the legacy service said {line!r}")
        self.url = line.removeprefix("listening on ")

    def executions(self, key: str) -> int:
        status, body = http_get(f"{self.url}/__sample/executions?key={urllib.parse.quote(key)}")
        assert status == 200, body
        return json.loads(body)["executions"]

    def stats(self) -> dict:
        status, body = http_get(f"{self.url}/__sample/stats")
        assert status == 200, body
        return json.loads(body)

    def stop(self) -> None:
        stop_process(self.proc)
        self.log.close()


class Proxy:
    """`idemproxy serve` on fixed ports, restartable."""

    def __init__(self, name: str, bin_dir: Path, service_url: str, database_url: str,
                 params: Params, logs: Path, wait_route: bool):
        self.name = name
        self.bin = bin_dir / "idemproxy"
        self.port = free_port()
        self.admin_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.database_url = database_url
        self.log_path = logs / f"{name}.log"
        self.config = logs / f"{name}.toml"
        routes = ""
        if wait_route:
            routes += '[[route]]\npath_prefix = "/wait/"\nwait = "10s"\n\n'
        routes += '[[route]]\npath_prefix = "/"\n'
        self.config.write_text(
            f"""# Written by demo/demo.py.
[server]
listen = "127.0.0.1:{self.port}"
admin_listen = "127.0.0.1:{self.admin_port}"
shutdown_grace = "5s"

[upstream]
url = "{service_url}"
timeout = "30s"

[store]
# IDEMPROXY_DATABASE_URL
database_url = "postgres://unused@127.0.0.1:1/unused"

[defaults]
lease = "{params.lease}"

{routes}"""
        )
        self.proc = None
        self.start()

    def start(self) -> None:
        log_file = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [str(self.bin), "serve", "--config", str(self.config)],
            stdout=log_file,
            stderr=log_file,
            env={**os.environ, "IDEMPROXY_DATABASE_URL": self.database_url, "RUST_LOG": "warn"},
        )
        log_file.close()

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise SystemExit(
                    f"demo: error: {self.name} exited at start; its log:\n"
                    + self.log_path.read_text()[-3000:]
                )
            return http_get(f"http://127.0.0.1:{self.admin_port}/readyz/store")[0] == 200

        wait_for(f"{self.name} ready (/readyz/store)", ready)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        stop_process(self.proc)


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------------------
# The clients. Each creates one charge and returns what it saw.


@dataclass
class Outcome:
    requests: int
    got: str
    key: str
    ok: bool
    attempt: str = ""
    seconds: float = 0.0


class CountingRequestsClient(stripe.RequestsClient):
    """The SDK's own requests-based HTTP client, counting what it sends."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.sent = 0
        self.keys: set[str] = set()

    def request(self, method, url, headers, post_data=None):
        self.sent += 1
        if headers and headers.get("Idempotency-Key"):
            self.keys.add(headers["Idempotency-Key"])
        return super().request(method, url, headers, post_data)


def stripe_client(base: str, p: Params) -> Outcome:
    http = CountingRequestsClient(timeout=p.timeout_s)
    client = stripe.StripeClient(
        "sk_test_demo",
        base_addresses={"api": base},
        max_network_retries=p.retries,
        http_client=http,
    )
    try:
        charge = client.v1.charges.create(
            params={"amount": AMOUNT, "currency": "usd", "source": "tok_visa"}
        )
        got, ok, attempt = f"charge {charge.id}", True, str(charge.to_dict().get("attempt", ""))
    except stripe.StripeError as e:
        got, ok, attempt = f"{type(e).__name__}", False, ""
    # The SDK mints one key per create() and sends it on every retry.
    assert len(http.keys) == 1, f"the SDK sent {len(http.keys)} keys"
    return Outcome(http.sent, got, next(iter(http.keys)), ok, attempt)


class CountingRetry(Retry):
    """urllib3's Retry, counting the attempts that failed, and honouring
    Retry-After on 409 too (idemproxy's answer to a retry that lands while
    the original still runs)."""

    RETRY_AFTER_STATUS_CODES = frozenset({409, 413, 429, 503})
    failed: list[int]  # shared by the copies Retry makes of itself

    def new(self, **kw):
        retry = super().new(**kw)
        retry.failed = self.failed
        return retry

    def increment(self, *args, **kwargs):
        self.failed[0] += 1
        return super().increment(*args, **kwargs)


def urllib3_retry(p: Params, failed: list[int]) -> CountingRetry:
    retry = CountingRetry(
        total=p.retries,
        allowed_methods=frozenset({"POST"}),
        status_forcelist=frozenset({409, 500, 502, 503, 504}),
        backoff_factor=0.5,
        backoff_max=5,
        respect_retry_after_header=True,
    )
    retry.failed = failed
    return retry


def urllib3_client(base: str, p: Params, key: str | None = None) -> Outcome:
    key = key or f"charge-{uuid.uuid4()}"  # one key per intent, before the first attempt
    failed = [0]
    pool = urllib3.PoolManager()
    try:
        r = pool.request(
            "POST",
            f"{base}/v1/charges",
            body=f"amount={AMOUNT}&currency=usd&source=tok_visa",
            headers={
                "Content-Type": "application/x-www-form-urlencoded",
                "Idempotency-Key": key,
            },
            retries=urllib3_retry(p, failed),
            timeout=urllib3.Timeout(connect=p.timeout_s, read=p.timeout_s),
        )
        if 200 <= r.status < 300:
            body = json.loads(r.data)
            return Outcome(failed[0] + 1, f"charge {body['id']}", key, True, str(body.get("attempt", "")))
        return Outcome(failed[0] + 1, f"HTTP {r.status}", key, False)
    except urllib3.exceptions.MaxRetryError as e:
        reason = type(e.reason).__name__ if e.reason else "MaxRetryError"
        return Outcome(failed[0], reason, key, False)
    finally:
        pool.clear()


def curl_client(base: str, p: Params) -> Outcome:
    key = f"charge-{uuid.uuid4()}"  # one key per intent, before the first attempt
    cmd = [
        "curl", "--no-progress-meter", "--fail", "--retry", str(p.retries),
        "--retry-all-errors", "--retry-delay", "1", "--max-time", str(p.timeout_s),
        "-H", f"Idempotency-Key: {key}",
        "-d", f"amount={AMOUNT}&currency=usd&source=tok_visa",
        f"{base}/v1/charges",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    retries = len(re.findall(r"Will retry in", r.stderr))
    if r.returncode == 0:
        body = json.loads(r.stdout)
        return Outcome(retries + 1, f"charge {body['id']}", key, True, str(body.get("attempt", "")))
    return Outcome(retries + 1, f"curl exit {r.returncode}", key, False)


def timed(fn, *args) -> Outcome:
    started = time.monotonic()
    outcome = fn(*args)
    outcome.seconds = time.monotonic() - started
    return outcome


# ---------------------------------------------------------------------------
# The rows.


@dataclass
class Row:
    client: str
    path: str
    expect: str  # "many", "once", "takeover"
    outcome: Outcome | None = None
    executions: int = 0
    problems: list[str] = field(default_factory=list)


def takeover_run(service: Service, proxy: Proxy, p: Params) -> Outcome:
    """urllib3 through a proxy that is killed while the service runs the
    charge, and started again at once."""
    key = f"charge-{uuid.uuid4()}"
    result: list[Outcome] = []
    started = time.monotonic()
    t = threading.Thread(target=lambda: result.append(urllib3_client(proxy.url, p, key)))
    t.start()
    wait_for("the first execution at the service", lambda: service.executions(key) >= 1, 30)
    log(f"killing {proxy.name} (SIGKILL) mid-call, and starting it again")
    proxy.kill()
    proxy.start()
    t.join(timeout=120)
    if t.is_alive():
        raise SystemExit("demo: error: the takeover client did not finish within 120 s")
    outcome = result[0]
    outcome.seconds = time.monotonic() - started
    return outcome


def check(row: Row) -> None:
    o, n = row.outcome, row.executions
    if row.expect == "many":
        if n <= 1:
            row.problems.append(f"directly, the service executed {n} time(s); the demo needs > 1")
    elif row.expect == "once":
        if n != 1:
            row.problems.append(f"through idemproxy the service executed {n} times, not once")
        if not o.ok:
            row.problems.append(f"through idemproxy the client got {o.got}, not its charge")
    elif row.expect == "takeover":
        if n != 2 or o.attempt != "2":
            row.problems.append(
                f"after the kill: {n} executions, answer from attempt {o.attempt or '?'}; "
                "expected 2, the second marked Idempotency-Attempt: 2"
            )
        if not o.ok:
            row.problems.append(f"after the kill the client got {o.got}, not its charge")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin-dir", type=Path, required=True)
    ap.add_argument("--database-url", required=True)
    ap.add_argument("--short", action="store_true", help="CI's shorter run (same counts)")
    ap.add_argument("--log-dir", type=Path, help="where the processes' logs go (default: a temporary directory)")
    args = ap.parse_args()
    p = SHORT if args.short else FULL
    logs = args.log_dir or Path(tempfile.mkdtemp(prefix="idemproxy-demo-"))
    logs.mkdir(parents=True, exist_ok=True)
    curl_version = subprocess.run(["curl", "--version"], capture_output=True, text=True).stdout.split()[1]

    service = Service(args.bin_dir, p.delay_ms, logs)
    proxy = Proxy("idemproxy", args.bin_dir, service.url, args.database_url, p, logs, wait_route=True)
    doomed = Proxy("idemproxy-killed", args.bin_dir, service.url, args.database_url, p, logs, wait_route=False)
    log(f"legacy service {service.url} (every charge takes {p.delay_ms} ms), "
        f"idemproxy {proxy.url} and {doomed.url}; logs in {logs}")
    try:
        clients = [
            (f"Stripe Python SDK {stripe.VERSION}", stripe_client),
            (f"urllib3 {urllib3.__version__} Retry", urllib3_client),
            (f"curl {curl_version} --retry", curl_client),
        ]
        paths = [
            ("direct", service.url, "many"),
            ("idemproxy", proxy.url, "once"),
            ("idemproxy, wait", proxy.url + "/wait", "once"),
        ]
        rows = []
        jobs = []
        # Every row is its own charge with its own key: they run side by side.
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(clients) * len(paths)) as pool:
            for name, fn in clients:
                for path, base, expect in paths:
                    row = Row(name, path, expect)
                    rows.append(row)
                    jobs.append((row, pool.submit(timed, fn, base, p)))
            log(f"{len(jobs)} clients creating one charge each")
            for row, job in jobs:
                row.outcome = job.result()
        takeover = Row(f"urllib3 {urllib3.__version__} Retry", "idemproxy, killed mid-call", "takeover")
        takeover.outcome = takeover_run(service, doomed, p)
        rows.append(takeover)

        # Let the service finish what it started (a client that gave up does
        # not stop the charge it asked for), then count.
        time.sleep(p.delay_ms / 1000 + 0.5)
        for row in rows:
            row.executions = service.executions(row.outcome.key)
            check(row)
    finally:
        proxy.stop()
        doomed.stop()
        service.stop()

    print_table(rows, p)
    problems = [f"{r.client}, {r.path}: {x}" for r in rows for x in r.problems]
    for x in problems:
        print(f"demo: FAILED: {x}", file=sys.stderr)
    return 1 if problems else 0


def print_table(rows: list[Row], p: Params) -> None:
    print(
        f"One charge per row. The legacy service takes {p.delay_ms / 1000:g} s per charge and "
        f"executes every request it gets;\neach client times out after {p.timeout_s:g} s and "
        f"retries up to {p.retries} times with one Idempotency-Key.\n"
        "idemproxy: a retry that lands while the original runs gets 409 + Retry-After; "
        "wait: it waits for\nthe original's answer instead; killed mid-call: SIGKILL and "
        "restart while the service runs the charge.\n"
    )
    header = ("client", "path", "retries sent", "executions", "client got", "time")
    table = [header]
    for r in rows:
        o = r.outcome
        execs = str(r.executions)
        if r.expect == "takeover":
            execs += " (attempt 2)"
        got = o.got if o.ok else f"error: {o.got}"
        table.append((r.client, r.path, str(o.requests - 1), execs, got, f"{o.seconds:.1f} s"))
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for i, row in enumerate(table):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


if __name__ == "__main__":
    sys.exit(main())
