package idemq

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// hostRewriter sends every request with another Host header.
type hostRewriter struct{ host string }

func (h hostRewriter) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Host = h.host
	return http.DefaultTransport.RoundTrip(r)
}

// counting counts the requests a client sends.
type counting struct{ n int64 }

func (c *counting) RoundTrip(r *http.Request) (*http.Response, error) {
	atomic.AddInt64(&c.n, 1)
	return http.DefaultTransport.RoundTrip(r)
}

func (c *counting) count() int64 { return atomic.LoadInt64(&c.n) }

func fastRetry(attempts int) Option {
	return WithRetry(RetryPolicy{MaxAttempts: attempts, InitialBackoff: 50 * time.Millisecond, MaxBackoff: 300 * time.Millisecond})
}

func TestUnreachableServerIsATypedConnectionError(t *testing.T) {
	port, err := freePort()
	if err != nil {
		t.Fatal(err)
	}
	tr := &counting{}
	c := NewClient(fmt.Sprintf("http://127.0.0.1:%d", port), WithHTTPClient(&http.Client{Transport: tr}), fastRetry(3))
	_, err = c.Enqueue(ctxT(t), "x", nil, nil)
	var ce *ConnectionError
	if !errors.As(err, &ce) || !errors.Is(err, ErrConnection) || !ce.Base.Retryable() {
		t.Fatalf("%T %v", err, err)
	}
	if tr.count() != 1 {
		t.Fatalf("an enqueue without a key was sent %d times", tr.count())
	}
	_, err = c.Enqueue(ctxT(t), "x", nil, &EnqueueOptions{IdempotencyKey: "k-unreachable"})
	if !errors.Is(err, ErrConnection) || tr.count() != 4 {
		t.Fatalf("a keyed enqueue: %v after %d requests", err, tr.count())
	}
	mustNoRawKey(t, "k-unreachable", err.Error(), fmt.Sprintf("%#v", err))
	if _, err := c.Health(ctxT(t)); !errors.Is(err, ErrConnection) {
		t.Fatalf("health: %v", err)
	}
}

func TestTimeoutIsTyped(t *testing.T) {
	ctx := ctxT(t)
	// The setup enqueue goes through an ordinary client: only the held call
	// below is the one whose timeout is tested.
	id, err := newTestClient().Enqueue(ctx, uniq("slow"), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestClient(WithTimeout(100*time.Millisecond), WithoutRetries())
	// The server holds the request for the wait; the client gives up first.
	cl := call{method: "GET", path: "/v1/jobs/" + id, query: url.Values{"wait_ms": {"2000"}}}
	err = c.do(ctx, cl, nil)
	var te *TimeoutError
	if !errors.As(err, &te) || !errors.Is(err, ErrTimeout) {
		t.Fatalf("%T %v", err, err)
	}
}

// A keyed enqueue is retried until a server that starts late answers; an
// enqueue without a key is sent once.
func TestSafeRetriesAcrossALateServer(t *testing.T) {
	port, err := freePort()
	if err != nil {
		t.Fatal(err)
	}
	base := fmt.Sprintf("http://127.0.0.1:%d", port)
	var late *testServer
	var startErr error
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		time.Sleep(800 * time.Millisecond)
		late, startErr = startServer(serverConfig{port: port})
	}()
	tr := &counting{}
	c := NewClient(base, WithHTTPClient(&http.Client{Transport: tr}),
		WithRetry(RetryPolicy{MaxAttempts: 60, InitialBackoff: 100 * time.Millisecond, MaxBackoff: 250 * time.Millisecond}))
	ctx := ctxT(t)
	typ := uniq("late")
	key := uniq("late-key")
	r, err := c.EnqueueWithResult(ctx, typ, 1, &EnqueueOptions{IdempotencyKey: key})
	wg.Wait()
	if startErr != nil {
		t.Fatal(startErr)
	}
	defer late.stop()
	if err != nil {
		t.Fatalf("the keyed enqueue was not retried until the server came up: %v", err)
	}
	if r.Outcome != OutcomeAccepted || tr.count() < 2 {
		t.Fatalf("%+v after %d requests", r, tr.count())
	}
	// An explicit job id is as safe as a key.
	if _, err := c.Enqueue(ctx, typ, 1, &EnqueueOptions{JobID: uniq("jid")}); err != nil {
		t.Fatal(err)
	}
	late.stop()

	// Down again; the server comes back later, but an enqueue without a key
	// or job id is not repeated.
	wg.Add(1)
	go func() {
		defer wg.Done()
		time.Sleep(500 * time.Millisecond)
		late, startErr = startServer(serverConfig{port: port})
	}()
	before := tr.count()
	_, err = c.Enqueue(ctx, typ, 1, nil)
	if !errors.Is(err, ErrConnection) || tr.count() != before+1 {
		t.Fatalf("an unkeyed enqueue: %v after %d requests", err, tr.count()-before)
	}
	// A batch is retried only when every item has a key or a job id.
	before = tr.count()
	_, err = c.EnqueueBatch(ctx, []JobRequest{{Type: typ, Options: &EnqueueOptions{IdempotencyKey: uniq("b")}}, {Type: typ}}, nil)
	if !errors.Is(err, ErrConnection) || tr.count() != before+1 {
		t.Fatalf("a half-keyed batch: %v after %d requests", err, tr.count()-before)
	}
	wg.Wait()
	if startErr != nil {
		t.Fatal(startErr)
	}
	defer late.stop()
	results, err := c.EnqueueBatch(ctx, []JobRequest{
		{Type: typ, Options: &EnqueueOptions{IdempotencyKey: uniq("b1")}},
		{Type: typ, Options: &EnqueueOptions{JobID: uniq("b2")}},
	}, nil)
	if err != nil || results[0].Err != nil || results[1].Err != nil {
		t.Fatalf("%+v %v", results, err)
	}
}

