// Package idemq is the Go client of idemq, a durable background-job queue
// whose promise is that each piece of work is accepted once.
//
// It speaks the HTTP API v1 of `idemq serve` (see docs/http-api.md in the
// idemq repository) with the standard library only: enqueue (single, batch,
// explain), job queries, operator actions, binding lookups, schedules, and a
// Worker for the worker protocol.
//
// # Retries
//
// A call is repeated only when repeating it is safe, and only after a
// connection error, a timeout or a 503 (with jittered exponential backoff
// that honours Retry-After). An enqueue (single or batch) is retried only
// when every item carries an idempotency key or an explicit job id: the
// worst case of a repeat is then "replayed". Worker calls are fenced by the
// lease token and always retried. Reads, explain and the idempotent operator
// actions are retried; a redrive only with an idempotency key. 400, 401, 403,
// 404, 409, 413 and 422 are never retried.
package idemq

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Version is the client's version, sent in the User-Agent header.
const Version = "0.1.0"

// Client talks to one idemq server. It is safe for concurrent use.
type Client struct {
	base    *url.URL
	token   string
	http    *http.Client
	retry   RetryPolicy
	timeout time.Duration
	agent   string

	mu  sync.Mutex
	rnd *rand.Rand
}

// RetryPolicy says how often and how patiently a safe call is repeated after
// a connection error, a timeout or a 503.
type RetryPolicy struct {
	// MaxAttempts counts the first try: 1 disables retries (default 4).
	MaxAttempts int
	// InitialBackoff is the first pause (default 100ms); each later pause
	// doubles, up to MaxBackoff (default 5s). Every pause is fully jittered,
	// and never shorter than the server's Retry-After.
	InitialBackoff time.Duration
	MaxBackoff     time.Duration
}

// DefaultRetryPolicy is the policy of a client built without WithRetry.
var DefaultRetryPolicy = RetryPolicy{MaxAttempts: 4, InitialBackoff: 100 * time.Millisecond, MaxBackoff: 5 * time.Second}

// Option configures a Client.
type Option func(*Client)

// WithToken sends `Authorization: Bearer <token>` with every request.
func WithToken(token string) Option { return func(c *Client) { c.token = token } }

// WithHTTPClient uses hc for every request (its Timeout, if any, also applies).
func WithHTTPClient(hc *http.Client) Option { return func(c *Client) { c.http = hc } }

// WithRetry replaces the retry policy; zero fields keep their defaults.
func WithRetry(p RetryPolicy) Option {
	return func(c *Client) {
		if p.MaxAttempts > 0 {
			c.retry.MaxAttempts = p.MaxAttempts
		}
		if p.InitialBackoff > 0 {
			c.retry.InitialBackoff = p.InitialBackoff
		}
		if p.MaxBackoff > 0 {
			c.retry.MaxBackoff = p.MaxBackoff
		}
	}
}

// WithoutRetries makes every call a single try.
func WithoutRetries() Option { return func(c *Client) { c.retry.MaxAttempts = 1 } }

// WithTimeout bounds each try of a call (default 30s). Long polls (claim and
// get-job with a wait) get their wait on top.
func WithTimeout(d time.Duration) Option { return func(c *Client) { c.timeout = d } }

// WithUserAgent replaces the User-Agent header.
func WithUserAgent(ua string) Option { return func(c *Client) { c.agent = ua } }

// NewClient returns a client of the server at baseURL, e.g.
// "http://127.0.0.1:8080". It panics only on a URL that cannot be parsed or
// is not http(s); use ParseClient to get an error instead.
func NewClient(baseURL string, opts ...Option) *Client {
	c, err := ParseClient(baseURL, opts...)
	if err != nil {
		panic(err)
	}
	return c
}

// ParseClient is NewClient returning an error for a bad URL.
func ParseClient(baseURL string, opts ...Option) (*Client, error) {
	u, err := url.Parse(strings.TrimRight(baseURL, "/"))
	if err != nil {
		return nil, fmt.Errorf("idemq: base URL: %w", err)
	}
	if u.Scheme != "http" && u.Scheme != "https" || u.Host == "" {
		return nil, fmt.Errorf("idemq: base URL %q: want http(s)://host[:port]", baseURL)
	}
	c := &Client{
		base:    u,
		http:    &http.Client{},
		retry:   DefaultRetryPolicy,
		timeout: 30 * time.Second,
		agent:   "idemq-go/" + Version,
		rnd:     rand.New(rand.NewSource(time.Now().UnixNano())),
	}
	for _, o := range opts {
		o(c)
	}
	return c, nil
}

// BaseURL returns the server's base URL.
func (c *Client) BaseURL() string { return c.base.String() }

// Format keeps the token out of every %v.
func (c *Client) Format(f fmt.State, verb rune) {
	tok := ""
	if c.token != "" {
		tok = " token=[redacted]"
	}
	fmt.Fprintf(f, "idemq.Client{%s%s}", c.base.String(), tok)
}

// GoString keeps the token out of %#v.
func (c *Client) GoString() string { return fmt.Sprintf("%v", c) }

