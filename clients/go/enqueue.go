package idemq

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"time"
)

// Outcome says what an enqueue did.
type Outcome string

// The outcomes of an enqueue (and OutcomeConflict, of an explain only).
const (
	OutcomeAccepted       Outcome = "accepted"
	OutcomeReplayed       Outcome = "replayed"
	OutcomeCoalesced      Outcome = "coalesced"
	OutcomeReplaced       Outcome = "replaced"
	OutcomeNonReplaceable Outcome = "non_replaceable"
	OutcomeConflict       Outcome = "conflict"
)

// Reason says why a replace could not land (with OutcomeNonReplaceable only).
type Reason string

// The reasons of OutcomeNonReplaceable.
const (
	ReasonIncompatibleMode Reason = "incompatible_mode"
	ReasonNotPending       Reason = "not_pending"
	ReasonWindowElapsed    Reason = "window_elapsed"
)

// EnqueueResult is what an enqueue did: the job it refers to, the outcome,
// and the reason, which is set exactly when Outcome is OutcomeNonReplaceable.
type EnqueueResult struct {
	JobID   string  `json:"job_id"`
	Outcome Outcome `json:"outcome"`
	Reason  Reason  `json:"reason,omitempty"`
}

// EnqueueOptions are the optional fields of an enqueue. The zero value of
// each field means "not given" (the server's default). Durations are sent
// as whole milliseconds, rounded away from zero; a negative one is sent as
// it is, and the server refuses it with a *ValidationError naming the field.
//
// Printing an EnqueueOptions with any fmt verb shows only the key's preview,
// never the raw idempotency key.
type EnqueueOptions struct {
	// IdempotencyKey binds this request to the job it returns, for TTL.
	// Equivalent repeats are "replayed"; a different request with the same
	// key fails with *EnqueueIdempotencyConflictError.
	IdempotencyKey string
	// Scope is the key's namespace ("default").
	Scope string
	// TTL is the key's retention window (1s – 30d; 24h).
	TTL time.Duration
	// KeyInHeader sends the key as the Idempotency-Key header instead of in
	// the body (single enqueues only; a key that is not printable ASCII
	// still travels in the body).
	KeyInHeader bool

	// Queue ("default").
	Queue string
	// JobID is an explicit job id; an existing job with that id makes the
	// request a replay or a conflict.
	JobID string
	// Priority: higher runs first among due jobs.
	Priority int
	// RunAt or Delay: when the job becomes due (not both).
	RunAt time.Time
	Delay time.Duration
	// MaxAttempts is the attempt budget (1–1000; 10).
	MaxAttempts int
	// Retry is the backoff between failed attempts.
	Retry *Backoff
	// Timeout of one attempt (1ms – 24h; 30m).
	Timeout time.Duration
	// Deadline after which the job must not start or go on.
	Deadline time.Time
	// ConcurrencyKey: at most one active job per key.
	ConcurrencyKey string
	// Tags for operators.
	Tags []string
	// Keep is how long the record is kept once terminal (nil: per-state default).
	Keep *time.Duration
	// Dedupe is the rate policy.
	Dedupe *Dedupe
}

// Dedupe is a dedupe key with its mode: {Key} pending, {Key, TTL} throttle,
// {Key, TTL, Extend} debounce, {Key, Replace[, TTL]} replace.
type Dedupe struct {
	Key     string
	TTL     time.Duration
	Extend  bool
	Replace bool
	MaxWait time.Duration
}

// Backoff is a job's retry policy; build one with ExponentialBackoff,
// FixedBackoff or NoRetry.
type Backoff struct {
	// Kind is "exponential", "fixed" or "none".
	Kind string
	// Exponential: Initial × Factor^(n-1), capped at Max, with optional full jitter.
	Initial time.Duration
	Factor  float64
	Max     time.Duration
	Jitter  *bool
	// Fixed: the same Delay after every failure.
	Delay time.Duration
}

// ExponentialBackoff is initial × factor^(n-1), capped at max, with full
// jitter when jitter is true.
func ExponentialBackoff(initial time.Duration, factor float64, max time.Duration, jitter bool) *Backoff {
	return &Backoff{Kind: "exponential", Initial: initial, Factor: factor, Max: max, Jitter: &jitter}
}