// unavailableProxy answers 503 with Retry-After to the first `fail`
// requests, then forwards to the real server.
func unavailableProxy(t *testing.T, fail int64, retryAfter string) (string, *int64) {
	return problemProxy(t, fail, 503, retryAfter,
		`{"type":"/problems/unavailable","title":"Service unavailable","status":503,"detail":"the backend is down or busy"}`)
}

// problemProxy answers the first `fail` requests with status and the
// problem document body (and Retry-After, unless ""), then forwards to the
// real server.
func problemProxy(t *testing.T, fail int64, status int, retryAfter, body string) (string, *int64) {
	target, _ := url.Parse(shared.url)
	rp := httputil.NewSingleHostReverseProxy(target)
	var seen int64
	l, err := netListen()
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if atomic.AddInt64(&seen, 1) <= fail {
			w.Header().Set("Content-Type", "application/problem+json")
			if retryAfter != "" {
				w.Header().Set("Retry-After", retryAfter)
			}
			w.WriteHeader(status)
			_, _ = w.Write([]byte(body))
			return
		}
		r.Host = target.Host
		rp.ServeHTTP(w, r)
	})}
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() { _ = srv.Close() })
	return "http://" + l.Addr().String(), &seen
}

func TestUnavailableHonoursRetryAfter(t *testing.T) {
	ctx := ctxT(t)
	proxy, seen := unavailableProxy(t, 2, "1")
	c := NewClient(proxy, fastRetry(4))
	start := time.Now()
	r, err := c.EnqueueWithResult(ctx, uniq("busy"), nil, &EnqueueOptions{IdempotencyKey: uniq("busy-key")})
	if err != nil {
		t.Fatal(err)
	}
	if r.Outcome != OutcomeAccepted || atomic.LoadInt64(seen) != 3 {
		t.Fatalf("%+v after %d requests", r, atomic.LoadInt64(seen))
	}
	if el := time.Since(start); el < 2*time.Second {
		t.Fatalf("Retry-After: 1 not honoured: two retries in %v", el)
	}

	proxy, seen = unavailableProxy(t, 1, "7")
	c = NewClient(proxy, fastRetry(4))
	_, err = c.Enqueue(ctx, uniq("busy"), nil, nil)
	var ue *UnavailableError
	if !errors.As(err, &ue) || ue.RetryAfter != 7*time.Second || !errors.Is(err, ErrUnavailable) || atomic.LoadInt64(seen) != 1 {
		t.Fatalf("an unkeyed enqueue on 503: %T %v (retry-after %v) after %d requests", err, err, ue, atomic.LoadInt64(seen))
	}
}

