package idemq

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand"
	"net/http"
	"os"
	"runtime/debug"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"
)

// HandlerFunc runs one job. Return a JSON-encodable result (nil: none) to
// complete it, or an error to fail the attempt: any error is retryable by the
// job's policy; wrap it with Permanent, RetryAfter or return Snooze for the
// other outcomes. ctx is cancelled when the handler must stop (see
// ClaimedJob.StopReason). A panic is a retryable failure.
type HandlerFunc func(ctx context.Context, job *ClaimedJob) (any, error)

// JobError is an error that tells the worker how to fail the attempt.
type JobError struct {
	Err        error
	Permanent  bool
	RetryAfter *time.Duration
	Snooze     *time.Duration
}

func (e *JobError) Error() string {
	switch {
	case e.Snooze != nil:
		return fmt.Sprintf("snoozed for %v", *e.Snooze)
	case e.Err == nil:
		return "job failed"
	}
	return e.Err.Error()
}

func (e *JobError) Unwrap() error { return e.Err }

// Permanent fails the job for good: it goes dead at once.
func Permanent(err error) error { return &JobError{Err: err, Permanent: true} }

// RetryAfter fails the attempt and retries it after d (unless the job's
// policy is "none").
func RetryAfter(err error, d time.Duration) error { return &JobError{Err: err, RetryAfter: &d} }

// Snooze runs the job again after d without consuming the attempt.
func Snooze(d time.Duration) error { return &JobError{Snooze: &d} }

// WorkerOptions configure a Worker. Only Handlers is required. A zero
// duration takes its default; Run refuses a negative one (Lease and PollWait
// with the *ValidationError of lease_ms and wait_ms a claim would get).
type WorkerOptions struct {
	// Queues to claim from (nil: every queue).
	Queues []string
	// Handlers by job type; the worker claims only these types.
	Handlers map[string]HandlerFunc
	// Concurrency is how many jobs run at once (default 10). A claim asks
	// for the free slots, at most 1,000 (the API's bound) at a time.
	Concurrency int
	// Name is the worker's name in the run ledger: 1–128 bytes of UTF-8
	// (default go-<host>-<pid>, the host name cut to fit). Run refuses a
	// longer one with a *ValidationError of field "worker".
	Name string
	// Lease of each claimed job (default 30s); heartbeats every Lease/3.
	Lease time.Duration
	// HeartbeatInterval overrides Lease/3.
	HeartbeatInterval time.Duration
	// PollWait is how long a claim waits for work (default 2s, at most 60s).
	// A shutdown waits for the claim in flight, and releases what it got.
	PollWait time.Duration
	// ShutdownGrace is how long running handlers may go on after ctx is
	// cancelled before they are stopped and their leases released (default 30s).
	ShutdownGrace time.Duration
	// CancelGrace is how long a handler may go on after a heartbeat saw a
	// cancel request (default 1s). A handler that returns within it ends the
	// attempt as usual; otherwise the attempt is failed, the job turns
	// cancelled, the slot is freed, and what the handler returns later is
	// dropped.
	CancelGrace time.Duration
	// CompleteBatch is the most completions sent in one round trip, carried
	// on a claim or in a batch of their own (default 100).
	CompleteBatch int
	// ErrorBackoff is the pause after a claim failed with a transient error (default 1s).
	ErrorBackoff time.Duration
	// OnError receives errors the worker handles itself (a failed heartbeat,
	// claim or acknowledgement). Nil ignores them.
	OnError func(error)
}

// WorkerStats counts what a worker did.
type WorkerStats struct {
	Completed int64 // attempts completed
	Failed    int64 // attempts failed (retried, dead or snoozed)
	Released  int64 // leases released unfinished (shutdown)
	Lost      int64 // leases lost: the result was not recorded
	// Cancelled counts attempts whose cancel request a heartbeat saw while
	// the handler ran; each also counts by how it ended (a handler that did
	// not return within CancelGrace: in Failed).
	Cancelled int64
}

// Worker runs handlers for claimed jobs over the worker protocol.
type Worker struct {
	c    *Client
	opts WorkerOptions
	// types is the sorted list of handled types.
	types []string

	completed, failed, released, lost, cancelled int64

	running  sync.WaitGroup
	slots    chan struct{}
	abort    chan struct{}
	batchOff int32

	// Completions wait in pending for the next claim to carry them, or for
	// the completer to send them; wake tells the completer there are some.
	ackMu     sync.Mutex
	pending   []*ack
	noCarry   bool
	ackWake   chan struct{}
	ackFinish chan struct{}
}

