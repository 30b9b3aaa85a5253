package idemq

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"time"
)

// Job states.
const (
	StateScheduled = "scheduled"
	StateReady     = "ready"
	StateActive    = "active"
	StateCompleted = "completed"
	StateDead      = "dead"
	StateCancelled = "cancelled"
)

// Job is a job record.
type Job struct {
	ID              string          `json:"id"`
	Type            string          `json:"type"`
	Queue           string          `json:"queue"`
	State           string          `json:"state"`
	Payload         json.RawMessage `json:"payload"`
	Result          json.RawMessage `json:"result,omitempty"`
	Priority        int             `json:"priority"`
	Attempt         int             `json:"attempt"`
	AttemptsUsed    int             `json:"attempts_used"`
	MaxAttempts     int             `json:"max_attempts"`
	RunAt           time.Time       `json:"run_at"`
	CreatedAt       time.Time       `json:"created_at"`
	UpdatedAt       time.Time       `json:"updated_at"`
	FinishedAt      *time.Time      `json:"finished_at,omitempty"`
	TimeoutMs       int64           `json:"timeout_ms"`
	Deadline        *time.Time      `json:"deadline,omitempty"`
	ConcurrencyKey  *string         `json:"concurrency_key,omitempty"`
	Tags            []string        `json:"tags"`
	LastError       *string         `json:"last_error,omitempty"`
	CancelRequested bool            `json:"cancel_requested"`
	KeepMs          *int64          `json:"keep_ms,omitempty"`
	LeaseExpiresAt  *time.Time      `json:"lease_expires_at,omitempty"`
	Retry           json.RawMessage `json:"retry,omitempty"`
	Idempotency     *JobIdempotency `json:"idempotency,omitempty"`
	Dedupe          *JobDedupe      `json:"dedupe,omitempty"`
}

// Terminal reports whether the job is completed, dead or cancelled.
func (j *Job) Terminal() bool {
	switch j.State {
	case StateCompleted, StateDead, StateCancelled:
		return true
	}
	return false
}

// DecodeResult decodes the job's result into v.
func (j *Job) DecodeResult(v any) error { return json.Unmarshal(nullIfEmpty(j.Result), v) }

// DecodePayload decodes the job's payload into v.
func (j *Job) DecodePayload(v any) error { return json.Unmarshal(nullIfEmpty(j.Payload), v) }

func nullIfEmpty(b json.RawMessage) json.RawMessage {
	if len(b) == 0 {
		return json.RawMessage("null")
	}
	return b
}

// JobIdempotency is the idempotency key a job was accepted under (preview and
// digest only: the raw key is never stored).
type JobIdempotency struct {
	Scope      string     `json:"scope"`
	KeyPreview string     `json:"key_preview"`
	KeyDigest  string     `json:"key_digest"`
	ExpiresAt  *time.Time `json:"expires_at,omitempty"`
}

// JobDedupe is the job's own dedupe key.
type JobDedupe struct {
	Key          string     `json:"key"`
	Mode         string     `json:"mode"`
	WindowUntil  *time.Time `json:"window_until,omitempty"`
	HoldsBinding bool       `json:"holds_binding"`
}

// Event is one entry of a job's history.
type Event struct {
	Seq  int64           `json:"seq"`
	Kind string          `json:"kind"`
	At   time.Time       `json:"at"`
	Data json.RawMessage `json:"data"`
}

// Run is one attempt of a job.
type Run struct {
	Attempt    int        `json:"attempt"`
	Worker     string     `json:"worker"`
	StartedAt  time.Time  `json:"started_at"`
	FinishedAt *time.Time `json:"finished_at,omitempty"`
	Outcome    *string    `json:"outcome,omitempty"`
	Error      *string    `json:"error,omitempty"`
}

// JobPage is a page of jobs, newest first; NextCursor is "" on the last page.
type JobPage struct {
	Jobs       []Job  `json:"jobs"`
	NextCursor string `json:"next_cursor,omitempty"`
}

