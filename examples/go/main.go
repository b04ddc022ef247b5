// Create one order, retrying safely: one Idempotency-Key per intent.
//
//	go run examples/go/main.go [BASE_URL]     # default http://localhost:8080
//
// The key is minted once, before the first attempt, and sent on every
// retry, so however many attempts reach the server, a service behind
// idemproxy executes the order once. Retried: timeouts and connection
// errors, 409 (the original is still running), 429, 502, 503 and 504, after
// Retry-After when the answer has one, else after an exponential backoff
// with jitter. Not retried: any other answer, and a replay
// (Idempotent-Replayed: true), which is the original's answer. Standard
// library only (net/http, crypto/rand).
//
// Environment: EXAMPLE_TIMEOUT_MS (per attempt, default 2000),
// EXAMPLE_ATTEMPTS (default 6). Prints the outcome as one JSON line on
// stdout and each attempt on stderr; exits 0 on a 2xx answer.
package main

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"math"
	mathrand "math/rand"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"
)

var retryStatuses = map[int]bool{409: true, 429: true, 502: true, 503: true, 504: true}

type outcome struct {
	Key      string          `json:"key"`
	Attempts int             `json:"attempts"`
	Status   *int            `json:"status"`
	Replayed bool            `json:"replayed"`
	Body     json.RawMessage `json:"body"`
}

func backoff(attempt int, retryAfter string) time.Duration {
	if secs, err := strconv.Atoi(strings.TrimSpace(retryAfter)); err == nil && secs >= 0 {
		return time.Duration(math.Min(float64(secs), 10)) * time.Second
	}
	ms := math.Min(250*math.Pow(2, float64(attempt-1)), 4000) * (0.5 + mathrand.Float64()/2)
	return time.Duration(ms) * time.Millisecond
}

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil {
		return v
	}
	return def
}

func main() {
	os.Exit(run())
}

func run() int {
	base := "http://localhost:8080"
	if len(os.Args) > 1 {
		base = os.Args[1]
	}
	base = strings.TrimRight(base, "/")
	client := &http.Client{Timeout: time.Duration(envInt("EXAMPLE_TIMEOUT_MS", 2000)) * time.Millisecond}
	attempts := envInt("EXAMPLE_ATTEMPTS", 6)

	raw := make([]byte, 16)
	if _, err := rand.Read(raw); err != nil {
		fmt.Fprintln(os.Stderr, "no randomness:", err)
		return 1
	}
	key := "order-" + hex.EncodeToString(raw) // one key per intent, minted once
	body := []byte(`{"amount": 100, "currency": "usd"}`)

	for attempt := 1; attempt <= attempts; attempt++ {
		retryAfter := ""
		req, err := http.NewRequest(http.MethodPost, base+"/v1/orders", bytes.NewReader(body))
		if err != nil {
			fmt.Fprintln(os.Stderr, "bad URL:", err)
			return 1
		}
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", key)
		resp, err := client.Do(req)
		if err != nil { // timeout, refused, reset
			fmt.Fprintf(os.Stderr, "attempt %d: %v\n", attempt, err)
		} else {
			text, readErr := io.ReadAll(resp.Body)
			resp.Body.Close()
			replayed := resp.Header.Get("Idempotent-Replayed") == "true"
			suffix := ""
			if replayed {
				suffix = " (replay)"
			}
			fmt.Fprintf(os.Stderr, "attempt %d: %d%s\n", attempt, resp.StatusCode, suffix)
			if readErr == nil && (!retryStatuses[resp.StatusCode] || replayed || attempt == attempts) {
				if !json.Valid(text) {
					text, _ = json.Marshal(string(text))
				}
				status := resp.StatusCode
				out, _ := json.Marshal(outcome{key, attempt, &status, replayed, text})
				fmt.Println(string(out))
				if status >= 200 && status < 300 {
					return 0
				}
				return 1
			}
			retryAfter = resp.Header.Get("Retry-After")
		}
		if attempt < attempts {
			time.Sleep(backoff(attempt, retryAfter))
		}
	}
	out, _ := json.Marshal(outcome{key, attempts, nil, false, json.RawMessage("null")})
	fmt.Println(string(out))
	return 1
}