// completionDelay is how long a finished job's completion waits before the
// completer sends it: the slot it frees usually starts a claim within this
// time, which carries it in the same round trip.
const completionDelay = 10 * time.Millisecond

const (
	// deadlineRecheck is the shortest wait before the server is asked about
	// a deadline again, when it said "not yet".
	deadlineRecheck = 10 * time.Millisecond
	// deadlineBackoff and deadlineBackoffMax bound the wait before a
	// deadline question the server did not answer is asked again.
	deadlineBackoff    = 50 * time.Millisecond
	deadlineBackoffMax = 2 * time.Second
)

type ack struct {
	c     Completion
	reply chan error
	// apart is set once a claim carrying it failed or was not trusted: it
	// then goes in a call of its own.
	apart bool
	// uncertain is 1 once a call carrying it went unanswered at least once
	// (a connection error or a timeout): the server may have recorded it,
	// and a later lease-lost answer may be about that.
	uncertain int32
}

func (a *ack) markUncertain(yes bool) {
	if yes {
		atomic.StoreInt32(&a.uncertain, 1)
	}
}

// maxClaimLimit is the most jobs one claim may ask for (API: limit ≤ 1,000).
const maxClaimLimit = 1000

// maxWorkerName is the longest worker name the server takes, in bytes.
const maxWorkerName = 128

// NewWorker returns a worker of client. Run starts it.
func NewWorker(client *Client, opts WorkerOptions) *Worker {
	if opts.Concurrency <= 0 {
		opts.Concurrency = 10
	}
	// Zero durations take their defaults; negative ones are kept for Run
	// to refuse.
	if opts.Lease == 0 {
		opts.Lease = 30 * time.Second
	}
	if opts.HeartbeatInterval == 0 {
		opts.HeartbeatInterval = opts.Lease / 3
	}
	if opts.PollWait == 0 {
		opts.PollWait = 2 * time.Second
	}
	if opts.PollWait > 60*time.Second {
		opts.PollWait = 60 * time.Second
	}
	if opts.ShutdownGrace == 0 {
		opts.ShutdownGrace = 30 * time.Second
	}
	if opts.CancelGrace == 0 {
		opts.CancelGrace = time.Second
	}
	if opts.CompleteBatch <= 0 || opts.CompleteBatch > 1000 {
		opts.CompleteBatch = 100
	}
	if opts.ErrorBackoff == 0 {
		opts.ErrorBackoff = time.Second
	}
	if opts.Name == "" {
		host, _ := os.Hostname()
		opts.Name = defaultWorkerName(host, os.Getpid())
	}
	w := &Worker{c: client, opts: opts}
	for t := range opts.Handlers {
		w.types = append(w.types, t)
	}
	sort.Strings(w.types)
	return w
}

// defaultWorkerName is go-<host>-<pid>, the host cut on a character
// boundary so that the name fits in maxWorkerName bytes.
func defaultWorkerName(host string, pid int) string {
	// JSON would send each invalid byte as U+FFFD, three bytes: count them so.
	host = strings.ToValidUTF8(host, "\uFFFD")
	if host == "" {
		host = "host"
	}
	suffix := fmt.Sprintf("-%d", pid)
	return "go-" + cutUTF8(host, maxWorkerName-len("go-")-len(suffix)) + suffix
}

// cutUTF8 is the longest prefix of s of at most n bytes that does not split
// a character.
func cutUTF8(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}

// check refuses options no claim could carry, before anything is sent.
func (w *Worker) check() error {
	o := w.opts
	switch {
	case len(o.Name) > maxWorkerName:
		return invalid(http.MethodPost, "/v1/claim", "worker", fmt.Sprintf("must be 1–128 bytes (WorkerOptions.Name is %d)", len(o.Name)))
	case !utf8.ValidString(o.Name):
		return invalid(http.MethodPost, "/v1/claim", "worker", "must be valid UTF-8 (WorkerOptions.Name is not)")
	case o.Lease < 0:
		return invalid(http.MethodPost, "/v1/claim", "lease_ms", "must be from 100 to 3600000 ms (WorkerOptions.Lease is negative)")
	case o.PollWait < 0:
		return invalid(http.MethodPost, "/v1/claim", "wait_ms", "must be from 0 to 60000 (WorkerOptions.PollWait is negative)")
	}
	for _, d := range []struct {
		name string
		d    time.Duration
	}{{"HeartbeatInterval", o.HeartbeatInterval}, {"ShutdownGrace", o.ShutdownGrace},
		{"CancelGrace", o.CancelGrace}, {"ErrorBackoff", o.ErrorBackoff}} {
		if d.d < 0 {
			return fmt.Errorf("idemq: WorkerOptions.%s must not be negative (it is %v)", d.name, d.d)
		}
	}
	return nil
}