// ListJobsOptions filters ListJobs; zero fields do not filter.
type ListJobsOptions struct {
	State  string
	Queue  string
	Type   string
	Tag    string
	Limit  int
	Cursor string
}

// CancelResult is the answer of a cancel: Cancelled is also true when an
// active job was flagged; State is the job's state after the call.
type CancelResult struct {
	Cancelled bool   `json:"cancelled"`
	State     string `json:"state"`
}

// RedriveOptions are the optional overrides of a redrive.
type RedriveOptions struct {
	// IdempotencyKey makes the redrive idempotent (scope idemq.redrive, 24h).
	IdempotencyKey   string
	MaxAttempts      int
	Deadline         time.Time
	RunAt            time.Time
	ResetCheckpoints bool
}

type redriveView RedriveOptions

// Format prints the options with the key replaced by its preview.
func (o RedriveOptions) Format(f fmt.State, verb rune) {
	v := redriveView(o)
	if v.IdempotencyKey != "" {
		v.IdempotencyKey = KeyPreview(v.IdempotencyKey)
	}
	formatView(f, verb, v, "idemq.redriveView", "idemq.RedriveOptions")
}

// GoString prints the options with the key replaced by its preview.
func (o RedriveOptions) GoString() string {
	v := redriveView(o)
	if v.IdempotencyKey != "" {
		v.IdempotencyKey = KeyPreview(v.IdempotencyKey)
	}
	return goStringView(v, "idemq.redriveView", "idemq.RedriveOptions")
}

// BulkFilter selects the jobs of a bulk action; zero fields do not filter.
type BulkFilter struct {
	State  string
	Queue  string
	Type   string
	Tag    string
	Before time.Time
}

// BulkResult is the answer of a bulk action.
type BulkResult struct {
	Matched int64 `json:"matched"`
	Done    int64 `json:"done"`
}

// IdempotencyBinding is a live idempotency binding.
type IdempotencyBinding struct {
	JobID      string    `json:"job_id"`
	KeyPreview string    `json:"key_preview"`
	KeyDigest  string    `json:"key_digest"`
	ExpiresAt  time.Time `json:"expires_at"`
}

// QueueInfo is a queue with its job counts by state.
type QueueInfo struct {
	Name   string           `json:"name"`
	Paused bool             `json:"paused"`
	Counts map[string]int64 `json:"counts"`
}

// Durability says whether the server's store runs with its durability
// settings checked. The zero value, "", means the server is too old to say.
type Durability string

// The durability of a store, as /healthz reports it.
const (
	DurabilityFull Durability = "full"
	// DurabilityRelaxed: a Redis store opened with ?durability=relaxed, its
	// durable settings unchecked; acknowledged jobs may be lost.
	DurabilityRelaxed Durability = "relaxed"
)

// Health is the answer of /healthz.
type Health struct {
	OK      bool   `json:"ok"`
	Backend string `json:"backend"`
	// Durability is DurabilityFull or DurabilityRelaxed; "" when the server
	// is too old to say.
	Durability Durability `json:"durability"`
}

// Schedule is a named repeatable job.
type Schedule struct {
	Name        string          `json:"name"`
	Cron        string          `json:"cron,omitempty"`
	EveryMs     int64           `json:"every_ms,omitempty"`
	Timezone    string          `json:"timezone"`
	Job         json.RawMessage `json:"job"`
	NextFireAt  *time.Time      `json:"next_fire_at,omitempty"`
	LastFiredAt *time.Time      `json:"last_fired_at,omitempty"`
	Paused      bool            `json:"paused"`
	CreatedAt   time.Time       `json:"created_at"`
	UpdatedAt   time.Time       `json:"updated_at"`
}

// ScheduleDefinition is a cron expression (six fields, seconds first) or an
// interval, and a job template (no idempotency key, job id, run time or
// deadline).
type ScheduleDefinition struct {
	Cron     string
	Every    time.Duration
	Timezone string
	Paused   bool
	Job      JobRequest
}

// GetJob returns the job, or a *NotFoundError.
func (c *Client) GetJob(ctx context.Context, id string) (*Job, error) {
	return c.getJob(ctx, id, 0)
}

