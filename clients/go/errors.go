package idemq

import (
	"errors"
	"fmt"
	"strings"
	"time"
)

// Problem type names, as the server writes them after "/problems/".
const (
	ProblemBadRequest          = "bad-request"
	ProblemValidation          = "validation"
	ProblemIdempotencyConflict = "idempotency-conflict"
	ProblemLeaseLost           = "lease-lost"
	ProblemNotDead             = "not-dead"
	ProblemNotFound            = "not-found"
	ProblemUnauthorized        = "unauthorized"
	ProblemForbiddenHost       = "forbidden-host"
	ProblemMethodNotAllowed    = "method-not-allowed"
	ProblemPayloadTooLarge     = "payload-too-large"
	ProblemUnavailable         = "unavailable"
	ProblemInternal            = "internal"
)

// Kinds of failure that do not come from a problem document.
const (
	// KindConnection: the server could not be reached, or the connection
	// broke before an answer arrived.
	KindConnection = "connection"
	// KindTimeout: no answer arrived within the client's timeout.
	KindTimeout = "timeout"
	// KindProtocol: the server answered something this client cannot read.
	KindProtocol = "protocol"
)

// Sentinel errors, one per kind of failure. Every error this package returns
// matches exactly one of them with errors.Is:
//
//	if errors.Is(err, idemq.ErrIdempotencyConflict) { ... }
var (
	ErrBadRequest          = errors.New("idemq: bad request")
	ErrValidation          = errors.New("idemq: validation failed")
	ErrIdempotencyConflict = errors.New("idemq: idempotency conflict")
	ErrLeaseLost           = errors.New("idemq: lease lost")
	ErrNotDead             = errors.New("idemq: job is not dead")
	ErrNotFound            = errors.New("idemq: not found")
	ErrUnauthorized        = errors.New("idemq: unauthorized")
	ErrForbiddenHost       = errors.New("idemq: forbidden host")
	ErrMethodNotAllowed    = errors.New("idemq: method not allowed")
	ErrPayloadTooLarge     = errors.New("idemq: payload too large")
	ErrUnavailable         = errors.New("idemq: unavailable")
	ErrInternal            = errors.New("idemq: internal server error")
	ErrConnection          = errors.New("idemq: connection failed")
	ErrTimeout             = errors.New("idemq: timed out")
	ErrProtocol            = errors.New("idemq: unexpected answer")
)

var sentinels = map[string]error{
	ProblemBadRequest:          ErrBadRequest,
	ProblemValidation:          ErrValidation,
	ProblemIdempotencyConflict: ErrIdempotencyConflict,
	ProblemLeaseLost:           ErrLeaseLost,
	ProblemNotDead:             ErrNotDead,
	ProblemNotFound:            ErrNotFound,
	ProblemUnauthorized:        ErrUnauthorized,
	ProblemForbiddenHost:       ErrForbiddenHost,
	ProblemMethodNotAllowed:    ErrMethodNotAllowed,
	ProblemPayloadTooLarge:     ErrPayloadTooLarge,
	ProblemUnavailable:         ErrUnavailable,
	ProblemInternal:            ErrInternal,
	KindConnection:             ErrConnection,
	KindTimeout:                ErrTimeout,
	KindProtocol:               ErrProtocol,
}

// ProblemTypes lists every problem type this client maps to a typed error.
func ProblemTypes() []string {
	return []string{
		ProblemBadRequest, ProblemValidation, ProblemIdempotencyConflict,
		ProblemLeaseLost, ProblemNotDead, ProblemNotFound, ProblemUnauthorized,
		ProblemForbiddenHost, ProblemMethodNotAllowed, ProblemPayloadTooLarge,
		ProblemUnavailable, ProblemInternal,
	}
}

// Error is the base of every error this package returns. The typed errors
// (EnqueueIdempotencyConflictError, ValidationError, ...) wrap one, so
//
//	var e *idemq.Error
//	errors.As(err, &e)
//
// works for all of them. Its text never holds a raw idempotency key.
type Error struct {
	// Kind is the problem type's name ("validation", "idempotency-conflict",
	// ...) or one of KindConnection, KindTimeout, KindProtocol. For a
	// problem type this client does not know, it is the name Status maps to
	// (KindProtocol when none).
	Kind string
	// Type is the problem document's type as the server wrote it
	// ("/problems/validation"; "" without one). When this client does not
	// know it, Kind comes from Status instead.
	Type string
	// Status is the HTTP status (0 when no answer arrived).
	Status int
	// Title and Detail come from the problem document.
	Title  string
	Detail string
	// Method and Path name the call that failed.
	Method string
	Path   string
	// Index is the failing item of an atomic batch (-1 otherwise).
	Index int
	// RetryAfter is the server's Retry-After, when it sent one.
	RetryAfter time.Duration
	// Members holds the problem document's extension members.
	Members map[string]any
	// Err is the underlying transport error for connection and timeout errors.
	Err error
}