// Stats returns what the worker did so far.
func (w *Worker) Stats() WorkerStats {
	return WorkerStats{
		Completed: atomic.LoadInt64(&w.completed), Failed: atomic.LoadInt64(&w.failed),
		Released: atomic.LoadInt64(&w.released), Lost: atomic.LoadInt64(&w.lost),
		Cancelled: atomic.LoadInt64(&w.cancelled),
	}
}

func (w *Worker) report(err error) {
	if err != nil && w.opts.OnError != nil {
		w.opts.OnError(err)
	}
}

// Run claims and runs jobs until ctx is cancelled, then shuts down
// gracefully: it stops claiming, lets running handlers finish for up to
// ShutdownGrace, stops the rest and releases their leases, and returns nil.
// It returns early with an error when a claim fails for good (e.g. an
// *UnauthorizedError or a *ValidationError), after the same shutdown, and
// at once, before any claim, for options no claim could carry (a Name over
// 128 bytes, a negative duration).
func (w *Worker) Run(ctx context.Context) error {
	if len(w.types) == 0 {
		return errors.New("idemq: a worker needs at least one handler")
	}
	if err := w.check(); err != nil {
		return err
	}
	w.slots = make(chan struct{}, w.opts.Concurrency)
	w.abort = make(chan struct{})
	w.ackWake = make(chan struct{}, 1)
	w.ackFinish = make(chan struct{})
	completerDone := make(chan struct{})
	go func() { defer close(completerDone); w.runCompleter() }()

	err := w.claimLoop(ctx)

	// Shutdown: running handlers get the grace period, then are stopped.
	drained := make(chan struct{})
	go func() { w.running.Wait(); close(drained) }()
	grace := time.NewTimer(w.opts.ShutdownGrace)
	select {
	case <-drained:
		grace.Stop()
	case <-grace.C:
		close(w.abort)
		<-drained
	}
	close(w.ackFinish)
	<-completerDone
	return err
}

func (w *Worker) claimLoop(ctx context.Context) error {
	for {
		if ctx.Err() != nil {
			return nil
		}
		select {
		case w.slots <- struct{}{}:
		case <-ctx.Done():
			return nil
		}
		// One slot is ours; take every other free one for this claim, up
		// to the most one claim may ask for.
		free := 1
	more:
		for free < w.opts.Concurrency && free < maxClaimLimit {
			select {
			case w.slots <- struct{}{}:
				free++
			default:
				break more
			}
		}
		carried := w.takeCarried()
		// The claim is not cancelled by ctx: a claim cut off mid-flight may
		// have leased jobs this worker would never see. It is bounded by
		// PollWait; what it returns during a shutdown is released.
		sent := time.Now()
		resp, uncertain, err := w.c.claim(context.Background(), ClaimRequest{
			Queues: w.opts.Queues, Types: w.types, Worker: w.opts.Name, Limit: free,
			Lease: w.opts.Lease, Wait: w.opts.PollWait, Complete: completionsOf(carried),
		})
		for _, a := range carried {
			a.markUncertain(uncertain)
		}
		if err != nil {
			for i := 0; i < free; i++ {
				<-w.slots
			}
			// Whether the claim recorded them is unknown: a call of their
			// own answers each (lease-lost for one that it did record, which
			// finish then finds completed when a try went unanswered).
			w.putBack(carried)
			b := baseOf(err)
			switch {
			case len(carried) > 0 && errors.Is(err, ErrBadRequest):
				// A server from before claims took completions refuses the
				// member like any unknown one.
				w.stopCarrying()
				w.report(err)
				continue
			case b == nil || !b.Retryable():
				if len(carried) == 0 {
					return err
				}
				// What was refused may be a completion (a result over the
				// size limit): the claim is tried again without them.
				w.report(err)
				continue
			}
			w.report(err)
			pause := w.opts.ErrorBackoff/2 + time.Duration(rand.Int63n(int64(w.opts.ErrorBackoff)))
			t := time.NewTimer(pause)
			select {
			case <-ctx.Done():
				t.Stop()
				return nil
			case <-t.C:
			}
			continue
		}
		if len(carried) > 0 {
			if len(resp.Completed) == len(carried) {
				for i, a := range carried {
					a.reply <- resp.Completed[i].Err
				}
			} else {
				// Answers that do not pair up with the completions cannot be
				// trusted (a server that ignored the member sends none).
				w.stopCarrying()
				w.putBack(carried)
			}
		}
		for i := len(resp.Jobs); i < free; i++ {
			<-w.slots
		}
		for _, job := range resp.Jobs {
			if ctx.Err() != nil {
				w.releaseLease(job)
				<-w.slots
				continue
			}
			w.running.Add(1)
			go func(job *ClaimedJob) {
				var once sync.Once
				freeSlot := func() { once.Do(func() { <-w.slots }) }
				defer func() { freeSlot(); w.running.Done() }()
				w.runJob(job, sent, freeSlot)
			}(job)
		}
	}
}