// WaitJob holds the request up to wait (at most 60s) until the job is
// terminal, and returns it in whatever state it is then.
func (c *Client) WaitJob(ctx context.Context, id string, wait time.Duration) (*Job, error) {
	return c.getJob(ctx, id, wait)
}

func (c *Client) getJob(ctx context.Context, id string, wait time.Duration) (*Job, error) {
	if wait < 0 {
		return nil, invalid(http.MethodGet, "/v1/jobs/"+pathEscape(id), "wait_ms", "must be from 0 to 60000")
	}
	cl := call{method: http.MethodGet, path: "/v1/jobs/" + pathEscape(id), retry: true, wait: wait}
	if wait > 0 {
		cl.query = url.Values{"wait_ms": {strconv.FormatInt(ms(wait), 10)}}
	}
	var j Job
	if err := c.do(ctx, cl, &j); err != nil {
		return nil, err
	}
	return &j, nil
}

// ListJobs returns a page of jobs, newest first.
func (c *Client) ListJobs(ctx context.Context, opts *ListJobsOptions) (*JobPage, error) {
	q := url.Values{}
	if o := opts; o != nil {
		for k, v := range map[string]string{"state": o.State, "queue": o.Queue, "type": o.Type, "tag": o.Tag, "cursor": o.Cursor} {
			if v != "" {
				q.Set(k, v)
			}
		}
		if o.Limit > 0 {
			q.Set("limit", strconv.Itoa(o.Limit))
		}
	}
	var p JobPage
	if err := c.do(ctx, call{method: http.MethodGet, path: "/v1/jobs", query: q, retry: true}, &p); err != nil {
		return nil, err
	}
	return &p, nil
}

// JobEvents returns the job's events, oldest first.
func (c *Client) JobEvents(ctx context.Context, id string) ([]Event, error) {
	var r struct {
		Events []Event `json:"events"`
	}
	err := c.do(ctx, call{method: http.MethodGet, path: "/v1/jobs/" + pathEscape(id) + "/events", retry: true}, &r)
	return r.Events, err
}

// JobRuns returns the job's run ledger.
func (c *Client) JobRuns(ctx context.Context, id string) ([]Run, error) {
	var r struct {
		Runs []Run `json:"runs"`
	}
	err := c.do(ctx, call{method: http.MethodGet, path: "/v1/jobs/" + pathEscape(id) + "/runs", retry: true}, &r)
	return r.Runs, err
}

// JobCheckpoints returns the job's stored checkpoints by name.
func (c *Client) JobCheckpoints(ctx context.Context, id string) (map[string]json.RawMessage, error) {
	var r struct {
		Checkpoints map[string]json.RawMessage `json:"checkpoints"`
	}
	err := c.do(ctx, call{method: http.MethodGet, path: "/v1/jobs/" + pathEscape(id) + "/checkpoints", retry: true}, &r)
	if r.Checkpoints == nil && err == nil {
		r.Checkpoints = map[string]json.RawMessage{}
	}
	return r.Checkpoints, err
}

// CancelJob cancels a waiting job at once, or flags an active one (its
// worker sees it at the next heartbeat).
func (c *Client) CancelJob(ctx context.Context, id string) (*CancelResult, error) {
	var r CancelResult
	if err := c.do(ctx, call{method: http.MethodPost, path: "/v1/jobs/" + pathEscape(id) + "/cancel", retry: true}, &r); err != nil {
		return nil, err
	}
	return &r, nil
}

// PurgeJob deletes a job that is not active; false for an unknown or active job.
func (c *Client) PurgeJob(ctx context.Context, id string) (bool, error) {
	var r struct {
		Purged bool `json:"purged"`
	}
	err := c.do(ctx, call{method: http.MethodPost, path: "/v1/jobs/" + pathEscape(id) + "/purge", retry: true}, &r)
	return r.Purged, err
}

// PromoteJob makes a scheduled job due now.
func (c *Client) PromoteJob(ctx context.Context, id string) (bool, error) {
	var r struct {
		Promoted bool `json:"promoted"`
	}
	err := c.do(ctx, call{method: http.MethodPost, path: "/v1/jobs/" + pathEscape(id) + "/promote", retry: true}, &r)
	return r.Promoted, err
}