// A problem type this client does not know is mapped by the HTTP status, as
// the Python client maps it; the type stays on the error.
func TestUnknownProblemTypeFallsBackOnStatus(t *testing.T) {
	ctx := ctxT(t)
	const overloaded = `{"type":"/problems/overloaded","title":"Overloaded","status":503,"detail":"too many requests in flight"}`

	// A keyed enqueue is retried after a 503 of an unknown type, no sooner
	// than its Retry-After.
	proxy, seen := problemProxy(t, 1, 503, "1", overloaded)
	start := time.Now()
	r, err := NewClient(proxy, fastRetry(4)).EnqueueWithResult(ctx, uniq("busy"), nil, &EnqueueOptions{IdempotencyKey: uniq("busy-key")})
	if err != nil || r.Outcome != OutcomeAccepted || atomic.LoadInt64(seen) != 2 {
		t.Fatalf("%+v %v after %d requests", r, err, atomic.LoadInt64(seen))
	}
	if el := time.Since(start); el < time.Second {
		t.Fatalf("Retry-After: 1 not honoured: retried after %v", el)
	}

	for _, tc := range []struct {
		status   int
		body     string
		sentinel error
		check    func(err error) bool
	}{
		{503, overloaded, ErrUnavailable, func(err error) bool {
			var ue *UnavailableError
			return errors.As(err, &ue) && ue.RetryAfter == 2*time.Second && ue.Base.Retryable()
		}},
		{422, `{"type":"https://idemq.example/problems/too-odd","title":"Too odd","status":422,"field":"payload","reason":"odd"}`, ErrValidation, func(err error) bool {
			var ve *ValidationError
			return errors.As(err, &ve) && ve.Field == "payload" && ve.Reason == "odd"
		}},
		{400, `{"type":"/problems/malformed","status":400}`, ErrBadRequest, func(err error) bool {
			var be *BadRequestError
			return errors.As(err, &be)
		}},
		{500, `{"type":"/problems/crashed","status":500}`, ErrInternal, func(err error) bool {
			var ie *InternalError
			return errors.As(err, &ie)
		}},
		// A 409 is one of three distinct errors: no guess.
		{409, `{"type":"/problems/clash","status":409,"job_id":"j1"}`, ErrProtocol, nil},
		{502, `{"type":"/problems/bad-gateway","status":502}`, ErrProtocol, nil},
	} {
		proxy, seen := problemProxy(t, 100, tc.status, "2", tc.body)
		_, err := NewClient(proxy, WithoutRetries()).Enqueue(ctx, uniq("odd"), nil, &EnqueueOptions{IdempotencyKey: uniq("odd-key")})
		var doc struct{ Type string }
		_ = json.Unmarshal([]byte(tc.body), &doc)
		base := baseOf(err)
		if base == nil || base.Status != tc.status || base.Type != doc.Type || !errors.Is(err, tc.sentinel) ||
			(tc.check != nil && !tc.check(err)) || !strings.Contains(err.Error(), doc.Type) || atomic.LoadInt64(seen) != 1 {
			t.Fatalf("%d %s: %T %v (base %+v) after %d requests", tc.status, doc.Type, err, err, base, atomic.LoadInt64(seen))
		}
		if tc.sentinel != ErrUnavailable && base.Retryable() {
			t.Fatalf("%d %s is retryable", tc.status, doc.Type)
		}
	}

	// The same for a batch item's problem.
	item := problemFromDoc(call{method: "POST", path: "/v1/jobs/batch"}, json.RawMessage(`{"type":"/problems/overloaded","status":503}`), 1)
	if base := baseOf(item); !errors.Is(item, ErrUnavailable) || base.Type != "/problems/overloaded" || base.Index != 1 {
		t.Fatalf("batch item: %T %v", item, item)
	}
}

func TestNeverRetriesClientErrors(t *testing.T) {
	tr := &counting{}
	c := newTestClient(WithHTTPClient(&http.Client{Transport: tr}), fastRetry(5))
	ctx := ctxT(t)
	key := uniq("k")
	typ := uniq("noretry")
	if _, err := c.Enqueue(ctx, typ, 1, &EnqueueOptions{IdempotencyKey: key}); err != nil {
		t.Fatal(err)
	}
	for name, f := range map[string]func() error{
		"409": func() error { _, err := c.Enqueue(ctx, typ, 2, &EnqueueOptions{IdempotencyKey: key}); return err },
		"422": func() error {
			_, err := c.Enqueue(ctx, typ, 2, &EnqueueOptions{IdempotencyKey: key, MaxAttempts: -3})
			return err
		},
		"404": func() error { _, err := c.GetJob(ctx, uniq("none")); return err },
	} {
		before := tr.count()
		if err := f(); err == nil || tr.count() != before+1 {
			t.Fatalf("%s: %v after %d requests", name, err, tr.count()-before)
		}
	}
}

func TestTokenAuth(t *testing.T) {
	srv, err := startServer(serverConfig{token: "s3cret-token"})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.stop()
	ctx := ctxT(t)
	_, err = NewClient(srv.url).Enqueue(ctx, "x", nil, nil)
	var ue *UnauthorizedError
	if !errors.As(err, &ue) || ue.Base.Status != 401 || !errors.Is(err, ErrUnauthorized) {
		t.Fatalf("without a token: %T %v", err, err)
	}
	_, err = NewClient(srv.url, WithToken("wrong")).Queues(ctx)
	if !errors.Is(err, ErrUnauthorized) {
		t.Fatalf("a wrong token: %v", err)
	}
	c := NewClient(srv.url, WithToken("s3cret-token"))
	if _, err := c.Enqueue(ctx, "x", nil, nil); err != nil {
		t.Fatal(err)
	}
	if h, err := NewClient(srv.url).Health(ctx); err != nil || !h.OK {
		t.Fatalf("healthz needs no token: %+v %v", h, err)
	}
	mustNoRawKey(t, "s3cret-token", fmt.Sprintf("%v %+v %#v", c, c, c))
}
