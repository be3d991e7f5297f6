"""Service plumbing every Motor process runs on: gRPC servers, metrics, logs, signals, settings, retries, stream fan-out and background tasks."""