func (w *Worker) releaseLease(job *ClaimedJob) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, uncertain, err := w.c.release(ctx, job.ID, job.LeaseToken); err != nil {
		if errors.Is(err, ErrLeaseLost) {
			// After an unanswered try, that try may have released it.
			if uncertain && w.endedByOwnCall(job, runReleased, nil) {
				atomic.AddInt64(&w.released, 1)
				return
			}
			atomic.AddInt64(&w.lost, 1)
			return
		}
		w.report(err)
		return
	}
	atomic.AddInt64(&w.released, 1)
}

type handlerResult struct {
	value any
	err   error
}

// runJob runs one claimed job to its end: completed, failed, released or lost.
// claimed is when the claim was sent: the lease is counted from then.
// freeSlot lets another job start while this one's completion waits.
func (w *Worker) runJob(job *ClaimedJob, claimed time.Time, freeSlot func()) {
	hctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	job.mu.Lock()
	job.cancel = cancel
	job.lost = make(chan struct{})
	lost := job.lost
	job.mu.Unlock()

	handler := w.opts.Handlers[job.Type]
	done := make(chan handlerResult, 1)
	go func() {
		defer func() {
			if p := recover(); p != nil {
				done <- handlerResult{err: fmt.Errorf("panic: %v\n%s", p, debug.Stack())}
			}
		}()
		if handler == nil {
			done <- handlerResult{err: Permanent(fmt.Errorf("no handler for job type %q", job.Type))}
			return
		}
		v, err := handler(hctx, job)
		done <- handlerResult{v, err}
	}()

	// Local enforcement of the timeout. The deadline is the server's to
	// enforce, on its clock: the heartbeater asks it when the deadline has come.
	var timeoutC <-chan time.Time
	if t := job.Timeout(); t > 0 {
		timer := time.NewTimer(t)
		defer timer.Stop()
		timeoutC = timer.C
	}
	beat := newHeartbeater(w, job, claimed)
	defer beat.stop()

	// After a heartbeat saw a cancel request, the handler has CancelGrace to
	// return; graceC fires when that is over.
	cancelSeen := beat.cancelled
	var graceC <-chan time.Time

	for {
		select {
		case r := <-done:
			beat.handlerReturned()
			w.finish(job, beat, lost, r, freeSlot)
			return
		case <-cancelSeen:
			cancelSeen = nil
			atomic.AddInt64(&w.cancelled, 1)
			grace := time.NewTimer(w.opts.CancelGrace)
			defer grace.Stop()
			graceC = grace.C
		case <-graceC:
			// The handler ignores its ctx: a fail ends the attempt, which
			// the server records as cancelled. The slot is freed when
			// runJob returns; the handler's eventual result goes to done,
			// which nothing reads any more.
			w.fail(job, FailOptions{Error: "cancelled while running"})
			return
		case <-lost:
			atomic.AddInt64(&w.lost, 1)
			return
		case <-timeoutC:
			job.setStop(ErrJobTimeout)
			w.fail(job, FailOptions{Error: fmt.Sprintf("timed out after %v", job.Timeout())})
			return
		case <-beat.passed:
			// The server ended the attempt at the job's deadline (dead,
			// reason deadline): nothing more to record.
			job.setStop(ErrJobDeadline)
			atomic.AddInt64(&w.failed, 1)
			return
		case <-w.abort:
			job.setStop(ErrShutdown)
			w.releaseLease(job)
			return
		}
	}
}

