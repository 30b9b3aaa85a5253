package idemq

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"sync"
	"time"
)

// ClaimRequest asks for due jobs. Zero fields take the server's defaults.
type ClaimRequest struct {
	// Queues to claim from (nil: every queue).
	Queues []string
	// Types to claim (nil: any type).
	Types []string
	// Worker is the worker's name, kept in the run ledger (1–128 bytes).
	Worker string
	// Limit is the most jobs to claim (1–1000; 1).
	Limit int
	// Lease is each claimed job's lease (100ms – 1h; 30s).
	Lease time.Duration
	// Wait holds the request up to this long (≤ 60s) until work arrives.
	Wait time.Duration
	// Complete carries completions recorded before the claim, in the same
	// round trip; their results come back in ClaimResponse.Completed.
	Complete []Completion
}

// ClaimResponse is the answer of a claim.
type ClaimResponse struct {
	Jobs      []*ClaimedJob
	Completed []CompletionResult
}

// Completion completes one job of a batch; Result is any JSON-encodable
// value (nil: none).
type Completion struct {
	ID         string
	LeaseToken string
	Result     any
}

// CompletionResult is one completion's answer: State ("completed"), or Err
// (a typed error; *LeaseLostError for a stale token).
type CompletionResult struct {
	State string
	Err   error
}

// HeartbeatResult is the answer of a heartbeat.
type HeartbeatResult struct {
	LeaseExpiresAt  time.Time `json:"lease_expires_at"`
	CancelRequested bool      `json:"cancel_requested"`
}

// FailOptions describe a failed attempt.
type FailOptions struct {
	// Error is what went wrong (kept truncated to 8 KiB).
	Error string
	// Permanent sends the job to dead at once.
	Permanent bool
	// RetryAfter overrides the backoff for this retry (nil: the policy's).
	RetryAfter *time.Duration
	// Snooze reschedules after this delay without consuming the attempt.
	Snooze *time.Duration
}

// FailResult is the job's state after a fail, and when it runs next.
type FailResult struct {
	State     string     `json:"state"`
	NextRunAt *time.Time `json:"next_run_at,omitempty"`
}

// ClaimedJob is a job under a lease: what a handler receives.
type ClaimedJob struct {
	ID             string          `json:"id"`
	Type           string          `json:"type"`
	Queue          string          `json:"queue"`
	Payload        json.RawMessage `json:"payload"`
	Attempt        int             `json:"attempt"`
	MaxAttempts    int             `json:"max_attempts"`
	LeaseToken     string          `json:"lease_token"`
	LeaseExpiresAt time.Time       `json:"lease_expires_at"`
	TimeoutMs      int64           `json:"timeout_ms"`
	Deadline       *time.Time      `json:"deadline,omitempty"`
	Tags           []string        `json:"tags,omitempty"`

	client *Client
	mu     sync.Mutex
	stop   error
	cancel context.CancelFunc
	lost   chan struct{}
	saved  map[string]json.RawMessage
}

// Timeout is the execution timeout of this attempt.
func (j *ClaimedJob) Timeout() time.Duration { return time.Duration(j.TimeoutMs) * time.Millisecond }

// Decode decodes the payload into v.
func (j *ClaimedJob) Decode(v any) error { return json.Unmarshal(nullIfEmpty(j.Payload), v) }

// StopReason says why the handler's context was cancelled: ErrJobCancelled,
// ErrLeaseLost, ErrJobTimeout, ErrJobDeadline or ErrShutdown (nil while the
// handler may go on).
func (j *ClaimedJob) StopReason() error {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.stop
}

// Reasons a running handler is stopped (see ClaimedJob.StopReason).
var (
	// ErrJobCancelled: an operator cancelled the job while it ran. Returning
	// a result within WorkerOptions.CancelGrace still completes it (the
	// effect happened); returning an error turns it cancelled. A handler
	// that has not returned by then has its attempt failed (the job turns
	// cancelled), and what it returns later is dropped.
	ErrJobCancelled = errors.New("idemq: the job was cancelled")
	// ErrJobTimeout: the attempt ran past the job's timeout; it was failed.
	ErrJobTimeout = errors.New("idemq: the attempt timed out")
	// ErrJobDeadline: the job's deadline passed, on the server's clock, and
	// the server ended the attempt (dead, reason deadline; never a retry).
	ErrJobDeadline = errors.New("idemq: the job's deadline passed")
	// ErrShutdown: the worker shut down and released the lease.
	ErrShutdown = errors.New("idemq: the worker is shutting down")
)