// FixedBackoff waits d after every failure.
func FixedBackoff(d time.Duration) *Backoff { return &Backoff{Kind: "fixed", Delay: d} }

// NoRetry makes the first failure final.
func NoRetry() *Backoff { return &Backoff{Kind: "none"} }

// JobRequest is one job of a batch (or a schedule's template).
type JobRequest struct {
	Type    string
	Payload any
	Options *EnqueueOptions
}

// BatchOptions configures EnqueueBatch.
type BatchOptions struct {
	// Atomic: any failing item fails the whole batch, and nothing is written.
	Atomic bool
}

// BatchResult is one item's answer: Result, or Err (a typed error).
type BatchResult struct {
	Result *EnqueueResult
	Err    error
}

// Explanation is what an enqueue would do now, and why (nothing is written).
type Explanation struct {
	Outcome     Outcome             `json:"outcome"`
	Reason      Reason              `json:"reason,omitempty"`
	JobID       string              `json:"job_id,omitempty"`
	Conflict    *ExplainConflict    `json:"conflict,omitempty"`
	Idempotency *ExplainIdempotency `json:"idempotency,omitempty"`
	Dedupe      *DedupeBinding      `json:"dedupe,omitempty"`
}

// ExplainConflict names the job a request would conflict with, and the fields.
type ExplainConflict struct {
	JobID  string   `json:"job_id"`
	Fields []string `json:"fields"`
}

// ExplainIdempotency is the live idempotency binding an explain found.
type ExplainIdempotency struct {
	JobID     string    `json:"job_id"`
	ExpiresAt time.Time `json:"expires_at"`
}

// DedupeBinding is a live dedupe binding.
type DedupeBinding struct {
	JobID       string     `json:"job_id"`
	Mode        string     `json:"mode"`
	WindowUntil *time.Time `json:"window_until,omitempty"`
}

// ---- wire forms ----

type enqueueWire struct {
	Type           string           `json:"type"`
	Payload        any              `json:"payload,omitempty"`
	Queue          *string          `json:"queue,omitempty"`
	JobID          *string          `json:"job_id,omitempty"`
	Priority       *int             `json:"priority,omitempty"`
	RunAt          *string          `json:"run_at,omitempty"`
	DelayMs        *int64           `json:"delay_ms,omitempty"`
	MaxAttempts    *int             `json:"max_attempts,omitempty"`
	Retry          map[string]any   `json:"retry,omitempty"`
	TimeoutMs      *int64           `json:"timeout_ms,omitempty"`
	Deadline       *string          `json:"deadline,omitempty"`
	ConcurrencyKey *string          `json:"concurrency_key,omitempty"`
	Tags           []string         `json:"tags,omitempty"`
	KeepMs         *int64           `json:"keep_ms,omitempty"`
	Idempotency    *idempotencyWire `json:"idempotency,omitempty"`
	Dedupe         *dedupeWire      `json:"dedupe,omitempty"`
}

type idempotencyWire struct {
	Key   string  `json:"key"`
	Scope *string `json:"scope,omitempty"`
	TTLMs *int64  `json:"ttl_ms,omitempty"`
}

type dedupeWire struct {
	Key       string `json:"key"`
	TTLMs     *int64 `json:"ttl_ms,omitempty"`
	Extend    *bool  `json:"extend,omitempty"`
	Replace   *bool  `json:"replace,omitempty"`
	MaxWaitMs *int64 `json:"max_wait_ms,omitempty"`
}

