package idemq

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// runWorker runs w until the returned stop function is called; stop waits
// for Run to return and hands back its error.
func runWorker(t *testing.T, w *Worker) (stop func() error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	var once sync.Once
	var err error
	stop = func() error {
		once.Do(func() {
			cancel()
			select {
			case err = <-done:
			case <-time.After(30 * time.Second):
				err = errors.New("the worker did not stop within 30s")
			}
		})
		return err
	}
	t.Cleanup(func() { _ = stop() })
	return stop
}

// expectStats waits until the worker's stats satisfy want, or fails the test
// after five seconds. A worker counts an attempt once the server answered for
// it, so a test that already saw the job's new state can read the stats a
// moment before they are counted.
func expectStats(t *testing.T, w *Worker, want func(WorkerStats) bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		st := w.Stats()
		if want(st) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("stats %+v", st)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// waitState polls until the job is in state, or fails the test.
func waitState(t *testing.T, c *Client, id, state string, within time.Duration) *Job {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		job, err := c.WaitJob(context.Background(), id, 200*time.Millisecond)
		if err != nil {
			t.Fatal(err)
		}
		if job.State == state {
			return job
		}
		if time.Now().After(deadline) {
			t.Fatalf("job %s is %s after %v, want %s", id, job.State, within, state)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestWorkerDrainsJobs(t *testing.T) {
	c := newTestClient()
	ctx := ctxT(t)
	q, typ := uniq("drain"), uniq("math.add")
	const n = 40
	ids := make([]string, n)
	for i := range ids {
		id, err := c.Enqueue(ctx, typ, map[string]int{"a": i, "b": 1}, &EnqueueOptions{Queue: q})
		if err != nil {
			t.Fatal(err)
		}
		ids[i] = id
	}
	var runs, inFlight, maxInFlight int64
	w := NewWorker(c, WorkerOptions{
		Queues: []string{q}, Concurrency: 4, PollWait: 200 * time.Millisecond,
		Handlers: map[string]HandlerFunc{typ: func(ctx context.Context, job *ClaimedJob) (any, error) {
			cur := atomic.AddInt64(&inFlight, 1)
			defer atomic.AddInt64(&inFlight, -1)
			for {
				m := atomic.LoadInt64(&maxInFlight)
				if cur <= m || atomic.CompareAndSwapInt64(&maxInFlight, m, cur) {
					break
				}
			}
			atomic.AddInt64(&runs, 1)
			var p struct{ A, B int }
			if err := job.Decode(&p); err != nil {
				return nil, Permanent(err)
			}
			time.Sleep(10 * time.Millisecond)
			return map[string]int{"sum": p.A + p.B}, nil
		}},
	})
	stop := runWorker(t, w)
	for i, id := range ids {
		job := waitState(t, c, id, StateCompleted, 30*time.Second)
		var r map[string]int
		if err := job.DecodeResult(&r); err != nil || r["sum"] != i+1 {
			t.Fatalf("job %d result %v %v", i, r, err)
		}
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if st := w.Stats(); st.Completed != n || st.Lost != 0 || runs != n {
		t.Fatalf("stats %+v, %d runs", st, runs)
	}
	if maxInFlight > 4 || maxInFlight < 2 {
		t.Fatalf("at most %d handlers ran at once with concurrency 4", maxInFlight)
	}
}

func TestWorkerRetriesAFailingJob(t *testing.T) {
	c := newTestClient()
	ctx := ctxT(t)
	q := uniq("retry")
	flaky, perm, snooze, after := uniq("flaky"), uniq("perm"), uniq("snooze"), uniq("after")
	var flakyRuns, snoozeRuns, afterRuns int64
	var afterFirst, afterSecond int64 // unix nanoseconds
	w := NewWorker(c, WorkerOptions{
		Queues: []string{q}, Concurrency: 4, PollWait: 200 * time.Millisecond,
		Handlers: map[string]HandlerFunc{
			flaky: func(ctx context.Context, job *ClaimedJob) (any, error) {
				if atomic.AddInt64(&flakyRuns, 1) == 1 {
					return nil, errors.New("the provider timed out")
				}
				return "ok", nil
			},
			perm: func(ctx context.Context, job *ClaimedJob) (any, error) {
				return nil, Permanent(errors.New("card declined"))
			},
			snooze: func(ctx context.Context, job *ClaimedJob) (any, error) {
				if atomic.AddInt64(&snoozeRuns, 1) == 1 {
					return nil, Snooze(100 * time.Millisecond)
				}
				return "woke", nil
			},
			after: func(ctx context.Context, job *ClaimedJob) (any, error) {
				if atomic.AddInt64(&afterRuns, 1) == 1 {
					atomic.StoreInt64(&afterFirst, time.Now().UnixNano())
					return nil, RetryAfter(errors.New("rate limited"), 700*time.Millisecond)
				}
				atomic.StoreInt64(&afterSecond, time.Now().UnixNano())
				return nil, nil
			},
		},
	})
	retry := FixedBackoff(50 * time.Millisecond)
	flakyID, _ := c.Enqueue(ctx, flaky, nil, &EnqueueOptions{Queue: q, Retry: retry})
	permID, _ := c.Enqueue(ctx, perm, nil, &EnqueueOptions{Queue: q, Retry: retry})
	snoozeID, _ := c.Enqueue(ctx, snooze, nil, &EnqueueOptions{Queue: q, Retry: retry, MaxAttempts: 1})
	afterID, _ := c.Enqueue(ctx, after, nil, &EnqueueOptions{Queue: q, Retry: retry})
	runWorker(t, w)

	job := waitState(t, c, flakyID, StateCompleted, 20*time.Second)
	runs, _ := c.JobRuns(ctx, flakyID)
	if job.Attempt != 2 || len(runs) != 2 || *runs[0].Outcome != "failed" || *runs[0].Error != "the provider timed out" || *runs[1].Outcome != "completed" {
		t.Fatalf("flaky job: attempt %d, runs %+v", job.Attempt, runs)
	}
	job = waitState(t, c, permID, StateDead, 20*time.Second)
	if job.Attempt != 1 || job.LastError == nil || *job.LastError != "card declined" {
		t.Fatalf("permanent failure: %+v", job)
	}
	// A snooze does not consume the single attempt.
	job = waitState(t, c, snoozeID, StateCompleted, 20*time.Second)
	runs, _ = c.JobRuns(ctx, snoozeID)
	if job.AttemptsUsed != 1 || len(runs) != 2 || *runs[0].Outcome != "snoozed" {
		t.Fatalf("snoozed job: used %d, runs %+v", job.AttemptsUsed, runs)
	}
	waitState(t, c, afterID, StateCompleted, 20*time.Second)
	if gap := time.Duration(atomic.LoadInt64(&afterSecond) - atomic.LoadInt64(&afterFirst)); gap < 600*time.Millisecond {
		t.Fatalf("retry-after 700ms, retried after %v", gap)
	}
}

func TestWorkerStopsOnCancel(t *testing.T) {
	c := newTestClient()
	ctx := ctxT(t)
	q, typ := uniq("cancel"), uniq("long")
	started := make(chan struct{})
	reason := make(chan error, 1)
	w := NewWorker(c, WorkerOptions{
		Queues: []string{q}, Lease: 600 * time.Millisecond, PollWait: 200 * time.Millisecond,
		Handlers: map[string]HandlerFunc{typ: func(ctx context.Context, job *ClaimedJob) (any, error) {
			close(started)
			select {
			case <-ctx.Done():
				reason <- job.StopReason()
				return nil, ctx.Err()
			case <-time.After(20 * time.Second):
				return "not stopped", nil
			}
		}},
	})
	id, _ := c.Enqueue(ctx, typ, nil, &EnqueueOptions{Queue: q})
	runWorker(t, w)
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("the job never started")
	}
	cr, err := c.CancelJob(ctx, id)
	if err != nil || !cr.Cancelled || cr.State != StateActive {
		t.Fatalf("cancel: %+v %v", cr, err)
	}
	select {
	case r := <-reason:
		if r != ErrJobCancelled {
			t.Fatalf("stop reason %v", r)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the handler was not stopped by the cancel")
	}
	waitState(t, c, id, StateCancelled, 5*time.Second)
	expectStats(t, w, func(st WorkerStats) bool { return st.Cancelled == 1 && st.Failed == 1 && st.Completed == 0 })
}

// A handler that ignores its ctx after a cancel gets CancelGrace to return;
// then its attempt is failed (the job turns cancelled), its slot is freed
// and what it returns later is dropped.
func TestWorkerFailsAHandlerThatIgnoresACancel(t *testing.T) {
	c := newTestClient()
	ctx := ctxT(t)
	q, typ := uniq("cancel-ignored"), uniq("stubborn")
	started := make(chan string, 2)
	returned := make(chan struct{}, 2)
	// The first handler ignores its ctx: it returns only once the test
	// closes release, after the next job completed, however long the
	// cancel, the grace and that job took.
	release := make(chan struct{})
	var releaseOnce sync.Once
	releaseHandler := func() { releaseOnce.Do(func() { close(release) }) }
	w := NewWorker(c, WorkerOptions{
		Queues: []string{q}, Concurrency: 1, Lease: 600 * time.Millisecond, PollWait: 200 * time.Millisecond,
		CancelGrace: 300 * time.Millisecond,
		Handlers: map[string]HandlerFunc{typ: func(ctx context.Context, job *ClaimedJob) (any, error) {
			started <- job.ID
			if job.Payload != nil && string(job.Payload) == `"quick"` {
				return "quick", nil
			}
			<-release // ignores ctx
			returned <- struct{}{}
			return "done", nil
		}},
	})
	id, _ := c.Enqueue(ctx, typ, nil, &EnqueueOptions{Queue: q})
	runWorker(t, w)
	// Registered after runWorker, so that it runs before the worker is
	// stopped: a test that fails early does not leave the handler blocked.
	t.Cleanup(releaseHandler)
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("the job never started")
	}
	if cr, err := c.CancelJob(ctx, id); err != nil || !cr.Cancelled || cr.State != StateActive {
		t.Fatalf("cancel: %+v %v", cr, err)
	}
	// The handler cannot return before release is closed: the job turns
	// cancelled only because the worker failed the attempt after CancelGrace.
	job := waitState(t, c, id, StateCancelled, 10*time.Second)
	runs, err := c.JobRuns(ctx, id)
	if err != nil || len(runs) != 1 || runs[0].Error == nil || *runs[0].Error != "cancelled while running" {
		t.Fatalf("runs %+v %v", runs, err)
	}
	if job.Result != nil && string(job.Result) != "null" {
		t.Fatalf("result %s", job.Result)
	}
	// The slot is free while the first handler still waits: with
	// Concurrency 1, another job runs.
	next, _ := c.Enqueue(ctx, typ, "quick", &EnqueueOptions{Queue: q})
	waitState(t, c, next, StateCompleted, 10*time.Second)
	select {
	case <-returned:
		t.Fatal("the first handler returned before the second job ran")
	default:
	}
	// Its eventual return records nothing.
	releaseHandler()
	select {
	case <-returned:
	case <-time.After(10 * time.Second):
		t.Fatal("the first handler never returned")
	}
	time.Sleep(300 * time.Millisecond)
	if job, err := c.GetJob(ctx, id); err != nil || job.State != StateCancelled {
		t.Fatalf("after the handler returned: %+v %v", job, err)
	}
	expectStats(t, w, func(st WorkerStats) bool {
		return st.Cancelled == 1 && st.Failed == 1 && st.Completed == 1 && st.Lost == 0
	})
}

// callRecorder records the completions a worker sends: carried on claims
// the server took, in batches, or one per call. With refuseCarried it
// answers a claim carrying completions as a server from before claims took
// them does (400, an unknown member); with dropCarried it strips them from
// the claim, as a server that ignores the member would, so the answer holds
// no results for them.
type callRecorder struct {
	refuseCarried, dropCarried bool

	mu             sync.Mutex
	carried        []string // job ids
	batched        []string
	singles        []string
	claimsCarrying int
}

func (r *callRecorder) RoundTrip(req *http.Request) (*http.Response, error) {
	var body map[string]json.RawMessage
	if req.GetBody != nil {
		rc, err := req.GetBody()
		if err != nil {
			return nil, err
		}
		raw, err := io.ReadAll(rc)
		rc.Close()
		if err != nil {
			return nil, err
		}
		_ = json.Unmarshal(raw, &body)
	}
	ids := func(member string) []string {
		var items []struct {
			ID string `json:"id"`
		}
		_ = json.Unmarshal(body[member], &items)
		out := make([]string, len(items))
		for i, it := range items {
			out[i] = it.ID
		}
		return out
	}
	path := req.URL.Path
	r.mu.Lock()
	switch {
	case req.Method != http.MethodPost:
	case path == "/v1/claim" && len(body["complete"]) > 0:
		r.claimsCarrying++
		switch {
		case r.refuseCarried:
			if req.Body != nil {
				req.Body.Close()
			}
			r.mu.Unlock()
			problem := `{"type":"/problems/bad-request","title":"Bad request","status":400,` +
				`"detail":"unknown field ` + "`complete`" + `","field":"complete"}`
			return &http.Response{
				StatusCode: http.StatusBadRequest, Status: "400 Bad Request", Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
				Header:        http.Header{"Content-Type": {"application/problem+json"}},
				Body:          io.NopCloser(strings.NewReader(problem)),
				ContentLength: int64(len(problem)), Request: req,
			}, nil
		case r.dropCarried:
			delete(body, "complete")
			raw, _ := json.Marshal(body)
			if req.Body != nil {
				req.Body.Close()
			}
			req = req.Clone(req.Context())
			req.Body, req.GetBody, req.ContentLength = io.NopCloser(bytes.NewReader(raw)), nil, int64(len(raw))
		default:
			r.carried = append(r.carried, ids("complete")...)
		}
	case path == "/v1/jobs/complete":
		r.batched = append(r.batched, ids("jobs")...)
	case strings.HasSuffix(path, "/complete"):
		r.singles = append(r.singles, strings.TrimSuffix(strings.TrimPrefix(path, "/v1/jobs/"), "/complete"))
	}
	r.mu.Unlock()
	return http.DefaultTransport.RoundTrip(req)
}

func (r *callRecorder) claimsWithCompletions() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.claimsCarrying
}

// sent returns the job ids whose completions were sent, however they went.
func (r *callRecorder) sent() (carried, batched, singles []string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.carried...), append([]string(nil), r.batched...), append([]string(nil), r.singles...)
}

func TestWorkerLosesALeaseAndDoesNotComplete(t *testing.T) {
	rec := &callRecorder{}
	c := newTestClient(WithHTTPClient(&http.Client{Transport: rec}))
	ctx := ctxT(t)
	q, typ := uniq("lease"), uniq("stuck")
	finished := make(chan struct{})
	w := NewWorker(c, WorkerOptions{
		// Heartbeats stop: the interval is far beyond the lease.
		Queues: []string{q}, Lease: 400 * time.Millisecond, HeartbeatInterval: time.Hour, PollWait: 200 * time.Millisecond,
		Handlers: map[string]HandlerFunc{typ: func(ctx context.Context, job *ClaimedJob) (any, error) {
			if job.Attempt > 1 {
				return "from the new attempt", nil
			}
			defer close(finished)
			time.Sleep(2500 * time.Millisecond) // ignores ctx on purpose
			if job.StopReason() != ErrLeaseLost {
				t.Errorf("stop reason %v", job.StopReason())
			}
			return "from the stale attempt", nil
		}},
	})
	id, _ := c.Enqueue(ctx, typ, nil, &EnqueueOptions{Queue: q})
	stop := runWorker(t, w)
	// The lease expires, the job is claimed again (by this worker: its slot
	// was freed when it gave the lease up) and completed by the new attempt.
	job := waitState(t, c, id, StateCompleted, 15*time.Second)
	<-finished
	time.Sleep(300 * time.Millisecond)
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	job, _ = c.GetJob(ctx, id)
	runs, _ := c.JobRuns(ctx, id)
	if string(job.Result) != `"from the new attempt"` || job.Attempt != 2 || len(runs) != 2 ||
		*runs[0].Outcome != "lease_expired" || *runs[1].Outcome != "completed" {
		t.Fatalf("job %+v runs %+v", job, runs)
	}
	carried, batched, singles := rec.sent()
	if n := len(carried) + len(batched) + len(singles); n != 1 {
		t.Fatalf("%d completions sent; the stale attempt must send none", n)
	}
	expectStats(t, w, func(st WorkerStats) bool { return st.Lost == 1 && st.Completed == 1 })
}

func TestCheckpointsSurviveARetry(t *testing.T) {
	c := newTestClient()
	ctx := ctxT(t)
	q, typ := uniq("cp"), uniq("charge")
	var charges, attempts int64
	w := NewWorker(c, WorkerOptions{
		Queues: []string{q}, PollWait: 200 * time.Millisecond,
		Handlers: map[string]HandlerFunc{typ: func(ctx context.Context, job *ClaimedJob) (any, error) {
			attempt := atomic.AddInt64(&attempts, 1)
			charge, err := Checkpoint(ctx, job, "charge", func(ctx context.Context) (string, error) {
				return fmt.Sprintf("ch_%d", atomic.AddInt64(&charges, 1)), nil
			})
			if err != nil {
				return nil, err
			}
			if attempt == 1 {
				return nil, errors.New("crashed after the charge")
			}
			return map[string]string{"charge": charge}, nil
		}},
	})
	id, _ := c.Enqueue(ctx, typ, map[string]int{"cents": 500}, &EnqueueOptions{Queue: q, Retry: FixedBackoff(50 * time.Millisecond)})
	runWorker(t, w)
	job := waitState(t, c, id, StateCompleted, 20*time.Second)
	if string(job.Result) != `{"charge":"ch_1"}` || atomic.LoadInt64(&charges) != 1 || atomic.LoadInt64(&attempts) != 2 {
		t.Fatalf("result %s, %d charges in %d attempts", job.Result, atomic.LoadInt64(&charges), atomic.LoadInt64(&attempts))
	}
	cps, _ := c.JobCheckpoints(ctx, id)
	if string(cps["charge"]) != `"ch_1"` {
		t.Fatalf("checkpoints %v", cps)
	}
}

func TestWorkerEnforcesTimeoutLocally(t *testing.T) {
	c := newTestClient()
	ctx := ctxT(t)
	q, slow := uniq("limits"), uniq("slow")
	reasons := make(chan error, 4)
	w := NewWorker(c, WorkerOptions{
		Queues: []string{q}, Concurrency: 4, PollWait: 200 * time.Millisecond,
		Handlers: map[string]HandlerFunc{slow: func(ctx context.Context, job *ClaimedJob) (any, error) {
			<-ctx.Done()
			reasons <- job.StopReason()
			time.Sleep(8 * time.Second) // a handler slow to give up: the worker does not wait for it
			return "too late", nil
		}},
	})
	timeoutID, _ := c.Enqueue(ctx, slow, nil, &EnqueueOptions{Queue: q, Timeout: 300 * time.Millisecond, MaxAttempts: 1})
	start := time.Now()
	runWorker(t, w)
	job := waitState(t, c, timeoutID, StateDead, 10*time.Second)
	if time.Since(start) > 5*time.Second || job.LastError == nil || !strings.Contains(*job.LastError, "timed out") {
		t.Fatalf("timeout recorded after %v: %+v", time.Since(start), job)
	}
	if got := <-reasons; got != ErrJobTimeout {
		t.Fatalf("stop reason %v", got)
	}
}

// wouldRetry has budget left and a policy that would retry 1 ms later: a
// worker that failed the attempt itself would leave a retry, or a death of
// its own (reason permanent).
func wouldRetry(q string, deadline time.Time) *EnqueueOptions {
	return &EnqueueOptions{Queue: q, Deadline: deadline, MaxAttempts: 5, Retry: FixedBackoff(time.Millisecond)}
}

// endedAtDeadline checks that the server ended the job's one attempt at its
// deadline: dead with reason deadline, the run recorded by the server, and
// no retry scheduled.
func endedAtDeadline(t *testing.T, c *Client, id string) {
	t.Helper()
	ctx := ctxT(t)
	events, err := c.JobEvents(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	var reasons []string
	for _, e := range events {
		switch e.Kind {
		case "retry_scheduled":
			t.Fatalf("a retry was scheduled: %+v", events)
		case "dead":
			var d struct {
				Reason string `json:"reason"`
			}
			if err := json.Unmarshal(e.Data, &d); err != nil {
				t.Fatal(err)
			}
			reasons = append(reasons, d.Reason)
		}
	}
	if len(reasons) != 1 || reasons[0] != "deadline" {
		t.Fatalf("dead with reasons %q, want [deadline]", reasons)
	}
	job, err := c.GetJob(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	if job.State != StateDead || job.Attempt != 1 || job.AttemptsUsed != 1 || job.LastError == nil || *job.LastError != "deadline passed" {
		t.Fatalf("job %+v", job)
	}
	runs, err := c.JobRuns(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	if len(runs) != 1 || runs[0].Outcome == nil || *runs[0].Outcome != "failed" || runs[0].Error == nil || *runs[0].Error != "deadline passed" {
		t.Fatalf("runs %+v", runs)
	}
}

// stopSeen is why and when a handler's ctx was cancelled.
type stopSeen struct {
	reason error
	at     time.Time
}

func TestDeadlineEndsTheJobDeadOnTheServer(t *testing.T) {
	c := newTestClient()
	ctx := ctxT(t)
	q, slow := uniq("deadline"), uniq("slow")
	stops := make(chan stopSeen, 1)
	w := NewWorker(c, WorkerOptions{
		Queues: []string{q}, PollWait: 200 * time.Millisecond,
		Handlers: map[string]HandlerFunc{slow: func(ctx context.Context, job *ClaimedJob) (any, error) {
			<-ctx.Done()
			stops <- stopSeen{job.StopReason(), time.Now()}
			time.Sleep(8 * time.Second) // a handler slow to give up: the worker does not wait for it
			return "too late", nil
		}},
	})
	// In whole milliseconds, as the server keeps it.
	deadline := time.Now().Add(1500 * time.Millisecond).Truncate(time.Millisecond)
	id, err := c.Enqueue(ctx, slow, nil, wouldRetry(q, deadline))
	if err != nil {
		t.Fatal(err)
	}
	stop := runWorker(t, w)
	waitState(t, c, id, StateDead, 10*time.Second)
	endedAtDeadline(t, c, id)
	// Stopped once the server's clock (this machine's) was past the deadline.
	if s := <-stops; s.reason != ErrJobDeadline || s.at.Before(deadline) {
		t.Fatalf("stopped with %v, %v after the deadline", s.reason, s.at.Sub(deadline))
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if st := w.Stats(); st.Failed != 1 || st.Lost != 0 || st.Completed != 0 {
		t.Fatalf("stats %+v", st)
	}
}

// skewed makes a worker's clock disagree with the server's: claim answers
// say the lease expires ahead later than it does (the server's clock seems
// ahead), and heartbeats cannot reach the server until downUntil. It records
// every heartbeat's answer.
type skewed struct {
	ahead     time.Duration
	downUntil time.Time
	mu        sync.Mutex
	beats     []beatSeen
}

// beatSeen is one heartbeat: its job, its status (0: unreachable) and when.
type beatSeen struct {
	id     string
	status int
	at     time.Time
}

func (s *skewed) RoundTrip(r *http.Request) (*http.Response, error) {
	path := r.URL.Path
	heartbeat := strings.HasSuffix(path, "/heartbeat")
	var id string
	if heartbeat {
		parts := strings.Split(path, "/")
		id = parts[len(parts)-2]
		if time.Now().Before(s.downUntil) {
			s.record(id, 0)
			return nil, errors.New("connection refused (a test's transport)")
		}
	}
	resp, err := http.DefaultTransport.RoundTrip(r)
	if err != nil {
		return nil, err
	}
	if heartbeat {
		s.record(id, resp.StatusCode)
	}
	if path == "/v1/claim" && resp.StatusCode == http.StatusOK && s.ahead != 0 {
		raw, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil {
			return nil, err
		}
		var body map[string]any
		if err := json.Unmarshal(raw, &body); err != nil {
			return nil, err
		}
		for _, j := range body["jobs"].([]any) {
			job := j.(map[string]any)
			at, err := time.Parse(time.RFC3339Nano, job["lease_expires_at"].(string))
			if err != nil {
				return nil, err
			}
			job["lease_expires_at"] = at.Add(s.ahead).Format(time.RFC3339Nano)
		}
		if raw, err = json.Marshal(body); err != nil {
			return nil, err
		}
		resp.Body = io.NopCloser(bytes.NewReader(raw))
		resp.ContentLength = int64(len(raw))
		resp.Header.Del("Content-Length")
	}
	return resp, nil
}

func (s *skewed) record(id string, status int) {
	s.mu.Lock()
	s.beats = append(s.beats, beatSeen{id, status, time.Now()})
	s.mu.Unlock()
}

func (s *skewed) of(id string) []beatSeen {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []beatSeen
	for _, b := range s.beats {
		if b.id == id {
			out = append(out, b)
		}
	}
	return out
}

func statuses(beats []beatSeen) []int {
	out := make([]int, len(beats))
	for i, b := range beats {
		out[i] = b.status
	}
	return out
}

func TestDeadlineWaitsForTheServersClock(t *testing.T) {
	c := newTestClient()
	ctx := ctxT(t)
	q, hang, finish := uniq("skew"), uniq("hang"), uniq("finish")
	var mu sync.Mutex
	stops := map[string]stopSeen{}
	seen := func(job *ClaimedJob) {
		mu.Lock()
		stops[job.ID] = stopSeen{job.StopReason(), time.Now()}
		mu.Unlock()
	}
	// The worker believes the server's clock 2 s ahead: it asks about the
	// deadline about 1 s after the claim, 2 s before the server says yes.
	skew := &skewed{ahead: 2 * time.Second}
	w := NewWorker(newTestClient(WithHTTPClient(&http.Client{Transport: skew})), WorkerOptions{
		Queues: []string{q}, PollWait: 200 * time.Millisecond,
		Lease: 30 * time.Second, // no heartbeat but the deadline's comes before it
		Handlers: map[string]HandlerFunc{
			hang: func(ctx context.Context, job *ClaimedJob) (any, error) {
				<-ctx.Done()
				seen(job)
				return "too late", nil
			},
			// Ends after the worker's timer says "deadline", before the server's
			// clock does: once the early question was answered ("not yet"),
			// however late the claim came, and well before the worker asks
			// again at the deadline. The bound only keeps a broken worker
			// from hanging the test.
			finish: func(ctx context.Context, job *ClaimedJob) (any, error) {
				bound := time.NewTimer(10 * time.Second)
				defer bound.Stop()
				tick := time.NewTicker(5 * time.Millisecond)
				defer tick.Stop()
				for len(skew.of(job.ID)) == 0 {
					select {
					case <-ctx.Done():
						seen(job)
						return "in time", nil
					case <-bound.C:
						return "in time", nil
					case <-tick.C:
					}
				}
				return "in time", nil
			},
		},
	})
	deadline := time.Now().Add(3 * time.Second).Truncate(time.Millisecond)
	hung, err := c.Enqueue(ctx, hang, nil, wouldRetry(q, deadline))
	if err != nil {
		t.Fatal(err)
	}
	done, err := c.Enqueue(ctx, finish, nil, wouldRetry(q, deadline))
	if err != nil {
		t.Fatal(err)
	}
	stop := runWorker(t, w)
	if job := waitState(t, c, done, StateCompleted, 10*time.Second); string(job.Result) != `"in time"` {
		t.Fatalf("result %s", job.Result)
	}
	waitState(t, c, hung, StateDead, 10*time.Second)
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	endedAtDeadline(t, c, hung)
	mu.Lock()
	defer mu.Unlock()
	if s, ok := stops[done]; ok {
		t.Fatalf("the handler that finished in time was stopped: %v", s.reason)
	}
	if got := statuses(skew.of(done)); len(got) != 1 || got[0] != http.StatusOK {
		t.Fatalf("heartbeats of the job that finished in time: %v", got)
	}
	if s := stops[hung]; s.reason != ErrJobDeadline || s.at.Before(deadline) {
		t.Fatalf("stopped with %v, %v after the deadline", s.reason, s.at.Sub(deadline))
	}
	// Asked early ("not yet": the lease renewed), then again at the deadline.
	if got := statuses(skew.of(hung)); len(got) < 2 || got[0] != http.StatusOK || got[len(got)-1] != http.StatusConflict {
		t.Fatalf("heartbeats of the job that ran past its deadline: %v", got)
	}
	expectStats(t, w, func(st WorkerStats) bool { return st.Completed == 1 && st.Failed == 1 && st.Lost == 0 })
}

func TestDeadlineIsAskedAgainWhileTheServerIsUnreachable(t *testing.T) {
	c := newTestClient()
	ctx := ctxT(t)
	q, hang := uniq("unreachable"), uniq("hang")
	stops := make(chan error, 1)
	deadline := time.Now().Add(time.Second).Truncate(time.Millisecond)
	// Heartbeats fail from the start until 1.2 s after the deadline.
	skew := &skewed{downUntil: deadline.Add(1200 * time.Millisecond)}
	var reported int64
	w := NewWorker(newTestClient(WithHTTPClient(&http.Client{Transport: skew}), WithoutRetries()), WorkerOptions{
		Queues: []string{q}, PollWait: 200 * time.Millisecond, Lease: 30 * time.Second,
		OnError: func(error) { atomic.AddInt64(&reported, 1) },
		Handlers: map[string]HandlerFunc{hang: func(ctx context.Context, job *ClaimedJob) (any, error) {
			<-ctx.Done()
			stops <- job.StopReason()
			return "too late", nil
		}},
	})
	id, err := c.Enqueue(ctx, hang, nil, wouldRetry(q, deadline))
	if err != nil {
		t.Fatal(err)
	}
	stop := runWorker(t, w)
	waitState(t, c, id, StateDead, 10*time.Second)
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	endedAtDeadline(t, c, id)
	// The handler went on while the question could not be answered, asked
	// again with a growing backoff, and stopped once the server ended the attempt.
	if got := <-stops; got != ErrJobDeadline {
		t.Fatalf("stop reason %v", got)
	}
	beats := skew.of(id)
	var down []time.Time
	for _, b := range beats {
		if b.status == 0 {
			down = append(down, b.at)
		}
	}
	if len(down) < 3 || len(down) > 8 || beats[len(beats)-1].status != http.StatusConflict {
		t.Fatalf("heartbeats %v", statuses(beats))
	}
	first, last := down[1].Sub(down[0]), down[len(down)-1].Sub(down[len(down)-2])
	for i := 1; i < len(down); i++ {
		if gap := down[i].Sub(down[i-1]); gap < 40*time.Millisecond {
			t.Fatalf("asked again after %v", gap)
		}
	}
	if last <= first {
		t.Fatalf("the backoff did not grow: %v then %v", first, last)
	}
	expectStats(t, w, func(st WorkerStats) bool { return st.Failed == 1 && st.Lost == 0 })
	if n := atomic.LoadInt64(&reported); n < int64(len(down)) {
		t.Fatalf("%d errors reported for %d failed questions", n, len(down))
	}
}

// slowCompletions holds every request that carries a completion (a claim
// carrying some, a batch, a completion of its own) for hold before it goes
// to the server, as a busy network or a long claim queue would. It records
// every heartbeat with the instant it was sent and its answer.
type slowCompletions struct {
	hold  time.Duration
	mu    sync.Mutex
	beats []beatSeen
	held  int
}

func (s *slowCompletions) RoundTrip(r *http.Request) (*http.Response, error) {
	path := r.URL.Path
	carries := strings.HasSuffix(path, "/complete")
	if path == "/v1/claim" && r.Body != nil {
		raw, err := io.ReadAll(r.Body)
		r.Body.Close()
		if err != nil {
			return nil, err
		}
		var body struct {
			Complete []json.RawMessage `json:"complete"`
		}
		if err := json.Unmarshal(raw, &body); err != nil {
			return nil, err
		}
		carries = len(body.Complete) > 0
		r.Body = io.NopCloser(bytes.NewReader(raw))
	}
	if carries {
		s.mu.Lock()
		s.held++
		s.mu.Unlock()
		time.Sleep(s.hold)
	}
	sent := time.Now()
	resp, err := http.DefaultTransport.RoundTrip(r)
	if strings.HasSuffix(path, "/heartbeat") {
		parts := strings.Split(path, "/")
		status := 0
		if err == nil {
			status = resp.StatusCode
		}
		s.mu.Lock()
		s.beats = append(s.beats, beatSeen{parts[len(parts)-2], status, sent})
		s.mu.Unlock()
	}
	return resp, err
}

// TestNoHeartbeatEndsACompletedAttemptPastTheDeadline: the handler returns
// before the deadline and its completion is slow to reach the server, past
// the deadline. A heartbeat sent meanwhile would reach the server past the
// deadline and end the attempt there (dead, deadline), and the completion
// would be refused; the worker sends none, and the completion is recorded.
func TestNoHeartbeatEndsACompletedAttemptPastTheDeadline(t *testing.T) {
	c := newTestClient()
	ctx := ctxT(t)
	q, finish := uniq("late-beat"), uniq("finish")
	deadline := time.Now().Add(1500 * time.Millisecond).Truncate(time.Millisecond)
	id, err := c.Enqueue(ctx, finish, nil, wouldRetry(q, deadline))
	if err != nil {
		t.Fatal(err)
	}
	// The handler returns 600 ms before the deadline (or at once, when the
	// claim came later), so that neither its return nor a heartbeat already
	// under way races the deadline. The completion is held 1.2 s: it reaches
	// the server past the deadline, well within the lease, and while it
	// waits at least two heartbeat intervals pass after the deadline, so a
	// worker that went on beating would end the attempt there.
	slow := &slowCompletions{hold: 1200 * time.Millisecond}
	var returned int64
	w := NewWorker(newTestClient(WithHTTPClient(&http.Client{Transport: slow})), WorkerOptions{
		Queues: []string{q}, PollWait: 200 * time.Millisecond,
		Lease: 4 * time.Second, HeartbeatInterval: 300 * time.Millisecond,
		Handlers: map[string]HandlerFunc{finish: func(ctx context.Context, job *ClaimedJob) (any, error) {
			select {
			case <-ctx.Done():
				return nil, ctx.Err()
			case <-time.After(time.Until(deadline.Add(-600 * time.Millisecond))):
			}
			atomic.StoreInt64(&returned, time.Now().UnixNano())
			return "in time", nil
		}},
	})
	stop := runWorker(t, w)
	var job *Job
	for until := time.Now().Add(10 * time.Second); ; {
		if job, err = c.GetJob(ctx, id); err != nil {
			t.Fatal(err)
		}
		if job.State == StateCompleted || job.State == StateDead || time.Now().After(until) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if job.State != StateCompleted || string(job.Result) != `"in time"` {
		lastError := ""
		if job.LastError != nil {
			lastError = *job.LastError
		}
		t.Fatalf("job %s with %s, last error %q", job.State, job.Result, lastError)
	}
	slow.mu.Lock()
	beats, held := append([]beatSeen(nil), slow.beats...), slow.held
	slow.mu.Unlock()
	if held == 0 {
		t.Fatal("no completion was held")
	}
	// Every heartbeat of the job was sent before the deadline and renewed
	// the lease: none went out while the completion waited past it.
	ret := time.Unix(0, atomic.LoadInt64(&returned))
	for _, b := range beats {
		if b.id == id && (b.status != http.StatusOK || !b.at.Before(deadline)) {
			t.Fatalf("heartbeat answered %d, sent %v after the handler returned (deadline %v later)",
				b.status, b.at.Sub(ret), deadline.Sub(b.at))
		}
	}
	expectStats(t, w, func(st WorkerStats) bool { return st.Completed == 1 && st.Lost == 0 && st.Failed == 0 })
}

// TestARegularHeartbeatFindsTheDeadlinePassed: the server's clock reaches
// the deadline long before the worker's estimate, so a regular heartbeat,
// not the one that asks about the deadline, is the first to find the
// attempt ended there. That is the deadline, not a lost lease.
func TestARegularHeartbeatFindsTheDeadlinePassed(t *testing.T) {
	c := newTestClient()
	ctx := ctxT(t)
	q, hang := uniq("behind"), uniq("hang")
	stops := make(chan error, 1)
	deadline := time.Now().Add(time.Second).Truncate(time.Millisecond)
	// The worker believes the server's clock 3 s behind: it would ask about
	// the deadline 3 s after it passed.
	skew := &skewed{ahead: -3 * time.Second}
	w := NewWorker(newTestClient(WithHTTPClient(&http.Client{Transport: skew})), WorkerOptions{
		Queues: []string{q}, PollWait: 200 * time.Millisecond,
		Lease: 3 * time.Second, HeartbeatInterval: 250 * time.Millisecond,
		Handlers: map[string]HandlerFunc{hang: func(ctx context.Context, job *ClaimedJob) (any, error) {
			<-ctx.Done()
			stops <- job.StopReason()
			return "too late", nil
		}},
	})
	id, err := c.Enqueue(ctx, hang, nil, wouldRetry(q, deadline))
	if err != nil {
		t.Fatal(err)
	}
	stop := runWorker(t, w)
	waitState(t, c, id, StateDead, 10*time.Second)
	var reason error
	select {
	case reason = <-stops:
	case <-time.After(10 * time.Second):
		t.Fatal("the handler was not stopped")
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	endedAtDeadline(t, c, id)
	if reason != ErrJobDeadline {
		t.Fatalf("stop reason %v", reason)
	}
	beats := skew.of(id)
	if len(beats) < 2 || beats[len(beats)-1].status != http.StatusConflict || !beats[len(beats)-1].at.Before(deadline.Add(2*time.Second)) {
		t.Fatalf("heartbeats %v", statuses(beats))
	}
	expectStats(t, w, func(st WorkerStats) bool { return st.Failed == 1 && st.Lost == 0 })
}

func TestGracefulShutdownReleasesLeases(t *testing.T) {
	c := newTestClient()
	ctx := ctxT(t)
	q, quick, stuck := uniq("shutdown"), uniq("quick"), uniq("stuck")
	started := make(chan struct{}, 2)
	w := NewWorker(c, WorkerOptions{
		Queues: []string{q}, Concurrency: 2, PollWait: 200 * time.Millisecond, ShutdownGrace: 500 * time.Millisecond,
		Handlers: map[string]HandlerFunc{
			quick: func(ctx context.Context, job *ClaimedJob) (any, error) {
				started <- struct{}{}
				time.Sleep(200 * time.Millisecond) // finishes within the grace period
				return "done", nil
			},
			stuck: func(ctx context.Context, job *ClaimedJob) (any, error) {
				started <- struct{}{}
				<-ctx.Done()
				return nil, ctx.Err()
			},
		},
	})
	quickID, _ := c.Enqueue(ctx, quick, nil, &EnqueueOptions{Queue: q})
	stuckID, _ := c.Enqueue(ctx, stuck, nil, &EnqueueOptions{Queue: q, MaxAttempts: 1})
	stop := runWorker(t, w)
	<-started
	<-started
	t0 := time.Now()
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if el := time.Since(t0); el < 400*time.Millisecond || el > 5*time.Second {
		t.Fatalf("shutdown took %v with a 500ms grace", el)
	}
	waitState(t, c, quickID, StateCompleted, time.Second)
	job := waitState(t, c, stuckID, StateReady, time.Second)
	runs, _ := c.JobRuns(ctx, stuckID)
	if job.AttemptsUsed != 0 || len(runs) != 1 || *runs[0].Outcome != "released" {
		t.Fatalf("released job: used %d, runs %+v", job.AttemptsUsed, runs)
	}
	expectStats(t, w, func(st WorkerStats) bool { return st.Completed == 1 && st.Released == 1 })
}

func TestWorkerStopsOnAFatalClaimError(t *testing.T) {
	srv, err := startServer(serverConfig{token: "worker-token"})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.stop()
	c := NewClient(srv.url)
	w := NewWorker(c, WorkerOptions{
		Handlers: map[string]HandlerFunc{"x": func(ctx context.Context, job *ClaimedJob) (any, error) { return nil, nil }}})
	err = w.Run(ctxT(t))
	var ue *UnauthorizedError
	if !errors.As(err, &ue) {
		t.Fatalf("Run returned %v", err)
	}
	if err := NewWorker(c, WorkerOptions{}).Run(ctxT(t)); err == nil {
		t.Fatal("a worker without handlers ran")
	}
}

func TestBatchCompletion(t *testing.T) {
	c := newTestClient()
	ctx := ctxT(t)
	q, typ := uniq("batchdone"), uniq("job")
	for i := 0; i < 3; i++ {
		if _, err := c.Enqueue(ctx, typ, i, &EnqueueOptions{Queue: q}); err != nil {
			t.Fatal(err)
		}
	}
	resp, err := c.Claim(ctx, ClaimRequest{Queues: []string{q}, Worker: "go-test", Limit: 3})
	if err != nil || len(resp.Jobs) != 3 {
		t.Fatalf("claim: %+v %v", resp, err)
	}
	j := resp.Jobs
	results, err := c.CompleteMany(ctx, []Completion{
		{ID: j[0].ID, LeaseToken: j[0].LeaseToken, Result: "r0"},
		{ID: j[1].ID, LeaseToken: "stale"},
	})
	if err != nil {
		t.Fatalf("POST /v1/jobs/complete: %v", err)
	}
	if results[0].State != StateCompleted || !errors.Is(results[1].Err, ErrLeaseLost) {
		t.Fatalf("results %+v", results)
	}
	// The rest are acknowledged on the next claim.
	resp, err = c.Claim(ctx, ClaimRequest{Queues: []string{q}, Worker: "go-test", Complete: []Completion{
		{ID: j[1].ID, LeaseToken: j[1].LeaseToken}, {ID: j[2].ID, LeaseToken: j[2].LeaseToken, Result: 2},
	}})
	if err != nil || len(resp.Completed) != 2 || resp.Completed[0].State != StateCompleted || resp.Completed[1].State != StateCompleted {
		t.Fatalf("claim with completions: %+v %v", resp, err)
	}
	for i, want := range []string{`"r0"`, ``, `2`} {
		job, _ := c.GetJob(ctx, j[i].ID)
		if job.State != StateCompleted || (want != "" && string(job.Result) != want) {
			t.Fatalf("job %d: %s %s", i, job.State, job.Result)
		}
	}
}

// drainWithRecorder enqueues n jobs of a new type (payload i), runs a worker
// of concurrency 2 over rec until every job is completed, and checks that
// each ran once and was completed by its first attempt with its own result.
func drainWithRecorder(t *testing.T, rec *callRecorder, n int) (ids []string) {
	t.Helper()
	plain := newTestClient()
	ctx := ctxT(t)
	q, typ := uniq("carry"), uniq("double")
	for i := 0; i < n; i++ {
		id, err := plain.Enqueue(ctx, typ, i, &EnqueueOptions{Queue: q})
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	var mu sync.Mutex
	runs := map[string]int{}
	w := NewWorker(newTestClient(WithHTTPClient(&http.Client{Transport: rec})), WorkerOptions{
		Queues: []string{q}, Concurrency: 2, PollWait: 200 * time.Millisecond,
		Handlers: map[string]HandlerFunc{typ: func(ctx context.Context, job *ClaimedJob) (any, error) {
			mu.Lock()
			runs[job.ID]++
			mu.Unlock()
			var i int
			if err := job.Decode(&i); err != nil {
				return nil, Permanent(err)
			}
			time.Sleep(10 * time.Millisecond)
			return map[string]int{"twice": 2 * i}, nil
		}},
	})
	stop := runWorker(t, w)
	for i, id := range ids {
		job := waitState(t, plain, id, StateCompleted, 30*time.Second)
		var r map[string]int
		if err := job.DecodeResult(&r); err != nil || r["twice"] != 2*i || job.Attempt != 1 {
			t.Fatalf("job %d: attempt %d, result %s %v", i, job.Attempt, job.Result, err)
		}
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	for _, id := range ids {
		if runs[id] != 1 {
			t.Fatalf("job %s ran %d times", id, runs[id])
		}
	}
	expectStats(t, w, func(st WorkerStats) bool { return st == (WorkerStats{Completed: int64(n)}) })
	return ids
}

func sameIDs(a, b []string) bool {
	a, b = append([]string(nil), a...), append([]string(nil), b...)
	sort.Strings(a)
	sort.Strings(b)
	return strings.Join(a, ",") == strings.Join(b, ",")
}

func TestWorkerCarriesCompletionsOnClaims(t *testing.T) {
	rec := &callRecorder{}
	ids := drainWithRecorder(t, rec, 40)
	carried, batched, singles := rec.sent()
	t.Logf("%d completions carried on claims, %d batched", len(carried), len(batched))
	// A handler that returns frees its slot, which starts a claim at once.
	if len(carried) == 0 {
		t.Fatalf("no claim carried a completion (%d batched)", len(batched))
	}
	if len(singles) != 0 {
		t.Fatalf("completions sent one per call: %v", singles)
	}
	if !sameIDs(append(carried, batched...), ids) {
		t.Fatalf("a completion sent twice, or never: %d carried, %d batched, %d jobs", len(carried), len(batched), len(ids))
	}
}

func TestWorkerSendsCompletionsApartWhenClaimsRefuseThem(t *testing.T) {
	rec := &callRecorder{refuseCarried: true}
	ids := drainWithRecorder(t, rec, 30)
	carried, batched, singles := rec.sent()
	// Refused once, then never carried again.
	if rec.claimsWithCompletions() != 1 || len(carried) != 0 || len(singles) != 0 {
		t.Fatalf("%d claims carried completions, %d accepted; %d single completions", rec.claimsWithCompletions(), len(carried), len(singles))
	}
	if !sameIDs(batched, ids) {
		t.Fatalf("%d completions batched for %d jobs", len(batched), len(ids))
	}
}

func TestWorkerSendsCompletionsApartWhenClaimsIgnoreThem(t *testing.T) {
	rec := &callRecorder{dropCarried: true}
	ids := drainWithRecorder(t, rec, 30)
	carried, batched, singles := rec.sent()
	// An answer without a result per completion is not trusted: they are
	// sent again on their own, and claims carry none from then on.
	if rec.claimsWithCompletions() != 1 || len(carried) != 0 || len(singles) != 0 {
		t.Fatalf("%d claims carried completions, %d accepted; %d single completions", rec.claimsWithCompletions(), len(carried), len(singles))
	}
	if !sameIDs(batched, ids) {
		t.Fatalf("%d completions batched for %d jobs", len(batched), len(ids))
	}
}

func TestWorkerFailsOnlyTheJobWhoseResultIsRefused(t *testing.T) {
	rec := &callRecorder{}
	plain := newTestClient()
	ctx := ctxT(t)
	q, typ := uniq("oversize"), uniq("sized")
	const n = 6
	var ids []string
	for i := 0; i < n; i++ {
		id, err := plain.Enqueue(ctx, typ, i, &EnqueueOptions{Queue: q})
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	big := ids[2]
	// Every handler returns once all have started, so the completions travel together.
	var started sync.WaitGroup
	started.Add(n)
	w := NewWorker(newTestClient(WithHTTPClient(&http.Client{Transport: rec})), WorkerOptions{
		Queues: []string{q}, Concurrency: n, PollWait: 200 * time.Millisecond,
		Handlers: map[string]HandlerFunc{typ: func(ctx context.Context, job *ClaimedJob) (any, error) {
			started.Done()
			started.Wait()
			if job.ID == big {
				return strings.Repeat("x", 1<<20+1024), nil
			}
			var i int
			if err := job.Decode(&i); err != nil {
				return nil, Permanent(err)
			}
			return map[string]int{"i": i}, nil
		}},
	})
	stop := runWorker(t, w)
	for i, id := range ids {
		if id == big {
			job := waitState(t, plain, id, StateDead, 30*time.Second)
			if job.AttemptsUsed != 1 || (len(job.Result) > 0 && string(job.Result) != "null") || job.LastError == nil ||
				!strings.Contains(*job.LastError, "the handler's result was refused") {
				t.Fatalf("the oversized job: attempts %d, result %.40s, last error %v", job.AttemptsUsed, job.Result, job.LastError)
			}
			continue
		}
		job := waitState(t, plain, id, StateCompleted, 30*time.Second)
		var r map[string]int
		if err := job.DecodeResult(&r); err != nil || r["i"] != i || job.Attempt != 1 {
			t.Fatalf("job %d: attempt %d, result %s %v", i, job.Attempt, job.Result, err)
		}
	}
	if err := stop(); err != nil {
		t.Fatalf("Run returned %v", err)
	}
	if st := w.Stats(); st != (WorkerStats{Completed: n - 1, Failed: 1}) {
		t.Fatalf("stats %+v", st)
	}
	// It went first with others, on a claim or in a batch, before its own call.
	carried, batched, singles := rec.sent()
	together := false
	for _, id := range append(carried, batched...) {
		together = together || id == big
	}
	if !together || len(singles) == 0 {
		t.Fatalf("%d carried, %d batched and %d single completions", len(carried), len(batched), len(singles))
	}
}

// answerLost passes every call on to next (the server), but loses the answer
// of the first call that carries a completion the server took: the server
// recorded it, and the client sees a broken connection and repeats the call.
type answerLost struct {
	next http.RoundTripper

	mu    sync.Mutex
	lost  string         // which call lost its answer: "carried", "batched" or "single"
	calls map[string]int // completion-carrying calls the server answered, by kind
}

func (a *answerLost) RoundTrip(req *http.Request) (*http.Response, error) {
	kind := ""
	if req.Method == http.MethodPost && req.GetBody != nil {
		rc, err := req.GetBody()
		if err != nil {
			return nil, err
		}
		var body map[string]json.RawMessage
		raw, _ := io.ReadAll(rc)
		rc.Close()
		_ = json.Unmarshal(raw, &body)
		switch p := req.URL.Path; {
		case p == "/v1/claim" && len(body["complete"]) > 0:
			kind = "carried"
		case p == "/v1/jobs/complete":
			kind = "batched"
		case strings.HasSuffix(p, "/complete"):
			kind = "single"
		}
	}
	resp, err := a.next.RoundTrip(req)
	if err != nil || kind == "" {
		return resp, err
	}
	a.mu.Lock()
	a.calls[kind]++
	lose := a.lost == "" && resp.StatusCode == http.StatusOK
	if lose {
		a.lost = kind
	}
	a.mu.Unlock()
	if !lose {
		return resp, nil
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return nil, errors.New("connection reset by peer (the answer was lost on purpose)")
}

func (a *answerLost) seen() (lost string, calls map[string]int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	calls = map[string]int{}
	for k, v := range a.calls {
		calls[k] = v
	}
	return a.lost, calls
}

// A completion whose answer was lost after the server recorded it is
// repeated and answered lease-lost; the worker reads the job and counts the
// attempt completed, not lost, on every way a completion goes.
func TestWorkerCountsACompletionWhoseAnswerWasLost(t *testing.T) {
	for _, tc := range []struct {
		name     string
		next     http.RoundTripper
		deadline bool
		want     []string // the kinds of call that may lose the answer
	}{
		// A job with a deadline completes in a call of its own.
		{"single", http.DefaultTransport, true, []string{"single"}},
		// Others go on the next claim, or in a batch when none starts in time.
		{"carried", http.DefaultTransport, false, []string{"carried", "batched"}},
		// A server that refuses completions on claims gets them in batches.
		{"batched", &callRecorder{refuseCarried: true}, false, []string{"batched"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			plain := newTestClient()
			ctx := ctxT(t)
			q, typ := uniq("lostanswer"), uniq("lostanswer")
			opts := &EnqueueOptions{Queue: q}
			if tc.deadline {
				opts.Deadline = time.Now().Add(time.Hour)
			}
			id, err := plain.Enqueue(ctx, typ, nil, opts)
			if err != nil {
				t.Fatal(err)
			}
			tr := &answerLost{next: tc.next, calls: map[string]int{}}
			w := NewWorker(newTestClient(WithHTTPClient(&http.Client{Transport: tr}), fastRetry(4)), WorkerOptions{
				Queues: []string{q}, Concurrency: 1, PollWait: 200 * time.Millisecond,
				Handlers: map[string]HandlerFunc{typ: func(context.Context, *ClaimedJob) (any, error) { return "done", nil }},
			})
			stop := runWorker(t, w)
			job := waitState(t, plain, id, StateCompleted, 30*time.Second)
			expectStats(t, w, func(st WorkerStats) bool { return st.Completed+st.Lost == 1 })
			if err := stop(); err != nil {
				t.Fatal(err)
			}
			lost, calls := tr.seen()
			t.Logf("the answer of a %s completion was lost; completion calls %v", lost, calls)
			if lost == "" || calls[lost] < 2 || !strings.Contains(strings.Join(tc.want, ","), lost) {
				t.Fatalf("lost the answer of %q, calls %v; want one of %v, repeated", lost, calls, tc.want)
			}
			if job.Attempt != 1 || string(job.Result) != `"done"` {
				t.Fatalf("job %+v", job)
			}
			if st := w.Stats(); st != (WorkerStats{Completed: 1}) {
				t.Fatalf("stats %+v: the completion the server recorded counts as completed", st)
			}
		})
	}
}

// oneAnswerLost passes every call on to the server, but loses the answer of
// the first call to path: the server recorded it, and the client sees a
// broken connection and repeats the call. It records the status of every
// later answer to path.
type oneAnswerLost struct {
	path string

	mu      sync.Mutex
	lost    []string
	answers []int
}

func (o *oneAnswerLost) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := http.DefaultTransport.RoundTrip(req)
	if err != nil || req.URL.Path != o.path {
		return resp, err
	}
	o.mu.Lock()
	lose := len(o.lost) == 0
	if lose {
		o.lost = append(o.lost, req.URL.Path)
	} else {
		o.answers = append(o.answers, resp.StatusCode)
	}
	o.mu.Unlock()
	if !lose {
		return resp, nil
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return nil, errors.New("connection reset by peer (the answer was lost on purpose)")
}

func (o *oneAnswerLost) seen() (lost []string, answers []int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]string(nil), o.lost...), append([]int(nil), o.answers...)
}

// runsOf is the job's runs as attempt, outcome and error ("<nil>" for none).
func runsOf(t *testing.T, c *Client, id string) []string {
	t.Helper()
	runs, err := c.JobRuns(ctxT(t), id)
	if err != nil {
		t.Fatal(err)
	}
	text := func(p *string) string {
		if p == nil {
			return "<nil>"
		}
		return *p
	}
	out := make([]string, len(runs))
	for i, r := range runs {
		out[i] = fmt.Sprintf("%d %s %s", r.Attempt, text(r.Outcome), text(r.Error))
	}
	return out
}

// A fail or release whose answer was lost after the server recorded it is
// repeated and answered lease-lost; the worker reads the job's runs and
// counts the attempt failed or released, not lost, when the run of the
// attempt it held ended as that call ends one.
func TestWorkerCountsAFailOrReleaseWhoseAnswerWasLost(t *testing.T) {
	// 10,000 bytes of UTF-8: the server keeps the first 8 KiB.
	long := strings.Repeat("\u00e9", 5000)
	for _, tc := range []struct {
		name  string
		state string
		run   string // attempt, outcome and error of the job's one run
		want  WorkerStats
	}{
		{"retry-after", StateScheduled, "1 failed later", WorkerStats{Failed: 1}},
		{"permanent", StateDead, "1 failed bad input", WorkerStats{Failed: 1}},
		{"long-error", StateDead, "1 failed " + strings.Repeat("\u00e9", 4096), WorkerStats{Failed: 1}},
		{"snooze", StateScheduled, "1 snoozed <nil>", WorkerStats{Failed: 1}},
		{"cancelled", StateCancelled, "1 cancelled stopped on cancel", WorkerStats{Failed: 1, Cancelled: 1}},
		{"release", StateReady, "1 released <nil>", WorkerStats{Released: 1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			plain := newTestClient()
			ctx := ctxT(t)
			q, typ := uniq("lostfail"), uniq("lostfail")
			id, err := plain.Enqueue(ctx, typ, tc.name, &EnqueueOptions{Queue: q, MaxAttempts: 3})
			if err != nil {
				t.Fatal(err)
			}
			call := "fail"
			if tc.name == "release" {
				call = "release"
			}
			tr := &oneAnswerLost{path: "/v1/jobs/" + id + "/" + call}
			started := make(chan struct{})
			w := NewWorker(newTestClient(WithHTTPClient(&http.Client{Transport: tr}), fastRetry(4)), WorkerOptions{
				Queues: []string{q}, Concurrency: 1, Lease: 600 * time.Millisecond, PollWait: 200 * time.Millisecond,
				ShutdownGrace: 100 * time.Millisecond, CancelGrace: 5 * time.Second,
				Handlers: map[string]HandlerFunc{typ: func(ctx context.Context, job *ClaimedJob) (any, error) {
					close(started)
					switch tc.name {
					case "retry-after":
						return nil, RetryAfter(errors.New("later"), time.Minute)
					case "permanent":
						return nil, Permanent(errors.New("bad input"))
					case "long-error":
						return nil, Permanent(errors.New(long))
					case "snooze":
						return nil, Snooze(time.Minute)
					}
					// Held until a cancel (a failure) or the shutdown (a
					// release) stops it.
					select {
					case <-ctx.Done():
					case <-time.After(20 * time.Second):
					}
					if tc.name == "cancelled" {
						return nil, errors.New("stopped on cancel")
					}
					return "too late", nil
				}},
			})
			stop := runWorker(t, w)
			select {
			case <-started:
			case <-time.After(10 * time.Second):
				t.Fatal("the job never started")
			}
			if tc.name == "cancelled" {
				if cr, err := plain.CancelJob(ctx, id); err != nil || !cr.Cancelled {
					t.Fatalf("cancel: %+v %v", cr, err)
				}
			}
			if tc.name != "release" {
				expectStats(t, w, func(st WorkerStats) bool { return st.Failed+st.Released+st.Lost >= 1 })
			}
			if err := stop(); err != nil {
				t.Fatal(err)
			}
			// The first try was recorded and its answer lost; the repeat
			// found the lease spent.
			lost, answers := tr.seen()
			if len(lost) != 1 || lost[0] != tr.path || len(answers) != 1 || answers[0] != http.StatusConflict {
				t.Fatalf("lost %v, then answered %v; want %s lost, then 409", lost, answers, tr.path)
			}
			if job, err := plain.GetJob(ctx, id); err != nil || job.State != tc.state {
				t.Fatalf("job %+v %v; want %s", job, err, tc.state)
			}
			if runs := runsOf(t, plain, id); len(runs) != 1 || runs[0] != tc.run {
				t.Fatalf("runs %q; want [%q]", runs, tc.run)
			}
			if st := w.Stats(); st != tc.want {
				t.Fatalf("stats %+v; want %+v", st, tc.want)
			}
		})
	}
}

// failHeld holds the first fail of job until ready says its attempt has
// ended otherwise, then ends it with a connection error, never sent; the
// attempt's heartbeats meanwhile fail the same way. It records the status
// of every fail of job answered.
type failHeld struct {
	job   string
	ready func() bool

	mu      sync.Mutex
	held    int
	holding bool
	answers []int
}

func (f *failHeld) RoundTrip(req *http.Request) (*http.Response, error) {
	failPath := "/v1/jobs/" + f.job + "/fail"
	f.mu.Lock()
	hold := req.URL.Path == failPath && f.held == 0
	if req.URL.Path == failPath {
		f.held++
	}
	if hold {
		f.holding = true
	}
	down := f.holding && req.URL.Path == "/v1/jobs/"+f.job+"/heartbeat"
	f.mu.Unlock()
	if req.Body != nil && (hold || down) {
		req.Body.Close()
	}
	if down {
		return nil, errors.New("connection refused (the connection is down on purpose)")
	}
	if hold {
		deadline := time.Now().Add(20 * time.Second)
		for !f.ready() && time.Now().Before(deadline) && req.Context().Err() == nil {
			time.Sleep(50 * time.Millisecond)
		}
		f.mu.Lock()
		f.holding = false
		f.mu.Unlock()
		return nil, errors.New("connection reset by peer (the connection broke on purpose)")
	}
	resp, err := http.DefaultTransport.RoundTrip(req)
	if err == nil && req.URL.Path == failPath {
		f.mu.Lock()
		f.answers = append(f.answers, resp.StatusCode)
		f.mu.Unlock()
	}
	return resp, err
}

func (f *failHeld) seen() (held int, answers []int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.held, append([]int(nil), f.answers...)
}

// A fail whose try went unanswered, but which the server never saw, is
// answered lease-lost on its repeat because the lease expired meanwhile:
// the attempt's run ended with the server's own outcome, so the attempt is
// lost indeed.
func TestWorkerCountsAFailAnsweredLeaseLostAfterItsLeaseExpiredAsLost(t *testing.T) {
	plain := newTestClient()
	ctx := ctxT(t)
	q, typ := uniq("expiredfail"), uniq("expiredfail")
	id, err := plain.Enqueue(ctx, typ, nil, &EnqueueOptions{Queue: q, MaxAttempts: 3})
	if err != nil {
		t.Fatal(err)
	}
	tr := &failHeld{job: id, ready: func() bool {
		job, err := plain.GetJob(context.Background(), id)
		return err == nil && (job.Attempt > 1 || job.State != StateActive)
	}}
	w := NewWorker(newTestClient(WithHTTPClient(&http.Client{Transport: tr}), fastRetry(4)), WorkerOptions{
		Queues: []string{q}, Concurrency: 2, Lease: 600 * time.Millisecond, PollWait: 200 * time.Millisecond,
		Handlers: map[string]HandlerFunc{typ: func(ctx context.Context, job *ClaimedJob) (any, error) {
			if job.Attempt == 1 {
				return nil, Permanent(errors.New("bad input"))
			}
			return "second", nil
		}},
	})
	stop := runWorker(t, w)
	job := waitState(t, plain, id, StateCompleted, 30*time.Second)
	expectStats(t, w, func(st WorkerStats) bool { return st.Completed+st.Lost >= 2 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if held, answers := tr.seen(); held != 2 || len(answers) != 1 || answers[0] != http.StatusConflict {
		t.Fatalf("%d fails sent, answered %v; want the held one, then one answered 409", held, answers)
	}
	if job.Attempt != 2 || string(job.Result) != `"second"` {
		t.Fatalf("job %+v", job)
	}
	if runs := runsOf(t, plain, id); len(runs) != 2 || !strings.HasPrefix(runs[0], "1 lease_expired") || !strings.HasPrefix(runs[1], "2 completed") {
		t.Fatalf("runs %q", runs)
	}
	if st := w.Stats(); st != (WorkerStats{Completed: 1, Lost: 1}) {
		t.Fatalf("stats %+v; want the expired attempt lost", st)
	}
}

// keptError, which the worker compares a run's error with, is the error
// text the server keeps: U+0000 and each byte that is not UTF-8 written as
// U+FFFD, cut to 8 KiB of UTF-8 on a character boundary.
func TestKeptErrorIsTheTextTheServerKeeps(t *testing.T) {
	c := newTestClient()
	ctx := ctxT(t)
	q := uniq("kepterror")
	for _, text := range []string{
		"plain",
		"nul\x00and\xffbad\xc3\x28bytes",
		strings.Repeat("x", 8191) + "\u00e9",        // cut before a character that does not fit
		strings.Repeat("\u20ac", 3000) + "\x00\xfe", // 9,000 bytes of UTF-8 first
	} {
		id, err := c.Enqueue(ctx, "kept", nil, &EnqueueOptions{Queue: q, MaxAttempts: 1})
		if err != nil {
			t.Fatal(err)
		}
		r, err := c.Claim(ctx, ClaimRequest{Queues: []string{q}, Limit: 1})
		if err != nil || len(r.Jobs) != 1 || r.Jobs[0].ID != id {
			t.Fatalf("claim: %+v %v", r, err)
		}
		if _, err := c.Fail(ctx, id, r.Jobs[0].LeaseToken, FailOptions{Error: text}); err != nil {
			t.Fatal(err)
		}
		runs, err := c.JobRuns(ctx, id)
		if err != nil || len(runs) != 1 || runs[0].Error == nil {
			t.Fatalf("runs %+v %v", runs, err)
		}
		if kept := keptError(text); *runs[0].Error != kept {
			t.Fatalf("the server kept %d bytes %.40q…, keptError says %d bytes %.40q…", len(*runs[0].Error), *runs[0].Error, len(kept), kept)
		}
	}
}
