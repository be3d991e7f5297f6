"""Nothing in a request chooses a program, code to load or a file on the node."""

from __future__ import annotations

import json

import pytest

from motor.contract.engine_policy import MAX_CONFIG_DEPTH, SGLANG_EXTRA_FLAGS, check_engine_config, parse_config_json
from motor.errors import InvalidArgument

SECTION = "motor_engine_prefill_config"


def _config(**engine_args):
    return {SECTION: {"engine_type": "sglang", "engine_args": {"model_path": "Qwen/Qwen2-0.5B", **engine_args}}}


@pytest.mark.parametrize(
    "engine_args, key, says",
    [
        ({"launcher": ["/bin/sh", "-c", "id > /tmp/x"]}, "engine_args.launcher", "may not choose what runs"),
        ({"worker_extension_cls": "evil.Module"}, "engine_args.worker_extension_cls", "Python class"),
        ({"tool_parser_plugin": "plugin.py"}, "engine_args.tool_parser_plugin", "plugin"),
        ({"trust_remote_code": True}, "engine_args.trust_remote_code", "must be false"),
        ({"model_path": "/etc"}, "engine_args.model_path", "'/etc' is a local path outside"),
        ({"model_path": "~root/.ssh"}, "engine_args.model_path", "local path outside"),
        ({"model_path": "/models/../etc/passwd"}, "engine_args.model_path", "local path outside"),
        ({"extra_args": ["--chat-template=/etc/shadow"]}, "engine_args.extra_args[0]", "'/etc/shadow'"),
        ({"extra_args": ["--chat-template", "../../etc/shadow"]}, "engine_args.extra_args[1]", "local path outside"),
    ],
)
def test_program_code_and_outside_paths_are_refused_naming_the_key(engine_args, key, says, tmp_path):
    with pytest.raises(InvalidArgument) as refused:
        check_engine_config(_config(**engine_args), [str(tmp_path)], field="spec.config_json")
    assert f"spec.config_json.{SECTION}.{key}:" in str(refused.value) and says in str(refused.value)


def test_engine_tls_files_do_not_come_from_a_request():
    config = {SECTION: {"engine_type": "sim", "mgmt_tls_config": {"enable_tls": True, "cert_file": "/etc/ssl/x.pem"}}}
    with pytest.raises(InvalidArgument) as refused:
        check_engine_config(config, [])
    assert "mgmt_tls_config: not accepted in a request" in str(refused.value)


def test_model_names_and_paths_inside_the_model_roots_are_accepted(tmp_path):
    model = tmp_path / "models" / "tiny"
    model.mkdir(parents=True)
    check_engine_config(_config(model_path=str(model), trust_remote_code=False, tp_size=2), [str(tmp_path / "models")])
    check_engine_config(_config(served_model_name="org/name", extra_args=["--max-running-requests", "8"]), [])
    check_engine_config({SECTION: {"engine_type": "sim", "engine_args": {"model": "sim-tiny", "latency_ms": 5}}}, [])


def test_a_symlink_out_of_a_model_root_is_outside(tmp_path):
    root = tmp_path / "models"
    root.mkdir()
    (root / "escape").symlink_to("/etc")
    with pytest.raises(InvalidArgument):
        check_engine_config(_config(model_path=str(root / "escape")), [str(root)])


def _vllm(**engine_args):
    return {
        "motor_engine_union_config": {"engine_type": "vllm", "engine_args": {"model": "Qwen/Qwen2-0.5B", **engine_args}}
    }


VLLM_UNION = "spec.config_json.motor_engine_union_config.engine_args"


