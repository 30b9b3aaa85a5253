package idemq

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"
)

// The drift check: every request this client sends (path, method, query
// parameters, headers and body members) must be in the committed OpenAPI
// document, every operation of the document must be reachable from the
// client, and the problem types the client maps must be the document's.

type recorded struct {
	method string
	path   string
	query  []string
	header []string
	body   any
}

type recorder struct {
	mu   sync.Mutex
	reqs []recorded
}

func (r *recorder) RoundTrip(req *http.Request) (*http.Response, error) {
	rec := recorded{method: req.Method, path: req.URL.EscapedPath()}
	for k := range req.URL.Query() {
		rec.query = append(rec.query, k)
	}
	for _, h := range []string{"Idempotency-Key"} {
		if req.Header.Get(h) != "" {
			rec.header = append(rec.header, h)
		}
	}
	if req.Body != nil {
		data, _ := io.ReadAll(req.Body)
		req.Body.Close()
		req.Body = io.NopCloser(bytes.NewReader(data))
		if len(data) > 0 {
			_ = json.Unmarshal(data, &rec.body)
		}
	}
	r.mu.Lock()
	r.reqs = append(r.reqs, rec)
	r.mu.Unlock()
	return http.DefaultTransport.RoundTrip(req)
}

func loadOpenAPI(t *testing.T) map[string]any {
	t.Helper()
	path := filepath.Join("..", "..", "crates", "idemq-server", "tests", "snapshots", "openapi.json")
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("reading the committed OpenAPI document: %v", err)
	}
	var doc map[string]any
	if err := json.Unmarshal(data, &doc); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return doc
}

// exerciseEveryCall sends every request the client can send, with every
// optional member set, and ignores the answers.
func exerciseEveryCall(c *Client) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	typ := uniq("drift")
	jitter := true
	keep := time.Hour
	full := &EnqueueOptions{
		IdempotencyKey: uniq("drift-key"), Scope: "drift", TTL: time.Hour, Queue: "drift", JobID: uniq("drift-id"),
		Priority: 3, Delay: time.Second, MaxAttempts: 3, Retry: &Backoff{Kind: "exponential", Initial: time.Second, Factor: 2, Max: time.Minute, Jitter: &jitter},
		Timeout: time.Minute, Deadline: time.Now().Add(time.Hour), ConcurrencyKey: "ck", Tags: []string{"a"}, Keep: &keep,
		Dedupe: &Dedupe{Key: "dk", TTL: time.Minute, Extend: true, MaxWait: time.Hour},
	}
	_, _ = c.Enqueue(ctx, typ, map[string]any{"x": 1}, full)
	_, _ = c.EnqueueWithResult(ctx, typ, 1, &EnqueueOptions{IdempotencyKey: uniq("h"), KeyInHeader: true, RunAt: time.Now().Add(time.Hour), Retry: FixedBackoff(time.Second)})
	_, _ = c.EnqueueWithResult(ctx, typ, 1, &EnqueueOptions{Retry: NoRetry(), Dedupe: &Dedupe{Key: "r", Replace: true, TTL: time.Minute}})
	_, _ = c.Explain(ctx, typ, 1, full)
	_, _ = c.Explain(ctx, typ, 1, &EnqueueOptions{IdempotencyKey: uniq("h"), KeyInHeader: true})
	_, _ = c.EnqueueBatch(ctx, []JobRequest{{Type: typ, Options: full}, {Type: typ}}, &BatchOptions{Atomic: true})
	id, _ := c.Enqueue(ctx, typ, nil, &EnqueueOptions{Queue: "drift"})
	_, _ = c.GetJob(ctx, id)
	_, _ = c.WaitJob(ctx, id, 10*time.Millisecond)
	_, _ = c.ListJobs(ctx, &ListJobsOptions{State: StateReady, Queue: "drift", Type: typ, Tag: "a", Limit: 5, Cursor: "x"})
	_, _ = c.JobEvents(ctx, id)
	_, _ = c.JobRuns(ctx, id)
	_, _ = c.JobCheckpoints(ctx, id)
	resp, _ := c.Claim(ctx, ClaimRequest{Queues: []string{"drift"}, Types: []string{typ}, Worker: "drift", Limit: 2,
		Lease: time.Second, Wait: 10 * time.Millisecond, Complete: []Completion{{ID: "none", LeaseToken: "none", Result: 1}}})
	token := "none"
	if resp != nil && len(resp.Jobs) > 0 {
		token = resp.Jobs[0].LeaseToken
	}
	_, _ = c.Heartbeat(ctx, id, token)
	_, _ = c.PutCheckpoint(ctx, id, "step", token, 1)
	_, _ = c.Complete(ctx, id, token, map[string]int{"r": 1})
	_, _ = c.CompleteMany(ctx, []Completion{{ID: id, LeaseToken: token, Result: 1}})
	d := time.Second
	_, _ = c.Fail(ctx, id, token, FailOptions{Error: "e", Permanent: true, RetryAfter: &d, Snooze: &d})
	_, _ = c.Release(ctx, id, token)
	_, _ = c.CancelJob(ctx, id)
	_, _ = c.PromoteJob(ctx, id)
	_, _ = c.RedriveJob(ctx, id, &RedriveOptions{IdempotencyKey: uniq("rk"), MaxAttempts: 2, Deadline: time.Now().Add(time.Hour),
		RunAt: time.Now().Add(time.Minute), ResetCheckpoints: true})
	_, _ = c.RedriveJob(ctx, id, nil)
	_, _ = c.PurgeJob(ctx, id)
	_, _ = c.BulkAction(ctx, BulkCancel, &BulkFilter{State: StateReady, Queue: "drift", Type: typ, Tag: "a", Before: time.Now()}, 10)
	_, _ = c.CancelByKey(ctx, typ, "dk")
	_, _ = c.DedupeLookup(ctx, typ, "d/k")
	_, _ = c.IdempotencyLookup(ctx, "drift", "k")
	_, _ = c.ReleaseIdempotency(ctx, "drift", "k")
	_, _ = c.Queues(ctx)
	_, _ = c.PauseQueue(ctx, "drift")
	_, _ = c.ResumeQueue(ctx, "drift")
	_, _ = c.Schedules(ctx)
	_, _ = c.PutSchedule(ctx, "drift", ScheduleDefinition{Cron: "0 * * * * *", Timezone: "UTC", Paused: true, Job: JobRequest{Type: typ, Payload: 1, Options: &EnqueueOptions{Queue: "drift"}}})
	_, _ = c.PutSchedule(ctx, "drift2", ScheduleDefinition{Every: time.Hour, Job: JobRequest{Type: typ}})
	_, _ = c.DeleteSchedule(ctx, "drift")
	_, _ = c.DeleteSchedule(ctx, "drift2")
	_, _ = c.Health(ctx)
}

