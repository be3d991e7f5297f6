"""Inference engines the engine server can wrap: vllm (in-process), sglang (child process), sim."""
