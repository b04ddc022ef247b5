// Create one order, retrying safely: one Idempotency-Key per intent.
//
//     node examples/node/create_order.mjs [BASE_URL]     # default http://localhost:8080
//
// The key is minted once, before the first attempt, and sent on every
// retry, so however many attempts reach the server, a service behind
// idemproxy executes the order once. Retried: timeouts and connection
// errors, 409 (the original is still running), 429, 502, 503 and 504, after
// Retry-After when the answer has one, else after an exponential backoff
// with jitter. Not retried: any other answer, and a replay
// (Idempotent-Replayed: true), which is the original's answer. Node 18+
// built-ins only (fetch, crypto).
//
// Environment: EXAMPLE_TIMEOUT_MS (per attempt, default 2000),
// EXAMPLE_ATTEMPTS (default 6). Prints the outcome as one JSON line on
// stdout and each attempt on stderr; exits 0 on a 2xx answer.

import { randomBytes } from "node:crypto";
import { setTimeout as sleep } from "node:timers/promises";

const RETRY_STATUSES = new Set([409, 429, 502, 503, 504]);

function backoffMs(attempt, retryAfter) {
  if (retryAfter !== null && /^\d+$/.test(retryAfter.trim())) {
    return Math.min(Number(retryAfter), 10) * 1000;
  }
  return Math.min(250 * 2 ** (attempt - 1), 4000) * (0.5 + Math.random() / 2);
}

async function main() {
  const base = (process.argv[2] ?? "http://localhost:8080").replace(/\/+$/, "");
  const timeoutMs = Number(process.env.EXAMPLE_TIMEOUT_MS ?? "2000");
  const attempts = Number(process.env.EXAMPLE_ATTEMPTS ?? "6");
  const key = "order-" + randomBytes(16).toString("hex"); // one key per intent, minted once
  const body = JSON.stringify({ amount: 100, currency: "usd" });

  for (let attempt = 1; attempt <= attempts; attempt++) {
    let retryAfter = null;
    try {
      const response = await fetch(`${base}/v1/orders`, {
        method: "POST",
        headers: { "Content-Type": "application/json", "Idempotency-Key": key },
        body,
        signal: AbortSignal.timeout(timeoutMs),
      });
      const text = await response.text();
      const replayed = response.headers.get("Idempotent-Replayed") === "true";
      console.error(`attempt ${attempt}: ${response.status}${replayed ? " (replay)" : ""}`);
      if (!RETRY_STATUSES.has(response.status) || replayed || attempt === attempts) {
        let parsed;
        try {
          parsed = JSON.parse(text);
        } catch {
          parsed = text;
        }
        console.log(JSON.stringify({ key, attempts: attempt, status: response.status, replayed, body: parsed }));
        return response.ok ? 0 : 1;
      }
      retryAfter = response.headers.get("Retry-After");
    } catch (error) {
      // AbortSignal.timeout: TimeoutError; refused or reset: TypeError.
      console.error(`attempt ${attempt}: ${error.name}: ${error.cause?.code ?? error.message}`);
    }
    if (attempt < attempts) await sleep(backoffMs(attempt, retryAfter));
  }
  console.log(JSON.stringify({ key, attempts, status: null, replayed: false, body: null }));
  return 1;
}

process.exitCode = await main();