type openapi struct {
	doc   map[string]any
	paths map[string]map[string]any // template -> method -> operation
}

func (o *openapi) resolve(s any) map[string]any {
	m, _ := s.(map[string]any)
	for i := 0; i < 20 && m != nil; i++ {
		ref, ok := m["$ref"].(string)
		if !ok {
			return m
		}
		cur := any(o.doc)
		for _, part := range strings.Split(strings.TrimPrefix(ref, "#/"), "/") {
			cm, _ := cur.(map[string]any)
			cur = cm[part]
		}
		m, _ = cur.(map[string]any)
	}
	return m
}

var templateParam = regexp.MustCompile(`\{[^}]+\}`)

// match returns the documented template of a concrete path (the one with
// the fewest parameters when several match).
func (o *openapi) match(path string) string {
	best, bestParams := "", 1000
	for tmpl := range o.paths {
		parts := templateParam.Split(tmpl, -1)
		for i := range parts {
			parts[i] = regexp.QuoteMeta(parts[i])
		}
		re := "^" + strings.Join(parts, `[^/]+`) + "$"
		if regexp.MustCompile(re).MatchString(path) {
			if n := strings.Count(tmpl, "{"); n < bestParams {
				best, bestParams = tmpl, n
			}
		}
	}
	return best
}

func jsonType(v any) string {
	switch x := v.(type) {
	case nil:
		return "null"
	case bool:
		return "boolean"
	case string:
		return "string"
	case float64:
		if x == float64(int64(x)) {
			return "integer"
		}
		return "number"
	case []any:
		return "array"
	case map[string]any:
		return "object"
	}
	return "unknown"
}

func typeAllowed(schema map[string]any, v any) bool {
	t, ok := schema["type"]
	if !ok {
		return true
	}
	have := jsonType(v)
	var types []string
	switch x := t.(type) {
	case string:
		types = []string{x}
	case []any:
		for _, e := range x {
			s, _ := e.(string)
			types = append(types, s)
		}
	}
	for _, want := range types {
		if want == have || want == "number" && have == "integer" {
			return true
		}
	}
	return false
}

