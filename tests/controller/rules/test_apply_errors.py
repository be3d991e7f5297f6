"""What `motorctl apply` (and ApplyDeployment) says about a bad deployment file: every error names
the field as the file spells it, with its path, before any revision is written; engine_args are
checked per engine type (the simulated engine's fields exactly, vLLM's and SGLang's argument
names), an unknown name with the closest valid one."""

from __future__ import annotations

import copy

import pytest

from controller.rules.deployment_checks import validate_deployment
from motor.contract.deployment_file import deployment_from_dict
from motor.errors import InvalidArgument

SIM_SECTION = {
    "engine_type": "sim",
    "engine_args": {"model": "sim-tiny", "latency_ms": 5, "utilization": 10},
    "health_check_config": {"max_failure_count": 3, "probe_interval": 5},
}


def document(**sections) -> dict:
    return {
        "name": "chat",
        "model": "sim-tiny",
        "instance_groups": [{"name": "u", "role": "union", "count": 1, "data_parallel_size": 1}],
        "engine_config": {"motor_engine_prefill_config": sections.get("prefill", copy.deepcopy(SIM_SECTION))},
    }


def refusal(data: dict) -> str:
    with pytest.raises(InvalidArgument) as err:
        validate_deployment(deployment_from_dict(data, source="chat.yaml"))
    return str(err.value)


def file_refusal(data: dict) -> str:
    with pytest.raises(InvalidArgument) as err:
        deployment_from_dict(data, source="chat.yaml")
    return str(err.value)


def test_the_example_deployment_passes():
    validate_deployment(deployment_from_dict(document()))


# ---------------------------------------------------------------- the file's own fields


def test_a_word_where_a_number_goes_is_named_with_its_path():
    data = document()
    data["instance_groups"][0]["data_parallel_size"] = "one"
    message = file_refusal(data)
    assert "chat.yaml: instance_groups[0].data_parallel_size: expected an integer, got 'one'" in message
    assert "invalid literal" not in message and "dataParallelSize" not in message


def test_a_misspelled_field_is_named_with_the_closest_field_in_the_files_spelling():
    data = document()
    data["instance_groups"][0]["data_parallel_sise"] = 2
    message = file_refusal(data)
    assert "instance_groups[0].data_parallel_sise: unknown field; did you mean 'data_parallel_size'?" in message
    assert "dataParallelSize" not in message and "accelerators_per_engine" in message  # the fields it has


def test_every_problem_of_the_file_is_named_at_once():
    data = document()
    data["instance_groups"][0]["count"] = -1
    data["instance_groups"][0]["role"] = "prefil"
    data["restart_policy"] = {"initial_backoff": "5 minutes", "scope": "group"}
    data["replicas"] = 2
    message = file_refusal(data)
    assert "instance_groups[0].count: expected a whole number (0 or more), got -1" in message
    assert "instance_groups[0].role: 'prefil' is not one of prefill, decode, union" in message
    assert "restart_policy.initial_backoff: expected a duration (seconds as a number (60) or with a unit" in message
    assert "replicas: unknown field" in message


def test_a_mapping_or_a_list_where_the_other_goes():
    data = document()
    data["instance_groups"] = {"name": "u"}
    assert "instance_groups: expected a list, got a mapping" in file_refusal(data)
    data = document()
    data["restart_policy"] = ["group"]
    assert "restart_policy: expected a mapping, got a list" in file_refusal(data)


# ---------------------------------------------------------------- engine_config: the simulated engine


def test_a_typo_in_the_simulated_engines_args_is_refused_at_apply_with_the_right_name():
    section = copy.deepcopy(SIM_SECTION)
    section["engine_args"]["latncy_ms"] = section["engine_args"].pop("latency_ms")
    message = refusal(document(prefill=section))
    assert "engine_config.motor_engine_prefill_config.engine_args.latncy_ms: Extra inputs are not permitted" in message
    assert "did you mean 'latency_ms'?" in message


def test_a_bad_value_of_the_simulated_engine_is_refused_at_apply():
    section = copy.deepcopy(SIM_SECTION)
    section["engine_args"]["utilization"] = 150
    message = refusal(document(prefill=section))
    assert "engine_config.motor_engine_prefill_config.engine_args.utilization: Input should be less than or" in message


def test_integral_numbers_pass_as_the_engine_server_reads_them():
    section = copy.deepcopy(SIM_SECTION)
    section["engine_args"]["max_tokens_default"] = 8  # an int field: a Struct holds it as 8.0
    validate_deployment(deployment_from_dict(document(prefill=section)))


def test_a_typo_in_the_health_check_config_is_refused_at_apply():
    section = copy.deepcopy(SIM_SECTION)
    section["health_check_config"]["probe_intervall"] = 5
    message = refusal(document(prefill=section))
    assert "engine_config.motor_engine_prefill_config.health_check_config.probe_intervall" in message
    assert "did you mean 'probe_interval'?" in message


def test_an_unknown_engine_type_is_refused_at_apply():
    section = copy.deepcopy(SIM_SECTION)
    section["engine_type"] = "vllmm"
    message = refusal(document(prefill=section))
    assert "engine_config.motor_engine_prefill_config.engine_type" in message


# ---------------------------------------------------------------- engine_config: vLLM and SGLang


def vllm_section(**engine_args) -> dict:
    return {
        "engine_type": "vllm",
        "engine_args": {"model": "Qwen/Qwen2-0.5B", "served_model_name": "sim-tiny", **engine_args},
    }


def test_an_unknown_vllm_argument_is_refused_with_the_closest_vllm_argument():
    message = refusal(document(prefill=vllm_section(gpu_memory_utilisation=0.5)))
    assert "engine_config.motor_engine_prefill_config.engine_args.gpu_memory_utilisation: not a vLLM" in message
    assert "did you mean 'gpu_memory_utilization'?" in message


def test_known_vllm_arguments_pass():
    validate_deployment(
        deployment_from_dict(document(prefill=vllm_section(gpu_memory_utilization=0.5, max_model_len=512)))
    )


def sglang_section(**engine_args) -> dict:
    return {
        "engine_type": "sglang",
        "engine_args": {"model_path": "Qwen/Qwen2-0.5B", "served_model_name": "sim-tiny", **engine_args},
    }


def test_an_unknown_sglang_engine_arg_is_refused_with_the_closest_one():
    message = refusal(document(prefill=sglang_section(tp_sise=2)))
    assert "engine_config.motor_engine_prefill_config.engine_args.tp_sise: Extra inputs are not permitted" in message
    assert "did you mean 'tp_size'?" in message


def test_an_unknown_sglang_flag_is_refused_with_the_closest_sglang_flag():
    message = refusal(document(prefill=sglang_section(extra_args=["--chunked-prefil-size", "512"])))
    assert "engine_config.motor_engine_prefill_config.engine_args.extra_args[0]: --chunked-prefil-size" in message
    assert "did you mean --chunked-prefill-size?" in message


def test_a_known_sglang_flag_passes():
    validate_deployment(
        deployment_from_dict(document(prefill=sglang_section(extra_args=["--chunked-prefill-size", "512"])))
    )
