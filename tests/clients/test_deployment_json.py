"""examples/go-client/local-deployment.json (what the clients and the grpcurl walkthrough apply)
is the example deployment examples/local-deployment.yaml, in protobuf JSON."""

from __future__ import annotations

import os

from google.protobuf import json_format

from motor.contract.deployment_file import load_deployment
from motor.v1 import controller_pb2
from tests.support import REPO_ROOT


def test_json_deployment_matches_the_yaml_example():
    with open(os.path.join(REPO_ROOT, "examples", "go-client", "local-deployment.json")) as handle:
        from_json = json_format.Parse(handle.read(), controller_pb2.Deployment())
    from_yaml = load_deployment(os.path.join(REPO_ROOT, "examples", "local-deployment.yaml"))
    assert from_json == from_yaml, (
        "regenerate examples/go-client/local-deployment.json from examples/local-deployment.yaml"
    )
