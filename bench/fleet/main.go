// motor-fleet: a simulated fleet of node managers for bench/controller_scale.py, in its own
// process so that the fleet is not what limits the controller it measures. Each simulated node
// registers, runs the engines the controller starts on it (one NodeManagerService stands for
// every node, routed by the engine's host), and heartbeats once per interval, the interval the
// controller announces in its answers (its heartbeat rate budget), as node managers do: on one
// StreamHeartbeats stream per node with deltas (a full list every -full-every beats and on every
// new stream), or with unary Heartbeat calls carrying the full list (-transport unary).
//
// Driven by one command per line on stdin; every answer is one JSON line on stdout:
//
//	grow N            register nodes until there are N, start their heartbeats  -> {"nodes": N}
//	starts            engines started so far                                   -> {"starts": S}
//	measure SECONDS   round trips seen in that window                          -> {"beats": ..., "p50_ms": ...}
//	silence           stop the victim nodes' heartbeats and their node manager -> {"victims": [...]}
//	quit
//
// With -tls-ca every node presents a certificate of its own (tls.go); else plaintext.
//
// Built by bench/fleet/build.sh (Go in GOPATH mode with Debian's grpc-go, offline).
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"math"
	"math/rand"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	motorv1 "github.com/motor-llm/motor/gen/go/motor/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
)

const enginesPerNode = 8

type node struct {
	id, host   string
	victim     bool
	mu         sync.Mutex
	generation uint64
	engines    map[string]*motorv1.Engine
	changed    map[string]bool // engine ids changed since the last beat
	removed    map[string]bool
	sinceFull  int
	interval   time.Duration // as the controller last announced (-interval until it does)
	stopped    int32
	client     motorv1.ControllerServiceClient // its own connection (-conns 0, or mutual TLS); nil: a shared one
}

type fleet struct {
	controllerAddr string
	ca             *authority // mutual TLS: every node presents a certificate of its own; nil: plaintext
	conns          []motorv1.ControllerServiceClient
	mainAddr       string
	victimAddr     string
	victimSrv      *grpc.Server
	victims        int
	transport      string
	fullEvery      int
	interval       time.Duration
	reportRate     float64

	mu     sync.Mutex
	nodes  []*node
	byHost map[string]*node
	starts int64
	ports  int64

	statsMu    sync.Mutex
	measuring  bool
	rtts       []float64
	errors     int
	fulls      int
	deltas     int
	deltaSizes int
	reportRtts []float64
	reportErrs int

	announced int64 // nanoseconds: the latest heartbeat interval and grace the controller announced
	grace     int64
}

// ---------------------------------------------------------------- the controller side

func (f *fleet) client(n *node) motorv1.ControllerServiceClient {
	if n.client != nil {
		return n.client
	}
	i, _ := strconv.Atoi(n.id[4:])
	return f.conns[i%len(f.conns)]
}

// dial opens a connection to the controller: plaintext, or presenting `creds` (mutual TLS).
func (f *fleet) dial(creds credentials.TransportCredentials) motorv1.ControllerServiceClient {
	security := grpc.WithInsecure()
	if creds != nil {
		security = grpc.WithTransportCredentials(creds)
	}
	// Small buffers: one connection per node makes thousands of them.
	cc, err := grpc.Dial(f.controllerAddr, security, grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(64<<20)),
		grpc.WithReadBufferSize(8<<10), grpc.WithWriteBufferSize(8<<10))
	if err != nil {
		panic(err)
	}
	return motorv1.NewControllerServiceClient(cc)
}

// connect gives a node its own connection when there are no shared ones (-conns 0 or mutual TLS).
func (f *fleet) connect(n *node) {
	if n.client != nil || len(f.conns) > 0 {
		return
	}
	var creds credentials.TransportCredentials
	if f.ca != nil {
		var err error
		if creds, err = f.ca.nodeCredentials(n.id); err != nil {
			panic(err)
		}
	}
	n.client = f.dial(creds)
}

