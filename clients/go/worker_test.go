package idemq

import (
	"context"
	"errors"
	"fmt"
	"net/http"
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
}

// completionCounter counts the completions a client sends.
type completionCounter struct{ n int64 }

func (cc *completionCounter) RoundTrip(r *http.Request) (*http.Response, error) {
	if r.Method == http.MethodPost && strings.HasSuffix(r.URL.Path, "/complete") {
		atomic.AddInt64(&cc.n, 1)
	}
	return http.DefaultTransport.RoundTrip(r)
}

func TestWorkerLosesALeaseAndDoesNotComplete(t *testing.T) {
	cc := &completionCounter{}
	c := newTestClient(WithHTTPClient(&http.Client{Transport: cc}))
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
	if n := atomic.LoadInt64(&cc.n); n != 1 {
		t.Fatalf("%d completion requests; the stale attempt must send none", n)
	}
	if st := w.Stats(); st.Lost != 1 || st.Completed != 1 {
		t.Fatalf("stats %+v", st)
	}
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

func TestWorkerEnforcesTimeoutAndDeadlineLocally(t *testing.T) {
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
	deadlineID, _ := c.Enqueue(ctx, slow, nil, &EnqueueOptions{Queue: q, Deadline: time.Now().Add(1200 * time.Millisecond)})
	start := time.Now()
	runWorker(t, w)
	job := waitState(t, c, timeoutID, StateDead, 10*time.Second)
	if time.Since(start) > 5*time.Second || job.LastError == nil || !strings.Contains(*job.LastError, "timed out") {
		t.Fatalf("timeout recorded after %v: %+v", time.Since(start), job)
	}
	job = waitState(t, c, deadlineID, StateDead, 10*time.Second)
	if time.Since(start) > 6*time.Second || job.LastError == nil || !strings.Contains(*job.LastError, "deadline") {
		t.Fatalf("deadline recorded after %v: %+v", time.Since(start), job)
	}
	got := map[error]bool{<-reasons: true, <-reasons: true}
	if !got[ErrJobTimeout] || !got[ErrJobDeadline] {
		t.Fatalf("stop reasons %v", got)
	}
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
	if st := w.Stats(); st.Completed != 1 || st.Released != 1 {
		t.Fatalf("stats %+v", st)
	}
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
