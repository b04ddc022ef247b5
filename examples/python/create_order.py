#!/usr/bin/env python3
"""Create one order, retrying safely: one Idempotency-Key per intent.

    python3 examples/python/create_order.py [BASE_URL]     # default http://localhost:8080

The key is minted once, before the first attempt, and sent on every retry,
so however many attempts reach the server, a service behind idemproxy
executes the order once. Retried: timeouts and connection errors, 409
(the original is still running), 429, 502, 503 and 504, after Retry-After
when the answer has one, else after an exponential backoff with jitter.
Not retried: any other answer, and a replay (Idempotent-Replayed: true),
which is the original's answer. Standard library only.

Environment: EXAMPLE_TIMEOUT_MS (per attempt, default 2000),
EXAMPLE_ATTEMPTS (default 6). Prints the outcome as one JSON line on
stdout and each attempt on stderr; exits 0 on a 2xx answer.
"""

import json
import os
import random
import secrets
import sys
import time
import urllib.error
import urllib.request

RETRY_STATUSES = {409, 429, 502, 503, 504}


def backoff(attempt, retry_after):
    """Seconds to wait before attempt + 1."""
    if retry_after is not None and retry_after.strip().isdigit():
        return min(int(retry_after), 10)
    return min(0.25 * 2 ** (attempt - 1), 4.0) * random.uniform(0.5, 1.0)


def main():
    base = (sys.argv[1] if len(sys.argv) > 1 else "http://localhost:8080").rstrip("/")
    timeout = int(os.environ.get("EXAMPLE_TIMEOUT_MS", "2000")) / 1000
    attempts = int(os.environ.get("EXAMPLE_ATTEMPTS", "6"))
    key = "order-" + secrets.token_hex(16)  # one key per intent, minted once
    body = json.dumps({"amount": 100, "currency": "usd"}).encode()

    for attempt in range(1, attempts + 1):
        request = urllib.request.Request(
            f"{base}/v1/orders",
            data=body,
            method="POST",
            headers={"Content-Type": "application/json", "Idempotency-Key": key},
        )
        retry_after = None
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                status, headers, text = response.status, response.headers, response.read()
        except urllib.error.HTTPError as error:
            status, headers, text = error.code, error.headers, error.read()
        except OSError as error:  # timeout, refused, reset
            print(f"attempt {attempt}: {type(error).__name__}: {error}", file=sys.stderr)
            status = None
        if status is not None:
            replayed = headers.get("Idempotent-Replayed") == "true"
            print(f"attempt {attempt}: {status}{' (replay)' if replayed else ''}", file=sys.stderr)
            if status not in RETRY_STATUSES or replayed or attempt == attempts:
                try:
                    parsed = json.loads(text)
                except ValueError:
                    parsed = text.decode(errors="replace")
                print(json.dumps({"key": key, "attempts": attempt, "status": status,
                                  "replayed": replayed, "body": parsed}))
                return 0 if 200 <= status < 300 else 1
            retry_after = headers.get("Retry-After")
        if attempt < attempts:
            time.sleep(backoff(attempt, retry_after))

    print(json.dumps({"key": key, "attempts": attempts, "status": None, "replayed": False, "body": None}))
    return 1


if __name__ == "__main__":
    sys.exit(main())