func (f *fleet) register(n *node) error {
	addr := f.mainAddr
	if n.victim {
		addr = f.victimAddr
	}
	ids := make([]uint32, enginesPerNode)
	for i := range ids {
		ids[i] = uint32(i)
	}
	n.mu.Lock()
	engines := make([]*motorv1.Engine, 0, len(n.engines))
	for _, e := range n.engines {
		engines = append(engines, e)
	}
	n.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	reply, err := f.client(n).RegisterNode(ctx, &motorv1.RegisterNodeRequest{
		Node: &motorv1.NodeInfo{NodeId: n.id, Address: addr, Host: n.host, AcceleratorIds: ids, AcceleratorType: "sim",
			PortRangeStart: 20000, PortRangeEnd: 29999},
		Engines: engines,
	})
	if err != nil {
		return err
	}
	n.mu.Lock()
	n.generation = reply.Generation
	n.sinceFull = f.fullEvery // the next beat is a full list
	n.mu.Unlock()
	f.follow(n, reply.HeartbeatInterval, reply.NodeGrace)
	return nil
}

// follow takes the interval the controller announced (and notes it and the grace for `measure`).
func (f *fleet) follow(n *node, interval, grace *durationpb.Duration) {
	if interval == nil || interval.AsDuration() <= 0 {
		return
	}
	n.interval = interval.AsDuration()
	atomic.StoreInt64(&f.announced, int64(n.interval))
	if grace != nil {
		atomic.StoreInt64(&f.grace, int64(grace.AsDuration()))
	}
}

// request builds the next beat: a full list every fullEvery beats (and first), else a delta.
func (f *fleet) request(n *node, seq uint64, full bool) *motorv1.HeartbeatRequest {
	n.mu.Lock()
	defer n.mu.Unlock()
	req := &motorv1.HeartbeatRequest{NodeId: n.id, Generation: n.generation, Sequence: seq}
	if full || n.sinceFull >= f.fullEvery {
		n.sinceFull = 1
		for _, e := range n.engines {
			req.Engines = append(req.Engines, e)
		}
	} else {
		n.sinceFull++
		req.Delta = true
		for id := range n.changed {
			if e, ok := n.engines[id]; ok {
				req.Engines = append(req.Engines, e)
			}
		}
		for id := range n.removed {
			req.RemovedEngineIds = append(req.RemovedEngineIds, id)
		}
	}
	n.changed, n.removed = map[string]bool{}, map[string]bool{}
	return req
}

func (f *fleet) record(rtt time.Duration, err error, req *motorv1.HeartbeatRequest) {
	f.statsMu.Lock()
	if f.measuring {
		if err != nil {
			f.errors++
		} else {
			f.rtts = append(f.rtts, float64(rtt.Microseconds())/1000)
			if req.Delta {
				f.deltas++
				f.deltaSizes += len(req.Engines)
			} else {
				f.fulls++
			}
		}
	}
	f.statsMu.Unlock()
}

func refused(err error) bool {
	c := status.Code(err)
	return c == codes.FailedPrecondition || c == codes.NotFound
}

func (f *fleet) beat(n *node) {
	if n.interval <= 0 {
		n.interval = f.interval
	}
	// Each node beats on a grid of the announced interval at a random phase of its own, so the
	// fleet's beats stay spread evenly: this one process registers its nodes within seconds and
	// follows every interval step at once, and a ticker started at registration kept them in
	// bursts (measured at 10,000 nodes: 2,250 of them beat within the same half second, and the
	// controller's p99 was 250-500 ms for a machine that is otherwise half idle). Real node
	// managers still beat one interval after registration (docs/benchmarks.md, controller scale).
	phase := rand.Float64()
	next := time.Now()
	var seq uint64
	var stream motorv1.ControllerService_StreamHeartbeatsClient
	for {
		next = gridAfter(next, n.interval, phase)
		time.Sleep(time.Until(next))
		if atomic.LoadInt32(&n.stopped) != 0 {
			if stream != nil {
				stream.CloseSend()
			}
			return
		}
		seq++
		var err error
		var req *motorv1.HeartbeatRequest
		var reply *motorv1.HeartbeatResponse
		started := time.Now()
		if f.transport == "unary" {
			req = f.request(n, seq, true)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			reply, err = f.client(n).Heartbeat(ctx, req)
			cancel()
		} else {
			fresh := stream == nil
			if fresh {
				stream, err = f.client(n).StreamHeartbeats(context.Background())
			}
			if err == nil {
				req = f.request(n, seq, fresh)
				started = time.Now()
				if err = stream.Send(&motorv1.StreamHeartbeatsRequest{Heartbeat: req}); err == nil {
					var answer *motorv1.StreamHeartbeatsResponse
					if answer, err = stream.Recv(); err == nil {
						reply = answer.Heartbeat
					}
				}
			}
			if err != nil {
				stream = nil
			}
		}
		f.record(time.Since(started), err, req)
		if err != nil && refused(err) {
			f.register(n)
		}
		if reply != nil {
			f.follow(n, reply.HeartbeatInterval, reply.NodeGrace)
		}
	}
}

