package idemq

import (
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestReplayReturnsTheSameJob(t *testing.T) {
	c := newTestClient()
	for _, header := range []bool{false, true} {
		t.Run(fmt.Sprintf("key_in_header=%v", header), func(t *testing.T) {
			ctx := ctxT(t)
			opts := &EnqueueOptions{IdempotencyKey: uniq("capture:inv_42"), Scope: "invoice-capture",
				TTL: time.Hour, Queue: "billing", KeyInHeader: header}
			typ := uniq("invoice.capture")
			first, err := c.EnqueueWithResult(ctx, typ, map[string]any{"invoice_id": "inv_42"}, opts)
			if err != nil {
				t.Fatal(err)
			}
			if first.Outcome != OutcomeAccepted || first.JobID == "" || first.Reason != "" {
				t.Fatalf("first enqueue: %+v", first)
			}
			again, err := c.EnqueueWithResult(ctx, typ, map[string]any{"invoice_id": "inv_42"}, opts)
			if err != nil {
				t.Fatal(err)
			}
			if again.Outcome != OutcomeReplayed || again.JobID != first.JobID {
				t.Fatalf("replay: %+v, first %+v", again, first)
			}
			id, err := c.Enqueue(ctx, typ, map[string]any{"invoice_id": "inv_42"}, opts)
			if err != nil || id != first.JobID {
				t.Fatalf("Enqueue replay: %q %v", id, err)
			}
			page, err := c.ListJobs(ctx, &ListJobsOptions{Type: typ})
			if err != nil {
				t.Fatal(err)
			}
			if len(page.Jobs) != 1 {
				t.Fatalf("want one job of type %s, got %d", typ, len(page.Jobs))
			}
			job := page.Jobs[0]
			if job.Queue != "billing" || job.Idempotency == nil || job.Idempotency.Scope != "invoice-capture" ||
				job.Idempotency.KeyPreview != KeyPreview(opts.IdempotencyKey) {
				t.Fatalf("stored job: %+v %+v", job, job.Idempotency)
			}
		})
	}
}

func TestConflictIsTypedAndNeverShowsTheKey(t *testing.T) {
	c := newTestClient()
	ctx := ctxT(t)
	key := uniq("order-secret-key")
	typ := uniq("order.place")
	opts := &EnqueueOptions{IdempotencyKey: key, Scope: "orders"}
	id, err := c.Enqueue(ctx, typ, map[string]any{"amount": 10}, opts)
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.Enqueue(ctx, typ, map[string]any{"amount": 11}, opts)
	if err == nil {
		t.Fatal("a changed payload under the same key was accepted")
	}
	var conflict *EnqueueIdempotencyConflictError
	if !errors.As(err, &conflict) {
		t.Fatalf("want *EnqueueIdempotencyConflictError, got %T: %v", err, err)
	}
	if conflict.JobID != id || conflict.Source != "idempotency_key" || conflict.Scope != "orders" {
		t.Fatalf("conflict: %+v", conflict)
	}
	if len(conflict.Fields) != 1 || conflict.Fields[0] != "payload" {
		t.Fatalf("fields: %v", conflict.Fields)
	}
	if conflict.KeyPreview != KeyPreview(key) || len(conflict.KeyDigest) != 16 {
		t.Fatalf("preview %q digest %q", conflict.KeyPreview, conflict.KeyDigest)
	}
	if !errors.Is(err, ErrIdempotencyConflict) || errors.Is(err, ErrValidation) {
		t.Fatal("errors.Is does not match the conflict sentinel alone")
	}
	var base *Error
	if !errors.As(err, &base) || base.Status != 409 || base.Kind != ProblemIdempotencyConflict || base.Retryable() {
		t.Fatalf("base error: %+v", base)
	}
	if !strings.Contains(err.Error(), id) || !strings.Contains(err.Error(), "payload") {
		t.Fatalf("the message should name the job and the field: %s", err)
	}
	mustNoRawKey(t, key, err.Error(), fmt.Sprintf("%v", err), fmt.Sprintf("%+v", err), fmt.Sprintf("%#v", err),
		fmt.Sprintf("%#v", *conflict), fmt.Sprintf("%+v", *base), fmt.Sprintf("%#v", *base), base.Error())

	// Nothing was written: still one job of that type, with the first payload.
	job, err := c.GetJob(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	if string(job.Payload) != `{"amount":10}` {
		t.Fatalf("payload changed: %s", job.Payload)
	}
	page, _ := c.ListJobs(ctx, &ListJobsOptions{Type: typ})
	if len(page.Jobs) != 1 {
		t.Fatalf("%d jobs", len(page.Jobs))
	}

	// The other way to conflict: an explicit job id.
	jid := uniq("job")
	if _, err := c.Enqueue(ctx, typ, 1, &EnqueueOptions{JobID: jid}); err != nil {
		t.Fatal(err)
	}
	_, err = c.Enqueue(ctx, typ, 1, &EnqueueOptions{JobID: jid, Queue: "elsewhere"})
	if !errors.As(err, &conflict) || conflict.Source != "job_id" || conflict.JobID != jid ||
		conflict.Scope != "" || conflict.KeyPreview != "" || len(conflict.Fields) != 1 || conflict.Fields[0] != "queue" {
		t.Fatalf("job id conflict: %v %+v", err, conflict)
	}
}

func TestConcurrentIdenticalEnqueues(t *testing.T) {
	c := newTestClient()
	ctx := ctxT(t)
	opts := &EnqueueOptions{IdempotencyKey: uniq("double-click")}
	typ := uniq("order.place")
	const n = 20
	results := make([]*EnqueueResult, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			<-start
			results[i], errs[i] = c.EnqueueWithResult(ctx, typ, map[string]any{"cart": 7}, opts)
		}(i)
	}
	close(start)
	wg.Wait()
	counts := map[Outcome]int{}
	ids := map[string]bool{}
	for i := range results {
		if errs[i] != nil {
			t.Fatalf("enqueue %d: %v", i, errs[i])
		}
		counts[results[i].Outcome]++
		ids[results[i].JobID] = true
	}
	if counts[OutcomeAccepted] != 1 || counts[OutcomeReplayed] != n-1 || len(ids) != 1 {
		t.Fatalf("outcomes %v, ids %v", counts, ids)
	}
	page, _ := c.ListJobs(ctx, &ListJobsOptions{Type: typ})
	if len(page.Jobs) != 1 {
		t.Fatalf("%d jobs", len(page.Jobs))
	}
}

func TestDedupeOutcomesAndReasons(t *testing.T) {
	c := newTestClient()
	t.Run("incompatible_mode", func(t *testing.T) {
		ctx := ctxT(t)
		typ, key := uniq("sync"), uniq("acct")
		first, err := c.EnqueueWithResult(ctx, typ, nil, &EnqueueOptions{Dedupe: &Dedupe{Key: key}})
		if err != nil || first.Outcome != OutcomeAccepted {
			t.Fatalf("%+v %v", first, err)
		}
		again, err := c.EnqueueWithResult(ctx, typ, nil, &EnqueueOptions{Dedupe: &Dedupe{Key: key}})
		if err != nil || again.Outcome != OutcomeCoalesced || again.JobID != first.JobID || again.Reason != "" {
			t.Fatalf("coalesced: %+v %v", again, err)
		}
		r, err := c.EnqueueWithResult(ctx, typ, nil, &EnqueueOptions{Dedupe: &Dedupe{Key: key, Replace: true}})
		if err != nil || r.Outcome != OutcomeNonReplaceable || r.Reason != ReasonIncompatibleMode || r.JobID != first.JobID {
			t.Fatalf("non_replaceable: %+v %v", r, err)
		}
		b, err := c.DedupeLookup(ctx, typ, key)
		if err != nil || b.JobID != first.JobID || b.Mode != "pending" {
			t.Fatalf("lookup: %+v %v", b, err)
		}
		ok, err := c.CancelByKey(ctx, typ, key)
		if err != nil || !ok {
			t.Fatalf("cancel by key: %v %v", ok, err)
		}
		if _, err := c.DedupeLookup(ctx, typ, key); !errors.Is(err, ErrNotFound) {
			t.Fatalf("binding after cancel by key: %v", err)
		}
		var nf *NotFoundError
		if _, err := c.DedupeLookup(ctx, typ, key); !errors.As(err, &nf) {
			t.Fatalf("want *NotFoundError, got %T", err)
		}
	})
	t.Run("replaced_then_window_elapsed", func(t *testing.T) {
		ctx := ctxT(t)
		typ, key := uniq("invite"), uniq("user")
		first, err := c.EnqueueWithResult(ctx, typ, map[string]any{"v": 1},
			&EnqueueOptions{Delay: time.Hour, Dedupe: &Dedupe{Key: key, Replace: true}})
		if err != nil || first.Outcome != OutcomeAccepted {
			t.Fatalf("%+v %v", first, err)
		}
		r, err := c.EnqueueWithResult(ctx, typ, map[string]any{"v": 2}, &EnqueueOptions{Dedupe: &Dedupe{Key: key, Replace: true}})
		if err != nil || r.Outcome != OutcomeReplaced || r.JobID != first.JobID {
			t.Fatalf("replaced: %+v %v", r, err)
		}
		// The replace landed with no delay: the job is due now.
		r, err = c.EnqueueWithResult(ctx, typ, map[string]any{"v": 3}, &EnqueueOptions{Dedupe: &Dedupe{Key: key, Replace: true}})
		if err != nil || r.Outcome != OutcomeNonReplaceable || r.Reason != ReasonWindowElapsed {
			t.Fatalf("window elapsed: %+v %v", r, err)
		}
		job, err := c.GetJob(ctx, first.JobID)
		if err != nil || string(job.Payload) != `{"v":2}` || job.Dedupe == nil || job.Dedupe.Key != key {
			t.Fatalf("job after replace: %+v %v", job, err)
		}
	})
}

func TestBatchReturnsPerItemResults(t *testing.T) {
	c := newTestClient()
	ctx := ctxT(t)
	typ := uniq("batch")
	key := uniq("batch-key")
	results, err := c.EnqueueBatch(ctx, []JobRequest{
		{Type: typ, Payload: 1},
		{Type: "not a valid type!", Payload: 2},
		{Type: typ, Payload: 3, Options: &EnqueueOptions{IdempotencyKey: key}},
		{Type: typ, Payload: 3, Options: &EnqueueOptions{IdempotencyKey: key}},
		{Type: typ, Payload: 4, Options: &EnqueueOptions{IdempotencyKey: key}},
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(results) != 5 {
		t.Fatalf("%d results", len(results))
	}
	if results[0].Err != nil || results[0].Result.Outcome != OutcomeAccepted {
		t.Fatalf("item 0: %+v", results[0])
	}
	var ve *ValidationError
	if !errors.As(results[1].Err, &ve) || ve.Field != "type" || ve.Reason == "" || results[1].Result != nil {
		t.Fatalf("item 1: %+v", results[1])
	}
	if results[2].Err != nil || results[2].Result.Outcome != OutcomeAccepted {
		t.Fatalf("item 2: %+v", results[2])
	}
	if results[3].Err != nil || results[3].Result.Outcome != OutcomeReplayed || results[3].Result.JobID != results[2].Result.JobID {
		t.Fatalf("item 3: %+v", results[3])
	}
	var conflict *EnqueueIdempotencyConflictError
	if !errors.As(results[4].Err, &conflict) || conflict.JobID != results[2].Result.JobID {
		t.Fatalf("item 4: %+v", results[4])
	}
	mustNoRawKey(t, key, results[4].Err.Error(), fmt.Sprintf("%#v", results[4].Err))
	page, _ := c.ListJobs(ctx, &ListJobsOptions{Type: typ})
	if len(page.Jobs) != 2 {
		t.Fatalf("%d jobs written", len(page.Jobs))
	}
}

func TestAtomicBatchFailureWritesNothing(t *testing.T) {
	c := newTestClient()
	ctx := ctxT(t)
	typ := uniq("atomic")
	key := uniq("atomic-key")
	results, err := c.EnqueueBatch(ctx, []JobRequest{
		{Type: typ, Payload: 1, Options: &EnqueueOptions{IdempotencyKey: key}},
		{Type: typ, Payload: 2, Options: &EnqueueOptions{MaxAttempts: 5000}},
	}, &BatchOptions{Atomic: true})
	if err == nil {
		t.Fatalf("the atomic batch succeeded: %+v", results)
	}
	var ve *ValidationError
	if !errors.As(err, &ve) || ve.Field != "max_attempts" {
		t.Fatalf("want a validation error on max_attempts, got %T %v", err, err)
	}
	if base := baseOf(err); base.Index != 1 || base.Status != 422 {
		t.Fatalf("base: %+v", base)
	}
	page, _ := c.ListJobs(ctx, &ListJobsOptions{Type: typ})
	if len(page.Jobs) != 0 {
		t.Fatalf("%d jobs written by a failed atomic batch", len(page.Jobs))
	}
	if _, err := c.IdempotencyLookup(ctx, "", key); !errors.Is(err, ErrNotFound) {
		t.Fatalf("the key was bound: %v", err)
	}
	// The same batch without the bad item goes through atomically.
	results, err = c.EnqueueBatch(ctx, []JobRequest{
		{Type: typ, Payload: 1, Options: &EnqueueOptions{IdempotencyKey: key}},
		{Type: typ, Payload: 2},
	}, &BatchOptions{Atomic: true})
	if err != nil || len(results) != 2 || results[0].Result.Outcome != OutcomeAccepted {
		t.Fatalf("%+v %v", results, err)
	}
}

func TestExplainWritesNothing(t *testing.T) {
	c := newTestClient()
	ctx := ctxT(t)
	typ := uniq("explain")
	opts := &EnqueueOptions{IdempotencyKey: uniq("explain-key")}
	ex, err := c.Explain(ctx, typ, map[string]any{"a": 1}, opts)
	if err != nil {
		t.Fatal(err)
	}
	if ex.Outcome != OutcomeAccepted || ex.Conflict != nil || ex.Idempotency != nil {
		t.Fatalf("explain of a new request: %+v", ex)
	}
	page, _ := c.ListJobs(ctx, &ListJobsOptions{Type: typ})
	if len(page.Jobs) != 0 {
		t.Fatal("explain wrote a job")
	}
	id, err := c.Enqueue(ctx, typ, map[string]any{"a": 1}, opts)
	if err != nil {
		t.Fatal(err)
	}
	events, _ := c.JobEvents(ctx, id)
	ex, err = c.Explain(ctx, typ, map[string]any{"a": 1}, opts)
	if err != nil || ex.Outcome != OutcomeReplayed || ex.JobID != id || ex.Idempotency == nil || ex.Idempotency.JobID != id {
		t.Fatalf("explain of a replay: %+v %v", ex, err)
	}
	hopts := *opts
	hopts.KeyInHeader = true
	ex, err = c.Explain(ctx, typ, map[string]any{"a": 1}, &hopts)
	if err != nil || ex.Outcome != OutcomeReplayed || ex.JobID != id {
		t.Fatalf("explain with the key in the header: %+v %v", ex, err)
	}
	ex, err = c.Explain(ctx, typ, map[string]any{"a": 2}, opts)
	if err != nil || ex.Outcome != OutcomeConflict || ex.Conflict == nil || ex.Conflict.JobID != id ||
		len(ex.Conflict.Fields) != 1 || ex.Conflict.Fields[0] != "payload" {
		t.Fatalf("explain of a conflict: %+v %v", ex, err)
	}
	after, _ := c.JobEvents(ctx, id)
	if len(after) != len(events) {
		t.Fatalf("explain appended events: %d -> %d", len(events), len(after))
	}
	if _, err := c.Explain(ctx, typ, nil, &EnqueueOptions{Queue: "bad queue"}); !errors.Is(err, ErrValidation) {
		t.Fatalf("explain of an invalid request: %v", err)
	}
}

func TestTypedErrors(t *testing.T) {
	c := newTestClient()
	t.Run("validation", func(t *testing.T) {
		_, err := c.Enqueue(ctxT(t), "x", nil, &EnqueueOptions{Queue: "no spaces allowed"})
		var ve *ValidationError
		if !errors.As(err, &ve) || ve.Field != "queue" || ve.Base.Status != 422 {
			t.Fatalf("%T %v", err, err)
		}
	})
	t.Run("payload_too_large", func(t *testing.T) {
		_, err := c.Enqueue(ctxT(t), "x", strings.Repeat("a", 1100*1024), nil)
		var pe *PayloadTooLargeError
		if !errors.As(err, &pe) || !errors.Is(err, ErrPayloadTooLarge) || pe.Base.Status != 413 {
			t.Fatalf("%T %v", err, err)
		}
	})
	t.Run("not_found", func(t *testing.T) {
		_, err := c.GetJob(ctxT(t), uniq("missing"))
		var nf *NotFoundError
		if !errors.As(err, &nf) || nf.Base.Status != 404 || !errors.Is(err, ErrNotFound) {
			t.Fatalf("%T %v", err, err)
		}
	})
	t.Run("bad_request", func(t *testing.T) {
		err := c.do(ctxT(t), call{method: "POST", path: "/v1/jobs", body: map[string]any{"type": "x", "bogus": 1}}, nil)
		var be *BadRequestError
		if !errors.As(err, &be) || !strings.Contains(be.Base.Detail, "bogus") {
			t.Fatalf("%T %v", err, err)
		}
	})
	t.Run("method_not_allowed", func(t *testing.T) {
		err := c.do(ctxT(t), call{method: "DELETE", path: "/v1/jobs"}, nil)
		var me *MethodNotAllowedError
		if !errors.As(err, &me) || me.Base.Status != 405 || len(me.Allow) == 0 {
			t.Fatalf("%T %v", err, err)
		}
		if me.Base.Title == "" {
			t.Fatalf("405 without a problem document: %+v", me.Base)
		}
	})
	t.Run("forbidden_host", func(t *testing.T) {
		hc := &http.Client{Transport: hostRewriter{"idemq.example.com"}}
		_, err := NewClient(shared.url, WithHTTPClient(hc)).Enqueue(ctxT(t), uniq("host"), nil, nil)
		var fe *ForbiddenHostError
		if !errors.As(err, &fe) || fe.Base.Status != 403 || !errors.Is(err, ErrForbiddenHost) {
			t.Fatalf("a foreign Host header: %T %v", err, err)
		}
	})
	t.Run("lease_lost", func(t *testing.T) {
		ctx := ctxT(t)
		typ := uniq("lease")
		id, _ := c.Enqueue(ctx, typ, nil, nil)
		_, err := c.Heartbeat(ctx, id, "not-a-token")
		var le *LeaseLostError
		if !errors.As(err, &le) || le.Base.Status != 409 {
			t.Fatalf("%T %v", err, err)
		}
	})
	t.Run("null_fields_accepted", func(t *testing.T) {
		err := c.do(ctxT(t), call{method: "POST", path: "/v1/jobs", body: map[string]any{
			"type": uniq("nulls"), "queue": nil, "tags": nil, "retry": nil, "idempotency": nil, "dedupe": nil}}, nil)
		if err != nil {
			t.Fatalf("null optional fields refused: %v", err)
		}
	})
}

func TestKeyPreview(t *testing.T) {
	for key, want := range map[string]string{
		"capture:inv_42":       "capture…",
		"ab":                   "a…",
		"a":                    "…",
		"ééééé":                "éé…",
		"0123456789abcdef0123": "01234567…",
	} {
		if got := KeyPreview(key); got != want {
			t.Errorf("KeyPreview(%q) = %q, want %q", key, got, want)
		}
	}
}

func TestFormattingNeverShowsTheKey(t *testing.T) {
	key := "super-secret-idempotency-key"
	opts := EnqueueOptions{IdempotencyKey: key, Scope: "s", Queue: "billing", TTL: time.Hour}
	red := RedriveOptions{IdempotencyKey: key, MaxAttempts: 3}
	req := JobRequest{Type: "t", Payload: 1, Options: &opts}
	var texts []string
	for _, v := range []any{opts, &opts, red, &red, req, &req, []JobRequest{req}} {
		for _, verb := range []string{"%v", "%+v", "%#v", "%s", "%q", "%10v"} {
			texts = append(texts, fmt.Sprintf(verb, v))
		}
	}
	texts = append(texts, opts.String(), opts.GoString(), red.GoString())
	mustNoRawKey(t, key, texts...)
	s := fmt.Sprintf("%+v", opts)
	if !strings.Contains(s, "billing") || !strings.Contains(s, KeyPreview(key)) {
		t.Fatalf("the options lost their other fields: %s", s)
	}
	if g := fmt.Sprintf("%#v", opts); !strings.HasPrefix(g, "idemq.EnqueueOptions{") {
		t.Fatalf("GoString: %s", g)
	}
	c := NewClient("http://127.0.0.1:1", WithToken("tok-secret"))
	mustNoRawKey(t, "tok-secret", fmt.Sprintf("%v", c), fmt.Sprintf("%+v", c), fmt.Sprintf("%#v", c))
	// The options are not changed by printing them.
	if opts.IdempotencyKey != key {
		t.Fatal("formatting changed the key")
	}
}