// setStop records the first stop reason and cancels the handler's context.
func (j *ClaimedJob) setStop(reason error) {
	j.mu.Lock()
	if j.stop == nil || (reason == ErrLeaseLost && j.stop == ErrJobCancelled) {
		j.stop = reason
		if reason == ErrLeaseLost && j.lost != nil {
			close(j.lost)
			j.lost = nil
		}
	}
	cancel := j.cancel
	j.mu.Unlock()
	if cancel != nil {
		cancel()
	}
}

// Checkpoint is a durable step: the first attempt that reaches it runs fn
// and stores its JSON result under the job; every later attempt of the same
// job gets the stored result without running fn. The first stored value
// wins: when another attempt stored one first, that value is returned.
func (j *ClaimedJob) Checkpoint(ctx context.Context, name string, fn func(ctx context.Context) (any, error)) (json.RawMessage, error) {
	if v, ok, err := j.storedCheckpoint(ctx, name, false); err != nil || ok {
		return v, err
	}
	val, err := fn(ctx)
	if err != nil {
		return nil, err
	}
	raw, err := json.Marshal(val)
	if err != nil {
		return nil, err
	}
	stored, err := j.client.PutCheckpoint(ctx, j.ID, name, j.LeaseToken, json.RawMessage(raw))
	if err != nil {
		if errors.Is(err, ErrLeaseLost) {
			j.setStop(ErrLeaseLost)
		}
		return nil, err
	}
	if stored {
		j.mu.Lock()
		j.saved[name] = raw
		j.mu.Unlock()
		return raw, nil
	}
	v, ok, err := j.storedCheckpoint(ctx, name, true)
	if err == nil && !ok {
		err = &Error{Kind: KindProtocol, Method: http.MethodGet, Path: "/v1/jobs/" + j.ID + "/checkpoints", Index: -1,
			Detail: "checkpoint " + name + " was refused as already stored, and is not there"}
	}
	return v, err
}