// RedriveJob puts a dead job back to ready (same id). Without an idempotency
// key a second redrive of a job that is no longer dead fails with
// *NotDeadError, so only a keyed redrive is retried.
func (c *Client) RedriveJob(ctx context.Context, id string, opts *RedriveOptions) (*EnqueueResult, error) {
	cl := call{method: http.MethodPost, path: "/v1/jobs/" + pathEscape(id) + "/redrive"}
	body := map[string]any{}
	if o := opts; o != nil {
		if o.IdempotencyKey != "" {
			hv := headerKey(o.IdempotencyKey)
			if hv == "" {
				return nil, &Error{Kind: ProblemValidation, Method: cl.method, Path: cl.path, Index: -1,
					Detail: "a redrive key travels in the Idempotency-Key header and must be printable ASCII"}
			}
			cl.header = http.Header{"Idempotency-Key": {hv}}
			cl.retry = true
			cl.secrets = []string{o.IdempotencyKey}
		}
		if o.MaxAttempts > 0 {
			body["max_attempts"] = o.MaxAttempts
		}
		if p := timePtr(o.Deadline); p != nil {
			body["deadline"] = *p
		}
		if p := timePtr(o.RunAt); p != nil {
			body["run_at"] = *p
		}
		if o.ResetCheckpoints {
			body["reset_checkpoints"] = true
		}
	}
	if len(body) > 0 {
		cl.body = body
	} else {
		cl.body = struct{}{}
	}
	var r EnqueueResult
	if err := c.do(ctx, cl, &r); err != nil {
		return nil, err
	}
	return &r, nil
}

// Bulk actions.
const (
	BulkCancel  = "cancel"
	BulkPurge   = "purge"
	BulkRedrive = "redrive"
)

// BulkAction applies action (BulkCancel, BulkPurge or BulkRedrive) to up to
// limit jobs (0: the server's default, 1,000) matching filter. Cancel and
// purge are retried; a redrive is not.
func (c *Client) BulkAction(ctx context.Context, action string, filter *BulkFilter, limit int) (*BulkResult, error) {
	body := map[string]any{"action": action}
	if f := filter; f != nil {
		fm := map[string]any{}
		for k, v := range map[string]string{"state": f.State, "queue": f.Queue, "type": f.Type, "tag": f.Tag} {
			if v != "" {
				fm[k] = v
			}
		}
		if p := timePtr(f.Before); p != nil {
			fm["before"] = *p
		}
		body["filter"] = fm
	}
	if limit > 0 {
		body["limit"] = limit
	}
	var r BulkResult
	cl := call{method: http.MethodPost, path: "/v1/jobs/bulk", body: body, retry: action != BulkRedrive}
	if err := c.do(ctx, cl, &r); err != nil {
		return nil, err
	}
	return &r, nil
}

// CancelByKey cancels every pending job of type typ whose dedupe key is key,
// and releases the binding; false when there was none.
func (c *Client) CancelByKey(ctx context.Context, typ, key string) (bool, error) {
	var r struct {
		Cancelled bool `json:"cancelled"`
	}
	err := c.do(ctx, call{method: http.MethodPost, path: "/v1/dedupe/cancel",
		body: map[string]string{"type": typ, "key": key}, retry: true}, &r)
	return r.Cancelled, err
}

// DedupeLookup returns the live dedupe binding of key on job type typ, or a
// *NotFoundError.
func (c *Client) DedupeLookup(ctx context.Context, typ, key string) (*DedupeBinding, error) {
	var r DedupeBinding
	if err := c.do(ctx, call{method: http.MethodGet, path: "/v1/dedupe/" + pathEscape(typ) + "/" + pathEscape(key), retry: true}, &r); err != nil {
		return nil, err
	}
	return &r, nil
}

func keyBody(scope, key string) map[string]string {
	b := map[string]string{"key": key}
	if scope != "" {
		b["scope"] = scope
	}
	return b
}

