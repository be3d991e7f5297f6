"""The generated Python API ships type stubs: mypy checks a client against them.

Motor is installed the way a user installs it (a regular, non-editable install into a scratch
directory), so the test sees what the distribution ships: the .pyi stubs and py.typed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.support import REPO_ROOT, require

GOOD = """
    import grpc

    from motor.v1 import controller_pb2, controller_pb2_grpc, types_pb2


    def not_normal(response: controller_pb2.ListInstancesResponse) -> list[str]:
        return [e.engine_id for i in response.instances for e in i.engines
                if e.health != types_pb2.HEALTH_STATUS_NORMAL]


    def main(address: str) -> None:
        with grpc.insecure_channel(address) as channel:
            stub = controller_pb2_grpc.ControllerServiceStub(channel)
            reply = stub.ListInstances(controller_pb2.ListInstancesRequest(), timeout=5)
            print(not_normal(reply))
            group = controller_pb2.InstanceGroup(name="decode", role=types_pb2.ROLE_DECODE, count=1)
            print(group.count + 1)
"""

# Each line is one mistake mypy must catch, with the error code it must report.
BAD = {
    'controller_pb2.InstanceGroup(name="decode", count="1")': "arg-type",
    "text: str = controller_pb2.InstanceGroup().count": "assignment",
    'controller_pb2.InstanceGroup().nmae = "decode"': "attr-defined",
    "controller_pb2_grpc.ControllerServiceStub(channel).ListNodes(controller_pb2.ListInstancesRequest())": "arg-type",
}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> str:
    try:
        import mypy  # noqa: F401
    except ImportError:
        mypy = None
    require(mypy is not None, "mypy (requirements/dev.txt; run `make setup`)")
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            REPO_ROOT,
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    assert (target / "motor" / "v1" / "py.typed").exists(), "py.typed is not in the installed package"
    return str(target)


def run_mypy(site: str, directory, source: str) -> subprocess.CompletedProcess:
    path = directory / "client.py"
    path.write_text(textwrap.dedent(source))
    env = dict(os.environ, PYTHONPATH=site)
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", str(path)],
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_correct_client_type_checks(installed, tmp_path):
    result = run_mypy(installed, tmp_path, GOOD)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success: no issues found" in result.stdout


def test_type_errors_in_a_client_are_caught(installed, tmp_path):
    lines = [
        "import grpc",
        "from motor.v1 import controller_pb2, controller_pb2_grpc",
        'channel = grpc.insecure_channel("localhost:50051")',
    ]
    source = "\n".join([*lines, *BAD]) + "\n"
    result = run_mypy(installed, tmp_path, source)
    assert result.returncode == 1, result.stdout + result.stderr
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    for number, (line, code) in enumerate(BAD.items(), start=len(lines) + 1):
        assert any(e.startswith(f"client.py:{number}: error:") and e.endswith(f"[{code}]") for e in errors), (
            f"mypy did not catch line {number} ({line}) as [{code}]:\n{result.stdout}"
        )
    assert f"Found {len(BAD)} errors" in result.stdout, result.stdout
