package idemq

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode/utf8"
)

// wantValidation fails the test unless err is a *ValidationError of field.
func wantValidation(t *testing.T, what string, err error, field string) {
	t.Helper()
	var ve *ValidationError
	if !errors.As(err, &ve) || !errors.Is(err, ErrValidation) || ve.Field != field {
		t.Fatalf("%s: got %T %v, want a *ValidationError of %s", what, err, err, field)
	}
}

// A negative duration is never taken for "not given": the server refuses it
// with the validation error of its field, and nothing is written.
func TestNegativeDurationsAreRefusedNotDropped(t *testing.T) {
	c := newTestClient()
	ctx := ctxT(t)
	q, typ := uniq("negative"), uniq("neg")
	neg := -5 * time.Second
	cases := []struct {
		field string
		opts  EnqueueOptions
	}{
		{"delay_ms", EnqueueOptions{Delay: neg}},
		{"delay_ms", EnqueueOptions{Delay: -time.Nanosecond}}, // not rounded to 0
		{"timeout_ms", EnqueueOptions{Timeout: neg}},
		{"keep_ms", EnqueueOptions{Keep: &neg}},
		{"dedupe.ttl_ms", EnqueueOptions{Dedupe: &Dedupe{Key: uniq("d"), TTL: -1}}},
		{"dedupe.max_wait_ms", EnqueueOptions{Dedupe: &Dedupe{Key: uniq("d"), Replace: true, MaxWait: neg}}},
		{"idempotency.ttl_ms", EnqueueOptions{IdempotencyKey: uniq("k"), TTL: neg}},
		{"idempotency.ttl_ms", EnqueueOptions{IdempotencyKey: uniq("k"), TTL: neg, KeyInHeader: true}},
		{"retry.delay_ms", EnqueueOptions{Retry: FixedBackoff(neg)}},
		{"retry.initial_ms", EnqueueOptions{Retry: ExponentialBackoff(neg, 2, time.Minute, true)}},
		{"retry.max_ms", EnqueueOptions{Retry: ExponentialBackoff(time.Second, 2, neg, true)}},
	}
	for i, tc := range cases {
		o := tc.opts
		o.Queue = q
		_, err := c.Enqueue(ctx, typ, i, &o)
		wantValidation(t, "enqueue "+tc.field, err, tc.field)
		_, err = c.Explain(ctx, typ, i, &o)
		wantValidation(t, "explain "+tc.field, err, tc.field)
		results, err := c.EnqueueBatch(ctx, []JobRequest{{Type: typ, Payload: i, Options: &o}}, nil)
		if err != nil {
			t.Fatal(err)
		}
		wantValidation(t, "batch item "+tc.field, results[0].Err, tc.field)
	}
	page, err := c.ListJobs(ctx, &ListJobsOptions{Queue: q})
	if err != nil || len(page.Jobs) != 0 {
		t.Fatalf("refused requests wrote %d jobs (%v)", len(page.Jobs), err)
	}
	_, err = c.PutSchedule(ctx, uniq("every"), ScheduleDefinition{Every: neg, Job: JobRequest{Type: typ, Options: &EnqueueOptions{Queue: q}}})
	wantValidation(t, "schedule every", err, "every_ms")

	// Values the server's parser would not even read are refused here, as
	// the server refuses them out of bounds, and nothing is sent.
	tr := &counting{}
	cc := newTestClient(WithHTTPClient(&http.Client{Transport: tr}))
	_, err = cc.Claim(ctx, ClaimRequest{Queues: []string{q}, Lease: neg})
	wantValidation(t, "claim lease", err, "lease_ms")
	_, err = cc.Claim(ctx, ClaimRequest{Queues: []string{q}, Wait: -time.Millisecond})
	wantValidation(t, "claim wait", err, "wait_ms")
	_, err = cc.WaitJob(ctx, "no-such-job", neg)
	wantValidation(t, "wait job", err, "wait_ms")
	_, err = cc.Fail(ctx, "no-such-job", "token", FailOptions{Error: "e", RetryAfter: &neg})
	wantValidation(t, "fail retry after", err, "retry_after_ms")
	_, err = cc.Fail(ctx, "no-such-job", "token", FailOptions{Error: "e", Snooze: &neg})
	wantValidation(t, "fail snooze", err, "snooze_ms")
	if n := tr.count(); n != 0 {
		t.Fatalf("%d requests sent for values refused here", n)
	}

	// A worker refuses negative options before it claims anything.
	handlers := map[string]HandlerFunc{typ: func(context.Context, *ClaimedJob) (any, error) { return nil, nil }}
	for _, tc := range []struct {
		opts WorkerOptions
		want string
	}{
		{WorkerOptions{Lease: neg}, "lease_ms"},
		{WorkerOptions{PollWait: neg}, "wait_ms"},
		{WorkerOptions{HeartbeatInterval: neg}, "HeartbeatInterval"},
		{WorkerOptions{ShutdownGrace: neg}, "ShutdownGrace"},
	} {
		o := tc.opts
		o.Queues, o.Handlers = []string{q}, handlers
		rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := NewWorker(cc, o).Run(rctx)
		cancel()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Fatalf("a worker with %+v: Run returned %v", tc.opts, err)
		}
		if strings.HasSuffix(tc.want, "_ms") {
			wantValidation(t, "worker "+tc.want, err, tc.want)
		}
	}
	if n := tr.count(); n != 0 {
		t.Fatalf("workers with negative options sent %d requests", n)
	}
}

