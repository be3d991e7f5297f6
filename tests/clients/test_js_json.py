"""The JS client's protobuf JSON handling (examples/js-client/wkt.test.js), run with node's
own test runner: Duration/Timestamp/Struct in canonical JSON, unknown fields named."""

from __future__ import annotations

import os
import subprocess

from tests.support.client_builds import JS_DIR, _build_js


def test_js_client_json_mapping():
    _build_js()
    result = subprocess.run(
        ["node", "--test", os.path.join(JS_DIR, "wkt.test.js")], cwd=JS_DIR, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "# fail 0" in result.stdout and "# pass 0" not in result.stdout, result.stdout