// finish records what the handler returned.
func (w *Worker) finish(job *ClaimedJob, beat *heartbeater, lost <-chan struct{}, r handlerResult, freeSlot func()) {
	if errors.Is(job.StopReason(), ErrLeaseLost) {
		atomic.AddInt64(&w.lost, 1)
		return
	}
	if r.err != nil {
		opts := FailOptions{Error: r.err.Error()}
		var je *JobError
		if errors.As(r.err, &je) {
			opts.Permanent, opts.RetryAfter, opts.Snooze = je.Permanent, je.RetryAfter, je.Snooze
		}
		w.fail(job, opts)
		return
	}
	var result json.RawMessage
	if r.value != nil {
		raw, err := json.Marshal(r.value)
		if err != nil {
			w.fail(job, FailOptions{Error: "the result cannot be encoded as JSON: " + err.Error(), Permanent: true})
			return
		}
		result = raw
	}
	// Without a deadline the heartbeat goes on until the completion is
	// answered, so the lease cannot lapse while it waits for a claim or a
	// batch; the completion is queued before the slot is freed, so that the
	// claim the free slot starts carries it. A job with a deadline gets no
	// heartbeat once its handler returned (one that reached the server past
	// the deadline would end the attempt there, and the completion would be
	// refused): its completion goes at once, in a call of its own, within
	// the lease left from the last renewal.
	direct := job.Deadline != nil
	if direct {
		freeSlot()
	}
	// uncertain: a call carrying this completion went unanswered, so the
	// server may have recorded it, and a lease-lost answer may be about that.
	uncertain := false
	for {
		var err error
		if direct {
			var unanswered bool
			unanswered, err = w.completeNow(job, result)
			uncertain = uncertain || unanswered
		} else {
			a := &ack{c: Completion{ID: job.ID, LeaseToken: job.LeaseToken}, reply: make(chan error, 1)}
			if result != nil {
				a.c.Result = result
			}
			w.handOver(a)
			freeSlot()
			select {
			case err = <-a.reply:
			case <-lost:
				if w.withdraw(a) {
					atomic.AddInt64(&w.lost, 1)
					return
				}
				// Already sent: a carried completion may be recorded while the
				// claim still waits for work, and a heartbeat then answers
				// lease-lost. The server's answer says which it was.
				err = <-a.reply
			}
			uncertain = uncertain || atomic.LoadInt32(&a.uncertain) == 1
		}
		if err == nil {
			atomic.AddInt64(&w.completed, 1)
			return
		}
		if b := baseOf(err); b != nil && (b.Kind == KindConnection || b.Kind == KindTimeout) {
			// Given up on unanswered: the next try may find it recorded.
			uncertain = true
		}
		if errors.Is(err, ErrLeaseLost) {
			// The lease is gone. After an unanswered try that may be because
			// that try completed the job: the job says whether it did.
			if uncertain && w.completedByThisAttempt(job) {
				atomic.AddInt64(&w.completed, 1)
				return
			}
			atomic.AddInt64(&w.lost, 1)
			return
		}
		if refusedResult(err) {
			// The same handler would return the same result: retrying the
			// attempt cannot help.
			w.fail(job, FailOptions{Error: "the handler's result was refused: " + err.Error(), Permanent: true})
			return
		}
		w.report(err)
		if b := baseOf(err); b == nil || !b.Retryable() || !beat.alive() {
			atomic.AddInt64(&w.lost, 1)
			return
		}
		select {
		case <-time.After(w.opts.ErrorBackoff):
		case <-lost:
			atomic.AddInt64(&w.lost, 1)
			return
		}
	}
}

// completeNow records job's completion in a call of its own; unanswered
// says whether a try went without an answer.
func (w *Worker) completeNow(job *ClaimedJob, result json.RawMessage) (unanswered bool, err error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var value any
	if result != nil {
		value = result
	}
	_, unanswered, err = w.c.complete(ctx, job.ID, job.LeaseToken, value)
	return unanswered, err
}

// completedByThisAttempt reports whether job is completed by the attempt
// this worker held: a completion answered lease-lost after a try of it went
// unanswered was then recorded by that try. Only the holder of an attempt's
// lease can complete it, and a new claim is a new attempt. When the job
// cannot be read, the completion counts as lost.
func (w *Worker) completedByThisAttempt(job *ClaimedJob) bool {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	now, err := w.c.GetJob(ctx, job.ID)
	if err != nil {
		w.report(err)
		return false
	}
	return now.State == StateCompleted && now.Attempt == job.Attempt
}

// The outcomes of a run (Run.Outcome) that the worker's own calls end an
// attempt with.
const (
	runFailed    = "failed"
	runSnoozed   = "snoozed"
	runReleased  = "released"
	runCancelled = "cancelled"
)

