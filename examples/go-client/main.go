// motor-go-client: a small Go client of the Motor controller, built from stubs generated from
// proto/ (see build.sh). It lists nodes and instances, applies a deployment written in protobuf
// JSON, and follows the controller's WatchEvents stream.
//
//	motor-go-client [-addr localhost:50051] [-json] nodes
//	motor-go-client [-addr ...] [-json] instances
//	motor-go-client [-addr ...] apply deployment.json
//	motor-go-client [-addr ...] [-json] watch [-until EVENT_TYPE_ENGINE_FAILED] [-count N]
//
// With TLS (docs/security.md): -cacert ca.crt, plus a client certificate (-cert, -key) or a
// bearer token (-token-file operator.token); without -cacert the connection is plaintext.
package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	motorv1 "github.com/motor-llm/motor/gen/go/motor/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
)

const usage = `usage: motor-go-client [flags] COMMAND [ARGS]

commands:
  nodes                 list the nodes the controller knows (ListNodes)
  instances             list the instances and their engines (ListInstances)
  apply FILE.json       apply a deployment written in protobuf JSON (ApplyDeployment)
  watch                 print the snapshot, then every event (WatchEvents); flags:
                          -until TYPE   stop after the first event of TYPE (e.g. EVENT_TYPE_ENGINE_FAILED)
                          -count N      stop after N events
flags:
`

// toJSON renders a message in protobuf JSON with the .proto field names, on one line.
func toJSON(m proto.Message) string {
	out, err := protojson.MarshalOptions{UseProtoNames: true}.Marshal(m)
	if err != nil {
		return fmt.Sprintf("<unprintable: %v>", err)
	}
	return string(out)
}

func fail(format string, args ...interface{}) {
	fmt.Fprintf(os.Stderr, "motor-go-client: "+format+"\n", args...)
	os.Exit(1)
}

// failRPC prints the gRPC status code and message, which name what to fix.
func failRPC(call string, err error) {
	st := status.Convert(err)
	fail("%s: %s: %s", call, st.Code(), st.Message())
}

func main() {
	addr := flag.String("addr", envOr("MOTOR_CONTROLLER", "localhost:50051"), "controller address (env MOTOR_CONTROLLER)")
	asJSON := flag.Bool("json", false, "print protobuf JSON, one message per line")
	timeout := flag.Duration("timeout", 10*time.Second, "deadline of unary calls and of connecting")
	caFile := flag.String("cacert", "", "CA bundle that signed the controller's certificate: connect with TLS")
	certFile := flag.String("cert", "", "client certificate (with -key and -cacert): identity from the certificate")
	keyFile := flag.String("key", "", "key of -cert")
	tokenFile := flag.String("token-file", "", "file holding a bearer token (with -cacert): identity from the token")
	flag.Usage = func() { fmt.Fprint(os.Stderr, usage); flag.PrintDefaults() }
	flag.Parse()
	if flag.NArg() < 1 {
		flag.Usage()
		os.Exit(2)
	}

	command, args := flag.Arg(0), flag.Args()[1:]
	switch {
	case command != "nodes" && command != "instances" && command != "apply" && command != "watch":
		fail("unknown command %q (nodes, instances, apply, watch)", command)
	case command == "apply" && len(args) != 1:
		fail("apply needs exactly one argument: the deployment JSON file")
	}

	dialCtx, cancelDial := context.WithTimeout(context.Background(), *timeout)
	options := append(transportOptions(*caFile, *certFile, *keyFile, *tokenFile), grpc.WithBlock())
	conn, err := grpc.DialContext(dialCtx, *addr, options...)
	cancelDial()
	if err != nil {
		fail("cannot connect to the controller at %s: %v", *addr, err)
	}
	defer conn.Close()
	client := motorv1.NewControllerServiceClient(conn)

	switch command {
	case "nodes":
		listNodes(client, *timeout, *asJSON)
	case "instances":
		listInstances(client, *timeout, *asJSON)
	case "apply":
		apply(client, *timeout, args[0])
	case "watch":
		watch(client, *asJSON, args)
	}
}

// bearerToken sends "authorization: Bearer <token>" with every call (over TLS only).
type bearerToken string

func (t bearerToken) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + string(t)}, nil
}

func (bearerToken) RequireTransportSecurity() bool { return true }