// IdempotencyLookup returns the job that owns the idempotency key in scope
// ("" means "default"), or a *NotFoundError. The key travels in the body.
func (c *Client) IdempotencyLookup(ctx context.Context, scope, key string) (*IdempotencyBinding, error) {
	var r IdempotencyBinding
	if err := c.do(ctx, call{method: http.MethodPost, path: "/v1/idempotency/lookup", body: keyBody(scope, key),
		retry: true, secrets: []string{key}}, &r); err != nil {
		return nil, err
	}
	return &r, nil
}

// ReleaseIdempotency releases the binding of the key in scope ("" means
// "default"), so the key can own a new job; false when there was none.
func (c *Client) ReleaseIdempotency(ctx context.Context, scope, key string) (bool, error) {
	var r struct {
		Released bool `json:"released"`
	}
	err := c.do(ctx, call{method: http.MethodPost, path: "/v1/idempotency/release", body: keyBody(scope, key),
		retry: true, secrets: []string{key}}, &r)
	return r.Released, err
}

// Queues lists every queue with its counts.
func (c *Client) Queues(ctx context.Context) ([]QueueInfo, error) {
	var r struct {
		Queues []QueueInfo `json:"queues"`
	}
	err := c.do(ctx, call{method: http.MethodGet, path: "/v1/queues", retry: true}, &r)
	return r.Queues, err
}

// PauseQueue stops claims from the queue (enqueues still land).
func (c *Client) PauseQueue(ctx context.Context, name string) (bool, error) {
	return c.pause(ctx, name, "pause")
}

// ResumeQueue lets claims take from the queue again.
func (c *Client) ResumeQueue(ctx context.Context, name string) (bool, error) {
	return c.pause(ctx, name, "resume")
}

func (c *Client) pause(ctx context.Context, name, verb string) (bool, error) {
	var r struct {
		Paused bool `json:"paused"`
	}
	err := c.do(ctx, call{method: http.MethodPost, path: "/v1/queues/" + pathEscape(name) + "/" + verb, retry: true}, &r)
	return r.Paused, err
}

// Schedules lists every schedule.
func (c *Client) Schedules(ctx context.Context) ([]Schedule, error) {
	var r struct {
		Schedules []Schedule `json:"schedules"`
	}
	err := c.do(ctx, call{method: http.MethodGet, path: "/v1/schedules", retry: true}, &r)
	return r.Schedules, err
}

// PutSchedule creates or replaces the schedule name.
func (c *Client) PutSchedule(ctx context.Context, name string, def ScheduleDefinition) (*Schedule, error) {
	job, _ := buildEnqueue(def.Job.Type, def.Job.Payload, def.Job.Options, false)
	body := map[string]any{"job": job}
	if def.Cron != "" {
		body["cron"] = def.Cron
	}
	if def.Every != 0 {
		body["every_ms"] = ms(def.Every)
	}
	if def.Timezone != "" {
		body["timezone"] = def.Timezone
	}
	if def.Paused {
		body["paused"] = true
	}
	var r Schedule
	cl := call{method: http.MethodPut, path: "/v1/schedules/" + pathEscape(name), body: body, retry: true,
		secrets: def.Job.Options.secrets()}
	if err := c.do(ctx, cl, &r); err != nil {
		return nil, err
	}
	return &r, nil
}

// DeleteSchedule deletes the schedule; false when there was none.
func (c *Client) DeleteSchedule(ctx context.Context, name string) (bool, error) {
	var r struct {
		Deleted bool `json:"deleted"`
	}
	err := c.do(ctx, call{method: http.MethodDelete, path: "/v1/schedules/" + pathEscape(name), retry: true}, &r)
	return r.Deleted, err
}

// Health asks GET /healthz. A server whose backend is down answers
// *UnavailableError.
func (c *Client) Health(ctx context.Context) (*Health, error) {
	var r Health
	if err := c.do(ctx, call{method: http.MethodGet, path: "/healthz", retry: true}, &r); err != nil {
		return nil, err
	}
	return &r, nil
}