// maxErrorBytes is the most bytes of a failure's error text the server keeps.
const maxErrorBytes = 8192

// keptError is a failure's error text as the server keeps it in the
// attempt's run: each byte that is not valid UTF-8 written as U+FFFD (as
// JSON sends it), U+0000 written as U+FFFD, cut to 8 KiB of UTF-8 on a
// character boundary.
func keptError(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && size == 1, r == 0:
			b.WriteRune(utf8.RuneError)
		default:
			b.WriteString(s[i : i+size])
		}
		i += size
	}
	return cutUTF8(b.String(), maxErrorBytes)
}

// endedByOwnCall reports whether a fail or release of job answered
// lease-lost after a try of it went unanswered (a connection error or a
// timeout) was recorded by that try. The run of the attempt this worker
// held then ended as the call ends one: outcome (runFailed, runSnoozed or
// runReleased), or runCancelled when a cancel was requested, with the error
// text sent as the server keeps it (errText; nil or "" for none, as for a
// snooze or a release). An attempt the server ended otherwise (its lease
// expired, a heartbeat recorded its timeout or deadline) keeps its own
// outcome or text, and one still running has no end: those are lost, and
// so is every attempt when the runs cannot be read.
func (w *Worker) endedByOwnCall(job *ClaimedJob, outcome string, errText *string) bool {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	runs, err := w.c.JobRuns(ctx, job.ID)
	if err != nil {
		w.report(err)
		return false
	}
	text := func(p *string) string {
		if p == nil {
			return ""
		}
		return *p
	}
	for _, r := range runs {
		if r.Attempt == job.Attempt && r.Outcome != nil && (*r.Outcome == outcome || *r.Outcome == runCancelled) &&
			text(r.Error) == text(errText) {
			return true
		}
	}
	return false
}

// endedByServer reports whether the server ended job's attempt when a
// heartbeat of a job with a deadline found the lease gone (at the deadline,
// or at its timeout, as a heartbeat then records it), rather than the
// attempt being another's already.
func (w *Worker) endedByServer(job *ClaimedJob) bool {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	now, err := w.c.GetJob(ctx, job.ID)
	return err == nil && now.Attempt == job.Attempt && now.State != StateActive && now.State != StateCompleted
}

func (w *Worker) fail(job *ClaimedJob, opts FailOptions) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if neg := func(d *time.Duration) bool { return d != nil && *d < 0 }; neg(opts.RetryAfter) || neg(opts.Snooze) {
		// RetryAfter or Snooze with a negative duration: the call is refused
		// (a *ValidationError, reported); the attempt is failed by the job's
		// retry policy instead, rather than left to its lease.
		_, err := w.c.Fail(ctx, job.ID, job.LeaseToken, opts)
		w.report(err)
		opts.RetryAfter, opts.Snooze = nil, nil
	}
	if _, uncertain, err := w.c.fail(ctx, job.ID, job.LeaseToken, opts); err != nil {
		if errors.Is(err, ErrLeaseLost) {
			// After an unanswered try, that try may have recorded it. A
			// snooze keeps no error text; a failure keeps the text sent.
			outcome, text := runFailed, keptError(opts.Error)
			if opts.Snooze != nil {
				outcome, text = runSnoozed, ""
			}
			if uncertain && w.endedByOwnCall(job, outcome, &text) {
				atomic.AddInt64(&w.failed, 1)
				return
			}
			atomic.AddInt64(&w.lost, 1)
			return
		}
		w.report(err)
		return
	}
	atomic.AddInt64(&w.failed, 1)
}

// refusedResult reports whether the server refused a completion for what it
// holds: a result over the payload limit, or one it cannot store.
func refusedResult(err error) bool {
	return errors.Is(err, ErrPayloadTooLarge) || errors.Is(err, ErrValidation) || errors.Is(err, ErrBadRequest)
}

func completionsOf(acks []*ack) []Completion {
	if len(acks) == 0 {
		return nil
	}
	out := make([]Completion, len(acks))
	for i, a := range acks {
		out[i] = a.c
	}
	return out
}

func (w *Worker) handOver(a *ack) {
	w.ackMu.Lock()
	w.pending = append(w.pending, a)
	w.ackMu.Unlock()
	w.wakeCompleter()
}

func (w *Worker) wakeCompleter() {
	select {
	case w.ackWake <- struct{}{}:
	default:
	}
}

