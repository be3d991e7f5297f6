"""The Go and JavaScript clients built for the tests, and the deployment JSON they send."""

from __future__ import annotations

import os
import shutil
import subprocess

from tests.support import REPO_ROOT, require

GO_DIR = os.path.join(REPO_ROOT, "examples", "go-client")


JS_DIR = os.path.join(REPO_ROOT, "examples", "js-client")


DEPLOYMENT_JSON = os.path.join(GO_DIR, "local-deployment.json")


def _build_go() -> list[str]:
    for tool in ("go", "protoc", "protoc-gen-go", "protoc-gen-go-grpc"):
        require(shutil.which(tool) is not None, f"{tool} (scripts/ci-clients.sh installs it)")
    require(
        os.path.isdir("/usr/share/gocode/src/google.golang.org/grpc"), "golang-google-grpc-dev (scripts/ci-clients.sh)"
    )
    result = subprocess.run(["bash", os.path.join(GO_DIR, "build.sh")], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"the Go client does not build:\n{result.stdout}{result.stderr}"
    return [os.path.join(GO_DIR, "bin", "motor-go-client")]


def _build_js() -> list[str]:
    require(shutil.which("node") is not None, "node (scripts/ci-clients.sh installs it)")
    if not os.path.isdir(os.path.join(JS_DIR, "node_modules", "@grpc", "grpc-js")):
        require(shutil.which("npm") is not None, "npm (scripts/ci-clients.sh installs it)")
        result = subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=JS_DIR,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, f"npm ci failed:\n{result.stdout}{result.stderr}"
    return ["node", os.path.join(JS_DIR, "client.js")]


BUILDERS = {"go": _build_go, "js": _build_js}