func strPtr(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

func intPtr(i int) *int {
	if i == 0 {
		return nil
	}
	return &i
}

func truePtr(b bool) *bool {
	if !b {
		return nil
	}
	return &b
}

func (b *Backoff) wire() map[string]any {
	if b == nil {
		return nil
	}
	m := map[string]any{"kind": b.Kind}
	switch b.Kind {
	case "exponential":
		if b.Initial != 0 {
			m["initial_ms"] = ms(b.Initial)
		}
		if b.Factor != 0 {
			m["factor"] = b.Factor
		}
		if b.Max != 0 {
			m["max_ms"] = ms(b.Max)
		}
		if b.Jitter != nil {
			m["jitter"] = *b.Jitter
		}
	case "fixed":
		m["delay_ms"] = ms(b.Delay)
	}
	return m
}

// wire builds the request body. When header is true and the key can travel
// as a header, the key is left out of the body unless a scope or ttl needs
// the body's idempotency object; the header value is returned.
func buildEnqueue(typ string, payload any, o *EnqueueOptions, header bool) (enqueueWire, string) {
	w := enqueueWire{Type: typ, Payload: payload}
	if o == nil {
		return w, ""
	}
	w.Queue = strPtr(o.Queue)
	w.JobID = strPtr(o.JobID)
	w.Priority = intPtr(o.Priority)
	w.RunAt = timePtr(o.RunAt)
	w.DelayMs = msPtr(o.Delay)
	w.MaxAttempts = intPtr(o.MaxAttempts)
	w.Retry = o.Retry.wire()
	w.TimeoutMs = msPtr(o.Timeout)
	w.Deadline = timePtr(o.Deadline)
	w.ConcurrencyKey = strPtr(o.ConcurrencyKey)
	w.Tags = o.Tags
	if o.Keep != nil {
		k := ms(*o.Keep)
		w.KeepMs = &k
	}
	if d := o.Dedupe; d != nil {
		w.Dedupe = &dedupeWire{Key: d.Key, TTLMs: msPtr(d.TTL), Extend: truePtr(d.Extend),
			Replace: truePtr(d.Replace), MaxWaitMs: msPtr(d.MaxWait)}
	}
	hv := ""
	if o.IdempotencyKey != "" {
		if header && o.KeyInHeader {
			hv = headerKey(o.IdempotencyKey)
		}
		if hv == "" || o.Scope != "" || o.TTL != 0 {
			w.Idempotency = &idempotencyWire{Key: o.IdempotencyKey, Scope: strPtr(o.Scope), TTLMs: msPtr(o.TTL)}
		}
	}
	return w, hv
}

// headerKey is the key as a structured-field string, or "" when it cannot be one.
func headerKey(key string) string {
	var b strings.Builder
	b.WriteByte('"')
	for i := 0; i < len(key); i++ {
		c := key[i]
		if c < 0x20 || c > 0x7e {
			return ""
		}
		if c == '"' || c == '\\' {
			b.WriteByte('\\')
		}
		b.WriteByte(c)
	}
	b.WriteByte('"')
	return b.String()
}

func (o *EnqueueOptions) safeToRetry() bool {
	return o != nil && (o.IdempotencyKey != "" || o.JobID != "")
}

func (o *EnqueueOptions) secrets() []string {
	if o == nil || o.IdempotencyKey == "" {
		return nil
	}
	return []string{o.IdempotencyKey}
}

func enqueueCall(path string, typ string, payload any, opts *EnqueueOptions, retry bool) call {
	body, hv := buildEnqueue(typ, payload, opts, true)
	cl := call{method: http.MethodPost, path: path, body: body, retry: retry, secrets: opts.secrets()}
	if hv != "" {
		cl.header = http.Header{"Idempotency-Key": {hv}}
	}
	return cl
}

// Enqueue enqueues one job and returns its id (the existing job's id for a
// replay, a coalesced or replaced request). payload is any JSON-encodable
// value (nil: none); opts may be nil.
func (c *Client) Enqueue(ctx context.Context, typ string, payload any, opts *EnqueueOptions) (string, error) {
	r, err := c.EnqueueWithResult(ctx, typ, payload, opts)
	if err != nil {
		return "", err
	}
	return r.JobID, nil
}

// EnqueueWithResult enqueues one job and says what happened: the job id, the
// outcome and, for OutcomeNonReplaceable, the reason. It is retried after a
// connection error or a 503 only when opts carries an idempotency key or a
// job id.
func (c *Client) EnqueueWithResult(ctx context.Context, typ string, payload any, opts *EnqueueOptions) (*EnqueueResult, error) {
	var r EnqueueResult
	if err := c.do(ctx, enqueueCall("/v1/jobs", typ, payload, opts, opts.safeToRetry()), &r); err != nil {
		return nil, err
	}
	return &r, nil
}

// Explain says what an enqueue of this request would do now, and why,
// without writing anything. An invalid request gets the error the enqueue
// would get.
func (c *Client) Explain(ctx context.Context, typ string, payload any, opts *EnqueueOptions) (*Explanation, error) {
	var r Explanation
	if err := c.do(ctx, enqueueCall("/v1/jobs/explain", typ, payload, opts, true), &r); err != nil {
		return nil, err
	}
	return &r, nil
}

// EnqueueBatch enqueues up to 1,000 jobs in one round trip and returns one
// result per job, in order; a failing item has Err set (a typed error) and
// does not undo the others. With opts.Atomic any failing item fails the
// whole call with that item's typed error (its base Error's Index names the
// item) and nothing is written. Keys always travel in the items' bodies. The
// batch is retried after a connection error or a 503 only when every item
// carries an idempotency key or a job id.
func (c *Client) EnqueueBatch(ctx context.Context, jobs []JobRequest, opts *BatchOptions) ([]BatchResult, error) {
	items := make([]enqueueWire, len(jobs))
	retry := len(jobs) > 0
	var secrets []string
	for i, j := range jobs {
		items[i], _ = buildEnqueue(j.Type, j.Payload, j.Options, false)
		retry = retry && j.Options.safeToRetry()
		secrets = append(secrets, j.Options.secrets()...)
	}
	body := map[string]any{"jobs": items}
	if opts != nil && opts.Atomic {
		body["atomic"] = true
	}
	cl := call{method: http.MethodPost, path: "/v1/jobs/batch", body: body, retry: retry, secrets: secrets}
	var r struct {
		Results []json.RawMessage `json:"results"`
	}
	if err := c.do(ctx, cl, &r); err != nil {
		return nil, err
	}
	out := make([]BatchResult, len(r.Results))
	for i, raw := range r.Results {
		var probe struct {
			Error json.RawMessage `json:"error"`
		}
		_ = json.Unmarshal(raw, &probe)
		if len(probe.Error) > 0 && string(probe.Error) != "null" {
			out[i].Err = problemFromDoc(cl, probe.Error, i)
			continue
		}
		var er EnqueueResult
		if err := json.Unmarshal(raw, &er); err != nil {
			out[i].Err = &Error{Kind: KindProtocol, Method: cl.method, Path: cl.path, Index: i, Detail: err.Error()}
			continue
		}
		out[i].Result = &er
	}
	if len(out) != len(jobs) {
		return out, &Error{Kind: KindProtocol, Method: cl.method, Path: cl.path, Index: -1,
			Detail: fmt.Sprintf("%d results for %d jobs", len(out), len(jobs))}
	}
	return out, nil
}

// ---- formatting without the raw key ----

type enqueueOptionsView EnqueueOptions

func (o EnqueueOptions) view() enqueueOptionsView {
	v := enqueueOptionsView(o)
	if v.IdempotencyKey != "" {
		v.IdempotencyKey = KeyPreview(v.IdempotencyKey)
	}
	return v
}

// Format prints the options with the idempotency key replaced by its preview.
func (o EnqueueOptions) Format(f fmt.State, verb rune) {
	formatView(f, verb, o.view(), "idemq.enqueueOptionsView", "idemq.EnqueueOptions")
}

// GoString prints the options with the idempotency key replaced by its preview.
func (o EnqueueOptions) GoString() string {
	return goStringView(o.view(), "idemq.enqueueOptionsView", "idemq.EnqueueOptions")
}

// String prints the options with the idempotency key replaced by its preview.
func (o EnqueueOptions) String() string { return fmt.Sprintf("%+v", o.view()) }

func formatView(f fmt.State, verb rune, v any, from, to string) {
	switch {
	case verb == 'v' && f.Flag('#'):
		fmt.Fprint(f, goStringView(v, from, to))
	case verb == 's' || verb == 'q':
		fmt.Fprintf(f, fmtDirective(f, verb), fmt.Sprintf("%+v", v))
	default:
		fmt.Fprintf(f, fmtDirective(f, verb), v)
	}
}

func goStringView(v any, from, to string) string {
	return strings.Replace(fmt.Sprintf("%#v", v), from, to, 1)
}

// fmtDirective rebuilds the directive that invoked a Formatter.
func fmtDirective(f fmt.State, verb rune) string {
	var b strings.Builder
	b.WriteByte('%')
	for _, fl := range "+-# 0" {
		if f.Flag(int(fl)) {
			b.WriteRune(fl)
		}
	}
	if w, ok := f.Width(); ok {
		fmt.Fprintf(&b, "%d", w)
	}
	if p, ok := f.Precision(); ok {
		fmt.Fprintf(&b, ".%d", p)
	}
	b.WriteRune(verb)
	return b.String()
}