// takeCarried takes the completions the next claim carries.
func (w *Worker) takeCarried() []*ack {
	w.ackMu.Lock()
	defer w.ackMu.Unlock()
	if w.noCarry {
		return nil
	}
	var taken []*ack
	kept := w.pending[:0]
	for _, a := range w.pending {
		if !a.apart && len(taken) < w.opts.CompleteBatch {
			taken = append(taken, a)
		} else {
			kept = append(kept, a)
		}
	}
	for i := len(kept); i < len(w.pending); i++ {
		w.pending[i] = nil
	}
	w.pending = kept
	return taken
}

// putBack queues completions a claim did not record for a call of their own,
// ahead of the rest: their leases are the oldest.
func (w *Worker) putBack(acks []*ack) {
	if len(acks) == 0 {
		return
	}
	w.ackMu.Lock()
	for _, a := range acks {
		a.apart = true
	}
	w.pending = append(append(make([]*ack, 0, len(acks)+len(w.pending)), acks...), w.pending...)
	w.ackMu.Unlock()
	w.wakeCompleter()
}

// withdraw drops a completion that was not sent yet (a lost lease never
// completes); false when it is in flight.
func (w *Worker) withdraw(a *ack) bool {
	w.ackMu.Lock()
	defer w.ackMu.Unlock()
	for i, p := range w.pending {
		if p == a {
			w.pending = append(w.pending[:i], w.pending[i+1:]...)
			return true
		}
	}
	return false
}

func (w *Worker) carrying() bool {
	w.ackMu.Lock()
	defer w.ackMu.Unlock()
	return !w.noCarry
}

func (w *Worker) stopCarrying() {
	w.ackMu.Lock()
	w.noCarry = true
	w.ackMu.Unlock()
}

// takeBatch takes the oldest completions, up to CompleteBatch; more is true
// when some are left.
func (w *Worker) takeBatch() (batch []*ack, more bool) {
	w.ackMu.Lock()
	defer w.ackMu.Unlock()
	n := len(w.pending)
	if n > w.opts.CompleteBatch {
		n = w.opts.CompleteBatch
	}
	batch = append([]*ack(nil), w.pending[:n]...)
	w.pending = append(w.pending[:0], w.pending[n:]...)
	return batch, len(w.pending) > 0
}

// runCompleter sends the completions no claim took, many per round trip.
func (w *Worker) runCompleter() {
	for {
		select {
		case <-w.ackWake:
		case <-w.ackFinish:
			// Run gets here once every job has ended, and a job ends only
			// when its completion was answered or withdrawn: none is left.
			return
		}
		if w.carrying() {
			time.Sleep(completionDelay)
		}
		batch, more := w.takeBatch()
		if len(batch) > 0 {
			w.sendBatch(batch)
		}
		if more {
			w.wakeCompleter()
		}
	}
}

func (w *Worker) sendBatch(batch []*ack) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if atomic.LoadInt32(&w.batchOff) == 0 {
		items := make([]Completion, len(batch))
		for i, a := range batch {
			items[i] = a.c
		}
		results, uncertain, err := w.c.completeMany(ctx, items)
		for _, a := range batch {
			a.markUncertain(uncertain)
		}
		if err == nil {
			for i, a := range batch {
				a.reply <- results[i].Err
			}
			return
		}
		switch b := baseOf(err); {
		case errors.Is(err, ErrMethodNotAllowed) || errors.Is(err, ErrNotFound):
			// A server without the batch endpoint: complete one by one from now on.
			atomic.StoreInt32(&w.batchOff, 1)
		case b != nil && b.Retryable():
			for _, a := range batch {
				a.reply <- err
			}
			return
		default:
			// Refused as a whole, as one result over the size limit does:
			// one call per completion answers each, so the others still
			// complete.
		}
	}
	for _, a := range batch {
		_, uncertain, err := w.c.complete(ctx, a.c.ID, a.c.LeaseToken, a.c.Result)
		a.markUncertain(uncertain)
		a.reply <- err
	}
}

// heartbeater renews one job's lease every HeartbeatInterval and, while the
// handler runs, asks the server about the job's deadline when it has come.
// A job with a deadline is renewed only while its handler runs.
type heartbeater struct {
	w    *Worker
	job  *ClaimedJob
	quit chan struct{}
	done chan struct{}
	// passed is closed when the server ended the attempt at its deadline.
	passed chan struct{}
	// cancelled is closed when a heartbeat's answer first said a cancel
	// was requested.
	cancelled chan struct{}
	// returned is 1 once the handler returned: the deadline is not asked
	// about after (a completion counts even past it), and a job with a
	// deadline is not renewed after (past the deadline on the server's
	// clock, a heartbeat would end the attempt the handler finished).
	returned int32
	mu       sync.Mutex
	lastOK   time.Time
}