func (j *ClaimedJob) storedCheckpoint(ctx context.Context, name string, refresh bool) (json.RawMessage, bool, error) {
	j.mu.Lock()
	if j.saved != nil && !refresh {
		v, ok := j.saved[name]
		j.mu.Unlock()
		return v, ok, nil
	}
	j.mu.Unlock()
	cps, err := j.client.JobCheckpoints(ctx, j.ID)
	if err != nil {
		return nil, false, err
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	j.saved = cps
	v, ok := cps[name]
	return v, ok, nil
}

// Checkpoint is ClaimedJob.Checkpoint with a typed result.
func Checkpoint[T any](ctx context.Context, job *ClaimedJob, name string, fn func(ctx context.Context) (T, error)) (T, error) {
	var out T
	raw, err := job.Checkpoint(ctx, name, func(ctx context.Context) (any, error) { return fn(ctx) })
	if err != nil {
		return out, err
	}
	err = json.Unmarshal(raw, &out)
	return out, err
}

// ---- the worker protocol's calls; all fenced by the lease token, so retried ----

type claimWire struct {
	Queues   []string         `json:"queues,omitempty"`
	Worker   string           `json:"worker,omitempty"`
	Limit    int              `json:"limit,omitempty"`
	LeaseMs  int64            `json:"lease_ms,omitempty"`
	Types    []string         `json:"types,omitempty"`
	WaitMs   int64            `json:"wait_ms,omitempty"`
	Complete []completionWire `json:"complete,omitempty"`
}

type completionWire struct {
	ID         string          `json:"id"`
	LeaseToken string          `json:"lease_token"`
	Result     json.RawMessage `json:"result,omitempty"`
}

func completionsWire(cs []Completion) ([]completionWire, error) {
	out := make([]completionWire, len(cs))
	for i, c := range cs {
		out[i] = completionWire{ID: c.ID, LeaseToken: c.LeaseToken}
		if c.Result != nil {
			raw, err := json.Marshal(c.Result)
			if err != nil {
				return nil, err
			}
			out[i].Result = raw
		}
	}
	return out, nil
}

func completionResults(cl call, raws []json.RawMessage) []CompletionResult {
	out := make([]CompletionResult, len(raws))
	for i, raw := range raws {
		var item struct {
			State string          `json:"state"`
			Error json.RawMessage `json:"error"`
		}
		_ = json.Unmarshal(raw, &item)
		if len(item.Error) > 0 && string(item.Error) != "null" {
			out[i].Err = problemFromDoc(cl, item.Error, -1)
		} else {
			out[i].State = item.State
		}
	}
	return out
}

// Claim claims up to req.Limit due jobs under a lease. A negative Lease or
// Wait is refused with a *ValidationError (lease_ms, wait_ms), nothing sent.
func (c *Client) Claim(ctx context.Context, req ClaimRequest) (*ClaimResponse, error) {
	r, _, err := c.claim(ctx, req)
	return r, err
}

// claim is Claim that also says whether a try went unanswered (see
// call.uncertain): completions it carried may have been recorded by it.
func (c *Client) claim(ctx context.Context, req ClaimRequest) (*ClaimResponse, bool, error) {
	switch {
	case req.Lease < 0:
		return nil, false, invalid(http.MethodPost, "/v1/claim", "lease_ms", "must be from 100 to 3600000 ms")
	case req.Wait < 0:
		return nil, false, invalid(http.MethodPost, "/v1/claim", "wait_ms", "must be from 0 to 60000")
	}
	w := claimWire{Queues: req.Queues, Worker: req.Worker, Limit: req.Limit, LeaseMs: ms(req.Lease),
		Types: req.Types, WaitMs: ms(req.Wait)}
	if len(req.Complete) > 0 {
		var err error
		if w.Complete, err = completionsWire(req.Complete); err != nil {
			return nil, false, err
		}
	}
	var uncertain bool
	cl := call{method: http.MethodPost, path: "/v1/claim", body: w, retry: true, wait: req.Wait, uncertain: &uncertain}
	var r struct {
		Jobs      []*ClaimedJob     `json:"jobs"`
		Completed []json.RawMessage `json:"completed"`
	}
	if err := c.do(ctx, cl, &r); err != nil {
		return nil, uncertain, err
	}
	for _, j := range r.Jobs {
		j.client = c
	}
	return &ClaimResponse{Jobs: r.Jobs, Completed: completionResults(cl, r.Completed)}, uncertain, nil
}

// Heartbeat renews the lease; CancelRequested says the job was cancelled.
func (c *Client) Heartbeat(ctx context.Context, id, leaseToken string) (*HeartbeatResult, error) {
	var r HeartbeatResult
	if err := c.do(ctx, call{method: http.MethodPost, path: "/v1/jobs/" + pathEscape(id) + "/heartbeat",
		body: map[string]string{"lease_token": leaseToken}, retry: true}, &r); err != nil {
		return nil, err
	}
	return &r, nil
}

// Complete records the attempt's success with an optional result (nil: none).
//
// Like every worker call it is retried after a connection error, a timeout
// or a 503. When a try went unanswered but the server recorded it, the
// retry is answered with a *LeaseLostError (the attempt is over); the
// Worker tells the two apart by reading the job (see the README).
func (c *Client) Complete(ctx context.Context, id, leaseToken string, result any) (string, error) {
	state, _, err := c.complete(ctx, id, leaseToken, result)
	return state, err
}

// complete is Complete that also says whether a try went unanswered.
func (c *Client) complete(ctx context.Context, id, leaseToken string, result any) (string, bool, error) {
	body := map[string]any{"lease_token": leaseToken}
	if result != nil {
		body["result"] = result
	}
	var r struct {
		State string `json:"state"`
	}
	var uncertain bool
	err := c.do(ctx, call{method: http.MethodPost, path: "/v1/jobs/" + pathEscape(id) + "/complete", body: body, retry: true,
		uncertain: &uncertain}, &r)
	return r.State, uncertain, err
}

// CompleteMany records many completions in one round trip and one commit;
// a stale token fails only its own item. Retried like Complete.
func (c *Client) CompleteMany(ctx context.Context, items []Completion) ([]CompletionResult, error) {
	out, _, err := c.completeMany(ctx, items)
	return out, err
}

// completeMany is CompleteMany that also says whether a try went unanswered.
func (c *Client) completeMany(ctx context.Context, items []Completion) ([]CompletionResult, bool, error) {
	jobs, err := completionsWire(items)
	if err != nil {
		return nil, false, err
	}
	var uncertain bool
	cl := call{method: http.MethodPost, path: "/v1/jobs/complete", body: map[string]any{"jobs": jobs}, retry: true,
		uncertain: &uncertain}
	var r struct {
		Results []json.RawMessage `json:"results"`
	}
	if err := c.do(ctx, cl, &r); err != nil {
		return nil, uncertain, err
	}
	out := completionResults(cl, r.Results)
	if len(out) != len(items) {
		return out, uncertain, &Error{Kind: KindProtocol, Method: cl.method, Path: cl.path, Index: -1, Detail: "results do not match the completions"}
	}
	return out, uncertain, nil
}

// Fail records a failed attempt. A negative RetryAfter or Snooze is refused
// with a *ValidationError (retry_after_ms, snooze_ms), nothing sent.
//
// Retried like Complete: when a try went unanswered but the server recorded
// it, the retry is answered with a *LeaseLostError; the Worker tells the two
// apart by reading the job's runs (see the README).
func (c *Client) Fail(ctx context.Context, id, leaseToken string, opts FailOptions) (*FailResult, error) {
	r, _, err := c.fail(ctx, id, leaseToken, opts)
	return r, err
}

// fail is Fail that also says whether a try went unanswered.
func (c *Client) fail(ctx context.Context, id, leaseToken string, opts FailOptions) (*FailResult, bool, error) {
	path := "/v1/jobs/" + pathEscape(id) + "/fail"
	switch {
	case opts.RetryAfter != nil && *opts.RetryAfter < 0:
		return nil, false, invalid(http.MethodPost, path, "retry_after_ms", "must not be negative")
	case opts.Snooze != nil && *opts.Snooze < 0:
		return nil, false, invalid(http.MethodPost, path, "snooze_ms", "must not be negative")
	}
	body := map[string]any{"lease_token": leaseToken, "error": opts.Error, "retryable": !opts.Permanent}
	if opts.RetryAfter != nil {
		body["retry_after_ms"] = ms(*opts.RetryAfter)
	}
	if opts.Snooze != nil {
		body["snooze_ms"] = ms(*opts.Snooze)
	}
	var r FailResult
	var uncertain bool
	if err := c.do(ctx, call{method: http.MethodPost, path: path, body: body, retry: true, uncertain: &uncertain}, &r); err != nil {
		return nil, uncertain, err
	}
	return &r, uncertain, nil
}

// Release gives the job back unfinished: it is ready at once and the
// attempt is not counted ("cancelled" when a cancel was pending). Retried
// like Fail.
func (c *Client) Release(ctx context.Context, id, leaseToken string) (string, error) {
	state, _, err := c.release(ctx, id, leaseToken)
	return state, err
}

// release is Release that also says whether a try went unanswered.
func (c *Client) release(ctx context.Context, id, leaseToken string) (string, bool, error) {
	var r struct {
		State string `json:"state"`
	}
	var uncertain bool
	err := c.do(ctx, call{method: http.MethodPost, path: "/v1/jobs/" + pathEscape(id) + "/release",
		body: map[string]string{"lease_token": leaseToken}, retry: true, uncertain: &uncertain}, &r)
	return r.State, uncertain, err
}

// PutCheckpoint stores value under name unless a value is already stored
// (then false, and the stored one is kept).
func (c *Client) PutCheckpoint(ctx context.Context, id, name, leaseToken string, value any) (bool, error) {
	var r struct {
		Stored bool `json:"stored"`
	}
	err := c.do(ctx, call{method: http.MethodPut, path: "/v1/jobs/" + pathEscape(id) + "/checkpoints/" + pathEscape(name),
		body: map[string]any{"lease_token": leaseToken, "value": value}, retry: true}, &r)
	return r.Stored, err
}