@pytest.mark.parametrize(
    "engine_args, key, says",
    [  # every spelling vLLM accepts, and the code-loading arguments missing from the old list
        ({"trust-remote-code": True}, "trust-remote-code", "must be false"),
        ({"Trust_Remote_Code": True}, "Trust_Remote_Code", "must be false"),
        ({"worker-cls": "evil.Worker"}, "worker-cls", "Python class"),
        ({"worker-extension-cls": "evil.X"}, "worker-extension-cls", "Python class"),
        ({"scheduler_cls": "evil.Sched"}, "scheduler_cls", "Python class"),
        ({"--scheduler-cls": "evil.Sched"}, "--scheduler-cls", "Python class"),
        (
            {"kv_transfer_config": {"kv_connector": "Evil", "kv_connector_module_path": "evil"}},
            "kv_transfer_config.kv_connector_module_path",
            "Python module",
        ),
        (
            {"kv_transfer_config": {"kv_connector_extra_config": {"spec_module_path": "evil"}}},
            "kv_transfer_config.kv_connector_extra_config.spec_module_path",
            "Python module",
        ),
        (
            {"ec_manager_config": {"encoder_cache_manager_cls": "evil.M"}},
            "ec_manager_config.encoder_cache_manager_cls",
            "Python class",
        ),
        ({"io-processor-plugin": "evil"}, "io-processor-plugin", "plugin"),
        ({"config": "args.yaml"}, "config", "a file of more vLLM arguments"),
        (
            {"logging_config": {"pylogging_config_file": "x.json"}},
            "logging_config.pylogging_config_file",
            "logging configuration",
        ),
        ({"logging_config": {"log_level": "info"}}, "logging_config", "logging configuration"),
        ({"distributed_executor_backend": "evil.Executor"}, "distributed_executor_backend", "must be one of"),
        # accepted by vLLM, but they cannot work under the engine server
        ({"distributed_executor_backend": "ray"}, "distributed_executor_backend", "Ray is not supported"),
        ({"data-parallel-backend": "ray"}, "data-parallel-backend", "Ray is not supported"),
        ({"ssl_certfile": "cert.pem"}, "ssl_certfile", "TLS on the inference plane is not supported"),
        ({"ssl_keyfile": "key.pem"}, "ssl_keyfile", "TLS on the inference plane is not supported"),
        ({"ssl_ca_certs": "ca.pem"}, "ssl_ca_certs", "TLS on the inference plane is not supported"),
        (
            {"compilation_config": {"backend": "evil.backend_fn"}},
            "compilation_config.backend",
            "Python name vLLM would import",
        ),
        (
            {"compilation_config": {"inductor_compile_config": {"cpp.cxx": "sh"}}},
            "compilation_config.inductor_compile_config",
            "compiler",
        ),
        (
            {"speculative_config": {"method": "custom_class", "model": "evil.Proposer"}},
            "speculative_config.model",
            "Python name",
        ),
        ({"some_new_vllm_argument": 1}, "some_new_vllm_argument", "not a vLLM 0.32.0 argument"),
        (
            {"served_model_name": ["x", "--trust-remote-code"]},
            "served_model_name[1]",
            "looks like a command-line option",
        ),
        ({"port": 9}, "port", "set by the engine server's command line"),
        # JSON in a string is what vLLM parses, so it is checked as JSON
        (
            {"speculative_config": '{"model": "/etc", "method": "eagle"}'},
            "speculative_config.model",
            "'/etc' is a local path outside",
        ),
        (
            {"compilation_config": '{"cache_dir": "/etc/x"}'},
            "compilation_config.cache_dir",
            "'/etc/x' is a local path outside",
        ),
        ({"compilation_config": ' {"backend": "evil.fn"}'}, "compilation_config.backend", "Python name"),
        (
            {"kv_transfer_config": '{"kv_connector_module_path": "evil"}'},
            "kv_transfer_config.kv_connector_module_path",
            "Python module",
        ),
        (
            {"hf_overrides": '[{"x": {"trust_remote_code": true}}]'},
            "hf_overrides[0].x.trust_remote_code",
            "must be false",
        ),
    ],
)
def test_vllm_code_keys_in_every_spelling_and_json_strings_are_refused(engine_args, key, says, tmp_path):
    with pytest.raises(InvalidArgument) as refused:
        check_engine_config(_vllm(**engine_args), [str(tmp_path)], field="spec.config_json")
    assert f"{VLLM_UNION}.{key}:" in str(refused.value) and says in str(refused.value), str(refused.value)