// call is one API call.
type call struct {
	method string
	path   string
	query  url.Values
	body   any
	header http.Header
	// retry: repeating this call is safe.
	retry bool
	// wait: extra time the server may hold the request (long polls).
	wait time.Duration
	// secrets: raw keys this call carries, scrubbed from any error text.
	secrets []string
	// status receives the HTTP status of the answer, when non-nil.
	status *int
	// uncertain, when non-nil, is set once a try failed without an answer
	// (a connection error or a timeout): the server may have carried that
	// try out, so what a later try answers may be about the first one.
	uncertain *bool
}

func (c *Client) do(ctx context.Context, cl call, out any) error {
	var body []byte
	if cl.body != nil {
		var err error
		if body, err = json.Marshal(cl.body); err != nil {
			return fmt.Errorf("idemq: encoding the request: %w", err)
		}
	}
	attempts := c.retry.MaxAttempts
	if !cl.retry || attempts < 1 {
		attempts = 1
	}
	for attempt := 1; ; attempt++ {
		err := c.once(ctx, cl, body, out)
		if err == nil {
			return nil
		}
		base := baseOf(err)
		if cl.uncertain != nil && base != nil && (base.Kind == KindConnection || base.Kind == KindTimeout) {
			*cl.uncertain = true
		}
		if attempt >= attempts || base == nil || !base.Retryable() || ctx.Err() != nil {
			return err
		}
		pause := c.backoff(attempt, base.RetryAfter)
		t := time.NewTimer(pause)
		select {
		case <-ctx.Done():
			t.Stop()
			return err
		case <-t.C:
		}
	}
}

func (c *Client) backoff(attempt int, retryAfter time.Duration) time.Duration {
	ceil := c.retry.InitialBackoff << uint(attempt-1)
	if ceil <= 0 || ceil > c.retry.MaxBackoff {
		ceil = c.retry.MaxBackoff
	}
	c.mu.Lock()
	d := time.Duration(c.rnd.Int63n(int64(ceil) + 1))
	c.mu.Unlock()
	if d < retryAfter {
		d = retryAfter
	}
	return d
}

