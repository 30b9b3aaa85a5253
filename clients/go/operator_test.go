package idemq

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"
)

// deadJob enqueues a job of typ and makes it dead through the worker protocol.
func deadJob(t *testing.T, ctx context.Context, c *Client, typ string) string {
	t.Helper()
	id, err := c.Enqueue(ctx, typ, map[string]any{"n": 1}, &EnqueueOptions{MaxAttempts: 1, Queue: "ops"})
	if err != nil {
		t.Fatal(err)
	}
	resp, err := c.Claim(ctx, ClaimRequest{Queues: []string{"ops"}, Types: []string{typ}, Worker: "go-test", Limit: 1})
	if err != nil || len(resp.Jobs) != 1 || resp.Jobs[0].ID != id {
		t.Fatalf("claim: %+v %v", resp, err)
	}
	fr, err := c.Fail(ctx, id, resp.Jobs[0].LeaseToken, FailOptions{Error: "boom", Permanent: true})
	if err != nil || fr.State != StateDead {
		t.Fatalf("fail: %+v %v", fr, err)
	}
	return id
}

func TestJobQueriesAndOperatorActions(t *testing.T) {
	c := newTestClient()
	ctx := ctxT(t)
	typ := uniq("ops")

	t.Run("get_wait_list_cursor", func(t *testing.T) {
		var ids []string
		for i := 0; i < 5; i++ {
			id, err := c.Enqueue(ctx, typ, map[string]any{"i": i}, &EnqueueOptions{Tags: []string{"t1", "grp"}, Queue: "listing", Delay: time.Hour})
			if err != nil {
				t.Fatal(err)
			}
			ids = append(ids, id)
		}
		job, err := c.GetJob(ctx, ids[0])
		if err != nil || job.ID != ids[0] || job.Type != typ || job.State != StateScheduled || len(job.Tags) != 2 {
			t.Fatalf("%+v %v", job, err)
		}
		var p map[string]int
		if err := job.DecodePayload(&p); err != nil || p["i"] != 0 {
			t.Fatalf("payload %v %v", p, err)
		}
		// A wait on a job that does not finish returns it as it is, after the wait.
		start := time.Now()
		job, err = c.WaitJob(ctx, ids[0], 300*time.Millisecond)
		if err != nil || job.State != StateScheduled || time.Since(start) < 250*time.Millisecond {
			t.Fatalf("wait: %+v %v after %v", job, err, time.Since(start))
		}
		seen := map[string]bool{}
		cursor := ""
		for pages := 0; ; pages++ {
			page, err := c.ListJobs(ctx, &ListJobsOptions{Type: typ, Tag: "grp", State: StateScheduled, Queue: "listing", Limit: 2, Cursor: cursor})
			if err != nil {
				t.Fatal(err)
			}
			for _, j := range page.Jobs {
				seen[j.ID] = true
			}
			if page.NextCursor == "" {
				break
			}
			cursor = page.NextCursor
			if pages > 5 {
				t.Fatal("the cursor never ends")
			}
		}
		if len(seen) != 5 {
			t.Fatalf("paged through %d of 5 jobs", len(seen))
		}
		if page, _ := c.ListJobs(ctx, &ListJobsOptions{Type: typ, State: StateReady}); len(page.Jobs) != 0 {
			t.Fatal("state filter ignored")
		}
		if _, err := c.ListJobs(ctx, &ListJobsOptions{State: "sleeping"}); !errors.Is(err, ErrValidation) {
			t.Fatalf("unknown state: %v", err)
		}

		ok, err := c.PromoteJob(ctx, ids[0])
		if err != nil || !ok {
			t.Fatalf("promote: %v %v", ok, err)
		}
		if job, _ := c.GetJob(ctx, ids[0]); job.State != StateReady {
			t.Fatalf("after promote: %s", job.State)
		}
		cr, err := c.CancelJob(ctx, ids[1])
		if err != nil || !cr.Cancelled || cr.State != StateCancelled {
			t.Fatalf("cancel: %+v %v", cr, err)
		}
		cr, err = c.CancelJob(ctx, ids[1])
		if err != nil || cr.Cancelled || cr.State != StateCancelled {
			t.Fatalf("cancel again: %+v %v", cr, err)
		}
		purged, err := c.PurgeJob(ctx, ids[1])
		if err != nil || !purged {
			t.Fatalf("purge: %v %v", purged, err)
		}
		if _, err := c.GetJob(ctx, ids[1]); !errors.Is(err, ErrNotFound) {
			t.Fatalf("purged job: %v", err)
		}
		if purged, _ := c.PurgeJob(ctx, ids[1]); purged {
			t.Fatal("purged twice")
		}
		br, err := c.BulkAction(ctx, BulkCancel, &BulkFilter{Type: typ, State: StateScheduled, Before: time.Now().Add(time.Minute)}, 10)
		if err != nil || br.Matched != 3 || br.Done != 3 {
			t.Fatalf("bulk cancel: %+v %v", br, err)
		}
		events, err := c.JobEvents(ctx, ids[2])
		if err != nil || len(events) < 2 || events[0].Kind != "accepted" || events[len(events)-1].Kind != "cancelled" {
			t.Fatalf("events: %+v %v", events, err)
		}
	})

	t.Run("runs_checkpoints_redrive", func(t *testing.T) {
		rtyp := uniq("redrive")
		id := deadJob(t, ctx, c, rtyp)
		runs, err := c.JobRuns(ctx, id)
		if err != nil || len(runs) != 1 || runs[0].Worker != "go-test" || runs[0].Outcome == nil || *runs[0].Outcome != "failed" {
			t.Fatalf("runs: %+v %v", runs, err)
		}
		job, _ := c.GetJob(ctx, id)
		if job.State != StateDead || job.LastError == nil || *job.LastError != "boom" {
			t.Fatalf("dead job: %+v", job)
		}
		key := uniq("redrive-key")
		r, err := c.RedriveJob(ctx, id, &RedriveOptions{IdempotencyKey: key, MaxAttempts: 2})
		if err != nil || r.Outcome != OutcomeAccepted || r.JobID != id {
			t.Fatalf("redrive: %+v %v", r, err)
		}
		r, err = c.RedriveJob(ctx, id, &RedriveOptions{IdempotencyKey: key, MaxAttempts: 2})
		if err != nil || r.Outcome != OutcomeReplayed {
			t.Fatalf("redrive replay: %+v %v", r, err)
		}
		_, err = c.RedriveJob(ctx, id, nil)
		var nd *NotDeadError
		if !errors.As(err, &nd) || nd.JobID != id || !errors.Is(err, ErrNotDead) {
			t.Fatalf("redrive of a ready job: %T %v", err, err)
		}
		rtyp2 := rtyp + "-b"
		other := deadJob(t, ctx, c, rtyp2)
		_, err = c.RedriveJob(ctx, other, &RedriveOptions{IdempotencyKey: key, MaxAttempts: 2})
		var conflict *EnqueueIdempotencyConflictError
		if !errors.As(err, &conflict) || len(conflict.Fields) != 1 || conflict.Fields[0] != "job_id" {
			t.Fatalf("a redrive key reused: %T %v", err, err)
		}
		mustNoRawKey(t, key, err.Error())
		br, err := c.BulkAction(ctx, BulkRedrive, &BulkFilter{Type: rtyp2, State: StateDead}, 0)
		if err != nil || br.Matched != 1 || br.Done != 1 {
			t.Fatalf("bulk redrive: %+v %v", br, err)
		}

		// Checkpoints through the low-level calls: the first writer wins.
		resp, err := c.Claim(ctx, ClaimRequest{Queues: []string{"ops"}, Types: []string{rtyp, rtyp2}, Worker: "go-test", Limit: 1, Lease: 5 * time.Second})
		if err != nil || len(resp.Jobs) != 1 {
			t.Fatalf("claim: %+v %v", resp, err)
		}
		j := resp.Jobs[0]
		stored, err := c.PutCheckpoint(ctx, j.ID, "step one", j.LeaseToken, map[string]int{"v": 1})
		if err != nil || !stored {
			t.Fatalf("put: %v %v", stored, err)
		}
		stored, err = c.PutCheckpoint(ctx, j.ID, "step one", j.LeaseToken, map[string]int{"v": 2})
		if err != nil || stored {
			t.Fatalf("second put: %v %v", stored, err)
		}
		cps, err := c.JobCheckpoints(ctx, j.ID)
		if err != nil || string(cps["step one"]) != `{"v":1}` {
			t.Fatalf("checkpoints: %s %v", cps["step one"], err)
		}
		hb, err := c.Heartbeat(ctx, j.ID, j.LeaseToken)
		if err != nil || hb.CancelRequested || hb.LeaseExpiresAt.IsZero() {
			t.Fatalf("heartbeat: %+v %v", hb, err)
		}
		st, err := c.Release(ctx, j.ID, j.LeaseToken)
		if err != nil || st != StateReady {
			t.Fatalf("release: %q %v", st, err)
		}
		resp, err = c.Claim(ctx, ClaimRequest{Queues: []string{"ops"}, Types: []string{rtyp, rtyp2}, Worker: "go-test", Limit: 5})
		if err != nil || len(resp.Jobs) != 2 {
			t.Fatalf("claim again: %+v %v", resp, err)
		}
		for _, j := range resp.Jobs {
			st, err := c.Complete(ctx, j.ID, j.LeaseToken, map[string]string{"done": j.ID})
			if err != nil || st != StateCompleted {
				t.Fatalf("complete: %q %v", st, err)
			}
		}
		job, _ = c.WaitJob(ctx, resp.Jobs[0].ID, time.Second)
		var res map[string]string
		if err := job.DecodeResult(&res); err != nil || res["done"] != job.ID || job.State != StateCompleted {
			t.Fatalf("result: %v %v %s", res, err, job.State)
		}
		if _, err := c.Complete(ctx, j.ID, resp.Jobs[0].LeaseToken+"x", nil); !errors.Is(err, ErrLeaseLost) {
			t.Fatalf("complete with a stale token: %v", err)
		}
	})

	t.Run("bindings", func(t *testing.T) {
		key := uniq("lookup-key")
		id, err := c.Enqueue(ctx, typ, nil, &EnqueueOptions{IdempotencyKey: key, Scope: "lookups"})
		if err != nil {
			t.Fatal(err)
		}
		b, err := c.IdempotencyLookup(ctx, "lookups", key)
		if err != nil || b.JobID != id || b.KeyPreview != KeyPreview(key) || len(b.KeyDigest) != 16 || b.ExpiresAt.IsZero() {
			t.Fatalf("lookup: %+v %v", b, err)
		}
		if _, err := c.IdempotencyLookup(ctx, "", key); !errors.Is(err, ErrNotFound) {
			t.Fatalf("lookup in the default scope: %v", err)
		}
		released, err := c.ReleaseIdempotency(ctx, "lookups", key)
		if err != nil || !released {
			t.Fatalf("release: %v %v", released, err)
		}
		r, err := c.EnqueueWithResult(ctx, typ, "new work", &EnqueueOptions{IdempotencyKey: key, Scope: "lookups"})
		if err != nil || r.Outcome != OutcomeAccepted || r.JobID == id {
			t.Fatalf("after release: %+v %v", r, err)
		}
	})

	t.Run("queues", func(t *testing.T) {
		q := uniq("q")
		if _, err := c.Enqueue(ctx, typ, nil, &EnqueueOptions{Queue: q}); err != nil {
			t.Fatal(err)
		}
		paused, err := c.PauseQueue(ctx, q)
		if err != nil || !paused {
			t.Fatalf("pause: %v %v", paused, err)
		}
		resp, err := c.Claim(ctx, ClaimRequest{Queues: []string{q}, Worker: "go-test"})
		if err != nil || len(resp.Jobs) != 0 {
			t.Fatalf("claim from a paused queue: %+v %v", resp, err)
		}
		queues, err := c.Queues(ctx)
		if err != nil {
			t.Fatal(err)
		}
		found := false
		for _, qi := range queues {
			if qi.Name == q {
				found = qi.Paused && qi.Counts["ready"] == 1
			}
		}
		if !found {
			t.Fatalf("queue %s not listed as paused with one ready job: %+v", q, queues)
		}
		paused, err = c.ResumeQueue(ctx, q)
		if err != nil || paused {
			t.Fatalf("resume: %v %v", paused, err)
		}
	})

	t.Run("schedules", func(t *testing.T) {
		name := uniq("nightly")
		s, err := c.PutSchedule(ctx, name, ScheduleDefinition{Cron: "0 0 3 * * *", Timezone: "Europe/Paris",
			Job: JobRequest{Type: typ, Payload: map[string]any{"report": true}, Options: &EnqueueOptions{Queue: "reports"}}})
		if err != nil || s.Name != name || s.Cron != "0 0 3 * * *" || s.NextFireAt == nil {
			t.Fatalf("put: %+v %v", s, err)
		}
		every := uniq("every")
		if _, err := c.PutSchedule(ctx, every, ScheduleDefinition{Every: time.Hour, Paused: true, Job: JobRequest{Type: typ}}); err != nil {
			t.Fatal(err)
		}
		list, err := c.Schedules(ctx)
		if err != nil {
			t.Fatal(err)
		}
		got := map[string]Schedule{}
		for _, s := range list {
			got[s.Name] = s
		}
		var tmpl map[string]any
		_ = json.Unmarshal(got[name].Job, &tmpl)
		if got[name].Timezone != "Europe/Paris" || tmpl["queue"] != "reports" || got[every].EveryMs != 3600000 || !got[every].Paused {
			t.Fatalf("schedules: %+v", got)
		}
		if _, err := c.PutSchedule(ctx, uniq("bad"), ScheduleDefinition{Cron: "not a cron", Job: JobRequest{Type: typ}}); !errors.Is(err, ErrValidation) {
			t.Fatalf("a bad cron: %v", err)
		}
		for _, n := range []string{name, every} {
			deleted, err := c.DeleteSchedule(ctx, n)
			if err != nil || !deleted {
				t.Fatalf("delete %s: %v %v", n, deleted, err)
			}
		}
		if deleted, _ := c.DeleteSchedule(ctx, name); deleted {
			t.Fatal("deleted twice")
		}
	})

	t.Run("health", func(t *testing.T) {
		h, err := c.Health(ctx)
		// Relaxed only on a Redis store opened with ?durability=relaxed.
		if err != nil || !h.OK || h.Backend != backend || h.Durability != DurabilityFull {
			t.Fatalf("%+v %v", h, err)
		}
	})
}

