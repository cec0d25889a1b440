// Command queuedemo calls Querator from Go with stubs generated from proto/:
// it creates a queue, produces three items, leases them, completes two,
// retries the third, leases it again and retries it once more, so another
// consumer gets it next. Each step prints one JSON line; any unexpected answer
// ends the program with exit status 1.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"os"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/durationpb"

	queratorv1 "example.com/queuedemo/gen/go/querator/v1"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:2319", "the server's address")
	queueName := flag.String("queue", "go-demo", "the queue to create and use")
	flag.Parse()
	log.SetFlags(0)

	// Every call gets a deadline; the whole run takes well under it.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	// grpc.Dial and WithInsecure are what Debian's grpc-go 1.33 has; newer
	// releases also offer grpc.NewClient and insecure.NewCredentials().
	conn, err := grpc.DialContext(ctx, *addr, grpc.WithInsecure(), grpc.WithBlock())
	check(err, "connect")
	defer conn.Close()
	queues := queratorv1.NewQueuesServiceClient(conn)
	queue := queratorv1.NewQueueServiceClient(conn)

	created, err := queues.CreateQueue(ctx, &queratorv1.CreateQueueRequest{Queue: &queratorv1.QueueInfo{
		QueueName:    *queueName,
		LeaseTimeout: durationpb.New(time.Minute),
		MaxAttempts:  5,
	}})
	check(err, "create queue")
	report("created", map[string]any{"queue": created.Queue.QueueName,
		"max_attempts": created.Queue.MaxAttempts, "lease_timeout_s": created.Queue.LeaseTimeout.AsDuration().Seconds()})

	produced, err := queue.Produce(ctx, &queratorv1.ProduceRequest{
		QueueName: *queueName,
		Items: []*queratorv1.ProduceItem{
			{Kind: "email", Payload: []byte("alice")},
			{Kind: "email", Payload: []byte("bob")},
			{Kind: "email", Payload: []byte("carol")},
		},
	})
	check(err, "produce")
	report("produced", map[string]any{"ids": produced.Ids, "partition": produced.Partition})

	// A Lease waits up to request_timeout for items; these are ready already.
	leased, err := queue.Lease(ctx, &queratorv1.LeaseRequest{
		QueueName: *queueName, BatchSize: 10, ClientId: "go-demo", RequestTimeout: durationpb.New(5 * time.Second),
	})
	check(err, "lease")
	if len(leased.Items) != 3 {
		log.Fatalf("lease: want 3 items, got %d", len(leased.Items))
	}
	report("leased", map[string]any{"payloads": payloads(leased.Items), "partition": leased.Partition})

	// Complete and Retry name the partition the lease came from.
	_, err = queue.Complete(ctx, &queratorv1.CompleteRequest{
		QueueName: *queueName, Partition: leased.Partition, Ids: []string{leased.Items[0].Id, leased.Items[1].Id},
	})
	check(err, "complete")
	report("completed", map[string]any{"payloads": payloads(leased.Items[:2])})

	carol := leased.Items[2]
	_, err = queue.Retry(ctx, &queratorv1.RetryRequest{
		QueueName: *queueName, Partition: leased.Partition, Items: []*queratorv1.RetryItem{{Id: carol.Id}},
	})
	check(err, "retry")
	report("retried", map[string]any{"payload": string(carol.Payload), "message_id": carol.MessageId})

	// The retried item comes back under a new id, with the same message_id and
	// one more attempt.
	again, err := queue.Lease(ctx, &queratorv1.LeaseRequest{
		QueueName: *queueName, BatchSize: 10, ClientId: "go-demo", RequestTimeout: durationpb.New(5 * time.Second),
	})
	check(err, "lease again")
	if len(again.Items) != 1 || again.Items[0].MessageId != carol.MessageId {
		log.Fatalf("lease again: want the retried item %s alone, got %d items", carol.MessageId, len(again.Items))
	}
	item := again.Items[0]
	report("leased again", map[string]any{"payload": string(item.Payload), "message_id": item.MessageId,
		"attempts": item.Attempts, "id_changed": item.Id != carol.Id})

	_, err = queue.Retry(ctx, &queratorv1.RetryRequest{
		QueueName: *queueName, Partition: again.Partition, Items: []*queratorv1.RetryItem{{Id: item.Id}},
	})
	check(err, "retry again")
	report("retried again", map[string]any{"payload": string(item.Payload), "message_id": item.MessageId})
}

func payloads(items []*queratorv1.LeaseItem) []string {
	out := make([]string, len(items))
	for i, item := range items {
		out[i] = string(item.Payload)
	}
	return out
}

func report(step string, fields map[string]any) {
	fields["step"] = step
	line, err := json.Marshal(fields)
	check(err, "encode")
	fmt.Fprintln(os.Stdout, string(line))
}

func check(err error, what string) {
	if err != nil {
		log.Fatalf("%s: %v", what, err)
	}
}