func newHeartbeater(w *Worker, job *ClaimedJob, since time.Time) *heartbeater {
	h := &heartbeater{w: w, job: job, quit: make(chan struct{}), done: make(chan struct{}), passed: make(chan struct{}), cancelled: make(chan struct{}), lastOK: since}
	go h.loop()
	return h
}

func (h *heartbeater) stop() { close(h.quit); <-h.done }

func (h *heartbeater) handlerReturned() { atomic.StoreInt32(&h.returned, 1) }

// untilDeadline is how long until the server's clock reads the job's
// deadline, given the lease expiry it answered just now (the claim's or a
// heartbeat's): its clock read that less the lease. Without one, this
// machine's clock stands in for the server's.
func (h *heartbeater) untilDeadline(leaseExpiresAt time.Time) time.Duration {
	if leaseExpiresAt.IsZero() {
		return time.Until(*h.job.Deadline)
	}
	// The claim sent the lease in whole milliseconds.
	lease := time.Duration(ms(h.w.opts.Lease)) * time.Millisecond
	return h.job.Deadline.Sub(leaseExpiresAt.Add(-lease))
}

// alive reports whether the lease may still be this worker's.
func (h *heartbeater) alive() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return time.Since(h.lastOK) < h.w.opts.Lease
}

func (h *heartbeater) loop() {
	defer close(h.done)
	interval := h.w.opts.HeartbeatInterval
	tick := time.NewTicker(interval)
	defer tick.Stop()
	// The lease is measured from the last acknowledged renewal; past it, the
	// job may belong to another worker already, so the handler is stopped.
	expiry := time.NewTimer(h.w.opts.Lease - time.Since(h.lastOK))
	defer expiry.Stop()
	// The deadline is the server's to decide, on its clock: this timer only
	// says when to ask, by the attempt's heartbeat. Past the deadline the
	// server ends the attempt (dead, reason deadline) and answers
	// lease-lost; before it, it renews the lease, and its answer says when
	// its clock will be there.
	var ask *time.Timer
	var askC <-chan time.Time
	if h.job.Deadline != nil {
		ask = time.NewTimer(h.untilDeadline(h.job.LeaseExpiresAt))
		defer ask.Stop()
		askC = ask.C
	}
	backoff := deadlineBackoff
	cancelSeen := false
	for {
		asking := false
		select {
		case <-h.quit:
			return
		case <-expiry.C:
			h.job.setStop(ErrLeaseLost)
			return
		case <-tick.C:
			if h.job.Deadline != nil && atomic.LoadInt32(&h.returned) == 1 {
				continue
			}
		case <-askC:
			if atomic.LoadInt32(&h.returned) == 1 {
				askC = nil
				continue
			}
			asking = true
		}
		sent := time.Now()
		ctx, cancel := context.WithTimeout(context.Background(), interval)
		r, err := h.w.c.Heartbeat(ctx, h.job.ID, h.job.LeaseToken)
		cancel()
		if err != nil {
			if errors.Is(err, ErrLeaseLost) {
				// With a deadline, any heartbeat may find the attempt ended
				// by the server: its clock may be past the deadline before
				// this worker's estimate says so.
				if h.job.Deadline != nil && h.w.endedByServer(h.job) {
					close(h.passed)
					return
				}
				h.job.setStop(ErrLeaseLost)
				return
			}
			h.w.report(err)
			if asking {
				// The server cannot be asked: the handler goes on, and the
				// question is asked again.
				ask.Reset(backoff)
				if backoff *= 2; backoff > deadlineBackoffMax {
					backoff = deadlineBackoffMax
				}
			}
			continue
		}
		h.mu.Lock()
		h.lastOK = sent
		h.mu.Unlock()
		if !expiry.Stop() {
			<-expiry.C
		}
		expiry.Reset(h.w.opts.Lease - time.Since(sent))
		if asking {
			// Not yet on the server's clock: ask again when it will be.
			backoff = deadlineBackoff
			next := h.untilDeadline(r.LeaseExpiresAt)
			if next < deadlineRecheck {
				next = deadlineRecheck
			}
			ask.Reset(next)
		}
		if r.CancelRequested && !cancelSeen {
			cancelSeen = true
			h.job.setStop(ErrJobCancelled)
			close(h.cancelled)
		}
	}
}