// cannedBodies answers each request with the next of its JSON bodies.
type cannedBodies struct {
	mu     sync.Mutex
	bodies []string
	paths  []string
}

func (c *cannedBodies) RoundTrip(r *http.Request) (*http.Response, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.paths = append(c.paths, r.Method+" "+r.URL.Path)
	body := c.bodies[0]
	c.bodies = c.bodies[1:]
	return &http.Response{
		StatusCode: http.StatusOK,
		Header:     http.Header{"Content-Type": []string{"application/json"}},
		Body:       io.NopCloser(strings.NewReader(body)),
		Request:    r,
	}, nil
}

func TestHealthReadsDurability(t *testing.T) {
	canned := &cannedBodies{bodies: []string{
		`{"ok": true, "backend": "redis", "durability": "relaxed", "newer": 1}`,
		`{"ok": true, "backend": "sqlite"}`,
	}}
	c := NewClient("http://127.0.0.1:9", WithHTTPClient(&http.Client{Transport: canned}), WithoutRetries())
	ctx := ctxT(t)
	h, err := c.Health(ctx)
	if err != nil || *h != (Health{OK: true, Backend: "redis", Durability: DurabilityRelaxed}) {
		t.Fatalf("relaxed: %+v %v", h, err)
	}
	// A server from before the member: too old to say, not DurabilityFull.
	h, err = c.Health(ctx)
	if err != nil || *h != (Health{OK: true, Backend: "sqlite", Durability: ""}) {
		t.Fatalf("an older server: %+v %v", h, err)
	}
	if strings.Join(canned.paths, ",") != "GET /healthz,GET /healthz" {
		t.Fatalf("sent %v", canned.paths)
	}
}

// "." and ".." are valid job ids; Go's client sends them as path segments
// as they are, and the server reads them so.
func TestJobIDsOfDotsAreReachable(t *testing.T) {
	c := newTestClient()
	ctx := ctxT(t)
	q := uniq("dots")
	for _, id := range []string{".", ".."} {
		got, err := c.Enqueue(ctx, "dots.job", map[string]any{"id": id}, &EnqueueOptions{JobID: id, Queue: q})
		if err != nil || got != id {
			t.Fatalf("enqueue %q: %q %v", id, got, err)
		}
		job, err := c.GetJob(ctx, id)
		if err != nil || job.ID != id || job.Queue != q {
			t.Fatalf("get %q: %+v %v", id, job, err)
		}
		cancelled, err := c.CancelJob(ctx, id)
		if err != nil || cancelled.State != StateCancelled {
			t.Fatalf("cancel %q: %+v %v", id, cancelled, err)
		}
	}
}