// A handler's RetryAfter or Snooze of a negative duration is refused, not
// taken for "at once": the refusal goes to OnError and the attempt fails by
// the job's own policy.
func TestWorkerRefusesANegativeRetryAfter(t *testing.T) {
	c := newTestClient()
	ctx := ctxT(t)
	q, typ := uniq("negretry"), uniq("negretry")
	id, err := c.Enqueue(ctx, typ, nil, &EnqueueOptions{Queue: q, Retry: FixedBackoff(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var reported []error
	w := NewWorker(c, WorkerOptions{
		Queues: []string{q}, PollWait: 200 * time.Millisecond,
		OnError: func(err error) { mu.Lock(); reported = append(reported, err); mu.Unlock() },
		Handlers: map[string]HandlerFunc{typ: func(context.Context, *ClaimedJob) (any, error) {
			return nil, RetryAfter(errors.New("try again"), -time.Second)
		}},
	})
	stop := runWorker(t, w)
	expectStats(t, w, func(st WorkerStats) bool { return st.Failed == 1 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	job, err := c.GetJob(ctx, id)
	if err != nil || job.State != StateScheduled || job.AttemptsUsed != 1 || time.Until(job.RunAt) < 30*time.Minute {
		t.Fatalf("after a refused retry-after: %+v %v", job, err)
	}
	mu.Lock()
	defer mu.Unlock()
	found := false
	for _, err := range reported {
		var ve *ValidationError
		found = found || errors.As(err, &ve) && ve.Field == "retry_after_ms"
	}
	if !found {
		t.Fatalf("reported %v, want the validation error of retry_after_ms", reported)
	}
	if st := w.Stats(); st != (WorkerStats{Failed: 1}) {
		t.Fatalf("stats %+v", st)
	}
}

// A claim asks for at most 1,000 jobs, however many slots are free.
func TestWorkerClaimsAtMostAThousandAtOnce(t *testing.T) {
	c := newTestClient()
	ctx := ctxT(t)
	q, typ := uniq("wide"), uniq("wide")
	id, err := c.Enqueue(ctx, typ, nil, &EnqueueOptions{Queue: q})
	if err != nil {
		t.Fatal(err)
	}
	w := NewWorker(c, WorkerOptions{
		Queues: []string{q}, Concurrency: 1500, PollWait: 200 * time.Millisecond,
		Handlers: map[string]HandlerFunc{typ: func(context.Context, *ClaimedJob) (any, error) { return "ok", nil }},
	})
	rctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- w.Run(rctx) }()
	for {
		select {
		case err := <-done:
			t.Fatalf("Run returned %v before the job was done", err)
		default:
		}
		job, err := c.WaitJob(ctx, id, 200*time.Millisecond)
		if err != nil {
			t.Fatal(err)
		}
		if job.State == StateCompleted {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("job is %s", job.State)
		}
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run returned %v", err)
	}
	expectStats(t, w, func(st WorkerStats) bool { return st == (WorkerStats{Completed: 1}) })
}

// The default name is cut on a character boundary, so that the server takes it.
func TestDefaultWorkerNameFitsTheBound(t *testing.T) {
	for _, host := range []string{"box", strings.Repeat("é", 100), strings.Repeat("x", 124) + "€€", "bad\xffhost", ""} {
		name := defaultWorkerName(host, 12345)
		if len(name) > maxWorkerName || !utf8.ValidString(name) || !strings.HasPrefix(name, "go-") || !strings.HasSuffix(name, "-12345") {
			t.Fatalf("host %q: name %q (%d bytes)", host, name, len(name))
		}
		if _, err := newTestClient().Claim(ctxT(t), ClaimRequest{Queues: []string{uniq("names")}, Worker: name}); err != nil {
			t.Fatalf("host %q: the server refused the name %q: %v", host, name, err)
		}
	}
	if got := defaultWorkerName("box", 7); got != "go-box-7" {
		t.Fatalf("a short name: %q", got)
	}
}

// A name the server would refuse is refused by Run before any claim.
func TestWorkerRefusesALongNameUpFront(t *testing.T) {
	tr := &counting{}
	c := newTestClient(WithHTTPClient(&http.Client{Transport: tr}))
	handlers := map[string]HandlerFunc{"x": func(context.Context, *ClaimedJob) (any, error) { return nil, nil }}
	for _, name := range []string{strings.Repeat("n", 129), strings.Repeat("é", 65), "bad\xffname"} {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		err := NewWorker(c, WorkerOptions{Name: name, Queues: []string{uniq("names")}, Handlers: handlers}).Run(ctx)
		cancel()
		wantValidation(t, "name "+name, err, "worker")
	}
	if n := tr.count(); n != 0 {
		t.Fatalf("%d requests sent", n)
	}
	// 128 bytes is a name the server takes.
	ok := strings.Repeat("é", 64)
	if _, err := c.Claim(ctxT(t), ClaimRequest{Queues: []string{uniq("names")}, Worker: ok}); err != nil {
		t.Fatal(err)
	}
}