// check returns the members of v that schema does not describe.
func (o *openapi) check(schema any, v any, at string) []string {
	s := o.resolve(schema)
	if s == nil {
		return nil
	}
	for _, comb := range []string{"oneOf", "anyOf"} {
		if alts, ok := s[comb].([]any); ok {
			var best []string
			for i, alt := range alts {
				errs := o.check(alt, v, at)
				if len(errs) == 0 {
					return nil
				}
				if i == 0 || len(errs) < len(best) {
					best = errs
				}
			}
			return best
		}
	}
	if !typeAllowed(s, v) {
		return []string{fmt.Sprintf("%s: a %s where the document says %v", at, jsonType(v), s["type"])}
	}
	var errs []string
	switch x := v.(type) {
	case map[string]any:
		props, _ := s["properties"].(map[string]any)
		if props == nil {
			return nil // any object
		}
		for k, val := range x {
			name := strings.TrimPrefix(at+"."+k, ".")
			if sub, ok := props[k]; ok {
				errs = append(errs, o.check(sub, val, name)...)
			} else if ap, ok := s["additionalProperties"]; ok && ap != false {
				errs = append(errs, o.check(ap, val, name)...)
			} else {
				errs = append(errs, name+": not in the document")
			}
		}
	case []any:
		for i, e := range x {
			errs = append(errs, o.check(s["items"], e, fmt.Sprintf("%s[%d]", at, i))...)
		}
	}
	return errs
}