@pytest.mark.parametrize(
    "extra_args, index, says",
    [
        (["--trust-remote-code"], 0, "must be false"),
        (["--trust_remote_code=true"], 0, "must be false"),
        (["--enable-custom-logit-processor"], 0, "send Python code"),
        (["--max-running-requests", "8", "--custom-weight-loader", "evil.load"], 2, "Python functions"),
        (["--json-model-override-args", "{}"], 0, "not among the SGLang flags a request may add"),
        (["-c", "x"], 0, "-c is not an SGLang 0.5.23 flag"),
        (["--chunked-prefil-size", "8"], 0, "not an SGLang 0.5.23 flag; did you mean --chunked-prefill-size?"),
        (["evil"], 0, "must start with a --flag"),
        (["--api-key", "sk-own"], 0, "--api-key: Motor gives SGLang the engines' key itself"),
        (["--dp-size", "2", "--config", "x.yaml"], 2, "--config: the engine server passes SGLang's --config"),
        (["--tokenizer-path", "/etc"], 1, "'/etc' is a local path outside"),
    ],
)
def test_sglang_extra_args_take_only_the_listed_flags(extra_args, index, says, tmp_path):
    with pytest.raises(InvalidArgument) as refused:
        check_engine_config(_config(extra_args=extra_args), [str(tmp_path)], field="spec.config_json")
    assert f"spec.config_json.{SECTION}.engine_args.extra_args[{index}]:" in str(refused.value), str(refused.value)
    assert says in str(refused.value), str(refused.value)


def test_ordinary_vllm_and_sglang_settings_are_accepted(tmp_path):
    model = tmp_path / "tiny"
    model.mkdir()
    check_engine_config(
        _vllm(
            model=str(model),
            max_model_len=256,
            enforce_eager=True,
            dtype="float16",
            trust_remote_code=False,
            served_model_name=["qwen.small", "b"],
            motor_utilization=50,
            seed=-1,
            distributed_executor_backend="mp",
            speculative_config=f'{{"model": "{model}", "method": "eagle"}}',
            compilation_config={"mode": 3, "cudagraph_capture_sizes": [1, 2]},
            kv_transfer_config={"kv_connector": "NixlConnector", "kv_role": "kv_both"},
        ),
        [str(tmp_path)],
    )
    check_engine_config(
        _config(
            extra_args=[
                "--max-running-requests",
                "8",
                "--random-seed",
                "-1",
                "--log-level=info",
                "--chat-template",
                str(model),
            ]
        ),
        [str(tmp_path)],
    )


def test_configurations_nested_too_deep_are_refused_naming_the_limit():
    deep = {"engine_args": {}}
    cursor = deep["engine_args"]
    for _ in range(MAX_CONFIG_DEPTH):
        cursor["x"] = {}
        cursor = cursor["x"]
    with pytest.raises(InvalidArgument) as refused:
        check_engine_config({SECTION: deep}, [])
    assert f"nested deeper than {MAX_CONFIG_DEPTH} levels" in str(refused.value)
    text = '{"a": ' + "[" * 5000 + "]" * 5000 + "}"  # deeper than Python's recursion limit
    with pytest.raises(InvalidArgument) as refused:
        check_engine_config(parse_config_json(text, "spec.config_json"), [], "spec.config_json")
    assert f"spec.config_json: nested deeper than {MAX_CONFIG_DEPTH} levels" in str(refused.value)
    with pytest.raises(InvalidArgument, match=f"^spec.config_json: nested deeper than {MAX_CONFIG_DEPTH} levels$"):
        check_engine_config(
            parse_config_json('{"a": ' + "[" * 500 + "]" * 500 + "}", "spec.config_json"), [], "spec.config_json"
        )
    inside_a_string = {"b": json.dumps({"c": [[[[[[]]]]]]})}  # a JSON string's levels count too: 8 here
    for _ in range(MAX_CONFIG_DEPTH - 7):
        inside_a_string = {"x": inside_a_string}
    with pytest.raises(InvalidArgument, match=f"^engine_config: nested deeper than {MAX_CONFIG_DEPTH} levels$"):
        check_engine_config(inside_a_string, None, "engine_config")
    check_engine_config(inside_a_string["x"], None, "engine_config")  # one level less is accepted


RUNS = "a request may not choose what runs on a node (engine commands come from the node manager's --engine-command)"


@pytest.mark.parametrize(
    "key, names",
    [
        ("engine.launcher", "the command that starts SGLang"),  # each part of a dotted key counts
        ("cls", "a Python class the engine imports"),
        ("Class", "a Python class the engine imports"),
        ("tokenizer_class", "a Python class the engine imports"),
        ("module", "a Python module the engine imports"),
        ("backend_module", "a Python module the engine imports"),
        ("x.Y-Module-Path", "a Python module the engine imports"),
        ("my_plugins", "a plugin the engine loads"),
    ],
)
def test_code_keys_are_refused_by_their_shape_with_the_whole_message(key, names):
    config = {SECTION: {"engine_type": "sim", "engine_args": {key: "x"}}}
    with pytest.raises(InvalidArgument) as refused:
        check_engine_config(config, [], "spec.config_json")
    assert str(refused.value) == f"spec.config_json.{SECTION}.engine_args.{key}: names {names}; {RUNS}"


