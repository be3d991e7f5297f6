// The simulated node managers' own server: one NodeManagerService stands for every node,
// routed by the engine's host (see main.go).
package main

import (
	"context"
	"fmt"
	"net"
	"sync/atomic"

	motorv1 "github.com/motor-llm/motor/gen/go/motor/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

type nodeManager struct {
	motorv1.UnimplementedNodeManagerServiceServer
	f *fleet
}

func (s *nodeManager) StartEngine(ctx context.Context, req *motorv1.StartEngineRequest) (*motorv1.StartEngineResponse, error) {
	f := s.f
	f.mu.Lock()
	n := f.byHost[req.Spec.Host]
	f.mu.Unlock()
	if n == nil {
		return nil, status.Errorf(codes.NotFound, "no simulated node with host %q", req.Spec.Host)
	}
	port := uint32(20000 + 2*(atomic.AddInt64(&f.ports, 1)%4000))
	spec := req.Spec
	spec.Port, spec.MgmtPort = port, port+1
	id := fmt.Sprintf("%s/rank%d", spec.InstanceId, spec.DpRank)
	engine := &motorv1.Engine{
		EngineId: id, Spec: spec, State: motorv1.EngineState_ENGINE_STATE_RUNNING,
		Health: motorv1.HealthStatus_HEALTH_STATUS_NORMAL, HealthReason: "sim", Pid: int32(100000 + atomic.AddInt64(&f.starts, 1)), NodeId: n.id,
	}
	n.mu.Lock()
	n.engines[id] = engine
	n.changed[id] = true
	delete(n.removed, id)
	n.mu.Unlock()
	return &motorv1.StartEngineResponse{Engine: engine}, nil
}

func (s *nodeManager) StopEngine(ctx context.Context, req *motorv1.StopEngineRequest) (*motorv1.StopEngineResponse, error) {
	return &motorv1.StopEngineResponse{}, nil // the controller starts the copy again: StartEngine replaces it
}

func (s *nodeManager) ListEngines(ctx context.Context, req *motorv1.ListEnginesRequest) (*motorv1.ListEnginesResponse, error) {
	return &motorv1.ListEnginesResponse{}, nil
}

func serve(f *fleet) (string, *grpc.Server) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		panic(err)
	}
	var options []grpc.ServerOption
	if f.ca != nil {
		creds, err := f.ca.serverCredentials()
		if err != nil {
			panic(err)
		}
		options = append(options, grpc.Creds(creds))
	}
	srv := grpc.NewServer(options...)
	motorv1.RegisterNodeManagerServiceServer(srv, &nodeManager{f: f})
	go srv.Serve(lis)
	return lis.Addr().String(), srv
}