// gridAfter is the first of the times (k + phase) x interval after t (counted from the Unix
// epoch): within one interval of t, whatever the interval was before.
func gridAfter(t time.Time, interval time.Duration, phase float64) time.Time {
	period := interval.Seconds()
	k := math.Floor(float64(t.UnixNano())/1e9/period-phase) + 1
	next := time.Unix(0, int64((k+phase)*period*1e9))
	if next.Sub(t) < time.Millisecond { // t was on the grid but for rounding: the point after it
		next = next.Add(interval)
	}
	return next
}

// reportFailures fails one random engine reportRate times a second and times ReportEngineEvent.
func (f *fleet) reportFailures() {
	if f.reportRate <= 0 {
		return
	}
	for range time.NewTicker(time.Duration(float64(time.Second) / f.reportRate)).C {
		f.mu.Lock()
		if len(f.nodes) <= f.victims {
			f.mu.Unlock()
			continue
		}
		n := f.nodes[f.victims+rand.Intn(len(f.nodes)-f.victims)]
		f.mu.Unlock()
		n.mu.Lock()
		var victim *motorv1.Engine
		for _, e := range n.engines {
			if e.State == motorv1.EngineState_ENGINE_STATE_RUNNING {
				victim = e
				break
			}
		}
		if victim == nil {
			n.mu.Unlock()
			continue
		}
		failed := proto.Clone(victim).(*motorv1.Engine)
		failed.State, failed.Health = motorv1.EngineState_ENGINE_STATE_FAILED, motorv1.HealthStatus_HEALTH_STATUS_ABNORMAL
		code := int32(1)
		failed.ExitCode = &code
		n.engines[failed.EngineId] = failed
		n.changed[failed.EngineId] = true
		req := &motorv1.ReportEngineEventRequest{NodeId: n.id, Generation: n.generation, Engine: failed, Reason: "exited with code 1 (fleet simulator)"}
		n.mu.Unlock()
		started := time.Now()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		_, err := f.client(n).ReportEngineEvent(ctx, req)
		cancel()
		rtt := time.Since(started)
		f.statsMu.Lock()
		if f.measuring {
			if err != nil {
				f.reportErrs++
			} else {
				f.reportRtts = append(f.reportRtts, float64(rtt.Microseconds())/1000)
			}
		}
		f.statsMu.Unlock()
	}
}

func (f *fleet) grow(size int) {
	var added []*node
	f.mu.Lock()
	for i := len(f.nodes); i < size; i++ {
		n := &node{id: fmt.Sprintf("sim-%05d", i), host: fmt.Sprintf("10.%d.%d.%d", i/65536, (i/256)%256, i%256),
			victim: i < f.victims, engines: map[string]*motorv1.Engine{}, changed: map[string]bool{}, removed: map[string]bool{}}
		f.nodes = append(f.nodes, n)
		f.byHost[n.host] = n
		added = append(added, n)
	}
	f.mu.Unlock()
	work := make(chan *node)
	var wg sync.WaitGroup
	for w := 0; w < 32; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for n := range work {
				f.connect(n)
				for f.register(n) != nil {
					time.Sleep(100 * time.Millisecond)
				}
				go f.beat(n) // at once: a registered node that stays silent past the grace turns SUSPECT
			}
		}()
	}
	for _, n := range added {
		work <- n
	}
	close(work)
	wg.Wait()
}

func quantile(sorted []float64, q float64) float64 {
	if len(sorted) == 0 {
		return -1
	}
	i := int(q * float64(len(sorted)))
	if i >= len(sorted) {
		i = len(sorted) - 1
	}
	return sorted[i]
}