@pytest.mark.parametrize("value", [False, "false", "False", " FALSE ", 0, "0", None])
def test_trust_remote_code_off_in_any_spelling_is_accepted(value):
    check_engine_config(_config(trust_remote_code=value), [])


@pytest.mark.parametrize("value", [True, "true", 1, "yes"])
def test_trust_remote_code_on_in_any_spelling_is_refused(value):
    with pytest.raises(InvalidArgument, match="trust_remote_code: must be false in a request: it runs Python code"):
        check_engine_config(_config(trust_remote_code=value), [])


def test_engine_tls_off_is_accepted_and_the_default_field_is_config_json():
    check_engine_config({SECTION: {"engine_type": "sim", "mgmt_tls_config": {"enable_tls": False}}}, [])
    with pytest.raises(InvalidArgument) as refused:
        check_engine_config({SECTION: {"engine_type": "sim", "mgmt_tls_config": {"enable_tls": True}}}, [])
    assert str(refused.value).startswith(f"config_json.{SECTION}.mgmt_tls_config: not accepted in a request: ")


@pytest.mark.parametrize("path", ["./evil", ".", "..", "models/..", "a/../../b"])
def test_relative_paths_count_as_local_paths(path, tmp_path):
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    with pytest.raises(InvalidArgument) as refused:
        check_engine_config(_config(model_path=path), roots, "spec.config_json")
    assert str(refused.value) == (
        f"spec.config_json.{SECTION}.engine_args.model_path: {path!r} is a local path outside "
        f"the node's model roots ({tmp_path}/a, {tmp_path}/b)"
    )


def test_a_node_without_model_roots_says_so():
    with pytest.raises(InvalidArgument) as refused:
        check_engine_config(_config(model_path="/m"), [], "f")
    assert str(refused.value) == (
        f"f.{SECTION}.engine_args.model_path: '/m' is a local path outside "
        "a model root (the node allows no local paths: --model-root)"
    )


def test_every_section_is_checked_and_motor_keys_do_not_end_the_check():
    config = {"other": 1, "motor_engine_decode_config": {"engine_type": "sim"}, **_vllm(motor_utilization=5, Xseed=1)}
    with pytest.raises(InvalidArgument) as refused:
        check_engine_config(config, [])
    assert str(refused.value) == (
        "config_json.motor_engine_union_config.engine_args.Xseed: not a vLLM 0.32.0 argument; did you mean 'seed'?"
    )
    check_engine_config(_vllm(**{"compilation_config.mode": 3, "--seed": 1}), [])  # a dotted key is its first part's


def test_sglang_extra_args_messages_name_the_flag_and_the_list():
    check_engine_config(_config(extra_args=["--served-model-name=a=b"]), [])
    with pytest.raises(InvalidArgument) as refused:
        check_engine_config(_config(extra_args=["--dp-size", "2", "--weird=1"]), [])
    assert (
        str(refused.value) == f"config_json.{SECTION}.engine_args.extra_args[2]: --weird is not an SGLang 0.5.23 flag"
    )
    with pytest.raises(InvalidArgument) as refused:
        check_engine_config(_config(extra_args=["--dp-size", "2", "--enable-lora"]), [])
    assert str(refused.value) == (
        f"config_json.{SECTION}.engine_args.extra_args[2]: --enable-lora is not among the SGLang flags "
        "a request may add (SGLANG_EXTRA_FLAGS in motor/contract/engine_policy.py, docs/security.md)"
    )


def test_the_sglang_allow_list_names_only_flags_of_the_pinned_sglang():
    """SGLang is not installed here: motor/contract/sglang_server_flags.py is its parser's flags,
    generated by scripts/sglang-server-flags.py from the pinned wheel; every flag a request may add,
    and every flag the engine server passes itself (engine_server/engines/sglang.py), is one."""
    from motor.contract.sglang_server_flags import SGLANG_SERVER_FLAGS

    assert SGLANG_EXTRA_FLAGS - SGLANG_SERVER_FLAGS == set()
    passed = {"model_path", "host", "port", "served_model_name", "tp_size", "mem_fraction_static",
              "context_length", "trust_remote_code", "disaggregation_mode", "disaggregation_transfer_backend",
              "disaggregation_bootstrap_port", "dist_init_addr", "enable_metrics", "config", "api_key"}  # fmt: skip
    assert passed - SGLANG_SERVER_FLAGS == set()