func (c *Client) once(ctx context.Context, cl call, body []byte, out any) error {
	target := c.base.String() + cl.path
	if len(cl.query) > 0 {
		target += "?" + cl.query.Encode()
	}
	tctx := ctx
	if c.timeout > 0 {
		var cancel context.CancelFunc
		tctx, cancel = context.WithTimeout(ctx, c.timeout+cl.wait)
		defer cancel()
	}
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(tctx, cl.method, target, rd)
	if err != nil {
		return fmt.Errorf("idemq: building the request: %w", err)
	}
	for k, vs := range cl.header {
		req.Header[k] = vs
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	req.Header.Set("Accept", "application/json, application/problem+json")
	req.Header.Set("User-Agent", c.agent)
	if c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return c.transportError(ctx, cl, err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return c.transportError(ctx, cl, err)
	}
	if cl.status != nil {
		*cl.status = resp.StatusCode
	}
	if resp.StatusCode >= 200 && resp.StatusCode < 300 {
		if out == nil || len(bytes.TrimSpace(data)) == 0 {
			return nil
		}
		if err := json.Unmarshal(data, out); err != nil {
			return &Error{Kind: KindProtocol, Status: resp.StatusCode, Method: cl.method, Path: cl.path, Index: -1,
				Detail: "cannot decode the answer: " + err.Error()}
		}
		return nil
	}
	return typed(problemError(cl, resp, data))
}

func (c *Client) transportError(ctx context.Context, cl call, err error) error {
	kind := KindConnection
	var ne net.Error
	if errors.Is(err, context.DeadlineExceeded) || errors.As(err, &ne) && ne.Timeout() {
		kind = KindTimeout
	}
	if ctx.Err() != nil {
		err = ctx.Err()
		if errors.Is(err, context.Canceled) {
			kind = KindConnection
		}
	}
	e := &Error{Kind: kind, Method: cl.method, Path: cl.path, Index: -1, Err: scrubbed{err, cl.secrets}}
	return typed(e)
}

// scrubbed keeps raw keys out of a wrapped transport error's text.
type scrubbed struct {
	err     error
	secrets []string
}

func (s scrubbed) Error() string { return redact(s.err.Error(), s.secrets) }
func (s scrubbed) Unwrap() error { return s.err }

// problemError reads a problem document (or makes one up from the status).
func problemError(cl call, resp *http.Response, data []byte) *Error {
	e := &Error{Status: resp.StatusCode, Method: cl.method, Path: cl.path, Index: -1, Members: map[string]any{}}
	var doc map[string]any
	if json.Unmarshal(data, &doc) == nil && doc != nil {
		if t, ok := doc["type"].(string); ok {
			e.Type = redact(t, cl.secrets)
			if i := strings.LastIndex(t, "/problems/"); i >= 0 {
				e.Kind = t[i+len("/problems/"):]
			}
		}
		e.Title, _ = doc["title"].(string)
		e.Detail, _ = doc["detail"].(string)
		if i, ok := doc["index"].(float64); ok {
			e.Index = int(i)
		}
		for k, v := range doc {
			switch k {
			case "type", "title", "detail", "status", "index":
			default:
				e.Members[k] = scrubValue(v, cl.secrets)
			}
		}
	} else if len(data) > 0 {
		d := strings.TrimSpace(string(data))
		if len(d) > 200 {
			d = d[:200] + "…"
		}
		e.Detail = d
	}
	e.Kind = kindOf(e.Kind, e.Type, resp.StatusCode)
	e.Title = redact(e.Title, cl.secrets)
	e.Detail = redact(e.Detail, cl.secrets)
	if ra := resp.Header.Get("Retry-After"); ra != "" {
		if secs, err := strconv.Atoi(strings.TrimSpace(ra)); err == nil && secs >= 0 {
			e.RetryAfter = time.Duration(secs) * time.Second
		} else if at, err := http.ParseTime(ra); err == nil {
			if d := time.Until(at); d > 0 {
				e.RetryAfter = d
			}
		}
	}
	if allow := resp.Header.Get("Allow"); allow != "" {
		if _, ok := e.Members["allow"]; !ok {
			var methods []any
			for _, m := range strings.Split(allow, ",") {
				if m = strings.TrimSpace(m); m != "" {
					methods = append(methods, m)
				}
			}
			e.Members["allow"] = methods
		}
	}
	return e
}

func scrubValue(v any, secrets []string) any {
	switch x := v.(type) {
	case string:
		return redact(x, secrets)
	case []any:
		for i := range x {
			x[i] = scrubValue(x[i], secrets)
		}
	case map[string]any:
		for k := range x {
			x[k] = scrubValue(x[k], secrets)
		}
	}
	return v
}

// kindOf is the Kind of a problem named name (the end of its type, "" when
// the type has no "/problems/"). A type this client does not know is read
// by the status alone, as the Python client reads it: a 503 is unavailable
// (and retried), a 409 (one of three distinct errors) and any status
// without a problem type of its own are KindProtocol. Without a type,
// kindOfStatus decides.
func kindOf(name, typ string, status int) string {
	if knownProblems[name] {
		return name
	}
	if typ == "" {
		return kindOfStatus(status)
	}
	switch status {
	case 400, 401, 403, 404, 405, 413, 422, 500, 503:
		return kindOfStatus(status)
	}
	return KindProtocol
}

var knownProblems = func() map[string]bool {
	m := map[string]bool{}
	for _, p := range ProblemTypes() {
		m[p] = true
	}
	return m
}()

func kindOfStatus(status int) string {
	switch status {
	case 400:
		return ProblemBadRequest
	case 401:
		return ProblemUnauthorized
	case 403:
		return ProblemForbiddenHost
	case 404:
		return ProblemNotFound
	case 405:
		return ProblemMethodNotAllowed
	case 413:
		return ProblemPayloadTooLarge
	case 422:
		return ProblemValidation
	case 503:
		return ProblemUnavailable
	}
	if status >= 500 {
		return ProblemInternal
	}
	return KindProtocol
}

// problemFromDoc turns a problem document inside a 200 answer (a batch
// item's error) into a typed error.
func problemFromDoc(cl call, raw json.RawMessage, index int) error {
	var doc map[string]any
	_ = json.Unmarshal(raw, &doc)
	e := &Error{Method: cl.method, Path: cl.path, Index: -1, Members: map[string]any{}}
	if t, ok := doc["type"].(string); ok {
		e.Type = redact(t, cl.secrets)
		if i := strings.LastIndex(t, "/problems/"); i >= 0 {
			e.Kind = t[i+len("/problems/"):]
		}
	}
	if s, ok := doc["status"].(float64); ok {
		e.Status = int(s)
	}
	e.Kind = kindOf(e.Kind, e.Type, e.Status)
	e.Title, _ = doc["title"].(string)
	e.Detail, _ = doc["detail"].(string)
	e.Title = redact(e.Title, cl.secrets)
	e.Detail = redact(e.Detail, cl.secrets)
	for k, v := range doc {
		switch k {
		case "type", "title", "detail", "status":
		default:
			e.Members[k] = scrubValue(v, cl.secrets)
		}
	}
	if index >= 0 {
		e.Index = index
	}
	return typed(e)
}

// ms converts a duration to whole milliseconds, rounding away from zero: a
// positive duration is never sent as 0, nor a negative one as 0 or more
// (the server then refuses it, as it refuses any value out of bounds).
func ms(d time.Duration) int64 {
	q := int64(d / time.Millisecond)
	switch r := d % time.Millisecond; {
	case r > 0:
		q++
	case r < 0:
		q--
	}
	return q
}

// msPtr is ms for an optional field: zero (not given) is left out; anything
// else, a negative duration included, is sent for the server to check.
func msPtr(d time.Duration) *int64 {
	if d == 0 {
		return nil
	}
	v := ms(d)
	return &v
}

func timePtr(t time.Time) *string {
	if t.IsZero() {
		return nil
	}
	s := t.UTC().Format(time.RFC3339Nano)
	return &s
}

func pathEscape(s string) string { return url.PathEscape(s) }