// Error implements error.
func (e *Error) Error() string {
	var b strings.Builder
	b.WriteString("idemq: ")
	if e.Method != "" {
		b.WriteString(e.Method + " " + e.Path + ": ")
	}
	if e.Status != 0 {
		fmt.Fprintf(&b, "%d ", e.Status)
	}
	b.WriteString(e.Kind)
	if e.Type != "" && !strings.HasSuffix(e.Type, "/problems/"+e.Kind) {
		// A problem type this client does not know.
		b.WriteString(" (type " + e.Type + ")")
	}
	if e.Index >= 0 {
		fmt.Fprintf(&b, " (batch item %d)", e.Index)
	}
	switch {
	case e.Detail != "":
		b.WriteString(": " + e.Detail)
	case e.Err != nil:
		b.WriteString(": " + e.Err.Error())
	case e.Title != "":
		b.WriteString(": " + e.Title)
	}
	return b.String()
}

// Unwrap returns the underlying transport error, if any.
func (e *Error) Unwrap() error { return e.Err }

// Is reports whether target is the sentinel of this error's kind.
func (e *Error) Is(target error) bool {
	s, ok := sentinels[e.Kind]
	return ok && s == target
}

// Retryable reports whether the failure is transient: a connection error, a
// timeout, or 503 unavailable. Whether a call may be repeated also depends on
// the call (see the package documentation on retries).
func (e *Error) Retryable() bool {
	switch e.Kind {
	case KindConnection, KindTimeout, ProblemUnavailable:
		return true
	}
	return false
}

func (e *Error) str(member string) string {
	s, _ := e.Members[member].(string)
	return s
}

func (e *Error) strings(member string) []string {
	raw, _ := e.Members[member].([]any)
	out := make([]string, 0, len(raw))
	for _, v := range raw {
		if s, ok := v.(string); ok {
			out = append(out, s)
		}
	}
	return out
}

// EnqueueIdempotencyConflictError: the idempotency key (or the explicit job
// id) is bound to a job that was accepted with other fields. Nothing was
// written and neither request won; use a new key for new work.
type EnqueueIdempotencyConflictError struct {
	// JobID is the job that owns the key.
	JobID string
	// Source is "idempotency_key" or "job_id".
	Source string
	// Scope, KeyPreview and KeyDigest describe the key ("" when Source is job_id).
	Scope      string
	KeyPreview string
	KeyDigest  string
	// Fields lists the differing fields as sorted dotted paths ("payload", "queue", ...).
	Fields []string
	// Base is the problem as received.
	Base *Error
}

func (e *EnqueueIdempotencyConflictError) Error() string {
	return fmt.Sprintf("idemq: idempotency conflict: the %s is bound to job %s accepted with other fields: %s",
		strings.ReplaceAll(e.Source, "_", " "), e.JobID, strings.Join(e.Fields, ", "))
}
func (e *EnqueueIdempotencyConflictError) Unwrap() error { return e.Base }

// ValidationError: the request breaks a bound (422). Nothing was written.
type ValidationError struct {
	// Field is the dotted path of the offending field, Reason the bound broken.
	Field  string
	Reason string
	Base   *Error
}

func (e *ValidationError) Error() string { return e.Base.Error() }
func (e *ValidationError) Unwrap() error { return e.Base }

// PayloadTooLargeError: the payload or the body is over the server's limit (413).
type PayloadTooLargeError struct {
	// Field is the too large field ("payload"), or "" for the whole body.
	Field string
	// Limit is the limit in bytes, when the server says it (0 otherwise).
	Limit int64
	Base  *Error
}

func (e *PayloadTooLargeError) Error() string { return e.Base.Error() }
func (e *PayloadTooLargeError) Unwrap() error { return e.Base }

// NotFoundError: the job, binding, schedule or route does not exist (404).
type NotFoundError struct{ Base *Error }

func (e *NotFoundError) Error() string { return e.Base.Error() }
func (e *NotFoundError) Unwrap() error { return e.Base }

// UnauthorizedError: the server needs a token, or another one (401).
type UnauthorizedError struct{ Base *Error }

func (e *UnauthorizedError) Error() string { return e.Base.Error() }
func (e *UnauthorizedError) Unwrap() error { return e.Base }

// ForbiddenHostError: the server refused the request's Host header (403).
type ForbiddenHostError struct{ Base *Error }

func (e *ForbiddenHostError) Error() string { return e.Base.Error() }
func (e *ForbiddenHostError) Unwrap() error { return e.Base }

// LeaseLostError: the lease token is stale or unknown (409). The worker must
// stop working on the job; another attempt owns it now.
type LeaseLostError struct {
	JobID string
	Base  *Error
}

func (e *LeaseLostError) Error() string { return e.Base.Error() }
func (e *LeaseLostError) Unwrap() error { return e.Base }

// NotDeadError: only dead jobs can be redriven (409).
type NotDeadError struct {
	JobID string
	// State is the job's state, when the server says it.
	State string
	Base  *Error
}