@pytest.mark.parametrize(
    "text, says",
    [
        ("nope", "spec.config_json is not a JSON object: Expecting value"),
        ("[1]", "spec.config_json is not a JSON object: list"),
    ],
)
def test_config_json_must_be_a_json_object(text, says):
    with pytest.raises(InvalidArgument) as refused:
        parse_config_json(text, "spec.config_json")
    assert str(refused.value).startswith(says)


@pytest.mark.parametrize("where", ["value", "in a JSON string", "in a list"])
@pytest.mark.parametrize("number", [float("nan"), float("inf"), float("-inf")])
def test_numbers_that_are_not_finite_are_refused_naming_the_key(number, where):
    """JSON has no NaN or Infinity, yet Python's parser and a protobuf Struct carry them: vLLM
    would get gpu_memory_utilization=NaN, which its own range check lets through."""
    value = {"value": number, "in a JSON string": json.dumps({"x": number}), "in a list": [1, number]}[where]
    key = {
        "value": "engine_args.gpu_memory_utilization",
        "in a JSON string": "engine_args.gpu_memory_utilization.x",
        "in a list": "engine_args.gpu_memory_utilization[1]",
    }[where]
    with pytest.raises(InvalidArgument) as refused:
        check_engine_config(_vllm(gpu_memory_utilization=value), None, field="engine_config")
    assert str(refused.value).startswith(
        f"engine_config.motor_engine_union_config.{key}: "
    ) and "not a finite number" in str(refused.value)


def test_config_json_with_nan_is_refused_naming_the_field():
    with pytest.raises(InvalidArgument, match=r"^spec.config_json is not a JSON object: NaN is not JSON"):
        parse_config_json('{"a": NaN}', "spec.config_json")


@pytest.mark.parametrize("text", ["nan", "-inf", "Infinity", "1e999", " NaN "])
def test_strings_an_argument_parser_turns_into_numbers_that_are_not_finite_are_refused(text):
    """vLLM's argparse reads gpu_memory_utilization "nan" as float('nan'); SGLang's extra_args
    likewise (found by a hostile tester of the NaN check)."""
    with pytest.raises(
        InvalidArgument,
        match=r"^engine_config.motor_engine_union_config.engine_args.gpu_memory_utilization: .* is not a finite number",
    ):
        check_engine_config(_vllm(gpu_memory_utilization=text), None, field="engine_config")
    with pytest.raises(
        InvalidArgument, match=rf"^spec.config_json.{SECTION}.engine_args.extra_args\[1\]: .* is not a finite number"
    ):
        check_engine_config(_config(extra_args=["--mem-fraction-static", text]), [], field="spec.config_json")
    check_engine_config(
        _vllm(gpu_memory_utilization="0.9", served_model_name=["nano", "info"]), None
    )  # finite and words: fine


@pytest.mark.parametrize("engine_args", [
    {"distributed_executor_backend": "mp"}, {"data_parallel_backend": "mp"}, {"ssl_certfile": None},
    {"enable_ssl_refresh": False},
])  # fmt: skip
def test_the_supported_backends_and_tls_left_off_pass(engine_args, tmp_path):
    check_engine_config(_vllm(**engine_args), [str(tmp_path)], field="spec.config_json")


def test_an_unknown_argument_with_no_close_name_is_refused_without_a_guess():
    with pytest.raises(InvalidArgument, match=r"\.qqqqzzzz: not a vLLM 0\.32\.0 argument$"):
        check_engine_config({SECTION: {"engine_type": "vllm", "engine_args": {"qqqqzzzz": 1}}}, [])


def test_a_configuration_too_deep_for_the_model_roots_check_names_its_field():
    from motor.contract.engine_policy import local_paths_outside

    deep: dict = {}
    cursor = deep
    for _ in range(MAX_CONFIG_DEPTH + 1):
        cursor["x"] = {}
        cursor = cursor["x"]
    with pytest.raises(InvalidArgument, match=f"^spec.engine_config: nested deeper than {MAX_CONFIG_DEPTH} levels$"):
        local_paths_outside(deep, [], "spec.engine_config")
