// Quick start: enqueue with an idempotency key, handle a conflict, run a worker.
//
//	idemq serve &                       # http://127.0.0.1:8080
//	go run ./examples/quickstart        # IDEMQ_URL overrides the address
package main

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"time"

	"github.com/idemq/idemq/clients/go"
)

func main() {
	url := os.Getenv("IDEMQ_URL")
	if url == "" {
		url = "http://127.0.0.1:8080"
	}
	client := idemq.NewClient(url, idemq.WithToken(os.Getenv("IDEMQ_TOKEN")))
	ctx := context.Background()

	// Enqueue once per business operation: repeats return the same job.
	key := fmt.Sprintf("capture:inv_%d", time.Now().UnixNano())
	opts := &idemq.EnqueueOptions{IdempotencyKey: key, Scope: "invoice-capture", Queue: "billing"}
	first, err := client.EnqueueWithResult(ctx, "invoice.capture", map[string]any{"invoice_id": "inv_42"}, opts)
	if err != nil {
		log.Fatal(err)
	}
	again, err := client.EnqueueWithResult(ctx, "invoice.capture", map[string]any{"invoice_id": "inv_42"}, opts)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(first.Outcome, again.Outcome, first.JobID == again.JobID) // accepted replayed true

	// The same key with another payload is a conflict: nothing is written.
	_, err = client.Enqueue(ctx, "invoice.capture", map[string]any{"invoice_id": "inv_43"}, opts)
	var conflict *idemq.EnqueueIdempotencyConflictError
	if errors.As(err, &conflict) {
		fmt.Println("conflict with job", conflict.JobID == first.JobID, "on", conflict.Fields) // true [payload]
	}

	// A worker runs the job; cancelling its context shuts it down gracefully.
	wctx, stop := context.WithCancel(ctx)
	worker := idemq.NewWorker(client, idemq.WorkerOptions{
		Queues:      []string{"billing"},
		Concurrency: 4,
		Handlers: map[string]idemq.HandlerFunc{
			"invoice.capture": func(ctx context.Context, job *idemq.ClaimedJob) (any, error) {
				var p struct {
					InvoiceID string `json:"invoice_id"`
				}
				if err := job.Decode(&p); err != nil {
					return nil, idemq.Permanent(err)
				}
				// A durable step: a retry of this job does not capture twice.
				charge, err := idemq.Checkpoint(ctx, job, "capture", func(ctx context.Context) (string, error) {
					return "ch_" + p.InvoiceID, nil // call the provider with job.ID as its idempotency key
				})
				if err != nil {
					return nil, err
				}
				return map[string]string{"charge": charge}, nil
			},
		},
	})
	done := make(chan error, 1)
	go func() { done <- worker.Run(wctx) }()

	job, err := client.WaitJob(ctx, first.JobID, 30*time.Second)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(job.State, string(job.Result)) // completed {"charge":"ch_inv_42"}
	stop()
	if err := <-done; err != nil {
		log.Fatal(err)
	}
}