func (e *NotDeadError) Error() string { return e.Base.Error() }
func (e *NotDeadError) Unwrap() error { return e.Base }

// UnavailableError: the backend is down or busy (503). RetryAfter is the
// server's advice (0 when it gave none).
type UnavailableError struct {
	RetryAfter time.Duration
	Base       *Error
}

func (e *UnavailableError) Error() string { return e.Base.Error() }
func (e *UnavailableError) Unwrap() error { return e.Base }

// BadRequestError: the body is not JSON, not an object, has a wrong type or
// an unknown member (400).
type BadRequestError struct{ Base *Error }

func (e *BadRequestError) Error() string { return e.Base.Error() }
func (e *BadRequestError) Unwrap() error { return e.Base }

// MethodNotAllowedError: the path exists but not with this method (405).
// Allow lists the methods it serves.
type MethodNotAllowedError struct {
	Allow []string
	Base  *Error
}

func (e *MethodNotAllowedError) Error() string { return e.Base.Error() }
func (e *MethodNotAllowedError) Unwrap() error { return e.Base }

// InternalError: the server failed unexpectedly (500).
type InternalError struct{ Base *Error }

func (e *InternalError) Error() string { return e.Base.Error() }
func (e *InternalError) Unwrap() error { return e.Base }

// ConnectionError: the server could not be reached or the connection broke.
// Whether the request was processed is unknown.
type ConnectionError struct{ Base *Error }

func (e *ConnectionError) Error() string { return e.Base.Error() }
func (e *ConnectionError) Unwrap() error { return e.Base }

// TimeoutError: no answer arrived in time. Whether the request was processed
// is unknown.
type TimeoutError struct{ Base *Error }

func (e *TimeoutError) Error() string { return e.Base.Error() }
func (e *TimeoutError) Unwrap() error { return e.Base }

// typed wraps a base error in the typed error of its kind.
func typed(e *Error) error {
	switch e.Kind {
	case ProblemIdempotencyConflict:
		return &EnqueueIdempotencyConflictError{
			JobID: e.str("job_id"), Source: e.str("source"), Scope: e.str("scope"),
			KeyPreview: e.str("key_preview"), KeyDigest: e.str("key_digest"),
			Fields: e.strings("fields"), Base: e,
		}
	case ProblemValidation:
		return &ValidationError{Field: e.str("field"), Reason: e.str("reason"), Base: e}
	case ProblemPayloadTooLarge:
		var limit int64
		if f, ok := e.Members["limit"].(float64); ok {
			limit = int64(f)
		}
		return &PayloadTooLargeError{Field: e.str("field"), Limit: limit, Base: e}
	case ProblemNotFound:
		return &NotFoundError{Base: e}
	case ProblemUnauthorized:
		return &UnauthorizedError{Base: e}
	case ProblemForbiddenHost:
		return &ForbiddenHostError{Base: e}
	case ProblemLeaseLost:
		return &LeaseLostError{JobID: e.str("job_id"), Base: e}
	case ProblemNotDead:
		return &NotDeadError{JobID: e.str("job_id"), State: e.str("state"), Base: e}
	case ProblemUnavailable:
		return &UnavailableError{RetryAfter: e.RetryAfter, Base: e}
	case ProblemBadRequest:
		return &BadRequestError{Base: e}
	case ProblemMethodNotAllowed:
		return &MethodNotAllowedError{Allow: e.strings("allow"), Base: e}
	case ProblemInternal:
		return &InternalError{Base: e}
	case KindConnection:
		return &ConnectionError{Base: e}
	case KindTimeout:
		return &TimeoutError{Base: e}
	}
	return e
}

// invalid is the *ValidationError the server would answer (422) for a value
// this client refuses before sending it, e.g. a negative duration where the
// server's parser would not even read one. Status is 0: no request was sent.
func invalid(method, path, field, reason string) error {
	return typed(&Error{Kind: ProblemValidation, Method: method, Path: path, Index: -1,
		Title: "Validation failed", Detail: "invalid " + field + ": " + reason,
		Members: map[string]any{"field": field, "reason": reason}})
}

// baseOf returns the *Error inside err, or nil.
func baseOf(err error) *Error {
	var e *Error
	if errors.As(err, &e) {
		return e
	}
	return nil
}

// redact removes every occurrence of the raw keys from s.
func redact(s string, keys []string) string {
	for _, k := range keys {
		if k != "" && strings.Contains(s, k) {
			s = strings.ReplaceAll(s, k, KeyPreview(k))
		}
	}
	return s
}

// KeyPreview is the display form of an idempotency key that idemq uses
// everywhere: the first min(8, n/2) characters of an n-character key, then "…".
func KeyPreview(key string) string {
	r := []rune(key)
	n := len(r) / 2
	if n > 8 {
		n = 8
	}
	return string(r[:n]) + "…"
}
