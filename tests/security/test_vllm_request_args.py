"""The vLLM allow-list (motor/contract/vllm_request_args.py) against the installed vLLM's `vllm serve`
parser: every argument vLLM has is either allowed or refused with a reason, so an argument a new
vLLM adds fails here until someone reviews it. Imports vLLM (about a minute)."""

from __future__ import annotations

import importlib.util

import pytest

from motor.contract.engine_policy import code_reason
from motor.contract.vllm_request_args import MOTOR_ENGINE_ARGS, VLLM_ARG_CHOICES, VLLM_REFUSED_ARGS, VLLM_REQUEST_ARGS
from tests.support import require

pytestmark = pytest.mark.processes


@pytest.fixture(scope="module")
def vllm_arguments() -> set[str]:
    require(importlib.util.find_spec("vllm") is not None, "vLLM")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    return {action.dest for action in parser._actions if action.option_strings}


def test_every_vllm_argument_is_either_allowed_or_refused_with_a_reason(vllm_arguments):
    unreviewed = vllm_arguments - VLLM_REQUEST_ARGS - set(VLLM_REFUSED_ARGS)
    assert not unreviewed, (
        f"vLLM arguments in neither list of motor/contract/vllm_request_args.py: {sorted(unreviewed)}"
    )
    assert not VLLM_REQUEST_ARGS & set(VLLM_REFUSED_ARGS)


def test_the_lists_name_only_arguments_vllm_has(vllm_arguments):
    assert not (VLLM_REQUEST_ARGS | set(VLLM_REFUSED_ARGS) | set(VLLM_ARG_CHOICES)) - vllm_arguments
    assert not MOTOR_ENGINE_ARGS & vllm_arguments


def test_no_allowed_argument_names_code_by_the_key_rules():
    assert not {name for name in VLLM_REQUEST_ARGS if code_reason(name)}