func TestDriftAgainstTheCommittedOpenAPIDocument(t *testing.T) {
	raw := loadOpenAPI(t)
	o := &openapi{doc: raw, paths: map[string]map[string]any{}}
	paths, _ := raw["paths"].(map[string]any)
	for p, ops := range paths {
		m := map[string]any{}
		for method, op := range ops.(map[string]any) {
			m[strings.ToUpper(method)] = op
		}
		o.paths[p] = m
	}
	rec := &recorder{}
	exerciseEveryCall(NewClient(shared.url, WithHTTPClient(&http.Client{Transport: rec}), WithoutRetries()))

	t.Run("paths_fields_and_headers", func(t *testing.T) {
		if len(rec.reqs) < 35 {
			t.Fatalf("only %d requests recorded", len(rec.reqs))
		}
		var problems []string
		seen := map[string]bool{}
		for _, r := range rec.reqs {
			tmpl := o.match(r.path)
			if tmpl == "" {
				problems = append(problems, fmt.Sprintf("%s %s: no such path", r.method, r.path))
				continue
			}
			op, ok := o.paths[tmpl][r.method].(map[string]any)
			if !ok {
				problems = append(problems, fmt.Sprintf("%s %s: %s does not serve %s", r.method, r.path, tmpl, r.method))
				continue
			}
			seen[r.method+" "+tmpl] = true
			params := map[string]bool{}
			for _, p := range asSlice(op["parameters"]) {
				pm := o.resolve(p)
				params[fmt.Sprint(pm["in"])+":"+strings.ToLower(fmt.Sprint(pm["name"]))] = true
			}
			for _, q := range r.query {
				if !params["query:"+q] {
					problems = append(problems, fmt.Sprintf("%s %s: query parameter %s is not documented", r.method, tmpl, q))
				}
			}
			for _, h := range r.header {
				if !params["header:"+strings.ToLower(h)] {
					problems = append(problems, fmt.Sprintf("%s %s: header %s is not documented", r.method, tmpl, h))
				}
			}
			if r.body != nil {
				rb := o.resolve(op["requestBody"])
				content, _ := rb["content"].(map[string]any)
				js, _ := content["application/json"].(map[string]any)
				if js == nil {
					problems = append(problems, fmt.Sprintf("%s %s: the document has no JSON body", r.method, tmpl))
					continue
				}
				for _, e := range o.check(js["schema"], r.body, "") {
					problems = append(problems, fmt.Sprintf("%s %s: body member %s", r.method, tmpl, e))
				}
			}
		}
		// Every documented API operation is one the client sends.
		for tmpl, ops := range o.paths {
			if !strings.HasPrefix(tmpl, "/v1/") && tmpl != "/healthz" {
				continue
			}
			for method, op := range ops {
				// The GET of a fixed path (/v1/jobs/batch, ...) is GET
				// /v1/jobs/{id} for a job whose id is that name, which the
				// client sends as such.
				if m, ok := op.(map[string]any); ok {
					if id, _ := m["operationId"].(string); strings.HasPrefix(id, "get_job_named_") {
						continue
					}
				}
				if !seen[method+" "+tmpl] {
					problems = append(problems, fmt.Sprintf("%s %s: documented but never called by the client", method, tmpl))
				}
			}
		}
		sort.Strings(problems)
		problems = dedupe(problems)
		if len(problems) > 0 {
			t.Fatalf("the client and the OpenAPI document disagree:\n  %s", strings.Join(problems, "\n  "))
		}
	})

	t.Run("response_fields", func(t *testing.T) {
		// Every member the client reads from an answer is documented there.
		schemas := map[string]any{
			"EnqueueResult": EnqueueResult{}, "Explain": Explanation{}, "ExplainConflict": ExplainConflict{},
			"ExplainIdempotency": ExplainIdempotency{}, "DedupeBinding": DedupeBinding{}, "Job": Job{},
			"JobIdempotency": JobIdempotency{}, "JobDedupe": JobDedupe{}, "Event": Event{}, "Run": Run{},
			"JobPage": JobPage{}, "Cancelled": CancelResult{}, "BulkDone": BulkResult{}, "Binding": IdempotencyBinding{},
			"QueueInfo": QueueInfo{}, "Health": Health{}, "Schedule": Schedule{}, "ClaimedJob": ClaimedJob{},
			"Heartbeat": HeartbeatResult{}, "FailOutcome": FailResult{},
		}
		var problems []string
		for name, v := range schemas {
			s := o.resolve(map[string]any{"$ref": "#/components/schemas/" + name})
			if s == nil {
				problems = append(problems, "no schema "+name)
				continue
			}
			props, _ := s["properties"].(map[string]any)
			rt := reflect.TypeOf(v)
			for i := 0; i < rt.NumField(); i++ {
				tag := strings.Split(rt.Field(i).Tag.Get("json"), ",")[0]
				if tag == "" || tag == "-" {
					continue
				}
				if _, ok := props[tag]; !ok {
					problems = append(problems, fmt.Sprintf("%s.%s (%s) is not in the document", name, tag, rt.Name()))
				}
			}
		}
		sort.Strings(problems)
		if len(problems) > 0 {
			t.Fatalf("answers:\n  %s", strings.Join(problems, "\n  "))
		}
	})

	t.Run("problem_types", func(t *testing.T) {
		documented := map[string]bool{}
		// The Problem schema's `type` lists the names; any /problems/<name>
		// mentioned elsewhere counts too.
		if prob := o.resolve(map[string]any{"$ref": "#/components/schemas/Problem"}); prob != nil {
			props, _ := prob["properties"].(map[string]any)
			tp, _ := props["type"].(map[string]any)
			desc, _ := tp["description"].(string)
			if i := strings.Index(desc, ":"); i >= 0 {
				for _, name := range regexp.MustCompile(`[a-z]+(?:-[a-z]+)*`).FindAllString(desc[i+1:], -1) {
					documented[name] = true
				}
			}
			for _, e := range asSlice(tp["enum"]) {
				documented[strings.TrimPrefix(fmt.Sprint(e), "/problems/")] = true
			}
		}
		all, _ := json.Marshal(raw)
		for _, m := range regexp.MustCompile(`/problems/([a-z]+(?:-[a-z]+)*)`).FindAllStringSubmatch(string(all), -1) {
			documented[m[1]] = true
		}
		if len(documented) == 0 {
			t.Fatal("the document lists no problem types")
		}
		mapped := map[string]bool{}
		for _, p := range ProblemTypes() {
			mapped[p] = true
		}
		var problems []string
		for name := range documented {
			if !mapped[name] {
				problems = append(problems, "documented but not mapped to a typed error: "+name)
			}
		}
		for name := range mapped {
			if !documented[name] {
				problems = append(problems, "mapped but not in the document: "+name)
			}
		}
		sort.Strings(problems)
		if len(problems) > 0 {
			t.Fatalf("problem types:\n  %s", strings.Join(problems, "\n  "))
		}
	})
}

func asSlice(v any) []any {
	s, _ := v.([]any)
	return s
}

func dedupe(s []string) []string {
	out := s[:0]
	for i, v := range s {
		if i == 0 || v != s[i-1] {
			out = append(out, v)
		}
	}
	return out
}