func (f *fleet) measure(seconds float64) map[string]interface{} {
	f.statsMu.Lock()
	f.rtts, f.reportRtts = nil, nil
	f.errors, f.fulls, f.deltas, f.deltaSizes, f.reportErrs = 0, 0, 0, 0, 0
	f.measuring = true
	f.statsMu.Unlock()
	time.Sleep(time.Duration(seconds * float64(time.Second)))
	f.statsMu.Lock()
	defer f.statsMu.Unlock()
	f.measuring = false
	sort.Float64s(f.rtts)
	sort.Float64s(f.reportRtts)
	return map[string]interface{}{
		"beats": len(f.rtts), "errors": f.errors, "rate": float64(len(f.rtts)) / seconds,
		"p50_ms": quantile(f.rtts, 0.5), "p99_ms": quantile(f.rtts, 0.99), "max_ms": quantile(f.rtts, 1),
		"full_beats": f.fulls, "delta_beats": f.deltas, "delta_engines": f.deltaSizes,
		"reports": len(f.reportRtts), "report_errors": f.reportErrs,
		"report_p50_ms": quantile(f.reportRtts, 0.5), "report_p95_ms": quantile(f.reportRtts, 0.95),
		"report_p99_ms": quantile(f.reportRtts, 0.99), "report_max_ms": quantile(f.reportRtts, 1),
		"interval_s": float64(atomic.LoadInt64(&f.announced)) / 1e9, "grace_s": float64(atomic.LoadInt64(&f.grace)) / 1e9,
	}
}

func (f *fleet) silence() map[string]interface{} {
	var ids []string
	f.mu.Lock()
	for _, n := range f.nodes {
		if n.victim {
			atomic.StoreInt32(&n.stopped, 1)
			ids = append(ids, n.id)
		}
	}
	f.mu.Unlock()
	f.victimSrv.Stop() // the controller's direct re-check finds nobody
	return map[string]interface{}{"victims": ids, "at_unix": float64(time.Now().UnixNano()) / 1e9}
}

func main() {
	controller := flag.String("controller", "127.0.0.1:50051", "controller address")
	conns := flag.Int("conns", 8, "connections the fleet spreads its streams and calls over (0: one per node; always so with -tls-ca)")
	caCert := flag.String("tls-ca", "", "CA certificate (PEM): mutual TLS, each node with a certificate minted from it")
	caKey := flag.String("tls-ca-key", "", "the CA's key (PKCS#8 PEM), with -tls-ca")
	transport := flag.String("transport", "stream", "stream (StreamHeartbeats with deltas) or unary (Heartbeat, full lists)")
	fullEvery := flag.Int("full-every", 30, "a full engine list every this many beats (stream)")
	interval := flag.Duration("interval", time.Second, "heartbeat interval until the controller announces one")
	victims := flag.Int("victims", 3, "nodes that `silence` stops (the first ones registered)")
	reportRate := flag.Float64("reports-per-s", 20, "engine failures reported (ReportEngineEvent) per second")
	flag.Parse()

	f := &fleet{controllerAddr: *controller, transport: *transport, fullEvery: *fullEvery, interval: *interval,
		victims: *victims, reportRate: *reportRate, byHost: map[string]*node{}}
	if *caCert != "" {
		ca, err := loadAuthority(*caCert, *caKey)
		if err != nil {
			fmt.Fprintln(os.Stderr, "motor-fleet: -tls-ca/-tls-ca-key:", err)
			os.Exit(2)
		}
		f.ca = ca
	} else {
		for i := 0; i < *conns; i++ {
			f.conns = append(f.conns, f.dial(nil)) // plaintext, shared by every n-th node
		}
	}
	f.mainAddr, _ = serve(f)
	f.victimAddr, f.victimSrv = serve(f)
	go f.reportFailures()

	out := json.NewEncoder(os.Stdout)
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		words := strings.Fields(in.Text())
		if len(words) == 0 {
			continue
		}
		switch words[0] {
		case "grow":
			size, _ := strconv.Atoi(words[1])
			f.grow(size)
			out.Encode(map[string]interface{}{"nodes": size})
		case "starts":
			out.Encode(map[string]interface{}{"starts": atomic.LoadInt64(&f.starts)})
		case "measure":
			seconds, _ := strconv.ParseFloat(words[1], 64)
			out.Encode(f.measure(seconds))
		case "silence":
			out.Encode(f.silence())
		case "quit":
			return
		default:
			out.Encode(map[string]interface{}{"error": "unknown command " + words[0]})
		}
	}
}