// transportOptions: plaintext without a CA; TLS with one, plus a client certificate or a token.
func transportOptions(caFile, certFile, keyFile, tokenFile string) []grpc.DialOption {
	if caFile == "" {
		if certFile != "" || tokenFile != "" {
			fail("-cert and -token-file need -cacert (the CA that signed the controller's certificate)")
		}
		return []grpc.DialOption{grpc.WithInsecure()}
	}
	pem, err := os.ReadFile(caFile)
	if err != nil {
		fail("-cacert: %v", err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(pem) {
		fail("-cacert: %s holds no PEM certificate", caFile)
	}
	config := &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}
	if (certFile == "") != (keyFile == "") {
		fail("-cert and -key go together")
	}
	if certFile != "" {
		pair, err := tls.LoadX509KeyPair(certFile, keyFile)
		if err != nil {
			fail("-cert/-key: %v", err)
		}
		config.Certificates = []tls.Certificate{pair}
	}
	options := []grpc.DialOption{grpc.WithTransportCredentials(credentials.NewTLS(config))}
	if tokenFile != "" {
		token, err := os.ReadFile(tokenFile)
		if err != nil {
			fail("-token-file: %v", err)
		}
		options = append(options, grpc.WithPerRPCCredentials(bearerToken(strings.TrimSpace(string(token)))))
	}
	return options
}

func envOr(name, fallback string) string {
	if value := os.Getenv(name); value != "" {
		return value
	}
	return fallback
}

func listNodes(client motorv1.ControllerServiceClient, timeout time.Duration, asJSON bool) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	resp, err := client.ListNodes(ctx, &motorv1.ListNodesRequest{})
	if err != nil {
		failRPC("ListNodes", err)
	}
	if asJSON {
		fmt.Println(toJSON(resp))
		return
	}
	table := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(table, "NODE\tSTATE\tADDRESS\tENGINES\tREASON")
	for _, node := range resp.Nodes {
		fmt.Fprintf(table, "%s\t%s\t%s\t%d\t%s\n", node.Info.GetNodeId(), shortEnum(node.State.String(), "NODE_STATE_"),
			node.Info.GetAddress(), len(node.Engines), node.StateReason)
	}
	table.Flush()
	for _, alarm := range resp.Alarms {
		fmt.Println("ALARM:", alarm)
	}
}

func listInstances(client motorv1.ControllerServiceClient, timeout time.Duration, asJSON bool) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	resp, err := client.ListInstances(ctx, &motorv1.ListInstancesRequest{})
	if err != nil {
		failRPC("ListInstances", err)
	}
	if asJSON {
		fmt.Println(toJSON(resp))
		return
	}
	table := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(table, "INSTANCE\tROLE\tSTATE\tENGINE\tNODE\tPORT\tHEALTH\tRESTARTS")
	for _, instance := range resp.Instances {
		for _, engine := range instance.Engines {
			fmt.Fprintf(table, "%s\t%s\t%s\t%s\t%s\t%d\t%s\t%d\n", instance.InstanceId,
				shortEnum(instance.Role.String(), "ROLE_"), shortEnum(instance.State.String(), "INSTANCE_STATE_"),
				engine.EngineId, engine.NodeId, engine.Port, shortEnum(engine.Health.String(), "HEALTH_STATUS_"),
				engine.Restarts)
		}
	}
	table.Flush()
}

func apply(client motorv1.ControllerServiceClient, timeout time.Duration, path string) {
	data, err := os.ReadFile(path)
	if err != nil {
		fail("cannot read the deployment: %v", err)
	}
	deployment := &motorv1.Deployment{}
	if err := protojson.Unmarshal(data, deployment); err != nil {
		fail("%s is not a motor.v1.Deployment in protobuf JSON: %v", path, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	resp, err := client.ApplyDeployment(ctx, &motorv1.ApplyDeploymentRequest{Deployment: deployment})
	if err != nil {
		failRPC("ApplyDeployment", err)
	}
	fmt.Printf("applied deployment %q, revision %d\n", resp.Deployment.GetName(), resp.Revision)
}

func watch(client motorv1.ControllerServiceClient, asJSON bool, args []string) {
	flags := flag.NewFlagSet("watch", flag.ExitOnError)
	until := flags.String("until", "", "stop after the first event of this type, e.g. EVENT_TYPE_ENGINE_FAILED")
	count := flags.Int("count", 0, "stop after this many events (0: never)")
	flags.Parse(args)
	if *until != "" {
		if _, known := motorv1.EventType_value[*until]; !known {
			fail("-until: unknown event type %q (e.g. EVENT_TYPE_ENGINE_FAILED)", *until)
		}
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stream, err := client.WatchEvents(ctx, &motorv1.WatchEventsRequest{})
	if err != nil {
		failRPC("WatchEvents", err)
	}
	seen := 0
	for {
		msg, err := stream.Recv()
		if err == io.EOF {
			return
		}
		if err != nil {
			failRPC("WatchEvents", err)
		}
		if asJSON {
			fmt.Println(toJSON(msg))
		} else if snapshot := msg.GetSnapshot(); snapshot != nil {
			fmt.Printf("snapshot: %d nodes, %d instances, %d recent events\n",
				len(snapshot.Nodes), len(snapshot.Instances), len(snapshot.RecentEvents))
		} else if event := msg.GetEvent(); event != nil {
			fmt.Printf("#%d %s %s %s\n", event.Sequence, event.Time.AsTime().Format(time.RFC3339Nano),
				shortEnum(event.Type.String(), "EVENT_TYPE_"), event.Message)
		}
		os.Stdout.Sync()
		if event := msg.GetEvent(); event != nil {
			seen++
			if event.Type.String() == *until || (*count > 0 && seen >= *count) {
				return
			}
		}
	}
}

func shortEnum(name, prefix string) string {
	return strings.TrimPrefix(name, prefix)
}
